"""Writing a cell's ``requests.jsonl`` (``schemas/request_rows.py``, which also streams it).

Rows are buffered and written in large chunks, hashed as they go; ``checkpoint`` fsyncs at each
rung's end and gives the count and SHA-256 of every line so far, which ``rung_rows`` journals.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Final

from cache_family.errors import Refused
from cache_family.schemas.bounded import MIB
from cache_family.schemas.journal import RungRows
from cache_family.schemas.request_rows import (
    ENCODER,
    RequestRowLine,
    RowsFileDigest,
    stream_rows,
)
from cache_family.states.fold import RowsSource

FLUSH_BYTES: Final = 4 * MIB


class RowFileWriter:
    """Append-only writer of one cell's rows file (created fresh; one owner)."""

    def __init__(self, path: str, relative: str, *, flush_bytes: int = FLUSH_BYTES) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
        self._fd: int | None = os.open(path, flags, 0o644)
        self.relative = relative
        self._flush_bytes = flush_bytes
        self._pending: list[RequestRowLine] = []
        self._pending_estimate = 0
        self._digest = hashlib.sha256()
        self.count = 0

    def add(self, line: RequestRowLine) -> None:
        self._pending.append(line)
        # Rows are a few hundred bytes; an estimate is enough to bound the buffer.
        self._pending_estimate += 512
        if self._pending_estimate >= self._flush_bytes:
            self.flush()

    @property
    def lines(self) -> int:
        """Lines given so far, written or still buffered."""
        return self.count + len(self._pending)

    def add_many(self, lines: Iterable[RequestRowLine]) -> None:
        for line in lines:
            self.add(line)

    def flush(self) -> None:
        if not self._pending:
            return
        if self._fd is None:
            raise ValueError("rows file is closed")
        data = ENCODER.encode_lines(self._pending)
        self.count += len(self._pending)
        self._pending, self._pending_estimate = [], 0
        self._digest.update(data)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def checkpoint(self) -> RowsFileDigest:
        """Write what is buffered and fsync (the file stays open): the count and SHA-256 of
        every line so far, which a ``rung_rows`` record then names."""
        self.flush()
        if self._fd is None:
            raise ValueError("rows file is closed")
        os.fsync(self._fd)
        return RowsFileDigest(path=self.relative, count=self.count, sha256=self._digest.hexdigest())

    def close(self) -> RowsFileDigest:
        """Write what is buffered, fsync, close; the digest the receipt records."""
        self.flush()
        if self._fd is not None:
            # Evidence from here on, read-only like the receipts that name it.
            os.fchmod(self._fd, 0o444)
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
        return RowsFileDigest(path=self.relative, count=self.count, sha256=self._digest.hexdigest())


def cell_rows(cell_dir: str) -> RowsSource:
    """The fold's ``RowsSource`` for the cell whose directory is ``cell_dir``: its rows file
    streamed a chunk at a time, each ``rung_rows`` record's digest checked before its lines
    are given, and the file's end checked against the last one."""

    def read(segments: Sequence[RungRows]) -> Iterator[RequestRowLine]:
        last = segments[-1]
        if os.path.basename(last.path) != last.path or last.path in ("", ".", ".."):
            raise Refused.one(
                "rows.path",
                "$.rung_rows.path",
                f"the rows file {last.path!r} is not a file of the cell's directory",
                "the journal was written by a faulty or foreign writer",
            )
        expected = RowsFileDigest(
            path=last.path, count=last.first_line + last.count, sha256=last.sha256
        )
        marks = [(segment.first_line + segment.count, segment.sha256) for segment in segments]
        yield from stream_rows(os.path.join(cell_dir, last.path), expected, marks=marks[:-1])

    return read
