"""A cell's per-request rows in their own streamed file, beside its ``cell.json``.

Layout of ``requests.jsonl``: one JSON line per request, in the order the requests ended::

    {"rung_index":0,"concurrency":8,"row":{"request_id":0,"status":"completed",...}}\\n

The file is written once, front to back, and never read whole: a receipt names it with
:class:`RowsFileDigest` (the SHA-256 of all its bytes and its line count), and a reader
verifies that digest while it streams the lines (``actors/request_rows.py``), so a cell of a
million requests is summarised and replayed in memory that does not hold its rows.

Evolution rule as for the journal: a new field gets a default and goes last.
"""

from __future__ import annotations

from typing import Final

import msgspec

from cache_family.schemas.measurement import RequestRow

REQUESTS_FILENAME: Final = "requests.jsonl"


class RequestRowLine(msgspec.Struct, frozen=True, kw_only=True):
    """One request of one rung."""

    rung_index: int
    concurrency: int
    row: RequestRow


class RowsFileDigest(msgspec.Struct, frozen=True, kw_only=True):
    """What a receipt holds of a rows file: where it is, how many lines, and their SHA-256."""

    path: str  # relative to the run directory
    count: int
    sha256: str


ENCODER: Final = msgspec.json.Encoder()
DECODER: Final = msgspec.json.Decoder(RequestRowLine)
