"""Every (state, event) pair of the cell and row tables: allowed ones go where the table says,
every other pair is a typed refusal with a stable code."""

from __future__ import annotations

import itertools
import logging
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest

from cache_family.errors import Refused
from cache_family.states import cell as cell_module
from cache_family.states.cell import (
    CELL_TABLE,
    ROW_TABLE,
    CellAction,
    CellEvent,
    CellState,
    Machine,
    RowEvent,
    RowState,
    new_cell_machine,
    render_table_markdown,
    validate_with_transitions,
)

C, V = CellState, CellEvent

# The expected cell lifecycle written out independently of the table, pair by pair.
EXPECTED_CELL: dict[tuple[CellState, CellEvent], CellState] = {
    (C.PIN_VERIFY, V.PINS_VERIFIED): C.LAUNCH,
    (C.LAUNCH, V.HOST_READY): C.WARMUP,
    (C.WARMUP, V.WARMUP_DONE): C.LADDER,
    (C.LADDER, V.LADDER_DONE): C.POST_VERIFY,
    (C.POST_VERIFY, V.PINS_VERIFIED): C.CLEANUP,
    (C.POST_VERIFY, V.PINS_MISMATCH): C.CLEANUP,
    (C.PIN_VERIFY, V.PINS_MISMATCH): C.CLEANUP,
    (C.CLEANUP, V.CLEANUP_DONE): C.FINALIZE,
    (C.FINALIZE, V.RECEIPT_PUBLISHED): C.DONE,
    (C.FINALIZE, V.CANCELLED): C.FINALIZE,
    (C.FINALIZE, V.DEADLINE_EXPIRED): C.FINALIZE,
}
for _state in (C.PIN_VERIFY, C.LAUNCH, C.WARMUP, C.LADDER, C.POST_VERIFY, C.CLEANUP):
    for _event in (V.FAULT, V.CANCELLED, V.DEADLINE_EXPIRED):
        EXPECTED_CELL[(_state, _event)] = C.CLEANUP

R, RE = RowState, RowEvent
EXPECTED_ROW: dict[tuple[RowState, RowEvent], RowState] = {
    (R.CORRECTNESS, RE.CORRECTNESS_FINISHED): R.SERIAL,
    (R.CORRECTNESS, RE.CORRECTNESS_NOT_RUN): R.SERIAL,
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


@pytest.mark.parametrize(("state", "event"), list(itertools.product(CellState, CellEvent)))
def test_every_cell_pair(state: CellState, event: CellEvent) -> None:
    machine = new_cell_machine("cell-0000/native-serial")
    machine.state = state
    expected = EXPECTED_CELL.get((state, event))
    if expected is None:
        with pytest.raises(Refused) as refused:
            machine.fire(event)
        assert refused.value.codes == ["cell.transition.refused"]
        assert refused.value.refusals[0].path == f"$.cell.{state.value}"
        assert event.value in refused.value.refusals[0].message
        assert machine.state == state  # a refused event changes nothing
    else:
        step = machine.fire(event)
        assert step.to == expected
        assert machine.state == expected


@pytest.mark.parametrize(("state", "event"), list(itertools.product(RowState, RowEvent)))
def test_every_row_pair(state: RowState, event: RowEvent) -> None:
    machine = Machine(ROW_TABLE, "row-3")
    machine.state = state
    expected = EXPECTED_ROW.get((state, event))
    if expected is None:
        with pytest.raises(Refused) as refused:
            machine.fire(event)
        assert refused.value.codes == ["row.transition.refused"]
    else:
        assert machine.fire(event).to == expected


def test_table_has_exactly_the_expected_pairs() -> None:
    assert {k: v.to for k, v in CELL_TABLE.rows.items()} == EXPECTED_CELL
    assert {k: v.to for k, v in ROW_TABLE.rows.items()} == EXPECTED_ROW


def test_transitions_library_agrees_with_both_tables() -> None:
    validate_with_transitions(CELL_TABLE)
    validate_with_transitions(ROW_TABLE)


def test_validation_refuses_a_table_whose_rows_name_an_unlisted_state() -> None:
    unlisted = replace(CELL_TABLE, states=tuple(s for s in CellState if s != C.WARMUP))
    with pytest.raises(ValueError, match="warmup is not a state"):
        validate_with_transitions(unlisted)
    no_final = replace(ROW_TABLE, states=tuple(s for s in RowState if s != R.DONE))
    with pytest.raises(ValueError, match="final state done is not among"):
        validate_with_transitions(no_final)


def test_validation_fires_nothing_and_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        validate_with_transitions(CELL_TABLE)
        validate_with_transitions(ROW_TABLE)
    assert [r for r in caplog.records if r.name.startswith("transitions")] == []


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": ":".join(sys.path), "PYTHONDONTWRITEBYTECODE": "1"},
        check=False,
    )


def test_importing_the_tables_validates_them() -> None:
    """A transitions machine that disagrees with the tables fails the import itself."""
    broken = _python(
        """
        import transitions
        transitions.Machine.get_triggers = lambda self, *states: []
        import cache_family.states.cell
        """
    )
    assert broken.returncode != 0
    assert "cell table disagrees with transitions" in broken.stderr
    assert "pins-verified: transitions refused it" in broken.stderr


def test_importing_the_tables_does_no_io() -> None:
    """Importing the tables (and validating them with transitions) opens, lists, spawns and
    connects nothing; only the import machinery itself reads files (finding modules)."""
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


def test_the_warmup_state_sends_no_request() -> None:
    """host-ready cuts the prompt and journals the warmup rule; the excluded warmup request is
    the serial rung's request 0, sent by run-rungs in ladder (the module docstring says so)."""
    assert CELL_TABLE.step(C.LAUNCH, V.HOST_READY).actions == (
        CellAction.CUT_PROMPT,
        CellAction.JOURNAL_WARMUP_RULE,
    )
    assert CELL_TABLE.step(C.WARMUP, V.WARMUP_DONE).actions == (CellAction.RUN_RUNGS,)
    assert not [a for a in CellAction if "send" in a.value]
    assert cell_module.__doc__ is not None
    assert "request 0 of the serial cell's one rung" in " ".join(cell_module.__doc__.split())


def test_happy_path_visits_every_state_with_the_intended_actions() -> None:
    machine = new_cell_machine("c")
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
    assert machine.visited == list(CellState)
    assert machine.finished and not machine.faulted
    assert actions[0] == CellAction.SPAWN_HOST
    assert CellAction.TERMINATE_HOST in actions
    assert actions[-2:] == [CellAction.FOLD_RECEIPT, CellAction.PUBLISH_RECEIPT]


@pytest.mark.parametrize("state", [C.PIN_VERIFY, C.LAUNCH, C.WARMUP, C.LADDER, C.POST_VERIFY])
@pytest.mark.parametrize("stop", [V.FAULT, V.CANCELLED, V.DEADLINE_EXPIRED])
def test_failure_is_sticky(state: CellState, stop: CellEvent) -> None:
    """After a fault, no event leads back to a working state: only cleanup and finalize."""
    machine = new_cell_machine("c")
    machine.state = state
    assert machine.fire(stop).actions[0] == CellAction.TERMINATE_HOST
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
    assert reachable == {C.CLEANUP, C.FINALIZE, C.DONE}
    for working in (V.PINS_VERIFIED, V.HOST_READY, V.WARMUP_DONE, V.LADDER_DONE):
        with pytest.raises(Refused):
            machine.fire(working)


def test_post_run_drift_is_a_fault_but_keeps_the_route() -> None:
    machine = new_cell_machine("c")
    for event in (V.PINS_VERIFIED, V.HOST_READY, V.WARMUP_DONE, V.LADDER_DONE):
        machine.fire(event)
    machine.fire(V.PINS_MISMATCH)
    assert machine.faulted and machine.state == C.CLEANUP


def test_generated_docs_come_from_the_table() -> None:
    text = render_table_markdown()
    assert "stateDiagram-v2" in text
    for (state, _event), step in CELL_TABLE.rows.items():
        assert f"| {state.value} |" in text
        assert f"{state.value.replace('-', '_')} --> {step.to.value.replace('-', '_')}" in text
    assert (
        "| post-verify | pins-verified, pins-mismatch, fault, cancelled, deadline-expired |" in text
    )
    assert repr(new_cell_machine("cell-7")) == "<cell machine cell-7 state=pin-verify>"
