"""What every fold shares: which lines count, whose they are, and the table steps they claim.

A receipt is folded through an explicit ``through_seq``: only lines with ``seq <= through_seq``
count. The live run folds with the seq the writer made durable; replay with the seq the
``receipt_published`` record names, so both see the same lines and give the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from enum import StrEnum
from typing import Any, Protocol, TypeVar

from cache_family.schemas.journal import (
    Cancellation,
    CellOpened,
    DeadlineExpired,
    InterruptFinishFailed,
    JournalLine,
    RowOpened,
    RungRows,
    RunStarted,
    Transition,
)
from cache_family.schemas.receipts import REAL_EVIDENCE_PREFIX, TerminalRefusal
from cache_family.schemas.request_rows import RequestRowLine
from cache_family.states.cell import MachineTable


def _terminal_of(record: object) -> TerminalRefusal | None:
    if isinstance(record, Cancellation):
        return "cancelled"
    if isinstance(record, DeadlineExpired):
        return "deadline_expired"
    if isinstance(record, InterruptFinishFailed):
        return "interrupt_finish_failed"
    return None


def run_wide_terminal(record: object) -> TerminalRefusal | None:
    """The terminal refusal a run-wide record (one naming no cell) stands for, if any."""
    return _terminal_of(record) if _scope_cell(record) is None else None


def _synthetic(run: RunStarted | None, opened: CellOpened | RowOpened | None) -> bool:
    """Synthetic if the opening record or the run's catalog says so (the label only adds)."""
    return (opened is not None and opened.synthetic) or (run is not None and run.catalog_synthetic)


def real_evidence_class(
    run: RunStarted | None, model_id: str, opened_load: tuple[float, float, float] | None
) -> str | None:
    """What a figure from a trained (not synthetic) model is: the model, the host's CPU and
    thread count, the load average at the run's start and when the row or cell opened, and
    the GPUs (none: CPU figures, never a GPU claim). None for a journal that kept no host."""
    if run is None or run.host is None:
        return None
    host = run.host
    cpu = host.cpu_model or "CPU model not given"
    cpus = f"{host.cpu_count} CPUs" if host.cpu_count else "CPU count not given"
    threads = (
        f"{run.operator_threads} thread{'' if run.operator_threads == '1' else 's'}"
        if run.operator_threads
        else "threads not set"
    )
    loads = [f"{run.load_average[0]:.1f} at run start"] if run.load_average else []
    if opened_load is not None:
        loads.append(f"{opened_load[0]:.1f} when measured")
    load = ("1-min load average " + ", ".join(loads)) if loads else "load average not kept"
    gpu = (
        "no GPU: CPU figures, not a GPU claim"
        if not host.gpus
        else "GPUs on the host: " + ", ".join(host.gpus)
    )
    model = model_id or "(model not named)"
    return f"{REAL_EVIDENCE_PREFIX}{model} on {cpu} ({cpus}), {threads}, {load}; {gpu}"


def _scope_cell(record: object) -> str | None:
    """The cell a record belongs to, or None for run-wide records."""
    cell_id = getattr(record, "cell_id", None)
    return cell_id if isinstance(cell_id, str) else None


_State = TypeVar("_State", bound=StrEnum)


_Event = TypeVar("_Event", bound=StrEnum)


def _table_step(
    table: MachineTable[_State, _Event, Any],
    states: type[_State],
    events: type[_Event],
    record: Transition,
    current: _State,
) -> tuple[_State, _Event, _State] | str:
    """The step a transition record claims, if the table allows it from ``current``; else
    what is wrong with it (the fold journals that as an invalid transition)."""
    try:
        from_state = states(record.from_state)
        event = events(record.event)
        to_state = states(record.to_state)
    except ValueError:
        return f"unknown name in {record}"
    step = table.rows.get((from_state, event))
    if from_state != current or step is None or step.to != to_state:
        return f"{record.from_state} --{record.event}--> {record.to_state} while in {current.value}"
    return from_state, event, to_state


def lines_through(lines: Iterable[JournalLine], through_seq: int | None) -> Iterable[JournalLine]:
    """The lines with ``seq <= through_seq`` (all of them for None)."""
    if through_seq is None:
        return lines
    return (line for line in lines if line.seq <= through_seq)


class _LineFold(Protocol):
    """A cell's or a row's fold: it takes the lines in seq order."""

    def apply(self, line: JournalLine) -> None: ...


def _apply_through(fold: _LineFold, lines: Iterable[JournalLine], through_seq: int | None) -> int:
    """Apply the lines up to ``through_seq``; the seq the receipt is folded through (the last
    line applied when no bound is given)."""
    last = 0
    for line in lines_through(lines, through_seq):
        fold.apply(line)
        last = line.seq
    return last if through_seq is None else through_seq


RowsSource = Callable[[Sequence[RungRows]], Iterable[RequestRowLine]]
"""The lines of a cell's rows file that its ``rung_rows`` records name, in file order (an
actor streams them and checks each record's digest: ``actors/journal/rows_file.py``)."""
