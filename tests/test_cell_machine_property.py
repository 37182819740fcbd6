"""Stateful property test: rules drive the cell machine and a simulated journal, injecting the
faults a real host session meets, and the invariants are checked after every step:

* a receipt never rises after a downgrade (and the fold's ceiling never rises at all);
* replay equals live: the receipt folded incrementally from the records as they were appended
  equals the receipt folded from scratch out of the encoded journal bytes;
* after finalize no recorded process is alive, judged from the journal bytes alone (never
  from state the rules keep): every ``child_spawned`` pid has a later ``cleanup_outcome`` for
  that pid with no surviving or escaped descendant before the cell's cleanup-done transition,
  and the fold's cleanup section names the last host;
* failure is sticky: a faulted machine is only ever in cleanup, finalize or done.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cache_family.schemas.journal import (
    Cancellation,
    ChildSpawned,
    CleanupOutcome,
    DeadlineExpired,
    Fault,
    JournalChain,
    Record,
    RequestOutcome,
    Transition,
    encode_line,
    read_journal,
)
from cache_family.schemas.measurement import RequestRow
from cache_family.schemas.receipts import ReceiptStatus, encode_receipt
from cache_family.states.cell import CELL_TABLE, CellEvent, CellState
from cache_family.states.fold import CellFold, fold_cell
from cache_family.states.receipts import may_follow
from cell_journal_builder import CellScript, run_started

C = CellState
WORKING = (C.PIN_VERIFY, C.LAUNCH, C.WARMUP, C.LADDER, C.POST_VERIFY)
STOPPABLE = (*WORKING, C.CLEANUP, C.FINALIZE)


class CellSession(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.script = CellScript(rungs=((1, 2), (2, 3))).open()
        self.chain = JournalChain()
        self.journal = bytearray()
        self.appended = 0
        self.live = CellFold(self.script.cell_id)
        self.clock = 0
        # What the cleanup actor knows it spawned (the invariant reads the journal instead).
        self.spawned: list[int] = []
        self.next_pid = 5000
        self.rung = 0
        self.request_id = 0
        self.previous_ceiling: ReceiptStatus = "completed"
        self.status_after_downgrade: ReceiptStatus | None = None
        self._append([run_started()])
        self._flush()

    # -- the simulated journal -----------------------------------------------------------------

    def _append(self, records: list[Record]) -> None:
        for record in records:
            self.clock += 1
            line, data = self.chain.line(record, mono_ns=self.clock * 1000, wall_ns=self.clock)
            assert data == encode_line(line) + b"\n"
            self.journal += data
            self.live.apply(line)

    def _flush(self) -> None:
        new = self.script.records[self.appended :]
        self.appended = len(self.script.records)
        self._append(new)

    @property
    def state(self) -> CellState:
        return self.script.state

    def _spawn(self) -> None:
        self.next_pid += 1
        self.script.pid = self.next_pid
        self.script.create_time = 1_700_000_000.0 + self.next_pid
        self.spawned.append(self.next_pid)

    # -- the happy path, one step at a time ----------------------------------------------------

    @precondition(lambda self: self.state == C.PIN_VERIFY)
    @rule()
    def pins_match_and_host_spawned(self) -> None:
        self._spawn()
        self.script.launch()
        self._flush()

    @precondition(lambda self: self.state == C.PIN_VERIFY)
    @rule()
    def pins_differ_before_launch(self) -> None:
        self.script.pins("before", drift=True)
        self.script.records.append(Fault(cell_id=self.script.cell_id, kind="pin_mismatch"))
        self.script.fire(CellEvent.PINS_MISMATCH)
        self._flush()

    @precondition(lambda self: self.state == C.LAUNCH)
    @rule()
    def host_becomes_ready(self) -> None:
        self.script.become_ready()
        self._flush()

    @precondition(lambda self: self.state == C.WARMUP)
    @rule()
    def warmup_done(self) -> None:
        self.script.warmup()
        self._flush()

    @precondition(lambda self: self.state == C.LADDER and self.rung < len(self.script.rungs))
    @rule()
    def rung_completes(self) -> None:
        for request_id in range(self.request_id, self.script.rungs[self.rung][1]):
            self.script.request(self.rung, request_id)
        self.script.rung_done(self.rung)
        self.rung += 1
        self.request_id = 0
        self._flush()

    @precondition(lambda self: self.state == C.LADDER and self.rung < len(self.script.rungs))
    @rule()
    def one_request_completes(self) -> None:
        self.script.request(self.rung, self.request_id)
        self.request_id += 1
        if self.request_id == self.script.rungs[self.rung][1]:
            self.script.rung_done(self.rung)
            self.rung += 1
            self.request_id = 0
        self._flush()

    @precondition(lambda self: self.state == C.LADDER and self.rung == len(self.script.rungs))
    @rule()
    def ladder_done(self) -> None:
        self.script.fire(CellEvent.LADDER_DONE)
        self._flush()

    @precondition(lambda self: self.state == C.POST_VERIFY)
    @rule(drift=st.booleans())
    def pins_rehashed(self, drift: bool) -> None:
        self.script.pins("after", drift=drift)
        self.script.fire(CellEvent.PINS_MISMATCH if drift else CellEvent.PINS_VERIFIED)
        self._flush()

    @precondition(lambda self: self.state == C.CLEANUP)
    @rule(forced=st.booleans())
    def cleanup(self, forced: bool) -> None:
        # The cleanup actor ends every process it spawned (SIGTERM, or SIGKILL when forced)
        # and journals one outcome per pid, the current host last.
        for pid in self.spawned or [None]:
            self.script.records.append(
                CleanupOutcome(
                    cell_id=self.script.cell_id,
                    pid=pid,
                    graceful=not forced,
                    forced=forced and pid is not None,
                    exit_code=-9 if forced else 0,
                    port_free=True,
                    state_dir_removed=True,
                )
            )
        self.script.fire(CellEvent.CLEANUP_DONE)
        self._flush()

    @precondition(lambda self: self.state == C.FINALIZE)
    @rule()
    def receipt_published(self) -> None:
        self.script.fire(CellEvent.RECEIPT_PUBLISHED)
        self._flush()

    @precondition(lambda self: self.state == C.DONE)
    @rule(deadline=st.booleans())
    def run_stops_after_the_cell_is_done(self, deadline: bool) -> None:
        """A run-wide stop journaled later never touches a published cell."""
        before = encode_receipt(self.live.receipt())
        stop: Record = (
            DeadlineExpired(cell_id=None, budget="execution")
            if deadline
            else Cancellation(cell_id=None, signal="SIGINT")
        )
        self._append([stop])
        after = self.live.receipt()
        assert encode_receipt(after) == before.replace(
            f'"journal_through_seq": {self.clock - 1}'.encode(),
            f'"journal_through_seq": {self.clock}'.encode(),
        )

    @precondition(lambda self: self.state in WORKING and not self.script.machine.faulted)
    @rule(drift=st.booleans(), forced=st.booleans())
    def everything_else_goes_well(self, drift: bool, forced: bool) -> None:
        """Finish the session from wherever it is, so complete sessions are common too."""
        if self.state == C.PIN_VERIFY:
            self.pins_match_and_host_spawned()
        if self.state == C.LAUNCH:
            self.host_becomes_ready()
        if self.state == C.WARMUP:
            self.warmup_done()
        while self.state == C.LADDER and self.rung < len(self.script.rungs):
            self.rung_completes()
        if self.state == C.LADDER:
            self.ladder_done()
        self.pins_rehashed(drift)
        self.cleanup(forced)

    # -- injected faults -----------------------------------------------------------------------

    @precondition(lambda self: self.state in (C.LAUNCH, C.WARMUP, C.LADDER))
    @rule()
    def child_exits(self) -> None:
        # Exited on its own: cleanup must still reap it and journal its outcome.
        self.script.fault("child_exited", "exit status 139")
        self._flush()

    @precondition(lambda self: self.state == C.LAUNCH and len(self.spawned) == 1)
    @rule()
    def host_spawned_twice(self) -> None:
        """A faulty launch leaves two hosts; cleanup owes an outcome for each pid."""
        event("host spawned twice")
        self._spawn()
        self.script.spawn()
        self.script.fault("internal", f"a second host {self.script.pid} was spawned")
        self._flush()

    @precondition(lambda self: self.state == C.LAUNCH)
    @rule()
    def marker_never_printed(self) -> None:
        self.script.fault("marker_missing", "no listening line within the startup budget")
        self._flush()

    @precondition(lambda self: self.state == C.LAUNCH)
    @rule()
    def readiness_fails(self) -> None:
        self.script.fault("readiness_failed", "GET /health never returned ok")
        self._flush()

    @precondition(lambda self: self.state in (C.WARMUP, C.LADDER))
    @rule()
    def request_times_out(self) -> None:
        self.script.records.append(
            RequestOutcome(
                cell_id=self.script.cell_id,
                rung_index=min(self.rung, len(self.script.rungs) - 1),
                concurrency=1,
                row=RequestRow(request_id=self.request_id, status="incomplete", error="timeout"),
            )
        )
        self.script.fault("request_timeout", "request budget spent")
        self._flush()

    @precondition(lambda self: self.state in STOPPABLE)
    @rule(run_wide=st.booleans())
    def cancelled(self, run_wide: bool) -> None:
        self.script.cancel(run_wide=run_wide)
        self._flush()

    @precondition(lambda self: self.state in STOPPABLE)
    @rule()
    def deadline_expires(self) -> None:
        self.script.deadline()
        self._flush()

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def ceiling_never_rises(self) -> None:
        assert may_follow(self.previous_ceiling, self.live.ceiling)
        self.previous_ceiling = self.live.ceiling

    @invariant()
    def receipt_never_rises_after_a_downgrade(self) -> None:
        status = self.live.receipt().status
        if self.status_after_downgrade is not None:
            assert may_follow(self.status_after_downgrade, status), (
                self.status_after_downgrade,
                status,
            )
            self.status_after_downgrade = status
        elif self.live.ceiling != "completed":
            self.status_after_downgrade = status

    @invariant()
    def replay_equals_live(self) -> None:
        read = read_journal(bytes(self.journal))
        assert read.chain_break is None and not read.unknown_types
        assert read.last_seq == self.clock
        from_bytes = fold_cell(read.lines, self.script.cell_id)
        assert encode_receipt(from_bytes) == encode_receipt(self.live.receipt())

    @invariant()
    def failure_is_sticky(self) -> None:
        if self.script.machine.faulted:
            assert self.state in CELL_TABLE.after_fault
            assert self.live.receipt().status != "completed"

    @invariant()
    def no_recorded_process_alive_after_finalize(self) -> None:
        if self.state not in (C.FINALIZE, C.DONE):
            return
        alive: set[int] = set()
        spawned: list[int] = []
        alive_at_cleanup_done: set[int] | None = None
        for line in read_journal(bytes(self.journal)).lines:
            record = line.record
            if isinstance(record, ChildSpawned):
                alive.add(record.pid)
                spawned.append(record.pid)
            elif isinstance(record, CleanupOutcome) and record.pid is not None:
                if not record.surviving_descendants and not record.escaped_descendants:
                    alive.discard(record.pid)
            elif (
                isinstance(record, Transition)
                and record.machine == "cell"
                and (record.from_state, record.to_state) == (C.CLEANUP, C.FINALIZE)
            ):
                alive_at_cleanup_done = set(alive)
        assert alive_at_cleanup_done is not None, "finalize reached without cleanup-done"
        assert not alive_at_cleanup_done, f"alive when cleanup was done: {alive_at_cleanup_done}"
        receipt = self.live.receipt()
        assert receipt.cleanup is not None
        assert receipt.cleanup.pid == (spawned[-1] if spawned else None)
        assert receipt.cleanup.surviving_descendants == ()
        if receipt.status == "completed":
            assert receipt.cleanup.clean and receipt.accepted_for_parity
            assert receipt.measurement.complete and not receipt.pins_drifted
            assert receipt.terminal_refusal is None

    def teardown(self) -> None:
        event(f"final state {self.state.value}, receipt {self.live.receipt().status}")


CellSession.TestCase.settings = settings(
    max_examples=int(os.environ.get("CELL_PROPERTY_EXAMPLES", "100")),
    stateful_step_count=45,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCellSession = CellSession.TestCase
