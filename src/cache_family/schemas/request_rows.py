"""A cell's per-request rows in their own streamed file, beside its ``cell.json``.

Written front to back as requests end and fsynced at each rung's end, when a ``rung_rows``
record names its lines and their SHA-256; the journal holds no row, and the file is never read
whole (a reader verifies the digests as it streams). A cell of more than ``INLINE_ROWS_MAX``
requests names the file in ``cell.json``; a smaller one also lists its rows inline.
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from typing import Final

import msgspec

from cache_family.errors import Refused
from cache_family.schemas.bounded import MIB, open_regular_file
from cache_family.schemas.measurement import RequestRow

REQUESTS_FILENAME: Final = "requests.jsonl"
# At about 800 bytes a row in an indented receipt, 10k inline rows keep ``cell.json`` near 8 MB.
INLINE_ROWS_MAX: Final = 10_000
CHUNK_BYTES: Final = 4 * MIB


class RequestRowLine(msgspec.Struct, frozen=True, kw_only=True):
    """One request of one rung."""

    rung_index: int
    concurrency: int
    row: RequestRow


class RowsFileDigest(msgspec.Struct, frozen=True, kw_only=True):
    """What a receipt holds of a rows file: where it is, how many lines, and their SHA-256."""

    # Relative to the directory of the receipt naming it, so a superseded cell moved by a
    # resume still finds its file.
    path: str
    count: int
    sha256: str


ENCODER: Final = msgspec.json.Encoder()
DECODER: Final = msgspec.json.Decoder(RequestRowLine)


def rows_digest(lines: Iterable[RequestRowLine], *, batch: int = 4096) -> tuple[int, str]:
    """Line count and SHA-256 of the file these lines make, without building it: the same
    bytes ``RowFileWriter`` writes (``encode_lines`` of consecutive batches concatenates)."""
    digest, count = hashlib.sha256(), 0
    it = iter(lines)
    while chunk := list(islice(it, batch)):
        digest.update(ENCODER.encode_lines(chunk))
        count += len(chunk)
    return count, digest.hexdigest()


def stream_rows(
    path: str,
    expected: RowsFileDigest,
    *,
    marks: Sequence[tuple[int, str]] = (),
    chunk_bytes: int = CHUNK_BYTES,
) -> Iterator[RequestRowLine]:
    """Every line of the rows file at ``path``, read ``chunk_bytes`` at a time; refuses
    (``rows.*``) an unreadable or undecodable file and, after its last line, one whose SHA-256
    or line count is not ``expected``'s. ``marks``: (lines, SHA-256 of the file through them)
    of earlier segments (``rung_rows`` records), each checked before its lines are given. A
    consumer keeps nothing it folded until the iteration ended without a refusal."""
    where = f"$.rows_file[{expected.path}]"
    pending = deque(sorted(marks))
    digest = hashlib.sha256()
    count = 0
    rest = b""
    with open_regular_file(path, subject=f"rows file {path}", json_path=where) as (fd, _):
        while True:
            try:
                chunk = os.read(fd, chunk_bytes)
            except OSError as exc:
                raise Refused.one(
                    "rows.unreadable",
                    where,
                    f"{path} could not be read: {exc.strerror}",
                    "check the file and the disk",
                ) from None
            if not chunk:
                break
            data = rest + chunk
            cut = data.rfind(b"\n") + 1
            rest = data[cut:]
            if not cut:
                continue
            body = data[:cut]
            try:
                lines = DECODER.decode_lines(body)
            except msgspec.DecodeError as exc:
                raise Refused.one(
                    "rows.undecodable",
                    where,
                    f"{path}: a line after line {count} is not a request row ({exc})",
                    "the file was edited or corrupted; re-run the cell",
                ) from None
            hashed = 0
            while pending and pending[0][0] <= count + len(lines):
                mark, sha256 = pending.popleft()
                end = _after_lines(body, hashed, mark - count - _lines_in(body, hashed))
                digest.update(body[hashed:end])
                hashed = end
                if digest.hexdigest() != sha256:
                    raise Refused.one(
                        "rows.digest_mismatch",
                        where,
                        f"{path}: its first {mark} rows do not have the SHA-256 the journal's"
                        f" rung_rows record holds ({sha256})",
                        "the rows file changed after its rows were journaled; re-run the cell",
                    )
            digest.update(body[hashed:])
            count += len(lines)
            yield from lines
    problems = []
    if rest:
        problems.append(f"it ends with {len(rest)} bytes of a torn line")
    if count != expected.count:
        problems.append(f"it holds {count} rows, the receipt says {expected.count}")
    if pending:
        problems.append(f"it ends before line {pending[0][0]} a rung_rows record names")
    if digest.hexdigest() != expected.sha256:
        problems.append(f"its SHA-256 is {digest.hexdigest()}, the receipt says {expected.sha256}")
    if problems:
        raise Refused.one(
            "rows.digest_mismatch",
            where,
            f"{path}: " + "; ".join(problems),
            "the rows file changed after its receipt was published; re-run the cell",
        )


def _lines_in(body: bytes, end: int) -> int:
    return body.count(b"\n", 0, end)


def _after_lines(body: bytes, start: int, lines: int) -> int:
    """The offset just after the ``lines``-th newline from ``start``."""
    for _ in range(lines):
        start = body.index(b"\n", start) + 1
    return start
