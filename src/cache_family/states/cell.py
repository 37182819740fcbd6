"""The cell machine (one host session of one arm), the row machine and the correctness machine
(one row's correctness arm), each as one table.

Read ``CELL_TABLE`` top to bottom: it is the whole lifecycle of a cell. Each row says: in this
state, on this event, go to that state and perform these actions. A (state, event) pair that is
not in the table is refused with ``cell.transition.refused`` (``row.transition.refused`` for
rows); nothing else is ever inferred. Faults, cancellation and deadline expiry lead from every
working state to ``cleanup`` (to ``not-launched`` before a host exists), and from there only
``finalize`` follows: failure is sticky by construction (checked when this module is imported).

The warmup state does the warmup: its actions cut the benchmark prompt with the host's own
tokenizer, journal the warmup rule and send the excluded warmup request (the serial rung's
request 0; a concurrent cell excludes none), so ``ladder`` sends only measured requests.

The running state of a cell or row is a :class:`LiveMachine`: a ``transitions.Machine`` built
from the table, whose ``on_step`` callback (given by the actor) journals every step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Final, Generic, TypeVar

from transitions import Machine, MachineError

from cache_family.errors import Refused


class CellState(StrEnum):
    PIN_VERIFY = "pin-verify"
    NOT_LAUNCHED = "not-launched"
    LAUNCH = "launch"
    WARMUP = "warmup"
    LADDER = "ladder"
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
    FOLD_ROW = "fold-row"
    PUBLISH_ROW = "publish-row"


S = TypeVar("S", bound=StrEnum)
E = TypeVar("E", bound=StrEnum)
A = TypeVar("A", bound=StrEnum)


@dataclass(frozen=True, slots=True)
class Step(Generic[S, A]):
    """Where an event leads and what the actor must do on the way."""

    to: S
    actions: tuple[A, ...] = ()


@dataclass(frozen=True)
class MachineTable(Generic[S, E, A]):
    name: str
    states: tuple[S, ...]
    events: tuple[E, ...]
    initial: S
    final: S
    # Events that record something going wrong; after one, the machine is "faulted".
    fault_events: frozenset[E]
    rows: Mapping[tuple[S, E], Step[S, A]]
    # States a faulted machine may still be in or enter.
    after_fault: frozenset[S] = field(default_factory=frozenset)

    def step(self, state: S, event: E) -> Step[S, A]:
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

    def allowed_events(self, state: S) -> tuple[E, ...]:
        return tuple(e for e in self.events if (state, e) in self.rows)

    def render_markdown(self) -> str:
        """A Markdown table and a Mermaid state diagram, both generated from the rows."""
        grouped = self._grouped()
        lines = ["| state | events | next state | actions |", "|---|---|---|---|"]
        for state, events, step in grouped:
            actions = ", ".join(a.value for a in step.actions) or "-"
            names = ", ".join(e.value for e in events)
            lines.append(f"| {state.value} | {names} | {step.to.value} | {actions} |")
        lines += ["", "```mermaid", "stateDiagram-v2", f"    [*] --> {_mermaid(self.initial)}"]
        for state, events, step in grouped:
            names = ", ".join(e.value for e in events)
            lines.append(f"    {_mermaid(state)} --> {_mermaid(step.to)}: {names}")
        lines += [f"    {_mermaid(self.final)} --> [*]", "```"]
        return "\n".join(lines) + "\n"

    def _grouped(self) -> list[tuple[S, list[E], Step[S, A]]]:
        """Consecutive rows with the same state and step, merged (as the source lists them)."""
        out: list[tuple[S, list[E], Step[S, A]]] = []
        for (state, event), step in self.rows.items():
            if out and out[-1][0] == state and out[-1][2] == step:
                out[-1][1].append(event)
            else:
                out.append((state, [event], step))
        return out


def _mermaid(state: StrEnum) -> str:
    return state.value.replace("-", "_")


def _table(
    rows: Iterable[tuple[S, Iterable[E], S, tuple[A, ...]]],
) -> Mapping[tuple[S, E], Step[S, A]]:
    out: dict[tuple[S, E], Step[S, A]] = {}
    for state, events, to, actions in rows:
        for event in events:
            if (state, event) in out:
                raise ValueError(f"duplicate table row for ({state.value}, {event.value})")
            out[(state, event)] = Step(to, actions)
    return MappingProxyType(out)


C, V, X = CellState, CellEvent, CellAction
_STOP = (V.FAULT, V.CANCELLED, V.DEADLINE_EXPIRED)
_CLEANUP = (X.END_HOST,)
_FINALIZE = (X.PUBLISH_RECEIPT,)

# fmt: off
CELL_TABLE: Final = MachineTable[CellState, CellEvent, CellAction](
    name="cell",
    states=tuple(CellState),
    events=tuple(CellEvent),
    initial=C.PIN_VERIFY,
    final=C.DONE,
    fault_events=frozenset((V.PINS_MISMATCH, *_STOP)),
    after_fault=frozenset((C.NOT_LAUNCHED, C.CLEANUP, C.FINALIZE, C.DONE)),
    rows=_table([
        # state            events                  next state       actions
        # pin-verify's work re-hashes the pins and reserves the port.
        (C.PIN_VERIFY,   [V.PINS_VERIFIED],        C.LAUNCH,        (X.SPAWN_HOST,
                                                                     X.AWAIT_READINESS)),
        # Nothing was launched, so nothing is ended and no cleanup is recorded.
        (C.PIN_VERIFY,   [V.PINS_MISMATCH, *_STOP], C.NOT_LAUNCHED, ()),
        (C.NOT_LAUNCHED, [V.NOTHING_LAUNCHED],     C.FINALIZE,      _FINALIZE),
        (C.LAUNCH,       [V.HOST_READY],           C.WARMUP,        (X.CUT_PROMPT,
                                                                     X.JOURNAL_WARMUP_RULE,
                                                                     X.SEND_WARMUP)),
        (C.LAUNCH,       _STOP,                    C.CLEANUP,       _CLEANUP),
        (C.WARMUP,       [V.WARMUP_DONE],          C.LADDER,        (X.RUN_RUNGS,)),
        (C.WARMUP,       _STOP,                    C.CLEANUP,       _CLEANUP),
        # post-verify's work re-hashes the same pins.
        (C.LADDER,       [V.LADDER_DONE],          C.POST_VERIFY,   ()),
        (C.LADDER,       _STOP,                    C.CLEANUP,       _CLEANUP),
        # Drift after the run keeps the measurements; the fold refuses parity.
        (C.POST_VERIFY,  [V.PINS_VERIFIED,
                          V.PINS_MISMATCH],        C.CLEANUP,       _CLEANUP),
        (C.POST_VERIFY,  _STOP,                    C.CLEANUP,       _CLEANUP),
        # Cleanup is shielded: late stops are recorded, cleanup carries on.
        (C.CLEANUP,      _STOP,                    C.CLEANUP,       ()),
        (C.CLEANUP,      [V.CLEANUP_DONE],         C.FINALIZE,      _FINALIZE),
        # A stop before publication still downgrades the receipt being folded.
        (C.FINALIZE,     [V.CANCELLED,
                          V.DEADLINE_EXPIRED],     C.FINALIZE,      ()),
        (C.FINALIZE,     [V.RECEIPT_PUBLISHED],    C.DONE,          ()),
    ]),
)
# fmt: on

R, RE, RA = RowState, RowEvent, RowAction
_ROW_STOP = (RE.CANCELLED, RE.DEADLINE_EXPIRED)
_ROW_FINALIZE = (RA.FOLD_ROW, RA.PUBLISH_ROW)

# fmt: off
ROW_TABLE: Final = MachineTable[RowState, RowEvent, RowAction](
    name="row",
    states=tuple(RowState),
    events=tuple(RowEvent),
    initial=R.CORRECTNESS,
    final=R.DONE,
    fault_events=frozenset(_ROW_STOP),
    after_fault=frozenset((R.FINALIZE, R.DONE)),
    rows=_table([
        # state            events                          next state      actions
        # The row's correctness arm runs in this state (its own machine, below).
        (R.CORRECTNESS,  [RE.CORRECTNESS_PASSED],          R.SERIAL,       (RA.RUN_SERIAL_CELL,)),
        (R.CORRECTNESS,  [RE.CORRECTNESS_NOT_PASSED],      R.FINALIZE,     (RA.SKIP_BASELINES,
                                                                            *_ROW_FINALIZE)),
        (R.CORRECTNESS,  [RE.MODEL_MISSING],               R.FINALIZE,     _ROW_FINALIZE),
        (R.CORRECTNESS,  _ROW_STOP,                        R.FINALIZE,     _ROW_FINALIZE),
        (R.SERIAL,       [RE.ARM_FINISHED,
                          RE.ARM_SKIPPED],                 R.CONCURRENT,   (RA.RUN_NEXT_CELL,)),
        (R.SERIAL,       _ROW_STOP,                        R.FINALIZE,     _ROW_FINALIZE),
        (R.CONCURRENT,   [RE.ARM_FINISHED,
                          RE.ARM_SKIPPED],                 R.CONCURRENT,   (RA.RUN_NEXT_CELL,)),
        (R.CONCURRENT,   [RE.ARMS_EXHAUSTED],              R.FINALIZE,     _ROW_FINALIZE),
        (R.CONCURRENT,   _ROW_STOP,                        R.FINALIZE,     _ROW_FINALIZE),
        (R.FINALIZE,     _ROW_STOP,                        R.FINALIZE,     ()),
        (R.FINALIZE,     [RE.RECEIPT_PUBLISHED],           R.DONE,         ()),
    ]),
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


K, KE, KA = CorrectnessState, CorrectnessEvent, CorrectnessAction
_K_STOP = (KE.CANCELLED, KE.DEADLINE_EXPIRED)
_K_VERDICT = (KA.JOURNAL_VERDICT,)

# fmt: off
CORRECTNESS_TABLE: Final = MachineTable[CorrectnessState, CorrectnessEvent, CorrectnessAction](
    name="correctness",
    states=tuple(CorrectnessState),
    events=tuple(CorrectnessEvent),
    initial=K.ADMIT,
    final=K.DONE,
    fault_events=frozenset((KE.NOT_RUNNABLE, *_K_STOP)),
    after_fault=frozenset((K.FINALIZE, K.DONE)),
    rows=_table([
        # state       events                     next state    actions
        # admit's work checks the profile against the row and plans the topologies.
        (K.ADMIT,     [KE.ADMITTED],             K.TOPOLOGY,   (KA.RUN_TOPOLOGY,)),
        (K.ADMIT,     [KE.NOT_RUNNABLE, *_K_STOP], K.FINALIZE, _K_VERDICT),
        # Every planned topology runs, also after one failed: each keeps its evidence.
        (K.TOPOLOGY,  [KE.TOPOLOGY_ENDED],       K.TOPOLOGY,   (KA.RUN_TOPOLOGY,)),
        (K.TOPOLOGY,  [KE.TOPOLOGIES_EXHAUSTED], K.GATE,       ()),
        (K.TOPOLOGY,  _K_STOP,                   K.FINALIZE,   _K_VERDICT),
        # gate's work: every topology passed with one identical non-empty prompt text.
        (K.GATE,      [KE.ACCEPTED, KE.REJECTED], K.FINALIZE,  _K_VERDICT),
        (K.GATE,      _K_STOP,                   K.FINALIZE,   _K_VERDICT),
        (K.FINALIZE,  _K_STOP,                   K.FINALIZE,   ()),
        (K.FINALIZE,  [KE.VERDICT_JOURNALED],    K.DONE,       ()),
    ]),
)
# fmt: on


OnStep = Callable[[S, E, S], None]


class LiveMachine(Generic[S, E, A]):
    """The running state of one cell or row: a ``transitions.Machine`` built from ``table``
    (synchronous, no auto transitions, invalid triggers refused). After every step it calls
    ``on_step(source, event, dest)``; the actors journal the step there."""

    def __init__(
        self, table: MachineTable[S, E, A], subject: str, on_step: OnStep[S, E] | None = None
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
    def state(self) -> S:
        return self._states(self._model.state)

    def fire(self, event: E) -> Step[S, A]:
        """Take ``event`` through the live machine; raise ``<name>.transition.refused`` where
        the table has no step for it. Returns the table's step (its actions are the actor's)."""
        source = self.state
        try:
            self._model.trigger(event.value)
        except (MachineError, AttributeError):
            self.table.step(source, event)  # raises the typed refusal
            raise
        return self.table.rows[(source, event)]

    def can_fire(self, event: E) -> bool:
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
