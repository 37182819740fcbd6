"""Builds journal records for the fold's tests by driving the live machines (tests only).

Every transition is taken through the table's live machine, whose step callback journals it,
so a script can never journal a step the machine would refuse; observations are the records
the actors write around them. Tests of the actors themselves run the real actors instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from cache_family.actors.journal.rows_file import RowFileWriter
from cache_family.actors.run.cell import pin_records
from cache_family.actors.run.context import PinResult
from cache_family.schemas.journal import (
    ArmPlan,
    Cancellation,
    CellOpened,
    ChildSpawned,
    CleanupOutcome,
    CorrectnessVerdict,
    DeadlineExpired,
    Fault,
    ListeningMarkerSeen,
    PortReserved,
    Ready,
    Record,
    RowOpened,
    RungCompleted,
    RungPlan,
    RungRows,
    RunStarted,
    Transition,
    WarmupExclusion,
)
from cache_family.schemas.measurement import HostCleanup, RequestRow, ServerTimings
from cache_family.schemas.request_rows import REQUESTS_FILENAME, RequestRowLine, rows_digest
from cache_family.states.cell import (
    CELL_TABLE,
    ROW_TABLE,
    CellEvent,
    CellState,
    LiveMachine,
    RowEvent,
)
from cache_family.states.plans import PinTarget, row_dir_name, row_opened_record
from cache_family.states.tally import tally_cell

PIN_A = "a" * 64
PIN_B = "b" * 64
PIN_X = "f" * 64


def run_started(*, synthetic: bool = False) -> RunStarted:
    """``run_started`` of a run planned by the packaged catalog, or by a synthetic (zoo) one."""
    return RunStarted(
        run_id="run-test",
        request_sha256="1" * 64,
        catalog_sha256="2" * 64,
        tool_version="t",
        catalog_path="/zoo/catalog.json" if synthetic else "/pkg/catalog.json",
        catalog_synthetic=synthetic,
        catalog_packaged=not synthetic,
    )


def completed_row(request_id: int, *, warmup: bool = False, elapsed: float = 20.0) -> RequestRow:
    return RequestRow(
        request_id=request_id,
        status="completed",
        excluded_warmup=warmup,
        elapsed_ms=elapsed + request_id,
        ttft_ms=5.0,
        tpot_ms=1.5,
        tokens_predicted=8,
        tokens_evaluated=40,
        timings=ServerTimings(prompt_n=40, cache_n=32, predicted_n=8),
        stop_type="limit",
    )


@dataclass
class CellScript:
    cell_id: str = "cell-0000/native-concurrent"
    row_index: int = 0
    arm: str = "native-concurrent"
    kind: str = "concurrent"
    rungs: Sequence[tuple[int, int]] = ((1, 2), (2, 4))
    pid: int = 4242
    create_time: float = 1700000000.25
    synthetic: bool = False
    records: list[Record] = field(default_factory=list)
    # The cell's rows file, in memory: what its load runs would have written.
    lines: list[RequestRowLine] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._journaled_lines = 0
        self.machine = LiveMachine(CELL_TABLE, self.cell_id, self._journal_step)

    def _journal_step(self, source: CellState, event: CellEvent, dest: CellState) -> None:
        self.records.append(
            Transition(
                machine="cell",
                cell_id=self.cell_id,
                from_state=source.value,
                event=event.value,
                to_state=dest.value,
            )
        )

    @property
    def state(self) -> CellState:
        return self.machine.state

    def fire(self, event: CellEvent) -> None:
        self.machine.fire(event)

    def open(self) -> CellScript:
        self.records.append(
            CellOpened(
                cell_id=self.cell_id,
                row_index=self.row_index,
                row_key="llama-p128",
                arm=self.arm,
                cohort=self.arm,
                cell_dir=f"{row_dir_name(self.row_index)}/{self.arm}",
                measurement_kind=self.kind,
                rungs=tuple(RungPlan(concurrency=c, requests=n) for c, n in self.rungs),
                ttft_slo_ms=2000.0,
                tpot_slo_ms=100.0,
                synthetic=self.synthetic,
            )
        )
        return self

    def pins(self, phase: str, *, drift: bool = False) -> None:
        for name, pin in (("binary", PIN_A), ("model", PIN_B)):
            observed = PIN_X if drift and name == "model" else pin
            result = PinResult(PinTarget(name, f"/pins/{name}", pin, "file"), observed)
            self.records += pin_records(self.cell_id, phase, result)

    def launch(self) -> None:
        """pin-verify -> launch: pins match, port reserved, host spawned."""
        self.pins("before")
        self.records.append(PortReserved(cell_id=self.cell_id, port=18080))
        self.fire(CellEvent.PINS_VERIFIED)
        self.spawn()

    def spawn(self) -> None:
        self.records.append(
            ChildSpawned(
                cell_id=self.cell_id,
                pid=self.pid,
                create_time=self.create_time,
                pgid=self.pid,
                argv_sha256="3" * 64,
                executable="/bin/llama-server",
            )
        )

    def become_ready(self) -> None:
        self.records.append(
            ListeningMarkerSeen(
                cell_id=self.cell_id,
                pid=self.pid,
                port=18080,
                marker="srv  llama_server: listening on http://127.0.0.1:18080",
            )
        )
        self.records.append(
            Ready(cell_id=self.cell_id, url="http://127.0.0.1:18080/", attempts=2, elapsed_ms=75.0)
        )
        self.fire(CellEvent.HOST_READY)

    def warmup(self) -> None:
        reason = "serial first request" if self.kind == "serial" else "no warmup on rungs"
        ids: tuple[int, ...] = (0,) if self.kind == "serial" else ()
        self.records.append(
            WarmupExclusion(cell_id=self.cell_id, rung_index=0, request_ids=ids, reason=reason)
        )
        self.fire(CellEvent.WARMUP_DONE)

    def request(self, rung: int, request_id: int, row: RequestRow | None = None) -> None:
        """A request of ``rung`` ended: its row goes to the rows file (journaled with the
        rung's ``rung_rows`` record by ``rows_done`` / ``rung_done``)."""
        concurrency = self.rungs[rung][0] if rung < len(self.rungs) else 1
        warm = self.kind == "serial" and request_id == 0
        self.lines.append(
            RequestRowLine(
                rung_index=rung,
                concurrency=concurrency,
                row=row or completed_row(request_id, warmup=warm),
            )
        )

    def rows_done(self, rung: int) -> None:
        """Journal the rows written since the last ``rung_rows`` record as one."""
        first = self._journaled_lines
        segment = self.lines[first:]
        if not segment:
            return
        _, sha256 = rows_digest(self.lines)
        self.records.append(
            RungRows(
                cell_id=self.cell_id,
                rung_index=rung,
                concurrency=segment[0].concurrency,
                path=REQUESTS_FILENAME,
                first_line=first,
                count=len(segment),
                completed=sum(line.row.status == "completed" for line in segment),
                sha256=sha256,
            )
        )
        self._journaled_lines = len(self.lines)

    def write_rows(self, cell_dir: str) -> None:
        """Write the rows file where the cell actor would have (its cell's directory)."""
        writer = RowFileWriter(os.path.join(cell_dir, REQUESTS_FILENAME), REQUESTS_FILENAME)
        writer.add_many(self.lines)
        writer.close()

    def rows_source(self, segments: Sequence[RungRows]) -> Iterator[RequestRowLine]:
        """The fold's ``RowsSource`` over the in-memory rows file."""
        last = segments[-1]
        return iter(self.lines[: last.first_line + last.count])

    def rung_done(
        self,
        rung: int,
        *,
        status: str = "completed",
        pid: int | None = None,
        makespan: float | None = -1.0,
    ) -> None:
        """The rung's rows (``rows_done``), then its completion with the tally of its rows."""
        self.rows_done(rung)
        concurrency, requests = self.rungs[rung]
        record = RungCompleted(
            cell_id=self.cell_id,
            rung_index=rung,
            concurrency=concurrency,
            requested_requests=requests,
            status=status,
            makespan_seconds=0.5 * (rung + 1) if makespan == -1.0 else makespan,
            prompt_sha256="4" * 64,
            output_tokens=8,
            host_pid=self.pid if pid is None else pid,
            host_create_time=self.create_time,
        )
        opened = next(r for r in self.records if isinstance(r, CellOpened))
        facts = tally_cell(opened, {rung: record}, self.lines).get(rung)
        self.records.append(msgspec.structs.replace(record, tally=facts))

    def ladder(self) -> None:
        for rung, (_, requests) in enumerate(self.rungs):
            for request_id in range(requests):
                self.request(rung, request_id)
            self.rung_done(rung)
        self.fire(CellEvent.LADDER_DONE)

    def cleanup(
        self,
        *,
        forced: bool = False,
        survivors: tuple[int, ...] = (),
        escaped: tuple[int, ...] = (),
        capture_truncated: bool = False,
        oversized_lines: int = 0,
        grace_shortened: bool = False,
        bounded_out: bool = False,
        state_dir_error: str | None = None,
    ) -> None:
        spawned = any(isinstance(r, ChildSpawned) for r in self.records)
        self.records.append(
            CleanupOutcome(
                cell_id=self.cell_id,
                cleanup=HostCleanup(
                    pid=self.pid if spawned else None,
                    graceful=not forced,
                    forced=forced,
                    exit_code=0 if not forced else -9,
                    surviving_descendants=survivors,
                    port_free=True,
                    state_dir_removed=state_dir_error is None,
                    elapsed_ms=12.0,
                    escaped_descendants=escaped,
                    capture_truncated=capture_truncated,
                    oversized_lines=oversized_lines,
                    grace_shortened=grace_shortened,
                    bounded_out=bounded_out,
                    state_dir_error=state_dir_error,
                ),
            )
        )
        self.fire(CellEvent.CLEANUP_DONE)

    def nothing_launched(self) -> None:
        """not-launched -> finalize: nothing was ended, so no cleanup is recorded."""
        self.fire(CellEvent.NOTHING_LAUNCHED)

    def fault(self, kind: str, detail: str = "") -> None:
        self.records.append(Fault(cell_id=self.cell_id, kind=kind, detail=detail))
        self.fire(CellEvent.FAULT)

    def cancel(self, *, run_wide: bool = False) -> None:
        self.records.append(
            Cancellation(cell_id=None if run_wide else self.cell_id, signal="SIGINT")
        )
        self.fire(CellEvent.CANCELLED)

    def deadline(self) -> None:
        self.records.append(DeadlineExpired(cell_id=self.cell_id, budget="cell"))
        self.fire(CellEvent.DEADLINE_EXPIRED)

    def happy(self, *, drift: bool = False, forced: bool = False, **cleanup: Any) -> CellScript:
        """A full session: every state visited, optional late drift, forced kill or other
        cleanup findings (``cleanup``'s keywords)."""
        self.open()
        self.launch()
        self.become_ready()
        self.warmup()
        self.ladder()
        self.pins("after", drift=drift)
        self.fire(CellEvent.PINS_MISMATCH if drift else CellEvent.PINS_VERIFIED)
        self.cleanup(forced=forced, **cleanup)
        return self


def serial_cell(*, synthetic: bool = False) -> CellScript:
    """Row 0's serial baseline cell: one rung of three requests, the first one the warmup."""
    return CellScript(
        cell_id="cell-0000/native-serial",
        arm="native-serial",
        kind="serial",
        rungs=((1, 3),),
        synthetic=synthetic,
    )


def row_records(
    row_index: int,
    arms: Sequence[ArmPlan],
    *,
    model_status: str = "present",
    synthetic: bool = False,
) -> RowOpened:
    """``row_opened`` as the row actor writes it (correctness journaled as not run)."""
    present = {"present": True, "missing-model": False}[model_status]
    return row_opened_record(
        row_index=row_index,
        row_key="llama-p128",
        case_key="llama",
        prefix_tokens=128,
        use_case=None,
        row_dir=row_dir_name(row_index) if present else "",
        present=present,
        arms=tuple(arms),
        synthetic=synthetic,
    )


class RowScript:
    """Row machine transitions for one row (tests only)."""

    def __init__(self, row_index: int) -> None:
        self.row_index = row_index
        self.records: list[Record] = []
        self.machine = LiveMachine(ROW_TABLE, f"row-{row_index}", self._journal_step)

    def _journal_step(self, source: Any, event: RowEvent, dest: Any) -> None:
        self.records.append(
            Transition(
                machine="row",
                row_index=self.row_index,
                from_state=source.value,
                event=event.value,
                to_state=dest.value,
            )
        )

    def fire(self, event: RowEvent) -> None:
        self.machine.fire(event)

    def pass_correctness(self, prompt_sha256: str = "c" * 64) -> None:
        """The correctness arm's passing verdict (one topology), then the row's step on."""
        self.records.append(
            CorrectnessVerdict(
                row_index=self.row_index,
                status="completed",
                planned_topologies=("one-stage",),
                prompt_sha256=prompt_sha256,
                suffix_prefill_matches=True,
            )
        )
        self.fire(RowEvent.CORRECTNESS_PASSED)
