"""The one driver (``actors/run/engine.py``) run with fakes over every (state, event) pair of the
cell, row and correctness tables: the step's actions run in order, each through its one handler;
the journal is fsynced before them exactly where the step's ``fsync`` column says; they run
shielded and time-bounded exactly as the destination's policy says. An actor missing a handler
(or holding one for nothing) is refused when its handlers are built, at import."""

from __future__ import annotations

import math
from collections import deque
from enum import StrEnum
from typing import Any

import pytest
import trio
import trio.testing

from cache_family.actors.run import cell as cell_actor
from cache_family.actors.run import correctness as correctness_actor
from cache_family.actors.run import row as row_actor
from cache_family.actors.run.engine import Handlers, check_handlers, drive
from cache_family.states.cell import (
    CELL_TABLE,
    CORRECTNESS_TABLE,
    ROW_TABLE,
    LiveMachine,
    MachineTable,
)

TABLES: dict[str, MachineTable[Any, Any, Any]] = {
    "cell": CELL_TABLE,
    "row": ROW_TABLE,
    "correctness": CORRECTNESS_TABLE,
}
PAIRS = [(name, state, event) for name, table in TABLES.items() for (state, event) in table.rows]


def path_to(table: MachineTable[Any, Any, Any], state: StrEnum) -> list[StrEnum]:
    """The events of the table's shortest path from its initial state to ``state``."""
    paths: dict[StrEnum, list[StrEnum]] = {table.initial: []}
    queue = deque([table.initial])
    while queue:
        current = queue.popleft()
        for (source, event), step in table.rows.items():
            if source == current and step.to not in paths:
                paths[step.to] = [*paths[current], event]
                queue.append(step.to)
    return paths[state]


class FakeActor:
    """Records what the driver asks of it: each sync, and each effect with the scope it ran
    in. Every state's work answers None (the machine rests), so one step is driven."""

    def __init__(self, outer: trio.CancelScope | None = None) -> None:
        self.log: list[tuple[str, object]] = []
        self.outer = outer
        self.shielded: bool | None = None

    async def sync(self) -> None:
        self.log.append(("sync", None))

    async def work(self) -> None:
        return None

    def effect(self, action: StrEnum) -> Any:
        async def run(actor: FakeActor) -> None:
            actor.log.append(("action", action))
            actor.log.append(("deadline", trio.current_effective_deadline() - trio.current_time()))
            if actor.outer is not None and actor.shielded is None:
                # Cancel the scope around the driver: only a shielded effect carries on.
                actor.outer.cancel()
                actor.shielded = False
                await trio.lowlevel.checkpoint()
                actor.shielded = True

        return run


def handlers_for(
    table: MachineTable[Any, Any, Any], actor: FakeActor
) -> Handlers[Any, Any, Any, Any]:
    work = {state: FakeActor.work for state in table.states if state != table.final}
    effects = {action: actor.effect(action) for action in table.actions()}
    return Handlers("fake", table, work, effects)


async def never_interrupted(exc: BaseException, stopping: bool) -> tuple[Any, bool]:
    raise exc


async def drive_one_step(
    table: MachineTable[Any, Any, Any], state: StrEnum, event: StrEnum, actor: FakeActor
) -> LiveMachine[Any, Any, Any]:
    machine: LiveMachine[Any, Any, Any] = LiveMachine(table, "t")
    for earlier in path_to(table, state):
        machine.fire(earlier)
    await drive(
        actor,
        machine,
        handlers_for(table, actor),
        sync=actor.sync,
        interrupted=never_interrupted,
        first=event,
    )
    return machine


@pytest.mark.parametrize(("name", "state", "event"), PAIRS)
async def test_the_driver_performs_each_step_as_its_table_row_says(
    name: str, state: StrEnum, event: StrEnum, autojump_clock: trio.testing.MockClock
) -> None:
    table = TABLES[name]
    step = table.rows[(state, event)]
    policy = table.policy(step.to)
    actor = FakeActor()
    machine = await drive_one_step(table, state, event, actor)
    assert machine.state == step.to
    expected: list[tuple[str, object]] = [("sync", None)] if step.fsync else []
    for action in step.actions:
        expected += [("action", action), ("deadline", policy.bound_seconds)]
    assert actor.log == expected


@pytest.mark.parametrize(
    ("name", "state", "event"), [pair for pair in PAIRS if TABLES[pair[0]].rows[pair[1:]].actions]
)
async def test_the_actions_of_a_step_run_shielded_exactly_where_the_policy_says(
    name: str, state: StrEnum, event: StrEnum, autojump_clock: trio.testing.MockClock
) -> None:
    table = TABLES[name]
    step = table.rows[(state, event)]
    with trio.CancelScope() as outer:
        actor = FakeActor(outer)
        await drive_one_step(table, state, event, actor)
    assert actor.shielded == table.policy(step.to).after_fault


async def test_a_stop_shields_every_later_step_and_is_raised_once_the_machine_finishes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A cancellation while the ladder climbs: the table takes the cell to cleanup, finalize
    and done, each step's actions run although the scope around the driver is cancelled,
    then the cancellation is raised."""
    actor = FakeActor()
    table = CELL_TABLE
    ladder = path_to(table, cell_actor.CellState.LADDER)
    machine: LiveMachine[Any, Any, Any] = LiveMachine(table, "t")
    for event in ladder:
        machine.fire(event)
    script = iter(
        [
            None,  # the ladder's work is cancelled (below)
            cell_actor.CellEvent.CLEANUP_DONE,
            cell_actor.CellEvent.RECEIPT_PUBLISHED,
        ]
    )

    async def work(_actor: FakeActor) -> Any:
        event = next(script)
        if event is None:
            await trio.sleep_forever()
        return event

    handlers = Handlers(
        "fake",
        table,
        {state: work for state in table.states if state != table.final},
        {action: actor.effect(action) for action in table.actions()},
    )

    async def interrupted(exc: BaseException, stopping: bool) -> tuple[Any, bool]:
        assert isinstance(exc, trio.Cancelled) and not stopping
        return cell_actor.CellEvent.CANCELLED, True

    with trio.CancelScope() as outer:
        outer.cancel()
        await drive(actor, machine, handlers, sync=actor.sync, interrupted=interrupted)
    assert outer.cancelled_caught  # the driver raised the stop once the machine finished
    assert machine.finished and machine.faulted
    actions = [entry for kind, entry in actor.log if kind == "action"]
    assert actions == [cell_actor.CellAction.END_HOST, cell_actor.CellAction.PUBLISH_RECEIPT]


async def test_a_state_whose_work_answers_none_rests_there(
    autojump_clock: trio.testing.MockClock,
) -> None:
    actor = FakeActor()
    machine: LiveMachine[Any, Any, Any] = LiveMachine(ROW_TABLE, "t")
    await drive(
        actor,
        machine,
        handlers_for(ROW_TABLE, actor),
        sync=actor.sync,
        interrupted=never_interrupted,
    )
    assert machine.state == ROW_TABLE.initial and actor.log == []


@pytest.mark.parametrize(
    ("owner", "table", "work", "effects"),
    [
        ("cell actor", CELL_TABLE, cell_actor._WORK, cell_actor._EFFECTS),
        ("row actor", ROW_TABLE, row_actor._WORK, row_actor._EFFECTS),
        (
            "correctness actor",
            CORRECTNESS_TABLE,
            correctness_actor._WORK,
            correctness_actor._EFFECTS,
        ),
    ],
)
def test_each_actor_has_one_handler_per_action_and_a_missing_one_is_refused(
    owner: str,
    table: MachineTable[Any, Any, Any],
    work: dict[Any, Any],
    effects: dict[Any, Any],
) -> None:
    """The actors' own handlers pass (their modules build them at import, so a broken actor
    does not import); one handler fewer, or one for a state the table does not have, is
    refused with what is missing."""
    check_handlers(owner, table, work, effects)
    assert set(effects) == table.actions()
    for action in table.actions():
        fewer = {a: h for a, h in effects.items() if a != action}
        with pytest.raises(ValueError, match=action.value):
            Handlers(owner, table, work, fewer)
    for state in work:
        with pytest.raises(ValueError, match=state.value):
            Handlers(owner, table, {s: w for s, w in work.items() if s != state}, effects)
    extra = {**work, table.final: next(iter(work.values()))}
    with pytest.raises(ValueError, match="handlers for nothing"):
        Handlers(owner, table, extra, effects)


def test_policies_are_columns_of_the_tables_and_the_sticky_states_are_the_shielded_ones() -> None:
    """The cell's finalize is bounded; a fault before the host is ready fails the cell, after
    it leaves the cell incomplete; only finalize and done hold a whole receipt; the ladder is
    the one measuring state."""
    cell = CELL_TABLE
    State = cell_actor.CellState
    assert {s for s in cell.states if not math.isinf(cell.policy(s).bound_seconds)} == {
        State.FINALIZE
    }
    assert {s for s in cell.states if cell.policy(s).on_fault == "failed"} == {
        State.PIN_VERIFY,
        State.NOT_LAUNCHED,
        State.LAUNCH,
    }
    assert {s for s in cell.states if cell.policy(s).finished} == {State.FINALIZE, State.DONE}
    assert {s for s in cell.states if cell.policy(s).measuring} == {State.LADDER, State.WORKLOAD}
    assert cell.after_fault == {State.NOT_LAUNCHED, State.CLEANUP, State.FINALIZE, State.DONE}
    # Steps sharing a later fsync: into warmup, post-verify, finalize and done (the cell),
    # between arms and into finalize after the arms (the row); the correctness arm fsyncs
    # every step.
    later = {(s, e) for (s, e), step in cell.rows.items() if not step.fsync}
    assert {cell.rows[pair].to for pair in later} == {
        State.WARMUP,
        State.POST_VERIFY,
        State.FINALIZE,
        State.DONE,
    }
    assert all(step.fsync for step in CORRECTNESS_TABLE.rows.values())
