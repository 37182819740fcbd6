"""Atomic, no-clobber publication of files this tool owns.

A file is written to a temporary name in the target's directory, fsynced, then linked into
place with ``os.link`` (which refuses an existing target) and the temporary name removed.
The returned identity lets a late refusal revoke exactly the file we wrote. Device and inode
alone are not enough: a file written at the same path after ours was unlinked may get the
very same inode number back, so size and both timestamps are part of the identity.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from cache_family.errors import Refused


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
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        except BaseException:
            # A full disk (ENOSPC) or any other failure must not leave a partial temporary
            # behind: nothing of this publication may remain.
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise Refused.one(
                "publish.exists",
                path,
                f"{path} already exists and is not ours to replace",
                "choose a fresh output path",
            ) from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        # Taken after the link count settled, so ctime matches what a later lstat sees.
        info = os.fstat(fd)
    finally:
        os.close(fd)
    fsync_dir(directory)
    return Published(
        path=path,
        device=info.st_dev,
        inode=info.st_ino,
        size=info.st_size,
        mtime_ns=info.st_mtime_ns,
        ctime_ns=info.st_ctime_ns,
    )


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


def fsync_dir(directory: str) -> None:
    """Make a directory entry change (a new link, an unlink) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
