"""Stateful property test: rules inject the faults a host session meets into the real
``CellActor`` (in-process FAKE hosts from ``fake_hosts/fake_custody.py``, the real journal
writer, fold and publication, trio's autojump clock), then run cells; after every step:

* a receipt never rises after a downgrade: folding each cell's journal line by line, its
  status never rises once it fell below ``completed``;
* replay equals live: every published ``cell.json`` is byte for byte the fold of the journal
  file through the seq its publication record names;
* after finalize no recorded process is alive, judged from the journal bytes alone: every
  ``child_spawned`` pid has a later ``cleanup_outcome`` for it with no surviving or escaped
  descendant before the cell's cleanup -> finalize step, and ``cell.json`` names that host;
* failure is sticky: once a cell's journal shows a fault event, it only visits the states the
  table allows after one, and its receipt is not ``completed``.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from cell_plans import cell_plan, host_profile
from fake_hosts.fake_custody import FakeHostScript, fake_opener, hasher
from fake_hosts.fake_llama_http import Reply
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from run_harness import thread_aware_autojump

from cache_family.actors.journal.rows_file import cell_rows
from cache_family.actors.journal.writer import JournalWriter
from cache_family.actors.run import cell as cell_actor
from cache_family.actors.run.cell import CellActor
from cache_family.actors.run.context import HostSettings, RunContext, RunStop
from cache_family.schemas.journal import (
    Cancellation,
    ChildSpawned,
    CleanupOutcome,
    DeadlineExpired,
    JournalLine,
    ReceiptPublished,
    Record,
    RunStarted,
    Transition,
    read_journal,
)
from cache_family.schemas.prepared import HostProfile
from cache_family.schemas.receipts import ReceiptStatus, decode_cell_receipt, encode_receipt
from cache_family.states.budgets import Budgets
from cache_family.states.cell import CELL_TABLE, CellEvent, CellState, Step
from cache_family.states.fold import CellFold, fold_cell
from cache_family.states.plans import CellPlan
from cache_family.states.receipts import may_follow

C = CellState
WORKING = (C.PIN_VERIFY, C.LAUNCH, C.WARMUP, C.LADDER, C.POST_VERIFY)
FAULT_EVENTS = {e.value for e in CELL_TABLE.fault_events}
CELL_SECONDS = 120.0


def run_cells(
    run_dir: str,
    cells: list[tuple[CellPlan, FakeHostScript, Any, Callable[..., None] | None]],
    also: Sequence[Record] = (),
) -> None:
    """Run the cells one after another in one trio run with the real journal writer."""

    async def main() -> None:
        writer = JournalWriter(
            os.path.join(run_dir, "journal.jsonl"), fsync=lambda _fd: None, resume=True
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            if writer.next_seq == 1:
                await writer.append(
                    RunStarted(
                        run_id="run-property",
                        request_sha256="1" * 64,
                        catalog_sha256="2" * 64,
                        tool_version="t",
                    )
                )
            for plan, script, pins, stop_at in cells:
                stop = RunStop(run_deadline=trio.current_time() + 10 * CELL_SECONDS)
                ctx = RunContext(
                    writer=writer,
                    run_dir=run_dir,
                    budgets=Budgets(stop.run_deadline, CELL_SECONDS, request_timeout_ms=30_000),
                    stop=stop,
                    hosts=HostSettings(host_opener=fake_opener(script), pin_hasher=pins),
                )
                with trio.CancelScope() as scope:
                    if stop_at is not None:
                        ctx.on_transition = functools.partial(stop_at, ctx=ctx, scope=scope)
                    await CellActor(plan, ctx).run()
            for record in also:
                await writer.append(record)
            await writer.aclose()

    with thread_aware_autojump() as clock:
        trio.run(main, clock=clock)


def stopper(kind: str, at: str) -> Callable[..., None]:
    """Stop the cell as the supervisor would, when it enters state ``at``: a signal (run-wide
    cancellation) or the run's deadline (run-wide expiry)."""

    def stop(_cell: str, state: str, *, ctx: RunContext, scope: trio.CancelScope) -> None:
        if state != at or scope.cancel_called:
            return
        # The cell journals its own stop; a run-wide record would also stop every later cell.
        if kind == "signal":
            ctx.stop.signal_name = "SIGINT"
        else:
            ctx.stop.deadline_hit = True
        scope.cancel()

    return stop


def journal_lines(run_dir: str) -> tuple[JournalLine, ...]:
    read = read_journal((Path(run_dir) / "journal.jsonl").read_bytes())
    assert read.chain_break is None and not read.unknown_types
    return read.lines


def unended_hosts(lines: tuple[JournalLine, ...], cell_id: str) -> set[int] | None:
    """Pids of the cell's hosts still alive at its cleanup -> finalize step, judged from the
    journal alone; None when the cell reached finalize some other way than cleanup."""
    alive: set[int] = set()
    at_cleanup_done: set[int] | None = None
    for line in lines:
        record = line.record
        if getattr(record, "cell_id", None) != cell_id:
            continue
        if isinstance(record, ChildSpawned):
            alive.add(record.pid)
        elif isinstance(record, CleanupOutcome) and record.cleanup.pid is not None:
            # Escaped descendants were ended one by one; surviving ones are still alive.
            if not record.cleanup.surviving_descendants:
                alive.discard(record.cleanup.pid)
        elif isinstance(record, Transition) and (record.from_state, record.to_state) == (
            C.CLEANUP,
            C.FINALIZE,
        ):
            at_cleanup_done = set(alive)
    return at_cleanup_done


class CellSessions(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.run_dir = tempfile.mkdtemp(prefix="cell-property-")
        self.root = tempfile.mkdtemp(prefix="cell-pins-")
        self.cells: list[str] = []
        self.stopped = False
        self._next()

    def _next(self) -> None:
        self.script = FakeHostScript(
            reply=lambda _i, _b: Reply(first_token_delay=0.01, token_delay=0.0)
        )
        self.drift: dict[int, str] = {}
        self.profile: HostProfile | None = host_profile(self.root)
        self.stop_at: Callable[..., None] | None = None
        self.injected: list[str] = []

    def _inject(self, what: str) -> None:
        self.injected.append(what)
        event(what)

    # -- injected faults (each applies to the next cell run) -------------------------------

    @precondition(lambda self: len(self.injected) < 2)
    @rule(phase=st.sampled_from(["before", "after"]), name=st.sampled_from(["binary", "model"]))
    def pins_drift(self, phase: str, name: str) -> None:
        self.drift[0 if phase == "before" else 1] = name
        self._inject(f"pin drift {phase}")

    @precondition(lambda self: len(self.injected) < 2)
    @rule()
    def no_host_profile(self) -> None:
        self.profile = None
        self._inject("no profile")

    @precondition(lambda self: len(self.injected) < 2)
    @rule()
    def host_never_ready(self) -> None:
        self.script.never_ready = True
        self._inject("never ready")

    @precondition(lambda self: len(self.injected) < 2)
    @rule(checks=st.integers(0, 2))
    def host_identity_lost(self, checks: int) -> None:
        self.script.identity_lasts = checks
        self._inject("identity lost")

    @precondition(lambda self: len(self.injected) < 2)
    @rule(request=st.integers(0, 4), behaviour=st.sampled_from(["http_500", "malformed_json"]))
    def request_fails(self, request: int, behaviour: str) -> None:
        def reply(index: int, _body: dict[str, Any]) -> Reply:
            hit = index == request
            return Reply(behaviour=behaviour if hit else "ok", first_token_delay=0.01)

        self.script.reply = reply
        self._inject("request fails")

    @precondition(lambda self: len(self.injected) < 2)
    @rule(request=st.integers(0, 4))
    def request_hangs_past_the_cell_budget(self, request: int) -> None:
        def reply(index: int, _body: dict[str, Any]) -> Reply:
            return Reply(behaviour="hang" if index == request else "ok", first_token_delay=0.01)

        self.script.reply = reply
        self._inject("request hangs")

    @precondition(lambda self: len(self.injected) < 2)
    @rule(
        forced=st.booleans(),
        finding=st.sampled_from(
            [
                {},
                {"escaped_descendants": (40999,)},
                {"capture_truncated": True},
                {"bounded_out": True},
            ]
        ),
    )
    def unclean_cleanup(self, forced: bool, finding: dict[str, Any]) -> None:
        self.script.forced_cleanup = forced
        self.script.cleanup_findings = finding
        self._inject("unclean cleanup")

    @precondition(lambda self: len(self.injected) < 2)
    @rule(
        kind=st.sampled_from(["signal", "deadline"]),
        at=st.sampled_from([s.value for s in (*WORKING[1:], C.CLEANUP, C.FINALIZE)]),
    )
    def run_stops(self, kind: str, at: str) -> None:
        self.stop_at = stopper(kind, at)
        self._inject(f"{kind} at {at}")

    # -- running ----------------------------------------------------------------------------

    @precondition(lambda self: len(self.cells) < 4 and not self.stopped)
    @rule(kind=st.sampled_from(["serial", "concurrent"]))
    def run_a_clean_cell(self, kind: str) -> None:
        """Run a cell with no fault injected (also when some were: they wait for the next)."""
        pending = (self.script, self.drift, self.profile, self.stop_at, self.injected)
        self._next()
        self.run_a_cell(kind)
        self.script, self.drift, self.profile, self.stop_at, self.injected = pending

    @precondition(lambda self: len(self.cells) < 4 and not self.stopped)
    @rule(kind=st.sampled_from(["serial", "concurrent"]))
    def run_a_cell(self, kind: str) -> None:
        plan = cell_plan(self.root, len(self.cells), kind, self.profile)
        run_cells(self.run_dir, [(plan, self.script, hasher(self.drift), self.stop_at)])
        self.cells.append(plan.cell_id)
        receipt = decode_cell_receipt(
            (Path(self.run_dir) / plan.cell_dir / "cell.json").read_bytes()
        )
        if not self.injected:
            assert receipt.status == "completed" and receipt.accepted_for_parity
        event(f"{kind}: {receipt.status}")
        self._next()

    @precondition(lambda self: bool(self.cells))
    @rule(deadline=st.booleans())
    def the_run_stops_after_its_cells_are_done(self, deadline: bool) -> None:
        """A run-wide stop journaled later never touches a published cell (it would stop
        every cell run after it, so none is)."""
        self.stopped = True
        lines = journal_lines(self.run_dir)
        before = {cell_id: fold_cell(lines, cell_id) for cell_id in self.cells}
        stop = (
            DeadlineExpired(cell_id=None, budget="execution")
            if deadline
            else Cancellation(cell_id=None, signal="SIGINT")
        )
        run_cells(self.run_dir, [], also=[stop])
        lines = journal_lines(self.run_dir)
        for cell_id, receipt in before.items():
            after = fold_cell(lines, cell_id)
            assert (
                msgspec.structs.replace(after, journal_through_seq=receipt.journal_through_seq)
                == receipt
            )

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def a_receipt_never_rises_after_a_downgrade(self) -> None:
        lines = journal_lines(self.run_dir) if self.cells else ()
        for cell_id in self.cells:
            fold = CellFold(cell_id)
            ceiling: ReceiptStatus = "completed"
            after_downgrade: ReceiptStatus | None = None
            for line in lines:
                fold.apply(line)
                assert may_follow(ceiling, fold.ceiling)
                ceiling = fold.ceiling
                if ceiling == "completed":
                    continue
                status = fold.receipt().status
                if after_downgrade is not None:
                    assert may_follow(after_downgrade, status), (cell_id, after_downgrade, status)
                after_downgrade = status

    @invariant()
    def replay_equals_live(self) -> None:
        if not self.cells:
            return
        lines = journal_lines(self.run_dir)
        published = [line.record for line in lines if isinstance(line.record, ReceiptPublished)]
        assert [p.cell_id for p in published] == self.cells
        for record in published:
            assert record.cell_id is not None
            live = (Path(self.run_dir) / record.path).read_bytes()
            rows = cell_rows(str((Path(self.run_dir) / record.path).parent))
            refolded = fold_cell(lines, record.cell_id, through_seq=record.through_seq, rows=rows)
            assert encode_receipt(refolded) == live

    @invariant()
    def no_recorded_process_alive_after_finalize(self) -> None:
        if not self.cells:
            return
        lines = journal_lines(self.run_dir)
        for cell_id in self.cells:
            receipt = fold_cell(lines, cell_id)
            spawned = [
                line.record.pid
                for line in lines
                if isinstance(line.record, ChildSpawned) and line.record.cell_id == cell_id
            ]
            alive = unended_hosts(lines, cell_id)
            if spawned:
                assert alive is not None, "finalize reached without cleanup-done"
                assert not alive, f"alive when cleanup was done: {alive}"
                assert receipt.cleanup is not None and receipt.cleanup.pid == spawned[-1]
            elif "launch" not in receipt.lifecycle:
                assert receipt.cleanup is None  # nothing launched, nothing claimed
            if receipt.status == "completed":
                assert receipt.cleanup is not None and receipt.cleanup.clean
                assert receipt.accepted_for_parity and receipt.measurement.complete
                assert not receipt.pins_drifted and receipt.terminal_refusal is None

    @invariant()
    def failure_is_sticky(self) -> None:
        if not self.cells:
            return
        lines = journal_lines(self.run_dir)
        for cell_id in self.cells:
            faulted = False
            for line in lines:
                record = line.record
                if not (isinstance(record, Transition) and record.cell_id == cell_id):
                    continue
                if faulted:
                    assert C(record.to_state) in CELL_TABLE.after_fault, record
                faulted = faulted or record.event in FAULT_EVENTS
            if faulted:
                assert fold_cell(lines, cell_id).status != "completed"

    def teardown(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)


CellSessions.TestCase.settings = settings(
    max_examples=int(os.environ.get("CELL_PROPERTY_EXAMPLES", "40")),
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCellSessions = CellSessions.TestCase


def test_a_row_sending_a_ladder_fault_past_cleanup_is_caught_by_running_the_actor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One row of a copy of the table changed (ladder --fault--> finalize, skipping cleanup):
    it passes the sticky check, but running the real actor shows the host still alive when
    the cell was finalized, which the no-orphan invariant refuses."""
    rows = dict(CELL_TABLE.rows)
    rows[(C.LADDER, CellEvent.FAULT)] = Step(
        C.FINALIZE, rows[(C.CLEANUP, CellEvent.CLEANUP_DONE)].actions
    )
    monkeypatch.setattr(cell_actor, "CELL_TABLE", replace(CELL_TABLE, rows=MappingProxyType(rows)))
    script = FakeHostScript(
        reply=lambda index, _b: Reply(
            behaviour="http_500" if index == 1 else "ok", first_token_delay=0.01
        )
    )
    plan = cell_plan(str(tmp_path), 0, "concurrent", host_profile(str(tmp_path)))
    run_cells(str(tmp_path), [(plan, script, hasher(), None)])
    lines = journal_lines(str(tmp_path))
    steps = [
        (t.record.from_state, t.record.to_state) for t in lines if isinstance(t.record, Transition)
    ]
    assert ("ladder", "finalize") in steps
    assert unended_hosts(lines, plan.cell_id) is None  # the invariant's "finalize without cleanup"
    # The published receipt was folded while the host was still in custody: no cleanup in it.
    receipt = decode_cell_receipt((tmp_path / plan.cell_dir / "cell.json").read_bytes())
    assert receipt.cleanup is None and script.launched == ["sweep-native-concurrent"]
