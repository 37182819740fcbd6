"""The cell's fold: one host session's lines in, ``cell.json`` out.

The cell's machine table (``states/cell.py``) and its policy columns say which steps are
allowed and what a fault in each state does to the receipt; the rules are in
``docs/state-machines.md`` ("What the fold applies").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Final

import msgspec

from cache_family.errors import Refused
from cache_family.schemas import request_rows
from cache_family.schemas.arms import WORKLOAD_KINDS
from cache_family.schemas.journal import (
    CellOpened,
    ChildSpawned,
    CleanupOutcome,
    Fault,
    JournalLine,
    ListeningMarkerSeen,
    PinDrift,
    PinObserved,
    PortReserved,
    Ready,
    RungCompleted,
    RungRows,
    RunStarted,
    ServerMetricsRead,
    Transition,
    WarmupExclusion,
)
from cache_family.schemas.measurement import (
    CacheTally,
    HostCleanup,
    RequestRow,
    RungSummary,
    SerialSummary,
)
from cache_family.schemas.receipts import (
    CacheVerdict,
    CellReceipt,
    ChatPromptCount,
    FaultEntry,
    HostIdentity,
    Measurement,
    PinEntry,
    Readiness,
    ReceiptStatus,
    RungReceipt,
    TerminalRefusal,
    evidence_class,
)
from cache_family.schemas.request_rows import RequestRowLine, RowsFileDigest
from cache_family.schemas.server_metrics import ServerMetricsVerdict
from cache_family.states.cache_reuse import verdicts_of_tallies
from cache_family.states.calibration import (
    NEAR_OVERHEAD_FACTOR,
    near_client_overhead,
    rung_latencies,
)
from cache_family.states.cell import (
    CELL_TABLE,
    CellEvent,
    CellState,
)
from cache_family.states.fold.lines import (
    RowsSource,
    _apply_through,
    _scope_cell,
    _synthetic,
    _table_step,
    _terminal_of,
    real_evidence_class,
)
from cache_family.states.projection import planned_row
from cache_family.states.receipts import meet, terminal_downgrade
from cache_family.states.server_metrics import verdict_of

_TERMINAL_EVENTS: Final[dict[str, TerminalRefusal]] = {
    CellEvent.CANCELLED.value: "cancelled",
    CellEvent.DEADLINE_EXPIRED.value: "deadline_expired",
}


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
        self.chat_prompt: ChatPromptCount | msgspec.UnsetType = msgspec.UNSET
        # Each rung's server metrics read (the last, should a rung journal two).
        self.server_metrics: dict[int, ServerMetricsRead] = {}
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
            if record.chat_prompt_tokens is not None:
                self.chat_prompt = ChatPromptCount(
                    prompt_tokens=record.chat_prompt_tokens,
                    message_tokens=record.chat_message_tokens or 0,
                    merged_tokens=record.chat_prompt_merged_tokens or 0,
                )
        elif isinstance(record, RungRows):
            self.segments.append(record)
            self.rung_concurrency.setdefault(record.rung_index, record.concurrency)
        elif isinstance(record, RungCompleted):
            self._rung(seq, record)
        elif isinstance(record, CleanupOutcome):
            self._cleanup(seq, record)
        elif isinstance(record, ServerMetricsRead) and record.scope == "rung":
            self.server_metrics[record.index] = record

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
            evidence_class=evidence_class(synthetic) or self._real_evidence(synthetic),
            chat_prompt=self.chat_prompt,
        )
        return receipt

    def _real_evidence(self, synthetic: bool) -> str | None:
        opened = self.opened
        if synthetic or opened is None:
            return None
        brief = planned_row(self.run, opened.row_index)
        return real_evidence_class(self.run, brief.model_id if brief else "", opened.load_average)

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
        disagreeing: list[int] = []
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
            read = self.server_metrics.get(index)
            server_metrics: ServerMetricsVerdict | msgspec.UnsetType = msgspec.UNSET
            if read is not None:
                server_metrics = verdict_of(read)
                if server_metrics.agreement == "disagrees":
                    disagreeing.append(index)
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
                    server_metrics=server_metrics,
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
            server_metrics_disagreeing_rungs=tuple(disagreeing)
            if self.server_metrics
            else msgspec.UNSET,
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
