"""The cell machine (one host session of one arm), the row machine and the correctness machine
(one row's correctness arm), each as one table. The warmup state sends the excluded warmup
request, so ``ladder`` sends only measured requests.

A (state, event) pair not in a table is refused (``cell.transition.refused``,
``row.transition.refused``); nothing else is inferred. Faults, cancellation and deadline expiry
lead from every working state to ``cleanup`` and from there only to ``finalize``: failure is
sticky, checked at import.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Final, Generic, TypeVar

from transitions import Machine, MachineError

from cache_family.errors import Refused
from cache_family.schemas.receipts import ReceiptStatus


class CellState(StrEnum):
    PIN_VERIFY = "pin-verify"
    NOT_LAUNCHED = "not-launched"
    LAUNCH = "launch"
    WARMUP = "warmup"
    LADDER = "ladder"
    # A workload arm's work in place of the ladder (``actors/run/workloads.py``).
    WORKLOAD = "workload"
    POST_VERIFY = "post-verify"
    CLEANUP = "cleanup"
    FINALIZE = "finalize"
    DONE = "done"


class CellEvent(StrEnum):
    PINS_VERIFIED = "pins-verified"
    PINS_MISMATCH = "pins-mismatch"
    NOTHING_LAUNCHED = "nothing-launched"
    HOST_READY = "host-ready"
    WARMUP_DONE = "warmup-done"
    LADDER_DONE = "ladder-done"
    # Warmup done for a workload arm: its workload runs instead of the rungs.
    WORKLOAD_READY = "workload-ready"
    WORKLOAD_DONE = "workload-done"
    FAULT = "fault"
    CANCELLED = "cancelled"
    DEADLINE_EXPIRED = "deadline-expired"
    CLEANUP_DONE = "cleanup-done"
    RECEIPT_PUBLISHED = "receipt-published"


class CellAction(StrEnum):
    SPAWN_HOST = "spawn-host"
    AWAIT_READINESS = "await-listening-marker-and-health"
    CUT_PROMPT = "cut-prompt-with-host-tokenizer"
    JOURNAL_WARMUP_RULE = "journal-warmup-rule"
    SEND_WARMUP = "send-excluded-warmup"
    RUN_RUNGS = "run-rungs"
    # The arm's measurement kind's workload (overlap points, sessions or open-loop rates).
    RUN_WORKLOAD = "run-workload"
    # Custody: SIGTERM the group, grace, SIGKILL, reap, check descendants and port, remove dir.
    END_HOST = "end-host"
    PUBLISH_RECEIPT = "fold-and-publish-receipt"


class RowState(StrEnum):
    CORRECTNESS = "correctness"
    SERIAL = "serial"
    CONCURRENT = "concurrent"
    FINALIZE = "finalize"
    DONE = "done"


class RowEvent(StrEnum):
    CORRECTNESS_PASSED = "correctness-passed"
    # Failed, refused or not runnable: the row keeps the evidence and skips its baselines.
    CORRECTNESS_NOT_PASSED = "correctness-not-passed"
    MODEL_MISSING = "model-missing"
    ARM_FINISHED = "arm-finished"
    ARM_SKIPPED = "arm-skipped"
    ARMS_EXHAUSTED = "arms-exhausted"
    CANCELLED = "cancelled"
    DEADLINE_EXPIRED = "deadline-expired"
    RECEIPT_PUBLISHED = "receipt-published"


class RowAction(StrEnum):
    SKIP_BASELINES = "skip-baselines"
    RUN_SERIAL_CELL = "run-serial-cell"
    RUN_NEXT_CELL = "run-next-concurrent-cell"
    PUBLISH_ROW = "fold-and-publish-row-receipt"


StateT = TypeVar("StateT", bound=StrEnum)
EventT = TypeVar("EventT", bound=StrEnum)
ActionT = TypeVar("ActionT", bound=StrEnum)

# A step whose ``fsync`` is this shares the fsync of the durable point that follows it.
SYNCED_LATER: Final = False


@dataclass(frozen=True, slots=True)
class Step(Generic[StateT, ActionT]):
    """Where an event leads and what the actor must do on the way. ``fsync``: the step's
    transition record is made durable before the actions run (else it shares the next
    durable point's fsync, with nothing outside the journal done in between)."""

    to: StateT
    actions: tuple[ActionT, ...] = ()
    fsync: bool = True


@dataclass(frozen=True, slots=True)
class StatePolicy:
    """What holds for every step into a state, and what a fault in it means: the columns the
    driver (``actors/run/engine.py``) and the folds (``states/fold/``) read."""

    # Reachable after a fault (failure is sticky); the actions of steps into it run shielded
    # from cancellation.
    after_fault: bool = False
    # How long the actions of a step into it may take (a wedged disk cannot hang a run).
    bound_seconds: float = math.inf
    # The receipt level a fault recorded in this state lowers the receipt to.
    on_fault: ReceiptStatus = "incomplete"
    # A receipt folded in this state is whole; a journal ending elsewhere ended too early.
    finished: bool = False
    # The state's work climbs the measured rungs (the progress display counts them).
    measuring: bool = False


# A state the table gives no policy has the defaults.
_DEFAULT_POLICY: Final = StatePolicy()


@dataclass(frozen=True)
class MachineTable(Generic[StateT, EventT, ActionT]):
    name: str
    states: tuple[StateT, ...]
    events: tuple[EventT, ...]
    initial: StateT
    final: StateT
    # Events that record something going wrong; after one, the machine is "faulted".
    fault_events: frozenset[EventT]
    rows: Mapping[tuple[StateT, EventT], Step[StateT, ActionT]]
    # Each state's policy columns.
    policies: Mapping[StateT, StatePolicy] = field(default_factory=dict)

    def policy(self, state: StateT) -> StatePolicy:
        return self.policies.get(state, _DEFAULT_POLICY)

    @property
    def after_fault(self) -> frozenset[StateT]:
        """States a faulted machine may still be in or enter."""
        return frozenset(state for state in self.states if self.policy(state).after_fault)

    def step(self, state: StateT, event: EventT) -> Step[StateT, ActionT]:
        try:
            return self.rows[(state, event)]
        except KeyError:
            allowed = ", ".join(e.value for e in self.allowed_events(state)) or "none"
            raise Refused.one(
                f"{self.name}.transition.refused",
                f"$.{self.name}.{state.value}",
                f"event {event.value!r} is not allowed in state {state.value!r}",
                f"allowed in {state.value!r}: {allowed}",
            ) from None

    def allowed_events(self, state: StateT) -> tuple[EventT, ...]:
        return tuple(e for e in self.events if (state, e) in self.rows)

    def actions(self) -> frozenset[ActionT]:
        """Every action some step of the table performs."""
        return frozenset(action for step in self.rows.values() for action in step.actions)

    def render_markdown(self) -> str:
        """A Markdown table of the steps, one of the state policies and a Mermaid state
        diagram, all generated from the table."""
        grouped = self._grouped()
        lines = [
            "| state | events | next state | actions | fsync |",
            "|---|---|---|---|---|",
        ]
        for state, events, step in grouped:
            actions = ", ".join(a.value for a in step.actions) or "-"
            names = ", ".join(e.value for e in events)
            fsync = "at the step" if step.fsync else "later"
            lines.append(f"| {state.value} | {names} | {step.to.value} | {actions} | {fsync} |")
        lines += [
            "",
            "| state | after a fault (shielded) | time bound | a fault lowers to | finished |",
            "|---|---|---|---|---|",
        ]
        for state in self.states:
            policy = self.policy(state)
            bound = "-" if math.isinf(policy.bound_seconds) else f"{policy.bound_seconds:g} s"
            yes = {True: "yes", False: "-"}
            lines.append(
                f"| {state.value} | {yes[policy.after_fault]} | {bound} | {policy.on_fault} "
                f"| {yes[policy.finished]} |"
            )
        lines += ["", "```mermaid", "stateDiagram-v2", f"    [*] --> {_mermaid(self.initial)}"]
        for state, events, step in grouped:
            names = ", ".join(e.value for e in events)
            lines.append(f"    {_mermaid(state)} --> {_mermaid(step.to)}: {names}")
        lines += [f"    {_mermaid(self.final)} --> [*]", "```"]
        return "\n".join(lines) + "\n"

    def _grouped(self) -> list[tuple[StateT, list[EventT], Step[StateT, ActionT]]]:
        """Consecutive rows with the same state and step, merged (as the source lists them)."""
        out: list[tuple[StateT, list[EventT], Step[StateT, ActionT]]] = []
        for (state, event), step in self.rows.items():
            if out and out[-1][0] == state and out[-1][2] == step:
                out[-1][1].append(event)
            else:
                out.append((state, [event], step))
        return out


def _mermaid(state: StrEnum) -> str:
    return state.value.replace("-", "_")


TableRow = (
    tuple[StateT, Iterable[EventT], StateT, tuple[ActionT, ...]]
    | tuple[StateT, Iterable[EventT], StateT, tuple[ActionT, ...], bool]
)


def _table(
    rows: Iterable[TableRow[StateT, EventT, ActionT]],
) -> Mapping[tuple[StateT, EventT], Step[StateT, ActionT]]:
    """The steps of ``rows``: (state, events, next state, actions[, fsync])."""
    out: dict[tuple[StateT, EventT], Step[StateT, ActionT]] = {}
    for state, events, to, actions, *fsync in rows:
        for event in events:
            if (state, event) in out:
                raise ValueError(f"duplicate table row for ({state.value}, {event.value})")
            out[(state, event)] = Step(to, actions, *fsync)
    return MappingProxyType(out)


# Finalize (fold + publish) is shielded; this bounds it so a wedged disk cannot hang a run.
FINALIZE_BOUND_SECONDS: Final = 30.0

Cell, CellOn, CellDo = CellState, CellEvent, CellAction
_STOP = (CellOn.FAULT, CellOn.CANCELLED, CellOn.DEADLINE_EXPIRED)
_CLEANUP = (CellDo.END_HOST,)
_FINALIZE = (CellDo.PUBLISH_RECEIPT,)
_WORKLOAD = (CellDo.RUN_WORKLOAD,)

# fmt: off
CELL_TABLE: Final = MachineTable[CellState, CellEvent, CellAction](
    name="cell",
    states=tuple(CellState),
    events=tuple(CellEvent),
    initial=Cell.PIN_VERIFY,
    final=Cell.DONE,
    fault_events=frozenset((CellOn.PINS_MISMATCH, *_STOP)),
    rows=_table([
        # state              events                        next state         actions
        # pin-verify's work re-hashes the pins and reserves the port.
        (Cell.PIN_VERIFY,   [CellOn.PINS_VERIFIED],        Cell.LAUNCH,       (CellDo.SPAWN_HOST,
                                                                               CellDo.AWAIT_READINESS)),
        # Nothing was launched, so nothing is ended and no cleanup is recorded.
        (Cell.PIN_VERIFY,   [CellOn.PINS_MISMATCH, *_STOP], Cell.NOT_LAUNCHED, ()),
        # Publication folds through the journal's fsync before it writes any file.
        (Cell.NOT_LAUNCHED, [CellOn.NOTHING_LAUNCHED],     Cell.FINALIZE,     _FINALIZE,
                                                                              SYNCED_LATER),
        # Warmup's actions only journal and talk HTTP to the cell's own host, and every way out
        # of warmup fsyncs (the ladder's step, or cleanup's before it signals the host).
        (Cell.LAUNCH,       [CellOn.HOST_READY],           Cell.WARMUP,       (CellDo.CUT_PROMPT,
                                                                               CellDo.JOURNAL_WARMUP_RULE,
                                                                               CellDo.SEND_WARMUP),
                                                                              SYNCED_LATER),
        (Cell.LAUNCH,       _STOP,                         Cell.CLEANUP,      _CLEANUP),
        (Cell.WARMUP,       [CellOn.WARMUP_DONE],          Cell.LADDER,       (CellDo.RUN_RUNGS,)),
        # A workload arm (``schemas/arms.py``) runs its workload in place of the ladder.
        (Cell.WARMUP,       [CellOn.WORKLOAD_READY],       Cell.WORKLOAD,     _WORKLOAD),
        (Cell.WARMUP,       _STOP,                         Cell.CLEANUP,      _CLEANUP),
        # post-verify's work re-hashes the same pins: it only reads and journals, and every
        # way out of it fsyncs (cleanup's step, before it signals the host).
        (Cell.LADDER,       [CellOn.LADDER_DONE],          Cell.POST_VERIFY,  (), SYNCED_LATER),
        (Cell.LADDER,       _STOP,                         Cell.CLEANUP,      _CLEANUP),
        (Cell.WORKLOAD,     [CellOn.WORKLOAD_DONE],        Cell.POST_VERIFY,  (), SYNCED_LATER),
        (Cell.WORKLOAD,     _STOP,                         Cell.CLEANUP,      _CLEANUP),
        # Drift after the run keeps the measurements; the fold refuses parity.
        (Cell.POST_VERIFY,  [CellOn.PINS_VERIFIED,
                             CellOn.PINS_MISMATCH],        Cell.CLEANUP,      _CLEANUP),
        (Cell.POST_VERIFY,  _STOP,                         Cell.CLEANUP,      _CLEANUP),
        # Cleanup is shielded: late stops are recorded, cleanup carries on.
        (Cell.CLEANUP,      _STOP,                         Cell.CLEANUP,      ()),
        (Cell.CLEANUP,      [CellOn.CLEANUP_DONE],         Cell.FINALIZE,     _FINALIZE,
                                                                              SYNCED_LATER),
        # A stop before publication still downgrades the receipt being folded.
        (Cell.FINALIZE,     [CellOn.CANCELLED,
                             CellOn.DEADLINE_EXPIRED],     Cell.FINALIZE,     (), SYNCED_LATER),
        # The next cell's ``cell_opened`` or the row's receipt follows, both durable.
        (Cell.FINALIZE,     [CellOn.RECEIPT_PUBLISHED],    Cell.DONE,         (), SYNCED_LATER),
    ]),
    policies={
        # A fault before the host is ready measured nothing: the cell failed.
        Cell.PIN_VERIFY: StatePolicy(on_fault="failed"),
        Cell.NOT_LAUNCHED: StatePolicy(after_fault=True, on_fault="failed"),
        Cell.LAUNCH: StatePolicy(on_fault="failed"),
        Cell.LADDER: StatePolicy(measuring=True),
        Cell.WORKLOAD: StatePolicy(measuring=True),
        Cell.CLEANUP: StatePolicy(after_fault=True),
        Cell.FINALIZE: StatePolicy(
            after_fault=True, bound_seconds=FINALIZE_BOUND_SECONDS, finished=True
        ),
        Cell.DONE: StatePolicy(after_fault=True, finished=True),
    },
)
# fmt: on

Row, RowOn, RowDo = RowState, RowEvent, RowAction
_ROW_STOP = (RowOn.CANCELLED, RowOn.DEADLINE_EXPIRED)
_ROW_FINALIZE = (RowDo.PUBLISH_ROW,)

# fmt: off
ROW_TABLE: Final = MachineTable[RowState, RowEvent, RowAction](
    name="row",
    states=tuple(RowState),
    events=tuple(RowEvent),
    initial=Row.CORRECTNESS,
    final=Row.DONE,
    fault_events=frozenset(_ROW_STOP),
    rows=_table([
        # state            events                          next state      actions
        # The row's correctness arm runs in this state's work (its own machine, below). A
        # step between the row's arms shares the fsync of what follows it (the next cell's
        # durable ``cell_opened``, or the row receipt's fold).
        (Row.CORRECTNESS, [RowOn.CORRECTNESS_PASSED],     Row.SERIAL,     (RowDo.RUN_SERIAL_CELL,),
                                                                          SYNCED_LATER),
        (Row.CORRECTNESS, [RowOn.CORRECTNESS_NOT_PASSED], Row.FINALIZE,   (RowDo.SKIP_BASELINES,
                                                                           *_ROW_FINALIZE),
                                                                          SYNCED_LATER),
        # A row whose model is missing has no directory and no receipt of its own: it rests
        # in finalize (the matrix folds it from ``row_opened``).
        (Row.CORRECTNESS, [RowOn.MODEL_MISSING],          Row.FINALIZE,   ()),
        (Row.CORRECTNESS, _ROW_STOP,                      Row.FINALIZE,   _ROW_FINALIZE),
        (Row.SERIAL,      [RowOn.ARM_FINISHED,
                           RowOn.ARM_SKIPPED],            Row.CONCURRENT, (RowDo.RUN_NEXT_CELL,),
                                                                          SYNCED_LATER),
        (Row.SERIAL,      _ROW_STOP,                      Row.FINALIZE,   _ROW_FINALIZE),
        (Row.CONCURRENT,  [RowOn.ARM_FINISHED,
                           RowOn.ARM_SKIPPED],            Row.CONCURRENT, (RowDo.RUN_NEXT_CELL,),
                                                                          SYNCED_LATER),
        (Row.CONCURRENT,  [RowOn.ARMS_EXHAUSTED],         Row.FINALIZE,   _ROW_FINALIZE,
                                                                          SYNCED_LATER),
        (Row.CONCURRENT,  _ROW_STOP,                      Row.FINALIZE,   _ROW_FINALIZE),
        (Row.FINALIZE,    _ROW_STOP,                      Row.FINALIZE,   ()),
        (Row.FINALIZE,    [RowOn.RECEIPT_PUBLISHED],      Row.DONE,       ()),
    ]),
    policies={
        Row.FINALIZE: StatePolicy(
            after_fault=True, bound_seconds=FINALIZE_BOUND_SECONDS, finished=True
        ),
        Row.DONE: StatePolicy(
            after_fault=True, bound_seconds=FINALIZE_BOUND_SECONDS, finished=True
        ),
    },
)
# fmt: on


class CorrectnessState(StrEnum):
    ADMIT = "admit"
    TOPOLOGY = "topology"
    GATE = "gate"
    FINALIZE = "finalize"
    DONE = "done"


class CorrectnessEvent(StrEnum):
    ADMITTED = "admitted"
    NOT_RUNNABLE = "not-runnable"
    TOPOLOGY_ENDED = "topology-ended"
    TOPOLOGIES_EXHAUSTED = "topologies-exhausted"
    ACCEPTED = "accepted"
    REJECTED = "rejected"
    CANCELLED = "cancelled"
    DEADLINE_EXPIRED = "deadline-expired"
    VERDICT_JOURNALED = "verdict-journaled"


class CorrectnessAction(StrEnum):
    # One planned topology: the tool as a supervised child, then the gate on its report.
    RUN_TOPOLOGY = "run-topology-child-and-gate-report"
    JOURNAL_VERDICT = "journal-stage-verdict"


Check, CheckOn, CheckDo = CorrectnessState, CorrectnessEvent, CorrectnessAction
_CHECK_STOP = (CheckOn.CANCELLED, CheckOn.DEADLINE_EXPIRED)
_VERDICT = (CheckDo.JOURNAL_VERDICT,)

# fmt: off
CORRECTNESS_TABLE: Final = MachineTable[CorrectnessState, CorrectnessEvent, CorrectnessAction](
    name="correctness",
    states=tuple(CorrectnessState),
    events=tuple(CorrectnessEvent),
    initial=Check.ADMIT,
    final=Check.DONE,
    fault_events=frozenset((CheckOn.NOT_RUNNABLE, *_CHECK_STOP)),
    rows=_table([
        # state           events                          next state       actions
        # admit's work checks the profile against the row and plans the topologies.
        (Check.ADMIT,     [CheckOn.ADMITTED],             Check.TOPOLOGY,  (CheckDo.RUN_TOPOLOGY,)),
        (Check.ADMIT,     [CheckOn.NOT_RUNNABLE,
                           *_CHECK_STOP],                 Check.FINALIZE,  _VERDICT),
        # Every planned topology runs, also after one failed: each keeps its evidence.
        (Check.TOPOLOGY,  [CheckOn.TOPOLOGY_ENDED],       Check.TOPOLOGY,  (CheckDo.RUN_TOPOLOGY,)),
        (Check.TOPOLOGY,  [CheckOn.TOPOLOGIES_EXHAUSTED], Check.GATE,      ()),
        (Check.TOPOLOGY,  _CHECK_STOP,                    Check.FINALIZE,  _VERDICT),
        # gate's work: every topology passed with one identical non-empty prompt text.
        (Check.GATE,      [CheckOn.ACCEPTED,
                           CheckOn.REJECTED],             Check.FINALIZE,  _VERDICT),
        (Check.GATE,      _CHECK_STOP,                    Check.FINALIZE,  _VERDICT),
        (Check.FINALIZE,  _CHECK_STOP,                    Check.FINALIZE,  ()),
        (Check.FINALIZE,  [CheckOn.VERDICT_JOURNALED],    Check.DONE,      ()),
    ]),
    policies={
        Check.FINALIZE: StatePolicy(
            after_fault=True, bound_seconds=FINALIZE_BOUND_SECONDS, finished=True
        ),
        Check.DONE: StatePolicy(
            after_fault=True, bound_seconds=FINALIZE_BOUND_SECONDS, finished=True
        ),
    },
)
# fmt: on


OnStep = Callable[[StateT, EventT, StateT], None]


class LiveMachine(Generic[StateT, EventT, ActionT]):
    """The running state of one cell or row: a ``transitions.Machine`` built from ``table``
    (synchronous, no auto transitions, invalid triggers refused). After every step it calls
    ``on_step(source, event, dest)``; the actors journal the step there."""

    def __init__(
        self,
        table: MachineTable[StateT, EventT, ActionT],
        subject: str,
        on_step: OnStep[StateT, EventT] | None = None,
    ) -> None:
        self.table = table
        self.subject = subject
        self.faulted = False
        self._on_step = on_step
        self._states = type(table.initial)
        self._events = type(next(iter(table.events)))
        self._model = _Model()
        self._machine = Machine(
            model=self._model,
            states=[state.value for state in table.states],
            transitions=[
                {"trigger": event.value, "source": state.value, "dest": step.to.value}
                for (state, event), step in table.rows.items()
            ],
            initial=table.initial.value,
            auto_transitions=False,
            ignore_invalid_triggers=False,
            send_event=True,
            after_state_change=[self._stepped],
        )

    @property
    def state(self) -> StateT:
        return self._states(self._model.state)

    def fire(self, event: EventT) -> Step[StateT, ActionT]:
        """Take ``event`` through the live machine; raise ``<name>.transition.refused`` where
        the table has no step for it. Returns the table's step (its actions are the actor's)."""
        source = self.state
        try:
            self._model.trigger(event.value)
        except (MachineError, AttributeError):
            self.table.step(source, event)  # raises the typed refusal
            raise
        return self.table.rows[(source, event)]

    def can_fire(self, event: EventT) -> bool:
        return event.value in self._machine.get_triggers(self._model.state)

    @property
    def finished(self) -> bool:
        return self.state == self.table.final

    def _stepped(self, data: Any) -> None:
        source = self._states(data.transition.source)
        event = self._events(data.event.name)
        dest = self._states(data.transition.dest)
        self.faulted = self.faulted or event in self.table.fault_events
        if self._on_step is not None:
            self._on_step(source, event, dest)

    def __repr__(self) -> str:
        flag = " faulted" if self.faulted else ""
        return f"<{self.table.name} machine {self.subject} state={self.state.value}{flag}>"


class _Model:
    """What ``transitions`` drives: it keeps ``state`` here and adds ``trigger``."""

    state: str
    trigger: Callable[[str], bool]


CellMachine = LiveMachine[CellState, CellEvent, CellAction]
RowMachine = LiveMachine[RowState, RowEvent, RowAction]
CorrectnessMachine = LiveMachine[CorrectnessState, CorrectnessEvent, CorrectnessAction]


def render_table_markdown() -> str:
    """Docs for both machines, generated from the tables (never written by hand)."""
    return (
        "## Cell machine\n\n"
        + CELL_TABLE.render_markdown()
        + "\n## Row machine\n\n"
        + ROW_TABLE.render_markdown()
        + "\n## Correctness machine\n\n"
        + CORRECTNESS_TABLE.render_markdown()
    )


def _check_sticky(table: MachineTable[Any, Any, Any]) -> None:
    """After a fault event, only states in ``after_fault`` may be reached."""
    for (_state, event), step in table.rows.items():
        if event in table.fault_events and step.to not in table.after_fault:
            raise ValueError(f"{table.name}: fault {event.value} leads to {step.to.value}")
    for (state, _event), step in table.rows.items():
        if state in table.after_fault and step.to not in table.after_fault:
            raise ValueError(f"{table.name}: {state.value} leads back to {step.to.value}")


_check_sticky(CELL_TABLE)
_check_sticky(ROW_TABLE)
_check_sticky(CORRECTNESS_TABLE)
