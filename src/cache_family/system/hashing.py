"""SHA-256 of a file's bytes: the one chunked reader behind pins, the native build's and the
zoo's checks and the test fixtures. Pins add their budget, progress and refusals around it
(``pins.hash_file``); the plain ``sha256_file`` is for bytes this tool wrote or downloaded."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Final, Protocol

CHUNK_BYTES: Final = 1024 * 1024


class Readable(Protocol):
    def readinto(self, buffer: bytearray, /) -> int | None: ...


def sha256_stream(
    stream: Readable,
    *,
    before_chunk: Callable[[], None] | None = None,
    after_chunk: Callable[[int], None] | None = None,
) -> tuple[str, int]:
    """(hex SHA-256, size) of everything ``stream`` gives, read in ``CHUNK_BYTES`` chunks;
    ``before_chunk`` runs before every read (a budget or a stop may raise there),
    ``after_chunk(count)`` after every non-empty one."""
    digest = hashlib.sha256()
    size = 0
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    while True:
        if before_chunk is not None:
            before_chunk()
        count = stream.readinto(buffer)
        if not count:
            return digest.hexdigest(), size
        digest.update(view[:count])
        size += count
        if after_chunk is not None:
            after_chunk(count)


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of the file at ``path`` (links followed); OSError when it cannot be read."""
    with open(path, "rb", buffering=0) as stream:
        return sha256_stream(stream)[0]
