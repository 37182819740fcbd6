"""Atomic publication of files this tool owns: fresh (no-clobber) or replacing.

Written to a temporary name beside the target and fsynced, then ``os.link``-ed (refusing an
existing target) or ``os.replace``-d where replacing is the point. The returned identity
includes size and timestamps, since a file written after ours was unlinked may get the same
inode back.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from cache_family.errors import Refused

TEMP_TOKEN_BYTES: Final = 6
_TEMP_NAME: Final = re.compile(rf"\..+\.[0-9a-f]{{{2 * TEMP_TOKEN_BYTES}}}\.tmp", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Published:
    path: str
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    def still_ours(self) -> bool:
        """True while ``path`` still names exactly the file we wrote."""
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return False
        return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns) == (
            self.device,
            self.inode,
            self.size,
            self.mtime_ns,
            self.ctime_ns,
        )


def publish_fresh(path: str, data: bytes, *, mode: int = 0o644) -> Published:
    """Write ``data`` to ``path``, which must not exist; atomic and durable."""
    tmp = temp_sibling(path)
    fd = _write_durably(tmp, data, mode)
    try:
        try:
            link_fresh(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        # Taken after the link count settled, so ctime matches what a later lstat sees.
        info = os.fstat(fd)
    finally:
        os.close(fd)
    fsync_dir(os.path.dirname(path) or ".")
    return Published(
        path=path,
        device=info.st_dev,
        inode=info.st_ino,
        size=info.st_size,
        mtime_ns=info.st_mtime_ns,
        ctime_ns=info.st_ctime_ns,
    )


def replace_atomically(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o644) -> None:
    """Write ``data`` to ``path``, replacing what is there: a reader sees the old bytes or the
    new ones, never a part. Only for files this tool regenerates (caches, generated docs)."""
    tmp = temp_sibling(path)
    os.close(_write_durably(tmp, data, mode))
    _move_into_place(tmp, path)


def replace_with_symlink(link: str | os.PathLike[str], target: str) -> None:
    """Point ``link`` at ``target``, replacing whatever ``link`` names, in one step."""
    tmp = temp_sibling(link)
    os.symlink(target, tmp)  # a fresh random name: nothing there is ever overwritten
    _move_into_place(tmp, link)


def link_fresh(tmp: str, path: str) -> None:
    """Give the written ``tmp`` its final name ``path``, which must not exist yet."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise Refused.one(
            "publish.exists",
            path,
            f"{path} already exists and is not ours to replace",
            "choose a fresh output path",
        ) from None


def temp_sibling(path: str | os.PathLike[str]) -> str:
    directory, name = os.path.split(os.fspath(path))
    return os.path.join(directory, f".{name}.{secrets.token_hex(TEMP_TOKEN_BYTES)}.tmp")


def is_temp_sibling(name: str) -> bool:
    """Whether a file name is one :func:`temp_sibling` gives (a publication's temporary)."""
    return _TEMP_NAME.fullmatch(name) is not None


def _write_durably(tmp: str, data: bytes, mode: int) -> int:
    """Create ``tmp`` (never through a link), write all of ``data`` and fsync; its descriptor."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return fd


def _move_into_place(tmp: str, path: str | os.PathLike[str]) -> None:
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(os.fspath(path)) or ".")


def revoke(published: Published) -> bool:
    """Remove a file we published, only if the path still names that same file."""
    if not published.still_ours():
        return False
    os.unlink(published.path)
    fsync_dir(os.path.dirname(published.path) or ".")
    return True


def path_inside(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip("/") + "/")


def overlapping_trees(output: str, trees: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (where, canonical tree) of every tree an output directory would overlap.

    ``output`` is canonical (its parent resolved); each tree is resolved here. Inside a
    tree the tool reads (a native build, a model cache, a toolkit), an output changes the
    very bytes that are pinned; holding one, it would be written over them.
    """
    found = []
    for where, tree in trees:
        canonical = os.path.realpath(tree)
        if path_inside(output, canonical) or path_inside(canonical, output):
            found.append((where, canonical))
    return found


# A directory is at most this many levels below the root (PATH_MAX / 2): a walk up from a
# descriptor that has not reached the root by then is cut short.
ANCESTORS_MAX: Final = 2048


def trees_holding(directory_fd: int, trees: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (where, tree) of every tree that is the directory open at ``directory_fd`` or one of
    its ancestors, judged by identity (device and inode), not by path: walking up through
    ``..`` from the descriptor, a link flipped in any path cannot hide the overlap. A tree that
    cannot be stat'ed holds nothing. OSError when the walk cannot read an ancestor."""
    identities: dict[tuple[int, int], list[tuple[str, str]]] = {}
    for where, tree in trees:
        try:
            info = os.stat(tree)
        except OSError:
            continue
        identities.setdefault((info.st_dev, info.st_ino), []).append((where, tree))
    found: list[tuple[str, str]] = []
    current = os.dup(directory_fd)
    try:
        for _ in range(ANCESTORS_MAX):
            info = os.fstat(current)
            found.extend(identities.get((info.st_dev, info.st_ino), ()))
            parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=current)
            above = os.fstat(parent)
            os.close(current)
            current = parent
            if (above.st_dev, above.st_ino) == (info.st_dev, info.st_ino):
                break  # the root is its own parent
    finally:
        os.close(current)
    return found


def fsync_dir(directory: str) -> None:
    """Make a directory entry change (a new link, an unlink) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
