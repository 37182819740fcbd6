"""Atomic, no-clobber publication of files this tool owns.

A file is written to a temporary name in the target's directory, fsynced, then linked into
place with ``os.link`` (which refuses an existing target) and the temporary name removed.
The returned identity (device, inode) lets a late refusal revoke exactly the file we wrote.
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


def publish_fresh(path: str, data: bytes, *, mode: int = 0o644) -> Published:
    """Write ``data`` to ``path``, which must not exist; atomic and durable."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
        info = os.fstat(fd)
    finally:
        os.close(fd)
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
    _fsync_dir(directory)
    return Published(path=path, device=info.st_dev, inode=info.st_ino)


def revoke(published: Published) -> bool:
    """Remove a file we published, only if the path still names that same file."""
    try:
        info = os.lstat(published.path)
    except FileNotFoundError:
        return False
    if (info.st_dev, info.st_ino) != (published.device, published.inode):
        return False
    os.unlink(published.path)
    _fsync_dir(os.path.dirname(published.path) or ".")
    return True


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
