"""Refolding a published receipt: the bytes the fold gives for it, found by its scope.

Which scopes can be refolded is one explicit mapping the caller passes (replay's names every
scope a run publishes: ``actors/audit/replay.py``); the cell's and the row's refolders are here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from cache_family.errors import Refused
from cache_family.schemas.journal import ReceiptPublished
from cache_family.schemas.receipts import encode_receipt
from cache_family.states.fold.cell import fold_cell
from cache_family.states.fold.index import JournalIndex
from cache_family.states.fold.lines import RowsSource
from cache_family.states.fold.row import fold_row

Refolder = Callable[[JournalIndex, ReceiptPublished], bytes]


def refold_cell(
    index: JournalIndex, published: ReceiptPublished, rows: RowsSource | None = None
) -> bytes:
    """``refold`` of a cell receipt, its inline rows read through ``rows``."""
    if published.cell_id is None:
        raise _bad_publication(published, "names no cell_id")
    return encode_receipt(
        fold_cell(
            index.lines_for_cell(published.cell_id),
            published.cell_id,
            through_seq=published.through_seq,
            rows=rows,
        )
    )


def refold_row(index: JournalIndex, published: ReceiptPublished) -> bytes:
    if published.row_index is None:
        raise _bad_publication(published, "names no row_index")
    return encode_receipt(
        fold_row(
            index.lines_for_row(published.row_index),
            published.row_index,
            through_seq=published.through_seq,
        )
    )


def _bad_publication(published: ReceiptPublished, why: str) -> Refused:
    return Refused.one(
        "fold.publication.invalid",
        "$.receipt_published",
        f"the {published.scope!r} publication of {published.path} {why}",
        "the journal was written by a faulty or foreign writer",
    )


def refold(
    index: JournalIndex, published: ReceiptPublished, refolders: Mapping[str, Refolder]
) -> bytes:
    """The canonical bytes the fold gives for a published receipt (what replay compares)."""
    refolder = refolders.get(published.scope)
    if refolder is None:
        raise Refused.one(
            "fold.scope.unsupported",
            "$.scope",
            f"this version cannot refold a {published.scope!r} receipt",
            "replay with the cache-family version that wrote the journal, or a newer one",
        )
    return refolder(index, published)
