"""Watching pinned files and trees between two hashes of them (inotify, Linux, via ctypes).

A byte flipped after a pin's first hash and restored before the second is invisible to both, so
the pinned paths are watched in between and any write, attribute change, move or delete is
drift. Not seen: writes through a shared ``mmap`` or through a hard link outside a tree; a path
that cannot be watched is listed in ``unwatched``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from cache_family.system.libc import libc as c_library

IN_MODIFY: Final = 0x00000002
IN_ATTRIB: Final = 0x00000004
IN_CLOSE_WRITE: Final = 0x00000008
IN_MOVED_FROM: Final = 0x00000040
IN_MOVED_TO: Final = 0x00000080
IN_CREATE: Final = 0x00000100
IN_DELETE: Final = 0x00000200
IN_DELETE_SELF: Final = 0x00000400
IN_MOVE_SELF: Final = 0x00000800
IN_Q_OVERFLOW: Final = 0x00004000
IN_IGNORED: Final = 0x00008000
IN_ONLYDIR: Final = 0x01000000
IN_DONT_FOLLOW: Final = 0x02000000
IN_NONBLOCK: Final = os.O_NONBLOCK
IN_CLOEXEC: Final = os.O_CLOEXEC

# A file: written, its metadata changed (mode, owner, times, link count), moved, deleted.
FILE_EVENTS: Final = IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVE_SELF | IN_DELETE_SELF
# A directory of a tree: all of that for it and for every entry in it, and entries that come,
# go or move.
TREE_EVENTS: Final = FILE_EVENTS | IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO
# A link on the way to a pinned file: re-pointed (replaced), moved or deleted.
LINK_EVENTS: Final = IN_ATTRIB | IN_MOVE_SELF | IN_DELETE_SELF
LINK_HOPS_MAX: Final = 40
EVENT_HEADER: Final = struct.Struct("iIII")  # wd, mask, cookie, len (then the name)
READ_BYTES: Final = 64 * 1024


@dataclass(frozen=True, slots=True)
class WatchedPin:
    name: str
    path: str
    tree: bool


class _Inotify:
    def __init__(self) -> None:
        libc = c_library()
        self._add = libc.inotify_add_watch
        self._add.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
        self._add.restype = ctypes.c_int
        init = libc.inotify_init1
        init.argtypes = (ctypes.c_int,)
        init.restype = ctypes.c_int
        fd = init(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        self.fd = fd

    def add(self, path: str, mask: int) -> int:
        wd = int(self._add(self.fd, os.fsencode(path), mask))
        if wd < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), path)
        return wd


class PinWatch:
    """The watch over a set of pins; ``changes()`` names each pin touched since it began."""

    def __init__(self, pins: Iterable[WatchedPin]) -> None:
        self.unwatched: list[str] = []
        self._names: dict[int, set[str]] = {}
        self._changed: set[str] = set()
        self._inotify: _Inotify | None = None
        pins = list(pins)
        try:
            self._inotify = _Inotify()
        except (OSError, AttributeError):  # not Linux, or no instance left
            self.unwatched = [pin.path for pin in pins]
            return
        for pin in pins:
            try:
                if pin.tree:
                    self._watch_tree(pin)
                else:
                    self._watch_file(pin)
            except OSError:
                # Missing or unreadable now, or past the watch limit: the hashes judge it.
                self.unwatched.append(pin.path)

    def _add(self, pin: WatchedPin, path: str, mask: int) -> None:
        assert self._inotify is not None
        self._names.setdefault(self._inotify.add(path, mask), set()).add(pin.name)

    def _watch_file(self, pin: WatchedPin) -> None:
        path = pin.path
        for _ in range(LINK_HOPS_MAX):
            if not os.path.islink(path):
                break
            self._add(pin, path, LINK_EVENTS | IN_DONT_FOLLOW)
            path = os.path.join(os.path.dirname(path), os.readlink(path))
        self._add(pin, path, FILE_EVENTS)

    def _watch_tree(self, pin: WatchedPin) -> None:
        root = os.path.realpath(pin.path, strict=True)
        self._add(pin, root, TREE_EVENTS | IN_ONLYDIR)
        for directory, subdirectories, _ in os.walk(root):
            for name in subdirectories:
                path = os.path.join(directory, name)
                if not os.path.islink(path):  # a link in a tree is an entry, not a subtree
                    self._add(pin, path, TREE_EVENTS | IN_ONLYDIR | IN_DONT_FOLLOW)

    def changes(self) -> list[str]:
        """The names of the pins touched since the watch began (sorted); reading the events
        that arrived since the last call."""
        inotify = self._inotify
        if inotify is not None:
            while True:
                try:
                    data = os.read(inotify.fd, READ_BYTES)
                except BlockingIOError:
                    break
                if not data:
                    break
                self._note(data)
        return sorted(self._changed)

    def _note(self, data: bytes) -> None:
        offset = 0
        while offset + EVENT_HEADER.size <= len(data):
            wd, mask, _cookie, length = EVENT_HEADER.unpack_from(data, offset)
            offset += EVENT_HEADER.size + length
            if mask & IN_Q_OVERFLOW:
                # Events were lost: any pin may have been touched.
                self._changed.update(name for names in self._names.values() for name in names)
            elif not mask & IN_IGNORED:
                self._changed.update(self._names.get(wd, ()))

    def close(self) -> None:
        if self._inotify is not None:
            with contextlib.suppress(OSError):
                os.close(self._inotify.fd)
            self._inotify = None

    def __enter__(self) -> PinWatch:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
