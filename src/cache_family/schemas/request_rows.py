"""A cell's per-request rows in their own streamed file, beside its ``cell.json``.

Layout of ``requests.jsonl``: one JSON line per request, in the order the requests ended::

    {"rung_index":0,"concurrency":8,"row":{"request_id":0,"status":"completed",...}}\\n

The file is written once, front to back, and never read whole: a receipt names it with
:class:`RowsFileDigest` (the SHA-256 of all its bytes and its line count), and a reader
verifies that digest while it streams the lines (``actors/request_rows.py``).

A cell of more than ``INLINE_ROWS_MAX`` requests keeps its rows here instead of in
``cell.json`` (the fold decides, ``states/fold.py``): rows sorted by rung, then request id, as
the receipt would have listed them. Smaller cells keep them inline, so a small receipt stays
one self-contained file and reads as before; a large one stays far below the receipt read cap
(a 100k-request ``cell.json`` with its rows inline is about 80 MB).

Evolution rule as for the journal: a new field gets a default and goes last.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from itertools import islice
from typing import Final

import msgspec

from cache_family.schemas.measurement import RequestRow

REQUESTS_FILENAME: Final = "requests.jsonl"
# At about 800 bytes a row in an indented receipt, 10k inline rows keep ``cell.json`` near 8 MB.
INLINE_ROWS_MAX: Final = 10_000


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
