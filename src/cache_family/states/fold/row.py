"""The row's fold: its identity, its row machine, its correctness arm and a cell fold per cell.

Folds ``row.json`` from the row's lines and its cells' (``JournalIndex.lines_for_row``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from cache_family.errors import Refused
from cache_family.schemas.journal import (
    CellOpened,
    CorrectnessTopologyRan,
    CorrectnessVerdict,
    JournalLine,
    ReceiptPublished,
    RowOpened,
    RunStarted,
    Transition,
)
from cache_family.schemas.receipts import (
    ArmObservation,
    CellReceipt,
    ParityVerdict,
    ReceiptStatus,
    RowReceipt,
    RungBrief,
    TerminalRefusal,
    evidence_class,
)
from cache_family.states.cell import (
    ROW_TABLE,
    RowEvent,
    RowState,
)
from cache_family.states.fold.cell import CellFold
from cache_family.states.fold.correctness import CorrectnessFold
from cache_family.states.fold.lines import (
    _apply_through,
    _scope_cell,
    _synthetic,
    _table_step,
    _terminal_of,
    real_evidence_class,
)
from cache_family.states.parity import ARM_NEW, ARM_OLD, observation_order, row_parity
from cache_family.states.projection import planned_row, project_row
from cache_family.states.receipts import meet, meet_all, terminal_downgrade


class RowFold:
    """Incremental fold of one row: its identity, its row machine and a CellFold per cell."""

    def __init__(self, row_index: int) -> None:
        self.row_index = row_index
        self.run: RunStarted | None = None
        self.opened: RowOpened | None = None
        self.state = RowState.CORRECTNESS
        self.lifecycle: list[str] = [RowState.CORRECTNESS.value]
        self.terminal_refusal: TerminalRefusal | None = None
        self.invalid_transitions: list[str] = []
        self.cells: dict[str, CellFold] = {}
        self._run_lines: list[JournalLine] = []
        self.last_seq = 0
        self.done_seq: int | None = None
        self.correctness = CorrectnessFold()

    def apply(self, line: JournalLine) -> None:
        if line.seq <= self.last_seq:
            return
        self.last_seq = line.seq
        record = line.record
        if isinstance(record, CorrectnessTopologyRan | CorrectnessVerdict):
            if record.row_index == self.row_index:
                self.correctness.apply(record)
            return
        cell_id = _scope_cell(record)
        if isinstance(record, CellOpened) and record.row_index == self.row_index:
            fold = CellFold(record.cell_id)
            for earlier in self._run_lines:
                fold.apply(earlier)
            self.cells.setdefault(record.cell_id, fold)
        if cell_id is not None:
            if cell_id in self.cells:
                self.cells[cell_id].apply(line)
            return
        if isinstance(record, RowOpened):
            if record.row_index == self.row_index and self.opened is None:
                self.opened = record
            return
        if isinstance(record, Transition):
            if record.machine == ROW_TABLE.name and record.row_index == self.row_index:
                self._transition(record)
            return
        if isinstance(record, ReceiptPublished):
            return
        # Run-wide: every cell of the row sees it, including cells opened later.
        self._run_lines.append(line)
        for fold in self.cells.values():
            fold.apply(line)
        if isinstance(record, RunStarted):
            self.run = record
        terminal = _terminal_of(record)
        if terminal is not None and self.done_seq is None and self.terminal_refusal is None:
            self.terminal_refusal = terminal

    def _transition(self, record: Transition) -> None:
        step = _table_step(ROW_TABLE, RowState, RowEvent, record, self.state)
        if isinstance(step, str):
            self.invalid_transitions.append(step)
            return
        _, _, to_state = step
        if to_state != self.state:
            self.lifecycle.append(to_state.value)
        self.state = to_state
        if to_state == RowState.DONE:
            self.done_seq = self.last_seq

    def receipt(self, *, through_seq: int | None = None) -> RowReceipt:
        opened = self.opened
        through = self.last_seq if through_seq is None else through_seq
        # Parity compares the paired cells' requests by the digests their facts keep.
        cell_receipts = [
            fold.receipt(through_seq=through, rows=fold.digest_rows) for fold in self.cells.values()
        ]
        observations: list[ArmObservation] = []
        planned_statuses: list[ReceiptStatus] = []
        used: set[str] = set()
        launched_any = False
        for plan in opened.arms if opened else ():
            if plan.status != "planned":
                unplanned: ReceiptStatus = (
                    "unavailable" if plan.status == "unavailable" else "skipped"
                )
                observations.append(
                    ArmObservation(
                        arm=plan.arm, planned=plan.status, status=unplanned, reason=plan.reason
                    )
                )
                continue
            mine = [r for r in cell_receipts if r.arm == plan.arm and r.cell_id not in used]
            skip = self.correctness.skip_reason()
            if not mine and skip is not None:
                observations.append(
                    ArmObservation(arm=plan.arm, planned="planned", status="skipped", reason=skip)
                )
                continue
            if not mine:
                stopped = self.terminal_refusal is not None
                observations.append(
                    ArmObservation(
                        arm=plan.arm,
                        planned="planned",
                        status="not-launched" if stopped else "not-run",
                        reason="cancellation_or_deadline" if stopped else "arm_never_started",
                        terminal_refusal=self.terminal_refusal,
                    )
                )
                planned_statuses.append("incomplete")
                continue
            for cell in mine:
                used.add(cell.cell_id)
                launched_any = True
                observations.append(_observation(cell, "planned"))
                planned_statuses.append(cell.status)
        for cell in cell_receipts:
            if cell.cell_id not in used:
                launched_any = True
                observations.append(_observation(cell, "unplanned"))

        reason: str | None = None
        status: ReceiptStatus = "completed"
        if opened is None:
            status, reason = "not-run", "row_never_opened"
        elif opened.model_status == "missing-model":
            status, reason = "missing-model", "missing-model"
        elif (shortfall := self.correctness.shortfall(self.terminal_refusal)) is not None:
            # A row whose correctness did not pass is never completed (nor promoted).
            status, reason = shortfall
            if planned_statuses:
                status = meet(status, meet_all(planned_statuses))
            if self.terminal_refusal is not None:
                status = terminal_downgrade(status)
        elif not planned_statuses:
            status, reason = "unmeasured", "no_native_arm_planned"
        elif not launched_any and self.terminal_refusal is not None:
            status, reason = "not-launched", "cancellation_or_deadline"
        else:
            status = meet_all(planned_statuses)
            if self.terminal_refusal is not None:
                status = terminal_downgrade(status)
            if not ROW_TABLE.policy(self.state).finished or self.invalid_transitions:
                status = meet(status, "incomplete")
                reason = (
                    "journal_transition_invalid"
                    if self.invalid_transitions
                    else "journal_ended_before_finalize"
                )
        parity = _paired_parity(opened, cell_receipts)
        if parity and status == "completed" and not all(p.matches for p in parity):
            # The row completes only with accepted parity at every rung.
            status = "incomplete"
            reason = "parity_not_accepted"
        terminal = self.terminal_refusal or next(
            (c.terminal_refusal for c in cell_receipts if c.terminal_refusal), None
        )
        if reason is None and status != "completed":
            reason = _first_shortfall(observations) or terminal
        run = self.run
        synthetic = _synthetic(run, opened) or any(c.synthetic for c in cell_receipts)
        brief = planned_row(run, self.row_index)
        real = (
            None
            if synthetic
            else real_evidence_class(
                run, brief.model_id if brief else "", opened.load_average if opened else None
            )
        )
        receipt = RowReceipt(
            run_id=run.run_id if run else "",
            request_sha256=run.request_sha256 if run else "",
            catalog_sha256=run.catalog_sha256 if run else "",
            row_index=self.row_index,
            row_key=opened.row_key if opened else None,
            case_key=opened.case_key if opened else None,
            prefix_tokens=opened.prefix_tokens if opened else None,
            use_case=opened.use_case if opened else None,
            row_dir=opened.row_dir if opened else None,
            model_status=opened.model_status if opened else "unknown",
            status=status,
            reason=reason,
            terminal_refusal=terminal,
            lifecycle=tuple(self.lifecycle),
            final_state=self.state.value,
            observations=tuple(observations),
            journal_through_seq=through,
            correctness=self.correctness.observation(opened, self.terminal_refusal),
            synthetic=synthetic,
            evidence_class=evidence_class(synthetic) or real,
            parity=parity,
            observation_order=observation_order(observations, parity),
        )
        return msgspec.structs.replace(
            receipt,
            producer_report_row=project_row(
                brief, receipt, synthetic=synthetic, real_evidence=real
            ),
        )


def _paired_parity(
    opened: RowOpened | None, cells: Sequence[CellReceipt]
) -> tuple[ParityVerdict, ...]:
    """Parity per planned rung when the row planned both old and new arms."""
    planned = {a.arm for a in opened.arms if a.status == "planned"} if opened else set()
    if not {ARM_OLD, ARM_NEW} <= planned:
        return ()
    old = next((c for c in cells if c.arm == ARM_OLD), None)
    new = next((c for c in cells if c.arm == ARM_NEW), None)
    ladder = next((c for c in (old, new) if c is not None), None)
    if ladder is None:
        return ()
    return row_parity([r.concurrency for r in ladder.measurement.rungs], old, new)


def _first_shortfall(observations: Iterable[ArmObservation]) -> str | None:
    """Why a row fell short: the reason of its first planned arm that did not complete."""
    for observation in observations:
        if observation.planned == "planned" and observation.status != "completed":
            return observation.reason or observation.status
    return None


def _cell_reason(cell: CellReceipt) -> str | None:
    """An arm's reason: the cell's first fault, else what else kept it from completing (a
    terminal refusal, or a measurement that is not whole, e.g. a rung that ended early)."""
    if cell.faults:
        return cell.faults[0].kind
    if cell.status == "completed":
        return None
    if cell.terminal_refusal is not None:
        return cell.terminal_refusal
    if not cell.measurement.complete:
        return "measurement_incomplete"
    return None


def _observation(cell: CellReceipt, planned: str) -> ArmObservation:
    return ArmObservation(
        arm=cell.arm or "",
        planned=planned,
        status=cell.status,
        reason=_cell_reason(cell),
        cell_id=cell.cell_id,
        cell_dir=cell.cell_dir,
        terminal_refusal=cell.terminal_refusal,
        accepted_for_parity=cell.accepted_for_parity,
        rungs=tuple(
            RungBrief(
                rung_index=rung.rung_index,
                concurrency=rung.concurrency,
                status=rung.status,
                rung_summary=rung.rung_summary,
                serial_summary=rung.serial_summary,
            )
            for rung in cell.measurement.rungs
        ),
    )


def fold_row(
    lines: Iterable[JournalLine], row_index: int, *, through_seq: int | None = None
) -> RowReceipt:
    """The native part of ``row.json`` for ``row_index`` from lines up to ``through_seq``."""
    fold = RowFold(row_index)
    through = _apply_through(fold, lines, through_seq)
    if fold.opened is None:
        raise Refused.one(
            "fold.row.unknown",
            "$.row_index",
            f"the journal opens no row {row_index}",
            "check the row index; a receipt can only be folded for a journaled row",
        )
    return fold.receipt(through_seq=through)
