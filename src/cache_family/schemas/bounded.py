"""Bounded reads: a regular file, never through a symlink, never more than a cap.

The SHA-256 returned is of exactly the bytes read, so a pin always describes what was parsed.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

from cache_family.errors import Refused

KIB = 1024
MIB = 1024 * KIB

#: Read-only, refusing a final symlink, and never blocking on a FIFO's missing writer.
_READ_NO_FOLLOW: Final = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


@dataclass(frozen=True, slots=True)
class BoundedBytes:
    path: str
    data: bytes
    sha256: str


@contextmanager
def open_regular_file(
    path: str, *, subject: str, json_path: str
) -> Iterator[tuple[int, os.stat_result]]:
    """Open the regular file ``path`` for reading without following a final symlink.

    Yields the descriptor and its ``fstat``, and closes the descriptor afterwards. A missing
    file, a symlink, a file that cannot be opened and anything but a regular file are refused
    (``file.*``); ``subject`` names the file in those messages (e.g. "operator input /x").
    """
    try:
        fd = os.open(path, _READ_NO_FOLLOW)
    except FileNotFoundError:
        raise Refused.one(
            "file.missing",
            json_path,
            f"{subject} does not exist",
            "check the path",
        ) from None
    except OSError as exc:
        if os.path.islink(path):
            raise Refused.one(
                "file.symlink",
                json_path,
                f"{subject} is a symlink",
                "point at the regular file itself",
            ) from None
        raise Refused.one(
            "file.unreadable",
            json_path,
            f"{subject} cannot be opened: {exc.strerror}",
            "check permissions",
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Refused.one(
                "file.not_regular",
                json_path,
                f"{subject} is not a regular file",
                "point at a regular file (not a directory, FIFO or device)",
            )
        yield fd, info
    finally:
        os.close(fd)


def read_bounded(
    path: str, limit: int, *, what: str = "file", json_path: str = "$"
) -> BoundedBytes:
    """Read a regular file of at most ``limit`` bytes without following a final symlink."""
    if not os.path.isabs(path):
        raise Refused.one(
            "file.not_absolute",
            json_path,
            f"{what} path {path!r} is not absolute",
            "give an absolute path",
        )
    with open_regular_file(path, subject=f"{what} {path}", json_path=json_path) as (fd, info):
        if info.st_size > limit:
            raise Refused.one(
                "file.too_large",
                json_path,
                f"{what} {path} has {info.st_size} bytes, more than the {limit}-byte limit",
                f"keep the {what} under {limit} bytes",
            )
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, min(MIB, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise Refused.one(
                    "file.too_large",
                    json_path,
                    f"{what} {path} grew past the {limit}-byte limit while being read",
                    f"keep the {what} under {limit} bytes",
                )
    data = b"".join(chunks)
    return BoundedBytes(path=path, data=data, sha256=hashlib.sha256(data).hexdigest())
