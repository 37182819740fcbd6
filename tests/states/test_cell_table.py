"""Every (state, event) pair of the cell and row tables on the live (``transitions``) machine:
allowed ones go where the table says and are journaled through the step callback, every other
pair is a typed refusal with a stable code. A table whose rows break the rules is refused."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
from collections import deque
from dataclasses import replace
from enum import StrEnum
from types import MappingProxyType
from typing import Any

import pytest
import transitions

from cache_family.actors.run import cell as cell_actor
from cache_family.actors.run.engine import check_handlers
from cache_family.errors import Refused
from cache_family.states import cell as cell_module
from cache_family.states.cell import (
    CELL_TABLE,
    ROW_TABLE,
    CellAction,
    CellEvent,
    CellState,
    LiveMachine,
    MachineTable,
    RowEvent,
    RowState,
    Step,
    _check_sticky,
    render_table_markdown,
)

C, V = CellState, CellEvent

# The expected cell lifecycle written out independently of the table, pair by pair.
EXPECTED_CELL: dict[tuple[CellState, CellEvent], CellState] = {
    (C.PIN_VERIFY, V.PINS_VERIFIED): C.LAUNCH,
    (C.PIN_VERIFY, V.PINS_MISMATCH): C.NOT_LAUNCHED,
    (C.NOT_LAUNCHED, V.NOTHING_LAUNCHED): C.FINALIZE,
    (C.LAUNCH, V.HOST_READY): C.WARMUP,
    (C.WARMUP, V.WARMUP_DONE): C.LADDER,
    (C.WARMUP, V.WORKLOAD_READY): C.WORKLOAD,
    (C.LADDER, V.LADDER_DONE): C.POST_VERIFY,
    (C.WORKLOAD, V.WORKLOAD_DONE): C.POST_VERIFY,
    (C.POST_VERIFY, V.PINS_VERIFIED): C.CLEANUP,
    (C.POST_VERIFY, V.PINS_MISMATCH): C.CLEANUP,
    (C.CLEANUP, V.CLEANUP_DONE): C.FINALIZE,
    (C.FINALIZE, V.RECEIPT_PUBLISHED): C.DONE,
    (C.FINALIZE, V.CANCELLED): C.FINALIZE,
    (C.FINALIZE, V.DEADLINE_EXPIRED): C.FINALIZE,
}
for _event in (V.FAULT, V.CANCELLED, V.DEADLINE_EXPIRED):
    EXPECTED_CELL[(C.PIN_VERIFY, _event)] = C.NOT_LAUNCHED
    for _state in (C.LAUNCH, C.WARMUP, C.LADDER, C.WORKLOAD, C.POST_VERIFY, C.CLEANUP):
        EXPECTED_CELL[(_state, _event)] = C.CLEANUP

# The actions and the fsync column of every cell step that has either, written out by hand
# (every other step has no action and fsyncs at the step).
A = CellAction
EXPECTED_CELL_ACTIONS: dict[tuple[CellState, CellEvent], tuple[tuple[CellAction, ...], bool]] = {
    (C.PIN_VERIFY, V.PINS_VERIFIED): ((A.SPAWN_HOST, A.AWAIT_READINESS), True),
    (C.NOT_LAUNCHED, V.NOTHING_LAUNCHED): ((A.PUBLISH_RECEIPT,), False),
    (C.LAUNCH, V.HOST_READY): ((A.CUT_PROMPT, A.JOURNAL_WARMUP_RULE, A.SEND_WARMUP), False),
    (C.WARMUP, V.WARMUP_DONE): ((A.RUN_RUNGS,), True),
    (C.WARMUP, V.WORKLOAD_READY): ((A.RUN_WORKLOAD,), True),
    (C.LADDER, V.LADDER_DONE): ((), False),
    (C.WORKLOAD, V.WORKLOAD_DONE): ((), False),
    (C.POST_VERIFY, V.PINS_VERIFIED): ((A.END_HOST,), True),
    (C.POST_VERIFY, V.PINS_MISMATCH): ((A.END_HOST,), True),
    (C.CLEANUP, V.CLEANUP_DONE): ((A.PUBLISH_RECEIPT,), False),
    (C.FINALIZE, V.CANCELLED): ((), False),
    (C.FINALIZE, V.DEADLINE_EXPIRED): ((), False),
    (C.FINALIZE, V.RECEIPT_PUBLISHED): ((), False),
}
for _event in (V.FAULT, V.CANCELLED, V.DEADLINE_EXPIRED):
    for _state in (C.LAUNCH, C.WARMUP, C.LADDER, C.WORKLOAD, C.POST_VERIFY):
        EXPECTED_CELL_ACTIONS[(_state, _event)] = ((A.END_HOST,), True)

R, RE = RowState, RowEvent
EXPECTED_ROW: dict[tuple[RowState, RowEvent], RowState] = {
    (R.CORRECTNESS, RE.CORRECTNESS_PASSED): R.SERIAL,
    (R.CORRECTNESS, RE.CORRECTNESS_NOT_PASSED): R.FINALIZE,
    (R.CORRECTNESS, RE.MODEL_MISSING): R.FINALIZE,
    (R.SERIAL, RE.ARM_FINISHED): R.CONCURRENT,
    (R.SERIAL, RE.ARM_SKIPPED): R.CONCURRENT,
    (R.CONCURRENT, RE.ARM_FINISHED): R.CONCURRENT,
    (R.CONCURRENT, RE.ARM_SKIPPED): R.CONCURRENT,
    (R.CONCURRENT, RE.ARMS_EXHAUSTED): R.FINALIZE,
    (R.FINALIZE, RE.RECEIPT_PUBLISHED): R.DONE,
}
for _rstate in (R.CORRECTNESS, R.SERIAL, R.CONCURRENT, R.FINALIZE):
    for _revent in (RE.CANCELLED, RE.DEADLINE_EXPIRED):
        EXPECTED_ROW[(_rstate, _revent)] = R.FINALIZE


def live_at(
    table: MachineTable[Any, Any, Any], state: StrEnum
) -> tuple[LiveMachine[Any, Any, Any], list[tuple[str, str, str]]]:
    """A live machine driven along the table's shortest path to ``state``, and a journal of
    the steps its callback reported from then on."""
    journal: list[tuple[str, str, str]] = []
    machine = LiveMachine(table, "t", lambda s, e, d: journal.append((s.value, e.value, d.value)))
    paths: dict[StrEnum, list[StrEnum]] = {table.initial: []}
    queue = deque([table.initial])
    while queue:
        current = queue.popleft()
        for (source, event), step in table.rows.items():
            if source == current and step.to not in paths:
                paths[step.to] = [*paths[current], event]
                queue.append(step.to)
    for event in paths[state]:
        machine.fire(event)
    assert machine.state == state
    journal.clear()
    return machine, journal


@pytest.mark.parametrize(("state", "event"), list(itertools.product(CellState, CellEvent)))
def test_every_cell_pair(state: CellState, event: CellEvent) -> None:
    machine, journal = live_at(CELL_TABLE, state)
    expected = EXPECTED_CELL.get((state, event))
    assert machine.can_fire(event) == (expected is not None)
    if expected is None:
        with pytest.raises(Refused) as refused:
            machine.fire(event)
        assert refused.value.codes == ["cell.transition.refused"]
        assert refused.value.refusals[0].path == f"$.cell.{state.value}"
        assert event.value in refused.value.refusals[0].message
        assert machine.state == state and journal == []  # a refused event changes nothing
    else:
        step = machine.fire(event)
        assert step.to == expected and machine.state == expected
        assert journal == [(state.value, event.value, expected.value)]


@pytest.mark.parametrize(("state", "event"), list(itertools.product(RowState, RowEvent)))
def test_every_row_pair(state: RowState, event: RowEvent) -> None:
    machine, journal = live_at(ROW_TABLE, state)
    expected = EXPECTED_ROW.get((state, event))
    assert machine.can_fire(event) == (expected is not None)
    if expected is None:
        with pytest.raises(Refused) as refused:
            machine.fire(event)
        assert refused.value.codes == ["row.transition.refused"]
        assert journal == []
    else:
        assert machine.fire(event).to == expected
        assert journal == [(state.value, event.value, expected.value)]


def test_table_has_exactly_the_expected_pairs() -> None:
    assert {k: v.to for k, v in CELL_TABLE.rows.items()} == EXPECTED_CELL
    assert {k: v.to for k, v in ROW_TABLE.rows.items()} == EXPECTED_ROW


def test_every_cell_step_has_exactly_the_expected_actions_and_fsync() -> None:
    """The actions column and the fsync column, pair by pair (``tests/test_engine.py`` checks
    the driver performs them as written)."""
    actual = {pair: (step.actions, step.fsync) for pair, step in CELL_TABLE.rows.items()}
    expected = {pair: EXPECTED_CELL_ACTIONS.get(pair, ((), True)) for pair in EXPECTED_CELL}
    assert actual == expected


def test_the_live_machine_is_a_transitions_machine() -> None:
    """The running state is held by ``transitions``: changing its model moves the machine."""
    machine = LiveMachine(CELL_TABLE, "c")
    assert isinstance(machine._machine, transitions.Machine)
    machine.fire(V.PINS_VERIFIED)
    assert machine._model.state == "launch"


def test_a_row_sending_a_fault_back_to_work_is_refused_at_import() -> None:
    """One row of a copy of the table changed (ladder --fault--> launch): the import-time
    sticky-failure check refuses it, as it would refuse the module's own table."""
    rows = dict(CELL_TABLE.rows)
    rows[(C.LADDER, V.FAULT)] = Step(C.LAUNCH, ())
    broken = replace(CELL_TABLE, rows=MappingProxyType(rows))
    with pytest.raises(ValueError, match="cell: fault fault leads to launch"):
        _check_sticky(broken)
    _check_sticky(CELL_TABLE)  # the real table passes
    cleanup_back = dict(CELL_TABLE.rows)
    cleanup_back[(C.CLEANUP, V.CLEANUP_DONE)] = Step(C.LADDER, ())
    with pytest.raises(ValueError, match="cleanup leads back to ladder"):
        _check_sticky(replace(CELL_TABLE, rows=MappingProxyType(cleanup_back)))


def test_the_actor_refuses_an_action_without_its_effect_handler() -> None:
    """A row naming an action the actor has no handler for is refused when the actor's module
    is imported (``check_handlers`` runs there), as is a state without work."""

    class Extra(StrEnum):
        RESTART_HOST = "restart-host"

    rows: dict[Any, Any] = dict(CELL_TABLE.rows)
    rows[(C.LADDER, V.FAULT)] = Step(C.CLEANUP, (CellAction.END_HOST, Extra.RESTART_HOST))
    broken = replace(CELL_TABLE, rows=MappingProxyType(rows))
    with pytest.raises(ValueError, match="restart-host"):
        check_handlers("cell actor", broken, cell_actor._WORK, cell_actor._EFFECTS)
    work = {k: v for k, v in cell_actor._WORK.items() if k != C.WARMUP}
    with pytest.raises(ValueError, match="warmup"):
        check_handlers("cell actor", CELL_TABLE, work, cell_actor._EFFECTS)
    check_handlers("cell actor", CELL_TABLE, cell_actor._WORK, cell_actor._EFFECTS)


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": ":".join(sys.path), "PYTHONDONTWRITEBYTECODE": "1"},
        check=False,
    )


def test_importing_the_tables_does_no_io() -> None:
    """Importing the tables opens, lists, spawns and connects nothing; only the import
    machinery itself reads files (finding modules)."""
    probe = _python(
        """
        import sys

        seen = []

        def audit(event, args):
            if not event.startswith(("open", "os.", "subprocess.", "socket.", "shutil.")):
                return
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith("<frozen importlib"):
                return  # finding and reading modules, not work done by them
            seen.append(f"{event} {args[:1]} from {caller.f_code.co_filename}")

        sys.addaudithook(audit)
        import cache_family.states.cell
        print("\\n".join(seen))
        """
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == ""


def test_the_warmup_state_sends_the_warmup_and_the_ladder_only_measured_requests() -> None:
    assert CELL_TABLE.step(C.LAUNCH, V.HOST_READY).actions == (
        CellAction.CUT_PROMPT,
        CellAction.JOURNAL_WARMUP_RULE,
        CellAction.SEND_WARMUP,
    )
    assert CELL_TABLE.step(C.WARMUP, V.WARMUP_DONE).actions == (CellAction.RUN_RUNGS,)
    assert cell_module.__doc__ is not None
    assert "ladder`` sends only measured requests" in " ".join(cell_module.__doc__.split())


def test_happy_path_visits_every_working_state_with_the_intended_actions() -> None:
    visited: list[str] = []
    machine = LiveMachine(CELL_TABLE, "c", lambda _s, _e, dest: visited.append(dest.value))
    actions: list[CellAction] = []
    for event in (
        V.PINS_VERIFIED,
        V.HOST_READY,
        V.WARMUP_DONE,
        V.LADDER_DONE,
        V.PINS_VERIFIED,
        V.CLEANUP_DONE,
        V.RECEIPT_PUBLISHED,
    ):
        actions += machine.fire(event).actions
    skipped = (C.PIN_VERIFY, C.NOT_LAUNCHED, C.WORKLOAD)
    assert visited == [s.value for s in CellState if s not in skipped]
    assert machine.finished and not machine.faulted
    assert actions[0] == CellAction.SPAWN_HOST
    assert actions[-2:] == [CellAction.END_HOST, CellAction.PUBLISH_RECEIPT]


def test_a_workload_arm_runs_its_workload_in_place_of_the_ladder() -> None:
    visited: list[str] = []
    machine = LiveMachine(CELL_TABLE, "c", lambda _s, _e, dest: visited.append(dest.value))
    actions: list[CellAction] = []
    for event in (
        V.PINS_VERIFIED,
        V.HOST_READY,
        V.WORKLOAD_READY,
        V.WORKLOAD_DONE,
        V.PINS_VERIFIED,
        V.CLEANUP_DONE,
        V.RECEIPT_PUBLISHED,
    ):
        actions += machine.fire(event).actions
    skipped = (C.PIN_VERIFY, C.NOT_LAUNCHED, C.LADDER)
    assert visited == [s.value for s in CellState if s not in skipped]
    assert CellAction.RUN_WORKLOAD in actions and CellAction.RUN_RUNGS not in actions
    assert CELL_TABLE.policy(C.WORKLOAD).measuring


def test_a_pin_mismatch_before_launch_ends_and_cleans_nothing() -> None:
    visited: list[str] = []
    machine = LiveMachine(CELL_TABLE, "c", lambda _s, _e, dest: visited.append(dest.value))
    actions: list[CellAction] = []
    for event in (V.PINS_MISMATCH, V.NOTHING_LAUNCHED, V.RECEIPT_PUBLISHED):
        actions += machine.fire(event).actions
    assert visited == ["not-launched", "finalize", "done"]
    assert actions == [CellAction.PUBLISH_RECEIPT] and machine.faulted


@pytest.mark.parametrize("state", [C.PIN_VERIFY, C.LAUNCH, C.WARMUP, C.LADDER, C.POST_VERIFY])
@pytest.mark.parametrize("stop", [V.FAULT, V.CANCELLED, V.DEADLINE_EXPIRED])
def test_failure_is_sticky(state: CellState, stop: CellEvent) -> None:
    """After a fault, no event leads back to a working state: only cleanup and finalize."""
    machine, _ = live_at(CELL_TABLE, state)
    actions = machine.fire(stop).actions
    assert actions == (() if state == C.PIN_VERIFY else (CellAction.END_HOST,))
    assert machine.faulted
    reachable = {machine.state}
    frontier = [machine.state]
    while frontier:
        current = frontier.pop()
        for event in CellEvent:
            step = CELL_TABLE.rows.get((current, event))
            if step is not None and step.to not in reachable:
                reachable.add(step.to)
                frontier.append(step.to)
    assert reachable <= {C.NOT_LAUNCHED, C.CLEANUP, C.FINALIZE, C.DONE}
    for working in (V.PINS_VERIFIED, V.HOST_READY, V.WARMUP_DONE, V.LADDER_DONE):
        with pytest.raises(Refused):
            machine.fire(working)


def test_generated_docs_come_from_the_table() -> None:
    text = render_table_markdown()
    assert "stateDiagram-v2" in text
    for (state, _event), step in CELL_TABLE.rows.items():
        assert f"| {state.value} |" in text
        assert f"{state.value.replace('-', '_')} --> {step.to.value.replace('-', '_')}" in text
    assert (
        "| post-verify | pins-verified, pins-mismatch, fault, cancelled, deadline-expired |" in text
    )
    assert repr(LiveMachine(CELL_TABLE, "cell-7")) == "<cell machine cell-7 state=pin-verify>"
