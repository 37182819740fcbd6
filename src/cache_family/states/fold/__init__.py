"""The fold: journal lines in, receipts out. Pure, deterministic, and the same live and in replay.

One module per kind of fold (``cell``, ``row``, ``correctness``), what they share (``lines``),
the journal grouped per receipt (``index``) and refolding a published receipt (``refold``).
The rules the folds apply are in ``docs/state-machines.md`` ("What the fold applies").
"""

from __future__ import annotations

from cache_family.states.fold.cell import CellFold, fold_cell
from cache_family.states.fold.correctness import CorrectnessFold
from cache_family.states.fold.index import JournalIndex
from cache_family.states.fold.lines import RowsSource, lines_through, run_wide_terminal
from cache_family.states.fold.refold import Refolder, refold, refold_cell, refold_row
from cache_family.states.fold.row import RowFold, fold_row

__all__ = [
    "CellFold",
    "CorrectnessFold",
    "JournalIndex",
    "Refolder",
    "RowFold",
    "RowsSource",
    "fold_cell",
    "fold_row",
    "lines_through",
    "refold",
    "refold_cell",
    "refold_row",
    "run_wide_terminal",
]
