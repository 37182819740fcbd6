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


def _temporary(path: str, data: bytes, mode: int) -> tuple[str, int]:
    """A fresh temporary file beside ``path`` holding ``data``, fsynced; name and open fd."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return tmp, fd


def publish_fresh(path: str, data: bytes, *, mode: int = 0o644) -> Published:
    """Write ``data`` to ``path``, which must not exist; atomic and durable."""
    directory = os.path.dirname(path) or "."
    tmp, fd = _temporary(path, data, mode)
    try:
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


def publish_replace(path: str, data: bytes, *, mode: int = 0o644) -> None:
    """Write ``data`` to ``path``, replacing a file already there; atomic and durable.

    For a document the operator names and regenerates (the report's README tables): a
    reader sees the old bytes or the new ones, never a mix. Receipts use ``publish_fresh``.
    """
    tmp, fd = _temporary(path, data, mode)
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(path) or ".")


def revoke(published: Published) -> bool:
    """Remove a file we published, only if the path still names that same file."""
    if not published.still_ours():
        return False
    os.unlink(published.path)
    fsync_dir(os.path.dirname(published.path) or ".")
    return True


def fsync_dir(directory: str) -> None:
    """Make a directory entry change (a new link, an unlink) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
