"""Writing a cell's ``requests.jsonl`` (``schemas/request_rows.py``, which also streams it).

The writer buffers encoded lines and writes them in large chunks (one ``write`` per
``flush_bytes``), hashing every byte as it goes; ``close`` fsyncs and returns the digest a
receipt records, and ``publish_rows_file`` gives a fold's rows file atomically.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterable
from typing import Final

from cache_family.actors.publish import fsync_dir, link_fresh, temp_sibling
from cache_family.errors import Refused
from cache_family.schemas.bounded import MIB
from cache_family.schemas.request_rows import ENCODER, RequestRowLine, RowsFileDigest

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

    def close(self) -> RowsFileDigest:
        """Write what is buffered, fsync, close; the digest the receipt records."""
        self.flush()
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
        return RowsFileDigest(path=self.relative, count=self.count, sha256=self._digest.hexdigest())


def publish_rows_file(path: str, lines: Iterable[RequestRowLine], expected: RowsFileDigest) -> None:
    """Write a receipt's rows file at ``path`` (which must not exist) atomically and durably,
    before the receipt naming it is published; refuses bytes whose digest is not ``expected``
    (the fold and the writer disagree about the encoding: a bug, never a published file)."""
    tmp = temp_sibling(path)
    writer = RowFileWriter(tmp, expected.path)
    try:
        writer.add_many(lines)
        written = writer.close()
        if written != expected:
            raise Refused.one(
                "rows.digest_mismatch",
                f"$.rows_file[{expected.path}]",
                f"the rows written ({written.count}, {written.sha256}) are not the folded"
                f" ones ({expected.count}, {expected.sha256})",
                "report this: the fold and the rows writer encode differently",
            )
        link_fresh(tmp, path)
    finally:
        writer.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_dir(os.path.dirname(path) or ".")
