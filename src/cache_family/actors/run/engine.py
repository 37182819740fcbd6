"""The one driver of every table (cell, row, correctness arm).

A step's ``fsync`` column says whether the journal is durable before its actions; the
destination's policy whether they run shielded and how long they may take. An exception becomes
an event through the actor's ``interrupted`` hook; a stop that ended the loop early is re-raised
once the machine is finished. ``Handlers`` refuses, at import, a state without work or an action
without its one handler.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from enum import StrEnum
from typing import Generic, TypeVar

import trio

from cache_family.states.cell import LiveMachine, MachineTable

ActorT = TypeVar("ActorT")
StateT = TypeVar("StateT", bound=StrEnum)
EventT = TypeVar("EventT", bound=StrEnum)
ActionT = TypeVar("ActionT", bound=StrEnum)

# A state's work: what it does before the machine takes its way out. None: the machine rests in
# this state (a row with nothing to publish), the driver returns.
Work = Callable[[ActorT], Awaitable[EventT | None]]
Effect = Callable[[ActorT], Awaitable[None]]
# Turns an exception escaping work or actions into the event the table takes from there, and
# says whether it is a stop to re-raise once the machine is finished (raise to propagate now).
Interrupted = Callable[[BaseException, bool], Awaitable[tuple[EventT, bool]]]


class Handlers(Generic[ActorT, StateT, EventT, ActionT]):
    """One actor's work for every state and one effect for every action of ``table``."""

    def __init__(
        self,
        owner: str,
        table: MachineTable[StateT, EventT, ActionT],
        work: Mapping[StateT, Work[ActorT, EventT]],
        effects: Mapping[ActionT, Effect[ActorT]],
    ) -> None:
        check_handlers(owner, table, work, effects)
        self.table = table
        self.work = work
        self.effects = effects


def check_handlers(
    owner: str,
    table: MachineTable[StateT, EventT, ActionT],
    work: Mapping[StateT, object],
    effects: Mapping[ActionT, object],
) -> None:
    """Every state but the final one has its work and every action of ``table`` its one
    effect handler; a handler for something the table does not have is refused too."""
    missing = {s.value for s in table.states if s != table.final and s not in work}
    missing |= {a.value for a in table.actions() if a not in effects}
    if missing:
        raise ValueError(f"{owner}: no work or effect handler for {sorted(missing)}")
    extra = {s.value for s in work if s not in table.states or s == table.final}
    extra |= {a.value for a in effects if a not in table.actions()}
    if extra:
        raise ValueError(f"{owner}: handlers for nothing the {table.name} table does: {extra}")


async def drive(
    actor: ActorT,
    machine: LiveMachine[StateT, EventT, ActionT],
    handlers: Handlers[ActorT, StateT, EventT, ActionT],
    *,
    sync: Callable[[], Awaitable[object]],
    interrupted: Interrupted[EventT],
    first: EventT | None = None,
) -> None:
    """Run ``machine`` through its table until it is finished or rests. ``sync`` makes the
    journal durable; ``first``: an event that happened before any work (a row never reached)."""
    event = first
    stopped: BaseException | None = None  # re-raised once the machine is finished
    while not machine.finished:
        try:
            if event is None:
                with trio.CancelScope(shield=stopped is not None):
                    event = await handlers.work[machine.state](actor)
                if event is None:
                    break
            step = machine.fire(event)
            event = None
            policy = machine.table.policy(step.to)
            # Cleanup and finalize, and everything after a stop, are shielded and bounded.
            with trio.CancelScope(shield=stopped is not None or policy.after_fault):
                with trio.move_on_after(policy.bound_seconds) as bounded:
                    if step.fsync:
                        await sync()
                    for action in step.actions:
                        await handlers.effects[action](actor)
            if bounded.cancelled_caught:
                break  # a wedged disk or journal: give up on this machine, not on the run
        except BaseException as exc:
            event, stops = await interrupted(exc, stopped is not None)
            if stops:
                stopped = stopped or exc
    if stopped is not None:
        raise stopped
