"""What the matrix receipt and the progress display are told about one finished row."""

from __future__ import annotations

from dataclasses import dataclass

from cache_family.schemas.receipts import RowReceipt


@dataclass(frozen=True, slots=True)
class RowResult:
    """What the matrix receipt says about one row."""

    index: int
    status: str
    launched: bool
    evidence: str | None = None  # the row.json path, relative to the run dir
    reason: str | None = None
    receipt: RowReceipt | None = None
