"""The bytes a host executes are the bytes its pins saw: it runs from a private copy.

Pins are hashed by path, and a binary exec'd by that path later could be other bytes; so the
build tree and server are copied into a fresh 0700 directory once per row (``RowExec``), the
pins checked are the copies', the host execs the copy, and once hashed the copies are held by
identity through descriptors across the row (``RowPins``), so a write to a copy or a replaced
copy between two cells is still found. Still read by path after the check: libraries outside
the build, the model (watched during the cell: ``pin_watch``) and toolkit trees.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from cache_family.actors.run.custody import make_private_dir, remove_tree
from cache_family.states.plans import PinTarget


@dataclass(frozen=True, slots=True)
class PrivateCopy:
    """Where a cell's host runs from: ``binary`` to exec, ``native_build`` (the copied tree,
    or None when the binary lies outside the build and only it was copied) for the host's
    environment, ``root`` (the row's, see ``RowExec``) to remove once the hosts have ended."""

    root: str
    binary: str
    native_build: str | None


def copied_pins(targets: Sequence[PinTarget], copy: PrivateCopy) -> tuple[PinTarget, ...]:
    """``targets`` with the binary and the native build as their private copies (the bytes
    the host will run), the rest where they are."""
    paths = {"binary": copy.binary}
    if copy.native_build is not None:
        paths["native_build"] = copy.native_build
    return tuple(
        replace(target, path=paths[target.name]) if target.name in paths else target
        for target in targets
    )


def inside(path: str, tree: str) -> bool:
    return os.path.commonpath([path, tree]) == tree and path != tree


def make_private_copy(binary: str, native_build: str | None, parent: str) -> PrivateCopy:
    """Copy the native build tree and ``binary`` into a new 0700 dir under ``parent``;
    OSError when it cannot (a missing binary, a full disk)."""
    copies = RowExec(parent)
    try:
        return copies.copy_for(binary, native_build)
    except BaseException:
        copies.close()
        raise


class RowExec:
    """The private copies hosts run from, in one 0700 dir under ``parent``: each native build
    tree once, each binary outside its tree once. A run makes its rows' copies before its
    first row (``row.run_private_copies``), so that they have settled, and can be held by
    identity, by the time a row verifies them; a row run on its own makes its own. ``close``
    removes them, once the last host that runs from them has ended."""

    def __init__(self, parent: str) -> None:
        self.parent = parent
        self.root = ""
        self._trees: dict[str, str] = {}  # canonical tree -> its copy
        self._binaries: dict[str, str] = {}  # canonical binary outside a tree -> its copy
        # When the newest copy was made (wall clock, ns; 0: none yet): the copies are old
        # enough to be held by identity ``RACY_SECONDS`` after it.
        self.newest_copy_ns = 0

    def prepare(
        self, pairs: Iterable[tuple[str, str | None]]
    ) -> dict[tuple[str, str | None], PrivateCopy]:
        """Make the copies of ``(binary, native_build)`` pairs ahead of the row's cells, so
        they are old enough to be held by identity when the first cell checks them, and
        return them by pair; a copy that cannot be made now is left out, tried again, and
        its problem reported, by that cell."""
        made: dict[tuple[str, str | None], PrivateCopy] = {}
        for binary, native_build in pairs:
            with contextlib.suppress(OSError):
                made[(binary, native_build)] = self.copy_for(binary, native_build)
        return made

    def copy_for(self, binary: str, native_build: str | None) -> PrivateCopy:
        """The copy ``binary`` runs from (made now unless the row made it already); OSError
        when it cannot be made."""
        source = os.path.realpath(binary, strict=True)
        tree = os.path.realpath(native_build, strict=True) if native_build else None
        root = self._root()
        copied_tree = None
        if tree is not None:
            copied_tree = self._trees.get(tree)
            if copied_tree is None:
                copied_tree = os.path.join(root, f"native-{len(self._trees)}")
                try:
                    shutil.copytree(tree, copied_tree, symlinks=True)
                except BaseException:
                    remove_tree(copied_tree)
                    raise
                self._trees[tree] = copied_tree
                self.newest_copy_ns = time.time_ns()
            if inside(source, tree):
                copied = os.path.join(copied_tree, os.path.relpath(source, tree))
                return PrivateCopy(root, copied, copied_tree)
        copied = self._binaries.get(source, "")
        if not copied:
            directory = os.path.join(root, f"bin-{len(self._binaries)}")
            copied = os.path.join(directory, os.path.basename(source))
            try:
                os.mkdir(directory, 0o700)
                shutil.copyfile(source, copied)
                os.chmod(copied, stat.S_IRUSR | stat.S_IXUSR)
            except BaseException:
                remove_tree(directory)
                raise
            self._binaries[source] = copied
            self.newest_copy_ns = time.time_ns()
        return PrivateCopy(root, copied, copied_tree)

    def _root(self) -> str:
        if not self.root:
            if os.statvfs(self.parent).f_flag & os.ST_NOEXEC:
                raise OSError(
                    errno.EACCES,
                    "the run directory is on a filesystem mounted noexec; the host runs from "
                    "a private copy there: choose an output on a filesystem that allows "
                    "executables",
                    self.parent,
                )
            self.root = make_private_dir(self.parent, "exec")
        return self.root

    def close(self) -> None:
        remove_tree(self.root)
        self.root = ""
        self._trees.clear()
        self._binaries.clear()
