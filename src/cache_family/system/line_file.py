"""A text file read line by line without holding it: bounded in size and line length, and
hashed as it is read, so that a pin names exactly the bytes that were parsed."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from typing import Final

from cache_family.errors import Refused
from cache_family.schemas.bounded import MIB, open_regular_file

_CHUNK: Final = MIB


class BoundedLines:
    """Iterates ``(line number, bytes)`` of a regular file (1-based, newline stripped). A line
    longer than ``max_line_bytes`` comes out cut to ``max_line_bytes + 1`` bytes, the rest
    skipped, so that its reader refuses it by its own rule without it ever being held. After
    a complete iteration ``sha256`` and ``size`` describe every byte read."""

    def __init__(
        self, path: str, *, max_bytes: int, max_line_bytes: int, what: str, json_path: str
    ) -> None:
        if not os.path.isabs(path):
            raise Refused.one(
                "file.not_absolute",
                json_path,
                f"{what} path {path!r} is not absolute",
                "give an absolute path",
            )
        self.path = path
        self.max_bytes = max_bytes
        self.max_line_bytes = max_line_bytes
        self.what = what
        self.json_path = json_path
        self.sha256: str | None = None
        self.size = 0

    def __repr__(self) -> str:
        return f"<BoundedLines {self.path} read={self.size} sha256={self.sha256}>"

    def _too_large(self, grew: bool) -> Refused:
        how = "grew past" if grew else "is larger than"
        return Refused.one(
            "file.too_large",
            self.json_path,
            f"{self.what} {self.path} {how} the {self.max_bytes}-byte limit",
            f"keep the {self.what} under {self.max_bytes} bytes",
        )

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        digest = hashlib.sha256()
        subject = f"{self.what} {self.path}"
        with open_regular_file(self.path, subject=subject, json_path=self.json_path) as (
            fd,
            info,
        ):
            if info.st_size > self.max_bytes:
                raise self._too_large(grew=False)
            pending = bytearray()
            cut = False  # the current line is past its limit: its rest is skipped
            number = 0
            size = 0
            while True:
                chunk = os.read(fd, _CHUNK)
                if not chunk:
                    break
                size += len(chunk)
                if size > self.max_bytes:
                    raise self._too_large(grew=True)
                digest.update(chunk)
                start = 0
                while True:
                    end = chunk.find(b"\n", start)
                    piece = chunk[start:] if end < 0 else chunk[start:end]
                    if not cut:
                        pending += piece[: self.max_line_bytes + 1 - len(pending)]
                        cut = len(pending) > self.max_line_bytes
                    if end < 0:
                        break
                    number += 1
                    yield number, bytes(pending)
                    pending.clear()
                    cut = False
                    start = end + 1
            if pending:
                number += 1
                yield number, bytes(pending)
        self.sha256, self.size = digest.hexdigest(), size
