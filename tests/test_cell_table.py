"""Every (state, event) pair of the cell and row tables: allowed ones go where the table says,
every other pair is a typed refusal with a stable code."""

from __future__ import annotations

import itertools

import pytest

from cache_family.errors import Refused
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
