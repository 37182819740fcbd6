"""The fold: journal lines in, receipts out. Pure, deterministic, and the same live and in replay.

A receipt is folded through an explicit ``through_seq``: only lines with ``seq <= through_seq``
count, and the receipt records that number. The live run folds with the seq the writer had made
durable; ``cache-family replay`` refolds with the seq the journal's ``receipt_published`` record
names, so both see exactly the same lines and produce the same bytes.

Rules the fold applies (see ``states/receipts.py`` for the lattice):

* Each fold keeps a *ceiling* that starts at ``completed`` and is only ever lowered.
* A fault before the host is ready (``pin-verify``, ``not-launched``, ``launch``) lowers it to
  ``failed``; a fault afterwards to ``incomplete`` (observations are kept).
* Pins that differ before launch: ``failed``. Pins that differ after the run (drift), a rung
  against a different host, or any of ``HostCleanup.problems()`` (unclean custody, a truncated
  output capture): ``incomplete``, measurements kept, parity refused.
* Cancellation, deadline expiry and a failed interrupt-finish set ``terminal_refusal`` (the
  first one wins) and lower the ceiling to ``incomplete``. Run-wide ones apply to every cell
  and row that had not reached ``done`` when they were journaled.
* At ``finalize`` the receipt is ``completed`` only if the ceiling still is and the evidence is
  whole: ready, every planned rung completed with a summarisable roster, every pin re-observed
  unchanged, clean cleanup. A journal that stops before ``finalize`` folds to ``incomplete``.
* Transition records are replayed through the machine tables; a step the table does not allow
  is itself a fault (``journal_transition_invalid``).
* A cell or row is ``synthetic`` when its ``cell_opened`` / ``row_opened`` says so or the run's
  catalog is synthetic (``run_started``); a synthetic receipt carries
  ``SYNTHETIC_EVIDENCE_CLASS``. Like a downgrade, the label is only ever added: a row from a
  synthetic catalog is never presented as real evidence, whatever its own flag says.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from enum import StrEnum
from typing import Any, Final, TypeVar

import msgspec

from cache_family.errors import Refused
from cache_family.schemas import request_rows
from cache_family.schemas.arms import WORKLOAD_KINDS
from cache_family.schemas.journal import (
    Cancellation,
    CellOpened,
    ChildSpawned,
    CleanupOutcome,
    CorrectnessTopologyRan,
    CorrectnessVerdict,
    DeadlineExpired,
    Fault,
    InterruptFinishFailed,
    JournalLine,
    ListeningMarkerSeen,
    PinDrift,
    PinObserved,
    PortReserved,
    Ready,
    ReceiptPublished,
    Record,
    RowOpened,
    RungCompleted,
    RungRows,
    RunResumed,
    RunStarted,
    Transition,
    WarmupExclusion,
    decode_line,
)
from cache_family.schemas.measurement import (
    CacheTally,
    HostCleanup,
    RequestRow,
    RungSummary,
    SerialSummary,
)
from cache_family.schemas.receipts import (
    CORRECTNESS_UNRECORDED,
    ArmObservation,
    CacheVerdict,
    CellReceipt,
    CorrectnessObservation,
    CorrectnessTopology,
    FaultEntry,
    HostIdentity,
    Measurement,
    ParityVerdict,
    PinEntry,
    Readiness,
    ReceiptStatus,
    RowReceipt,
    RungBrief,
    RungReceipt,
    TerminalRefusal,
    encode_receipt,
    evidence_class,
)
from cache_family.schemas.request_rows import RequestRowLine, RowsFileDigest
from cache_family.states.cache_reuse import verdicts_of_tallies
from cache_family.states.calibration import (
    NEAR_OVERHEAD_FACTOR,
    near_client_overhead,
    rung_latencies,
)
from cache_family.states.cell import (
    CELL_TABLE,
    CORRECTNESS_TABLE,
    ROW_TABLE,
    CellEvent,
    CellState,
    MachineTable,
    RowEvent,
    RowState,
)
from cache_family.states.parity import ARM_NEW, ARM_OLD, observation_order, row_parity
from cache_family.states.projection import planned_row, project_row
from cache_family.states.receipts import meet, meet_all, terminal_downgrade

_TERMINAL_EVENTS: Final[dict[str, TerminalRefusal]] = {
    CellEvent.CANCELLED.value: "cancelled",
    CellEvent.DEADLINE_EXPIRED.value: "deadline_expired",
}


def _terminal_of(record: object) -> TerminalRefusal | None:
    if isinstance(record, Cancellation):
        return "cancelled"
    if isinstance(record, DeadlineExpired):
        return "deadline_expired"
    if isinstance(record, InterruptFinishFailed):
        return "interrupt_finish_failed"
    return None


def run_wide_terminal(record: object) -> TerminalRefusal | None:
    """The terminal refusal a run-wide record (one naming no cell) stands for, if any."""
    return _terminal_of(record) if _scope_cell(record) is None else None


def _synthetic(run: RunStarted | None, opened: CellOpened | RowOpened | None) -> bool:
    """Synthetic if the opening record or the run's catalog says so (the label only adds)."""
    return (opened is not None and opened.synthetic) or (run is not None and run.catalog_synthetic)


def _scope_cell(record: object) -> str | None:
    """The cell a record belongs to, or None for run-wide records."""
    cell_id = getattr(record, "cell_id", None)
    return cell_id if isinstance(cell_id, str) else None


_State = TypeVar("_State", bound=StrEnum)
_Event = TypeVar("_Event", bound=StrEnum)


def _table_step(
    table: MachineTable[_State, _Event, Any],
    states: type[_State],
    events: type[_Event],
    record: Transition,
    current: _State,
) -> tuple[_State, _Event, _State] | str:
    """The step a transition record claims, if the table allows it from ``current``; else
    what is wrong with it (the fold journals that as an invalid transition)."""
    try:
        from_state = states(record.from_state)
        event = events(record.event)
        to_state = states(record.to_state)
    except ValueError:
        return f"unknown name in {record}"
    step = table.rows.get((from_state, event))
    if from_state != current or step is None or step.to != to_state:
        return f"{record.from_state} --{record.event}--> {record.to_state} while in {current.value}"
    return from_state, event, to_state


class CellFold:
    """Incremental fold of one cell. ``apply`` every line in seq order, then ``receipt``."""

    def __init__(self, cell_id: str) -> None:
        self.cell_id = cell_id
        self.run: RunStarted | None = None
        self.opened: CellOpened | None = None
        self.state = CellState.PIN_VERIFY
        self.lifecycle: list[str] = [CellState.PIN_VERIFY.value]
        self.ceiling: ReceiptStatus = "completed"
        self.terminal_refusal: TerminalRefusal | None = None
        self.parity_refused = False
        self.faults: list[FaultEntry] = []
        self.host: ChildSpawned | None = None
        self.port: int | None = None
        self.marker: ListeningMarkerSeen | None = None
        self.ready: Ready | None = None
        self.pins_before: dict[str, PinEntry] = {}
        self.pins_after: dict[str, PinEntry] = {}
        self.drifted = False
        self.cleanup: HostCleanup | None = None
        # The cell's ``rung_rows`` records in journal order: its rows file, segment by segment.
        self.segments: list[RungRows] = []
        self.rung_concurrency: dict[int, int] = {}
        self.rungs: dict[int, RungCompleted] = {}
        self.host_retained: dict[int, bool | None] = {}
        self.exclusions: dict[int, list[int]] = {}
        self.last_seq = 0
        self.done_seq: int | None = None

    # -- lowering ---------------------------------------------------------------------------

    def _lower(self, status: ReceiptStatus) -> None:
        self.ceiling = meet(self.ceiling, status)

    def _note_fault(self, seq: int | None, kind: str, detail: str) -> None:
        self.faults.append(FaultEntry(seq=seq, kind=kind, state=self.state.value, detail=detail))

    def _fault(self, seq: int | None, kind: str, detail: str = "") -> None:
        self._note_fault(seq, kind, detail)
        self._lower(CELL_TABLE.policy(self.state).on_fault)

    def _refuse_parity(self) -> None:
        """Late failures keep the observations but refuse parity."""
        self._lower("incomplete")
        self.parity_refused = True

    def _custody_fault(self, seq: int | None, kind: str, detail: str) -> None:
        self._note_fault(seq, kind, detail)
        self._refuse_parity()

    def _terminal(self, refusal: TerminalRefusal) -> None:
        if self.terminal_refusal is None:
            self.terminal_refusal = refusal
        self.ceiling = terminal_downgrade(self.ceiling)
        self.parity_refused = True

    # -- applying lines ---------------------------------------------------------------------

    def apply(self, line: JournalLine) -> None:
        if line.seq <= self.last_seq:
            return  # a line seen twice (merged views) changes nothing
        self.last_seq = line.seq
        record = line.record
        seq = line.seq
        if isinstance(record, RunStarted):
            self.run = record
            return
        terminal = _terminal_of(record)
        if terminal is not None:
            scope = _scope_cell(record)
            if scope == self.cell_id or (scope is None and self.done_seq is None):
                self._terminal(terminal)
            return
        if _scope_cell(record) != self.cell_id:
            return
        if isinstance(record, CellOpened):
            if self.opened is None:
                self.opened = record
        elif isinstance(record, Transition):
            if record.machine == CELL_TABLE.name:
                self._transition(seq, record)
        elif isinstance(record, Fault):
            self._fault(seq, record.kind, record.detail)
        elif isinstance(record, PinObserved | PinDrift):
            self._pin(seq, record)
        elif isinstance(record, PortReserved):
            self.port = record.port
        elif isinstance(record, ChildSpawned):
            if record.role != "host":
                return
            if self.host is not None:
                self._fault(seq, "host_respawned", f"second host pid {record.pid}")
            else:
                self.host = record
        elif isinstance(record, ListeningMarkerSeen):
            self.marker = record
            if self.port is None:
                self.port = record.port
        elif isinstance(record, Ready):
            self.ready = record
        elif isinstance(record, WarmupExclusion):
            self.exclusions.setdefault(record.rung_index, []).extend(record.request_ids)
        elif isinstance(record, RungRows):
            self.segments.append(record)
            self.rung_concurrency.setdefault(record.rung_index, record.concurrency)
        elif isinstance(record, RungCompleted):
            self._rung(seq, record)
        elif isinstance(record, CleanupOutcome):
            self._cleanup(seq, record)

    def _transition(self, seq: int, record: Transition) -> None:
        step = _table_step(CELL_TABLE, CellState, CellEvent, record, self.state)
        if isinstance(step, str):
            self._fault(seq, "journal_transition_invalid", step)
            return
        from_state, event, to_state = step
        on_fault = CELL_TABLE.policy(from_state).on_fault
        if event == CellEvent.PINS_MISMATCH:
            if from_state == CellState.POST_VERIFY:
                self.drifted = True
                self._refuse_parity()
            else:
                self._lower(on_fault)
        elif event == CellEvent.FAULT:
            self._lower(on_fault)
        elif event.value in _TERMINAL_EVENTS:
            self._terminal(_TERMINAL_EVENTS[event.value])
        if to_state != self.state:
            self.lifecycle.append(to_state.value)
        self.state = to_state
        if to_state == CellState.DONE:
            self.done_seq = seq

    def _pin(self, seq: int, record: PinObserved | PinDrift) -> None:
        matches = record.observed_sha256 == record.expected_sha256
        entry = PinEntry(
            name=record.name,
            path=record.path,
            expected_sha256=record.expected_sha256,
            observed_sha256=record.observed_sha256,
            matches=matches,
        )
        table = self.pins_after if record.phase == "after" else self.pins_before
        if isinstance(record, PinObserved) or record.name not in table:
            table[record.name] = entry
        if matches and isinstance(record, PinObserved):
            return
        # Drift after the ladder keeps the measurements; a pin that differs before launch fails.
        if record.phase == "after":
            self.drifted = True
            self._refuse_parity()
        else:
            self._lower("failed")
        if isinstance(record, PinDrift):
            detail = (
                f"{record.name}: expected {record.expected_sha256}, got {record.observed_sha256}"
            )
            self._note_fault(seq, "pin_drift", detail)

    def _rung(self, seq: int, record: RungCompleted) -> None:
        self.rungs[record.rung_index] = record
        self.rung_concurrency.setdefault(record.rung_index, record.concurrency)
        retained: bool | None = None
        if record.host_pid is not None and self.host is not None:
            retained = (record.host_pid, record.host_create_time) == (
                self.host.pid,
                self.host.create_time,
            )
            if not retained:
                self._custody_fault(
                    seq,
                    "host_identity_changed",
                    f"rung {record.rung_index} ran against pid {record.host_pid} "
                    f"created {record.host_create_time}, not pid {self.host.pid}",
                )
        self.host_retained[record.rung_index] = retained
        if record.status != "completed":
            self._lower("incomplete")

    def _cleanup(self, seq: int, record: CleanupOutcome) -> None:
        self.cleanup = record.cleanup
        for kind, detail in record.cleanup.problems():
            self._custody_fault(seq, kind, detail)

    # -- the receipt -----------------------------------------------------------------------

    def receipt(
        self, *, through_seq: int | None = None, rows: RowsSource | None = None
    ) -> CellReceipt:
        """The cell's receipt as of the lines applied so far (pure; call any time). A cell of
        at most ``INLINE_ROWS_MAX`` rows lists them inline, read through ``rows`` (without
        it, none are listed: a row's fold needs only the summaries); a larger one names its
        rows file instead (``Measurement.rows_file``)."""
        status = self.ceiling
        faults = list(self.faults)
        measurement, measurement_problems = self._measurement(rows)

        def inferred(kind: str, detail: str) -> None:
            nonlocal status
            faults.append(FaultEntry(seq=None, kind=kind, state=self.state.value, detail=detail))
            status = meet(status, "incomplete")

        if not CELL_TABLE.policy(self.state).finished:
            inferred("journal_ended_before_finalize", f"last state {self.state.value}")
        elif status == "completed":
            if self.ready is None:
                inferred("readiness_unrecorded", "no ready record")
            if not self.pins_before:
                inferred("pins_unrecorded", "no pin was observed before launch")
            for problem in measurement_problems:
                inferred("measurement_incomplete", problem)
            missing_after = sorted(set(self.pins_before) - set(self.pins_after))
            if missing_after:
                inferred("post_verify_unrecorded", f"pins not re-observed: {missing_after}")
            if self.cleanup is None:
                inferred("cleanup_unrecorded", "no cleanup outcome")
        opened = self.opened
        run = self.run
        host = self.host
        synthetic = _synthetic(run, opened)
        receipt = CellReceipt(
            run_id=run.run_id if run else "",
            request_sha256=run.request_sha256 if run else "",
            catalog_sha256=run.catalog_sha256 if run else "",
            cell_id=self.cell_id,
            row_index=opened.row_index if opened else None,
            row_key=opened.row_key if opened else None,
            arm=opened.arm if opened else None,
            cohort=opened.cohort if opened else None,
            cell_dir=opened.cell_dir if opened else None,
            host=HostIdentity(
                pid=host.pid,
                create_time=host.create_time,
                pgid=host.pgid,
                argv_sha256=host.argv_sha256,
                executable=host.executable,
            )
            if host
            else None,
            status=status,
            terminal_refusal=self.terminal_refusal,
            accepted_for_parity=status == "completed" and not self.parity_refused,
            faults=tuple(faults),
            lifecycle=tuple(self.lifecycle),
            final_state=self.state.value,
            readiness=Readiness(
                port=self.port,
                marker_seen=self.marker is not None,
                marker=self.marker.marker if self.marker else None,
                ready=self.ready is not None,
                url=self.ready.url if self.ready else None,
                attempts=self.ready.attempts if self.ready else 0,
                elapsed_ms=self.ready.elapsed_ms if self.ready else None,
            ),
            before_identity=tuple(self.pins_before.values()),
            after_identity=tuple(self.pins_after.values()),
            pins_drifted=self.drifted,
            cleanup=self.cleanup,
            measurement=measurement,
            journal_through_seq=self.last_seq if through_seq is None else through_seq,
            synthetic=synthetic,
            evidence_class=evidence_class(synthetic),
        )
        return receipt

    def digest_rows(self, segments: Sequence[RungRows]) -> Iterator[RequestRowLine]:
        """A ``RowsSource`` from the journal alone: the rows of every rung whose facts keep
        its requests' digests, as rows that hold only those (what parity compares)."""
        del segments  # the facts already cover every segment of their rung
        for index, record in sorted(self.rungs.items()):
            for digest in record.tally.digests if record.tally else ():
                yield RequestRowLine(
                    rung_index=index,
                    concurrency=record.concurrency,
                    row=RequestRow(
                        request_id=digest.request_id,
                        status=digest.status,
                        content_sha256=digest.content_sha256,
                        first_chunk_sha256=digest.first_chunk_sha256,
                    ),
                )

    def _rows(
        self, rows: RowsSource | None, problems: list[str]
    ) -> tuple[dict[int, list[RequestRow]], RowsFileDigest | None]:
        """The rows listed inline by rung, or the rows file the receipt names instead."""
        segments = self.segments
        expected_first = 0
        for segment in segments:
            if segment.path != segments[0].path or segment.first_line != expected_first:
                problems.append(
                    f"rung {segment.rung_index}'s rows are not the next lines of the rows file"
                    f" (line {segment.first_line} of {segment.path}, expected {expected_first})"
                )
            expected_first = segment.first_line + segment.count
        inline: dict[int, list[RequestRow]] = {}
        if sum(segment.count for segment in segments) > request_rows.INLINE_ROWS_MAX:
            last = segments[-1]
            return inline, RowsFileDigest(
                path=last.path, count=last.first_line + last.count, sha256=last.sha256
            )
        if rows is not None and segments:
            for line in rows(segments):
                inline.setdefault(line.rung_index, []).append(line.row)
        return inline, None

    def _measurement(self, source: RowsSource | None) -> tuple[Measurement, list[str]]:
        opened = self.opened
        kind = opened.measurement_kind if opened else "concurrent"
        planned = opened.rungs if opened else ()
        journaled = {segment.rung_index for segment in self.segments}
        indices = sorted(set(range(len(planned))) | journaled | set(self.rungs))
        problems: list[str] = []
        inline, rows_file = self._rows(source, problems)
        rungs: list[RungReceipt] = []
        verdicts = self._cache_verdicts(indices)
        for index in indices:
            plan = planned[index] if index < len(planned) else None
            record = self.rungs.get(index)
            rows = tuple(sorted(inline.get(index, ()), key=lambda row: row.request_id))
            concurrency = (
                record.concurrency
                if record
                else plan.concurrency
                if plan
                else self.rung_concurrency.get(index, 0)
            )
            requested = (
                record.requested_requests
                if record
                else plan.requests
                if plan
                else sum(s.count for s in self.segments if s.rung_index == index)
            )
            rung_summary: RungSummary | None = None
            serial_summary: SerialSummary | None = None
            refusals: tuple[str, ...] = ()
            first_with_final: tuple[int, ...] = ()
            if record is not None:
                if record.tally is None:
                    refusals = ("fold.tally_missing",)
                else:
                    rung_summary = record.tally.rung_summary
                    serial_summary = record.tally.serial_summary
                    refusals = record.tally.summary_refusals
                    first_with_final = record.tally.first_content_with_final_ids
            status = record.status if record else "not-run"
            if plan is None:
                problems.append(f"rung {index} was not planned")
            elif status != "completed":
                problems.append(f"rung {index} is {status}")
            elif refusals:
                problems.append(f"rung {index} roster refused: {', '.join(refusals)}")
            elif (rung_summary is not None and not rung_summary.complete) or (
                serial_summary is not None and not serial_summary.complete
            ):
                problems.append(f"rung {index} summary is not complete")
            rungs.append(
                RungReceipt(
                    rung_index=index,
                    concurrency=concurrency,
                    requested_requests=requested,
                    status=status,
                    makespan_seconds=record.makespan_seconds if record else None,
                    prompt_sha256=record.prompt_sha256 if record else None,
                    output_tokens=record.output_tokens if record else None,
                    host_pid=record.host_pid if record else None,
                    host_create_time=record.host_create_time if record else None,
                    host_retained=self.host_retained.get(index),
                    stop_reason=record.stop_reason if record else None,
                    warmup_excluded_ids=tuple(sorted(set(self.exclusions.get(index, ())))),
                    rows=rows,
                    rung_summary=rung_summary,
                    serial_summary=serial_summary,
                    summary_refusals=refusals,
                    cache_verdict=verdicts.get(index),
                    client_overhead_ms=record.client_overhead_ms if record else None,
                    near_client_overhead=near_client_overhead(
                        rung_latencies(rung_summary, serial_summary),
                        record.client_overhead_ms if record else None,
                        (record.client_overhead_factor if record else None) or NEAR_OVERHEAD_FACTOR,
                    ),
                    first_content_with_final_ids=first_with_final if kind != "serial" else (),
                )
            )
        if not planned and kind not in WORKLOAD_KINDS:  # a workload's is in workload.json
            problems.append("no rung was planned")
        status = _measurement_status(
            planned=bool(planned),
            rungs=rungs,
            problems=problems,
            rows_journaled=bool(self.segments),
            completed_journaled=any(segment.completed for segment in self.segments),
        )
        if self.terminal_refusal is not None:
            status = terminal_downgrade(status)
        measurement = Measurement(
            kind=kind,
            complete=not problems,
            rungs=tuple(rungs),
            status=status,
            terminal_refusal=self.terminal_refusal,
            ignore_eos=opened.ignore_eos if opened else None,
            cache_shortfall_rungs=tuple(i for i, v in sorted(verdicts.items()) if v.shortfall),
            rows_file=rows_file,
        )
        return measurement, problems

    def _cache_verdicts(self, indices: Sequence[int]) -> dict[int, CacheVerdict]:
        """Each rung's cache verdict by the rule the cell opened with (none without one)."""
        expectation = self.opened.cache_expectation if self.opened else None
        if expectation is None:
            return {}
        tallies: list[CacheTally | None] = []
        for index in indices:
            record = self.rungs.get(index)
            tallies.append(record.tally.cache if record and record.tally else None)
        return dict(zip(indices, verdicts_of_tallies(expectation, tallies), strict=True))


def _measurement_status(
    *,
    planned: bool,
    rungs: Sequence[RungReceipt],
    problems: Sequence[str],
    rows_journaled: bool,
    completed_journaled: bool,
) -> ReceiptStatus:
    """The measurement level's status before any terminal refusal: ``unmeasured`` with nothing
    planned, ``not-run`` when no rung reported and no request was journaled, ``completed``
    with nothing missing, ``incomplete`` when some evidence was produced, else ``failed``."""
    if not planned:
        return "unmeasured"
    if all(rung.status == "not-run" for rung in rungs) and not rows_journaled:
        return "not-run"
    if not problems:
        return "completed"
    produced = completed_journaled or any(
        rung.status in ("completed", "incomplete") for rung in rungs
    )
    return "incomplete" if produced else "failed"


def lines_through(lines: Iterable[JournalLine], through_seq: int | None) -> Iterable[JournalLine]:
    """The lines with ``seq <= through_seq`` (all of them for None)."""
    if through_seq is None:
        return lines
    return (line for line in lines if line.seq <= through_seq)


def _apply_through(
    fold: CellFold | RowFold, lines: Iterable[JournalLine], through_seq: int | None
) -> int:
    """Apply the lines up to ``through_seq``; the seq the receipt is folded through (the last
    line applied when no bound is given)."""
    last = 0
    for line in lines_through(lines, through_seq):
        fold.apply(line)
        last = line.seq
    return last if through_seq is None else through_seq


RowsSource = Callable[[Sequence[RungRows]], Iterable[RequestRowLine]]
"""The lines of a cell's rows file that its ``rung_rows`` records name, in file order (an
actor streams them and checks each record's digest: ``actors/journal/rows_file.py``)."""


def fold_cell(
    lines: Iterable[JournalLine],
    cell_id: str,
    *,
    through_seq: int | None = None,
    rows: RowsSource | None = None,
) -> CellReceipt:
    """``cell.json`` of ``cell_id`` from the journal lines up to ``through_seq``, its inline
    rows (a cell of at most ``INLINE_ROWS_MAX``) read through ``rows``.

    ``lines`` may be the whole journal or any seq-ordered subset holding the run-wide lines and
    the cell's own (``JournalIndex.lines_for_cell``). Refused with ``fold.cell.unknown`` when
    no ``cell_opened`` record names the cell.
    """
    fold = CellFold(cell_id)
    through = _apply_through(fold, lines, through_seq)
    if fold.opened is None:
        raise Refused.one(
            "fold.cell.unknown",
            "$.cell_id",
            f"the journal opens no cell {cell_id!r}",
            "check the cell id; a receipt can only be folded for a journaled cell",
        )
    return fold.receipt(through_seq=through, rows=rows)


# --- rows -----------------------------------------------------------------------------------


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
            evidence_class=evidence_class(synthetic),
            parity=parity,
            observation_order=observation_order(observations, parity),
        )
        brief = planned_row(run, self.row_index)
        return msgspec.structs.replace(
            receipt, producer_report_row=project_row(brief, receipt, synthetic=synthetic)
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


class CorrectnessFold:
    """The row's correctness arm from its topology and verdict records."""

    def __init__(self) -> None:
        self.topologies: list[CorrectnessTopologyRan] = []
        self.verdict: CorrectnessVerdict | None = None

    def apply(self, record: CorrectnessTopologyRan | CorrectnessVerdict) -> None:
        if isinstance(record, CorrectnessVerdict):
            self.verdict = self.verdict or record
        else:
            self.topologies.append(record)

    @property
    def passed(self) -> bool:
        return self.verdict is not None and self.verdict.status == "completed"

    def shortfall(self, terminal: TerminalRefusal | None) -> tuple[ReceiptStatus, str] | None:
        """The present row's status and reason when its correctness arm did not pass (a row
        stopped before its correctness began is judged by the stop instead)."""
        if self.passed:
            return None
        if self.verdict is None and not self.topologies:
            return None if terminal is not None else ("incomplete", "correctness_not_run")
        verdict = self.verdict
        reason = (verdict.reason if verdict else None) or "correctness_incomplete"
        refused = verdict is not None and reason.startswith("correctness_report_refused")
        return ("failed" if refused else "incomplete"), reason.split(":", 1)[0]

    def skip_reason(self) -> str | None:
        """Why the planned baselines did not run: correctness did not pass."""
        if self.verdict is None or self.passed:
            return None
        return f"correctness {self.verdict.status}: baselines skipped"

    def observation(
        self, opened: RowOpened | None, terminal: TerminalRefusal | None
    ) -> CorrectnessObservation:
        if opened is None:
            return CORRECTNESS_UNRECORDED
        verdict = self.verdict
        if verdict is None and not self.topologies:
            return CorrectnessObservation(
                status=opened.correctness_status,
                reason=opened.correctness_reason,
                terminal_refusal=terminal if opened.model_status == "present" else None,
            )
        return CorrectnessObservation(
            status=verdict.status if verdict else "failed-or-incomplete",
            reason=verdict.reason if verdict else "correctness_journal_ended_before_verdict",
            planned_topologies=verdict.planned_topologies if verdict else (),
            topologies=tuple(
                CorrectnessTopology(
                    topology=t.topology,
                    status=t.status,
                    reason=t.reason,
                    evidence_dir=t.evidence_dir or None,
                    cache_storage_bytes=t.cache_storage_bytes,
                    cache_hit_import_ms=t.cache_hit_import_ms,
                    cache_hit_decode_ms=t.cache_hit_decode_ms,
                    cache_hit_total_ms=t.cache_hit_total_ms,
                    recompute_total_ms=t.recompute_total_ms,
                    benchmark_prompt_token_count=t.benchmark_prompt_token_count,
                    suffix_prefill_matches=t.suffix_prefill_matches,
                    refusal_codes=t.refusal_codes,
                )
                for t in self.topologies
            ),
            prompt_sha256=verdict.prompt_sha256 if verdict else None,
            terminal_refusal=terminal,
            suffix_prefill_matches=verdict.suffix_prefill_matches if verdict else None,
        )


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


# --- indexing and refolding -----------------------------------------------------------------


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


def _refold_row(index: JournalIndex, published: ReceiptPublished) -> bytes:
    if published.row_index is None:
        raise _bad_publication(published, "names no row_index")
    return encode_receipt(
        fold_row(
            index.lines_for_row(published.row_index),
            published.row_index,
            through_seq=published.through_seq,
        )
    )


# Receipt scopes replay can re-fold. Another pure module adds its own (the matrix receipt)
# with ``register_refolder`` at import time; ``actors/audit/replay.py`` imports such modules.
REFOLDERS: dict[str, Refolder] = {"cell": refold_cell, "row": _refold_row}


def register_refolder(scope: str, refolder: Refolder) -> None:
    existing = REFOLDERS.get(scope)
    if existing is not None and existing is not refolder:
        raise ValueError(f"a refolder for {scope!r} receipts is already registered")
    REFOLDERS[scope] = refolder


def _bad_publication(published: ReceiptPublished, why: str) -> Refused:
    return Refused.one(
        "fold.publication.invalid",
        "$.receipt_published",
        f"the {published.scope!r} publication of {published.path} {why}",
        "the journal was written by a faulty or foreign writer",
    )


def refold(index: JournalIndex, published: ReceiptPublished) -> bytes:
    """The canonical bytes the fold gives for a published receipt (what replay compares)."""
    refolder = REFOLDERS.get(published.scope)
    if refolder is None:
        raise Refused.one(
            "fold.scope.unsupported",
            "$.scope",
            f"this version cannot refold a {published.scope!r} receipt",
            "replay with the cache-family version that wrote the journal, or a newer one",
        )
    return refolder(index, published)
