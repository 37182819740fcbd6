"""The matrix fold: journal lines in, ``cache-family-matrix.json`` out. Pure, live = replay.

Every planned row is journaled with ``row_opened`` (one never reached is opened and stopped at
once), so the journal alone names the whole plan. The matrix is completed only if every measured
row is; a run-wide terminal refusal lowers it to incomplete; synthetic rows are named so in
``scope``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from cache_family.errors import Refused
from cache_family.schemas.journal import (
    ClientCalibrated,
    ReceiptPublished,
    ReportFailed,
    RowOpened,
    RunStarted,
)
from cache_family.schemas.matrix import (
    MATRIX_SCOPE,
    MATRIX_SCOPE_SYNTHETIC,
    MatrixCatalog,
    MatrixReceipt,
    MatrixRow,
    MatrixRowResult,
    encode_matrix,
)
from cache_family.schemas.production import ProducerRow, encode_production
from cache_family.schemas.receipts import ReceiptStatus, RowReceipt
from cache_family.states.fold import (
    JournalIndex,
    fold_row,
    lines_through,
    run_wide_terminal,
)
from cache_family.states.projection import project_row
from cache_family.states.receipts import MEASURED_CHAIN, meet_all, terminal_downgrade

SCOPE_PRODUCTION_JSON: Final = "production-json"
SCOPE_PRODUCTION_MD: Final = "production-md"
PRODUCTION_SCOPES: Final = (SCOPE_PRODUCTION_JSON, SCOPE_PRODUCTION_MD)

# Row statuses on the measured chain; unmeasured ones (missing-model, not-launched, ...) never
# lower the matrix by themselves.
_MEASURED: Final[dict[str, ReceiptStatus]] = {status: status for status in MEASURED_CHAIN}

# No cell is ever named this, so the index's view of it holds exactly the run-wide lines.
_NO_CELL = ""


def fold_matrix(index: JournalIndex, *, through_seq: int) -> MatrixReceipt:
    """The matrix receipt from the journal lines with ``seq <= through_seq``."""
    run: RunStarted | None = None
    terminal: str | None = None
    reports = _ReportFiles()
    calibrated: ClientCalibrated | None = None
    for line in lines_through(index.lines_for_cell(_NO_CELL), through_seq):
        record = line.record
        if isinstance(record, RunStarted) and run is None:
            run = record
        found = run_wide_terminal(record)
        if found is not None and terminal is None:
            terminal = found
        reports.apply(record)
        if isinstance(record, ClientCalibrated) and calibrated is None:
            calibrated = record
    if run is None:
        raise Refused.one(
            "fold.matrix.no_run",
            "$.journal",
            "the journal has no run_started record",
            "a matrix can only be folded from a run's journal",
        )

    rows: list[MatrixRow] = []
    for folded in _folded_rows(index, through_seq):
        opened, receipt = folded.opened, folded.receipt
        # A folded row's label also counts its cells' (the row receipt says the same).
        synthetic = opened.synthetic or run.catalog_synthetic
        if opened.model_status == "missing-model":
            result = MatrixRowResult(status="missing-model", launched=False)
        elif folded.published is not None:
            result = MatrixRowResult(status=receipt.status, evidence=folded.published.path)
            synthetic = receipt.synthetic
        else:
            result = MatrixRowResult(status=receipt.status, reason=receipt.reason)
            synthetic = receipt.synthetic
        rows.append(
            MatrixRow(
                index=folded.index,
                case=opened.case_key,
                prefix_tokens=opened.prefix_tokens,
                use_case=opened.use_case,
                result=result,
                synthetic=synthetic,
            )
        )
    rows.sort(key=lambda row: row.index)

    measured = [_MEASURED[row.result.status] for row in rows if row.result.status in _MEASURED]
    status: ReceiptStatus = meet_all(measured)
    if terminal is not None:
        status = terminal_downgrade(status)
    synthetic = run.catalog_synthetic or any(row.synthetic for row in rows)
    return MatrixReceipt(
        status=status,
        scope=MATRIX_SCOPE_SYNTHETIC if synthetic else MATRIX_SCOPE,
        request_sha256=run.request_sha256,
        catalog_sha256=run.catalog_sha256,
        planned_cells=len(rows),
        rows=tuple(rows),
        promotion=None,
        terminal_refusal=terminal,
        journal_through_seq=through_seq,
        catalog=MatrixCatalog(
            path=run.catalog_path,
            sha256=run.catalog_sha256,
            synthetic=run.catalog_synthetic,
            packaged=run.catalog_packaged,
        ),
        report_error=reports.error(),
        report=reports.published.get(SCOPE_PRODUCTION_MD),
        report_input=reports.published.get(SCOPE_PRODUCTION_JSON),
        client_calibration=calibrated.calibration if calibrated is not None else None,
        client_calibration_error=calibrated.error if calibrated is not None else None,
    )


@dataclass(slots=True)
class _ReportFiles:
    """The run's report files as the journal last saw them: published, or failed and why."""

    published: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    def apply(self, record: object) -> None:
        if isinstance(record, ReceiptPublished) and record.scope in PRODUCTION_SCOPES:
            self.published[record.scope] = record.path
            self.failed.pop(record.path, None)
        elif isinstance(record, ReportFailed):
            self.failed[record.path] = record.detail
            for scope, path in list(self.published.items()):
                if path == record.path:
                    del self.published[scope]

    def error(self) -> str | None:
        if self.failed:
            return "; ".join(f"{path}: {detail}" for path, detail in sorted(self.failed.items()))
        if len(self.published) < len(PRODUCTION_SCOPES):
            return "the report files were not written"
        return None


@dataclass(frozen=True, slots=True)
class _FoldedRow:
    index: int
    opened: RowOpened
    published: ReceiptPublished | None
    receipt: RowReceipt


def _folded_rows(index: JournalIndex, through_seq: int) -> list[_FoldedRow]:
    """Every journaled row in index order with its receipt: as published (folded through its
    publication) or, for a row that published none, as the journal leaves it."""
    out: list[_FoldedRow] = []
    for row_index in index.row_indices():
        lines = list(lines_through(index.lines_for_row(row_index), through_seq))
        opened = next(
            (
                line.record
                for line in lines
                if isinstance(line.record, RowOpened) and line.record.row_index == row_index
            ),
            None,
        )
        if opened is None:
            continue
        published = next(
            (
                line.record
                for line in reversed(lines)
                if isinstance(line.record, ReceiptPublished)
                and line.record.scope == "row"
                and line.record.row_index == row_index
            ),
            None,
        )
        through = published.through_seq if published is not None else through_seq
        receipt = fold_row(lines, row_index, through_seq=through)
        out.append(_FoldedRow(row_index, opened, published, receipt))
    out.sort(key=lambda row: row.index)
    return out


def fold_production(index: JournalIndex, *, through_seq: int) -> tuple[ProducerRow, ...]:
    """``production-cache-bench.json``'s rows: one per planned row of ``run_started``, in
    plan order; a row never launched (missing model, never reached) is unmeasured."""
    run = next(
        (
            line.record
            for line in lines_through(index.lines_for_cell(_NO_CELL), through_seq)
            if isinstance(line.record, RunStarted)
        ),
        None,
    )
    if run is None:
        raise Refused.one(
            "fold.matrix.no_run",
            "$.journal",
            "the journal has no run_started record",
            "the report rows can only be folded from a run's journal",
        )
    folded = {row.index: row for row in _folded_rows(index, through_seq)}
    rows: list[ProducerRow] = []
    for brief in run.planned_rows:
        found = folded.get(brief.index)
        if found is not None and found.opened.row_dir:
            row = found.receipt.producer_report_row
            if row is not None:
                rows.append(row)
                continue
        synthetic = brief.synthetic or run.catalog_synthetic
        rows.append(project_row(brief, None, synthetic=synthetic))
    return tuple(rows)


def refold_production(index: JournalIndex, published: ReceiptPublished) -> bytes:
    return encode_production(fold_production(index, through_seq=published.through_seq))


def refold_matrix(index: JournalIndex, published: ReceiptPublished) -> bytes:
    return encode_matrix(fold_matrix(index, through_seq=published.through_seq))
