"""The journal's lines grouped by what they concern, so one receipt's fold reads only its own."""

from __future__ import annotations

import heapq
import re
from collections.abc import Iterable, Sequence
from typing import Final

from cache_family.schemas.journal import (
    CellOpened,
    CorrectnessTopologyRan,
    CorrectnessVerdict,
    JournalLine,
    ReceiptPublished,
    Record,
    RowOpened,
    RunResumed,
    Transition,
    decode_line,
)
from cache_family.states.cell import (
    CORRECTNESS_TABLE,
    ROW_TABLE,
)
from cache_family.states.fold.lines import _scope_cell, run_wide_terminal


class JournalIndex:
    """Lines grouped by what they concern, so one receipt's fold reads only its own lines.

    Run-wide lines (run start, run-wide cancellation/deadline/interrupt, run-level pins and
    faults) go to every view; a cell's lines to its cell; ``row_opened``, row transitions and
    row receipts to their row. ``lines_for_row`` adds the lines of the row's cells.
    """

    def __init__(self, lines: Iterable[JournalLine] = ()) -> None:
        # Each list holds decoded lines and, for lines the writer wrote, their bytes (without
        # the newline) until a fold first reads them: ``_decoded`` turns those into lines.
        self._run: list[JournalLine | bytes] = []
        self._rows: dict[int, list[JournalLine | bytes]] = {}
        self._cells: dict[str, list[JournalLine | bytes]] = {}
        self._cells_of_row: dict[int, list[str]] = {}
        # Written batches not filed yet, each (first seq, records, line bytes): filed (in
        # order) by the first read, off the append path.
        self._unfiled: list[tuple[int, Sequence[Record], Sequence[bytes]]] = []
        self._last_seq = 0
        for line in lines:
            self.add(line)

    @property
    def last_seq(self) -> int:
        self._file()
        return self._last_seq

    def add(self, line: JournalLine) -> None:
        if self._unfiled:
            self._file()
        self._add(line.seq, line.record, line)

    def _file(self) -> None:
        unfiled, self._unfiled = self._unfiled, []
        add = self._add
        for first, records, datas in unfiled:
            for seq, record, data in zip(
                range(first, first + len(records)), records, datas, strict=True
            ):
                add(seq, record, data)

    def _add(self, seq: int, record: Record, line: JournalLine | bytes) -> None:
        if seq > self._last_seq:
            self._last_seq = seq
        # The hot path (a request row or any observation of a cell already filed): straight
        # to that cell's lines; everything else is filed below.
        cell_id = getattr(record, "cell_id", None)
        if type(cell_id) is str and type(record) is not CellOpened:
            known = self._cells.get(cell_id)
            if known is not None:
                known.append(line)
                return
        if isinstance(record, RunResumed):
            self._resume(record)
        if isinstance(record, CellOpened):
            cells = self._cells_of_row.setdefault(record.row_index, [])
            if record.cell_id not in cells:
                cells.append(record.cell_id)
        cell_id = _scope_cell(record)
        if cell_id is not None:
            if cell_id not in self._cells:
                # A scope no cell opens (the correctness arm's tool children and pins)
                # belongs to the row whose directory it names, so it leaves with that row.
                owner = _row_of_scope(cell_id)
                if owner is not None:
                    cells = self._cells_of_row.setdefault(owner, [])
                    if cell_id not in cells:
                        cells.append(cell_id)
            self._cells.setdefault(cell_id, []).append(line)
            return
        row_index = _row_of(record)
        if row_index is not None:
            self._rows.setdefault(row_index, []).append(line)
            return
        self._run.append(line)

    def add_written(
        self, first_seq: int, records: Sequence[Record], datas: Sequence[bytes]
    ) -> None:
        """Index lines the writer just wrote (seqs from ``first_seq``; each line's bytes
        without its newline): filed by the records they were written from when first read,
        and decoded from those bytes only when a fold first reads them. Nothing per line
        happens here: this is on the writer's hot path."""
        if records:
            self._unfiled.append((first_seq, records, datas))

    def lines_for_cell(self, cell_id: str) -> list[JournalLine]:
        self._file()
        views = [_decoded(self._run), _decoded(self._cells.get(cell_id, []))]
        return list(heapq.merge(*views, key=_seq))

    def lines_for_row(self, row_index: int) -> list[JournalLine]:
        self._file()
        views: list[list[JournalLine | bytes]] = [self._run, self._rows.get(row_index, [])]
        views += [self._cells.get(c, []) for c in self._cells_of_row.get(row_index, [])]
        return list(heapq.merge(*map(_decoded, views), key=_seq))

    def cell_ids(self) -> list[str]:
        self._file()
        return list(self._cells)

    def row_indices(self) -> list[int]:
        self._file()
        return sorted(set(self._rows) | set(self._cells_of_row))

    def _resume(self, record: RunResumed) -> None:
        """A resumed run starts a new segment: the rows it re-runs begin afresh, and the
        stops of the interrupted segment (cancellation, deadline, interrupt finish) no longer
        apply to anything opened after it. Kept rows keep their lines."""
        for row_index in record.rerun_rows:
            self.forget_row(row_index)
        self._run = [line for line in _decoded(self._run) if run_wide_terminal(line.record) is None]

    def forget_row(self, row_index: int) -> None:
        """Drop a finished row's lines (its receipts are published) to bound memory."""
        self._file()
        self._rows.pop(row_index, None)
        for cell_id in self._cells_of_row.pop(row_index, []):
            self._cells.pop(cell_id, None)

    def __repr__(self) -> str:
        return (
            f"<JournalIndex last_seq={self.last_seq} run_lines={len(self._run)} "
            f"rows={len(self._rows)} cells={len(self._cells)}>"
        )


_ROW_SCOPE: Final = re.compile(r"cell-(\d{4,})/")


def _row_of_scope(cell_id: str) -> int | None:
    """The row of a scope named after its row directory (``cell-NNNN/...``), if any."""
    match = _ROW_SCOPE.match(cell_id)
    return int(match.group(1)) if match else None


def _seq(line: JournalLine) -> int:
    return line.seq


def _decoded(lines: list[JournalLine | bytes]) -> list[JournalLine]:
    """``lines`` with every line still in bytes decoded, in place, so each is decoded once."""
    for position, line in enumerate(lines):
        if type(line) is bytes:
            lines[position] = decode_line(line)
    return lines  # type: ignore[return-value]  # every member is decoded now


def _row_of(record: object) -> int | None:
    if isinstance(record, RowOpened | CorrectnessTopologyRan | CorrectnessVerdict):
        return record.row_index
    if isinstance(record, Transition) and record.machine in (
        ROW_TABLE.name,
        CORRECTNESS_TABLE.name,
    ):
        return record.row_index
    if isinstance(record, ReceiptPublished) and record.scope == "row":
        return record.row_index
    return None
