"""What the operator sees while work runs: one progress concept, four renderings.

The rendering is chosen once per command (``choose_mode``): live ``rich`` on a terminal, plain
lines otherwise, nothing with ``--quiet``, JSON lines with ``--json-events``. A run's progress
is read from the records its journal receives (``RunProgress.record``), so the display never
guesses from timers.
"""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, TextIO

from cache_family.actors.run.run_progress import synthetic_mark
from cache_family.schemas.arms import CORRECTNESS
from cache_family.schemas.journal import (
    CellOpened,
    Record,
    RungCompleted,
    Transition,
)
from cache_family.states.cell import CELL_TABLE, CORRECTNESS_TABLE, CorrectnessState
from cache_family.system.hashing_progress import NullProgress, ProgressSink

if TYPE_CHECKING:
    from rich.progress import Progress as RichBar
    from rich.progress import Task, TaskID

    from cache_family.schemas.prepared import PreparedRow
    from cache_family.schemas.row_result import RowResult
    from cache_family.states.budgets import Budgets

Mode = Literal["rich", "plain", "quiet", "json"]

# The cell states whose work climbs the measured rungs (the table's ``measuring`` column).
_MEASURING: Final = frozenset(
    state.value for state in CELL_TABLE.states if CELL_TABLE.policy(state).measuring
)
# The state a cell or the correctness arm ends in.
_DONE = "done"


def is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return isatty is not None and bool(isatty())


def choose_mode(stream: TextIO, *, quiet: bool = False, json_events: bool = False) -> Mode:
    """JSON events win over quiet (they go to stdout); otherwise a terminal gets rich."""
    if json_events:
        return "json"
    if quiet:
        return "quiet"
    return "rich" if is_terminal(stream) else "plain"


class EventLines:
    """JSON lines, one event each, flushed at once; safe to call from several threads."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: object) -> None:
        line = json.dumps({"event": event, **fields}, separators=(",", ":"))
        with self._lock:
            self.stream.write(line + "\n")
            self.stream.flush()


# --- hashing: bytes ---------------------------------------------------------------------------


class BytesBar:
    """A bytes / rate / ETA bar on a terminal, driven from any thread."""

    def __init__(self, stream: TextIO, description: str = "hashing") -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(file=stream),
            transient=True,
        )
        self._description = description
        self._task: TaskID | None = None
        self._lock = threading.Lock()

    def begin(self, files: int, total_bytes: int) -> None:
        with self._lock:
            if self._task is None:
                self._progress.start()
                self._task = self._progress.add_task(
                    f"{self._description} {files} file(s)", total=total_bytes
                )
            else:
                self._progress.update(
                    self._task,
                    total=(self._progress.tasks[0].total or 0) + total_bytes,
                    description=f"{self._description} {files} more file(s)",
                )

    def advance(self, nbytes: int) -> None:
        if self._task is not None:
            self._progress.advance(self._task, nbytes)

    def end(self) -> None:
        with self._lock:
            if self._task is not None:
                self._progress.stop()
                self._task = None

    def set_completed(self, done: int, total: int, description: str) -> None:
        """Absolute update, for a parent that renders a worker's reported counts."""
        with self._lock:
            if self._task is None:
                self._progress.start()
                self._task = self._progress.add_task(description, total=total)
            self._progress.update(self._task, completed=done, total=total, description=description)


def bytes_progress_for(stream: TextIO | None = None) -> ProgressSink:
    """A bytes bar when ``stream`` (default stderr) is a terminal, otherwise nothing."""
    target = sys.stderr if stream is None else stream
    return BytesBar(target) if is_terminal(target) else NullProgress()


# --- runs: one line per row and arm ---------------------------------------------------------


@dataclass(slots=True)
class ArmProgress:
    """Where one arm of one row stands, as its journal records say (trio clock seconds)."""

    row: str
    row_number: int
    arm: str
    state: str
    opened: float
    deadline: float
    rungs: int = 0  # planned rungs (0: no ladder)
    # Rungs completed; for correctness, the topologies begun (each one is a step into
    # the "topology" state; their number is known only at the verdict).
    rungs_done: int = 0
    at: float = 0.0  # when the last record about it was journaled
    shown: tuple[str, int] | None = None  # (state, rung) as last rendered

    @property
    def rung(self) -> int:
        """The rung being run (1-based) while the ladder climbs, else the rungs done; for
        correctness, the topology being run (then the number run)."""
        if self.state in _MEASURING and self.rungs_done < self.rungs:
            return self.rungs_done + 1
        return self.rungs_done

    @property
    def elapsed(self) -> float:
        return max(self.at - self.opened, 0.0)

    @property
    def budget_left(self) -> float:
        return max(self.deadline - self.at, 0.0)

    def rung_text(self) -> str:
        if self.rungs:
            return f"rung {self.rung}/{self.rungs}"
        return f"topology {self.rung}" if self.arm == CORRECTNESS.name else "rung -"

    def line(self) -> str:
        # Indented under the row's own "row k/n" line that follows when the row ends.
        return (
            f"  {self.row} {self.arm}: {self.state}, "
            f"{self.rung_text()}, {self.elapsed:.1f}s elapsed, {self.budget_left:.1f}s budget left"
        )

    def event(self, rows: int) -> dict[str, object]:
        return {
            "row": self.row,
            "row_number": self.row_number,
            "rows": rows,
            "arm": self.arm,
            "state": self.state,
            "rung": self.rung,
            "rungs": self.rungs,
            "elapsed_s": round(self.elapsed, 3),
            "budget_left_s": round(self.budget_left, 3),
        }


class RunProgress:
    """A run's progress as plain lines on ``stream`` (stderr is not a terminal: logs, CI).

    Subclasses render the same events otherwise; the bookkeeping of rows and arms is here.
    """

    def __init__(self, stream: TextIO, total: int, *, synthetic: bool = False) -> None:
        self.stream = stream
        self.total = total
        # The run's catalog is synthetic: the start line says so.
        self.synthetic = synthetic
        self._budgets: Budgets | None = None
        self._rows: dict[int, tuple[str, int]] = {}
        self._cells: dict[str, ArmProgress] = {}
        self._correctness: dict[int, ArmProgress] = {}

    # -- what the supervisor calls ------------------------------------------------------------

    def start_line(self, run_dir: str) -> str:
        return f"run: {self.total} planned row(s) -> {run_dir}{synthetic_mark(self.synthetic)}"

    def start(self, run_dir: str, budgets: Budgets | None = None) -> None:
        self._budgets = budgets
        self.started(run_dir)

    def row_started(self, row: PreparedRow) -> None:
        self._rows[row.index] = (row.output_relative, row.index + 1)

    def row_finished(self, row: PreparedRow, result: RowResult, seconds: float) -> None:
        detail = f" ({result.reason})" if result.reason and result.status != "completed" else ""
        self.finished_row(
            row.index + 1, row.output_relative, result.status, detail, row.synthetic, seconds
        )

    def record(self, record: Record, mono_ns: int) -> None:
        """Every record the run journals, with its monotonic stamp (the journal's tap)."""
        at = mono_ns / 1e9
        arm: ArmProgress | None = None
        if isinstance(record, CellOpened):
            arm = self._open(record.row_index, record.arm, at)
            arm.rungs = len(record.rungs)
            arm.state = "opened"
            self._cells[record.cell_id] = arm
        elif (
            isinstance(record, Transition) and record.machine == CELL_TABLE.name and record.cell_id
        ):
            arm = self._cells.get(record.cell_id)
            if arm is not None:
                arm.state = record.to_state
        elif isinstance(record, Transition) and record.machine == CORRECTNESS_TABLE.name:
            if record.row_index is None:
                return
            arm = self._correctness.get(record.row_index)
            if arm is None:
                arm = self._open(record.row_index, CORRECTNESS.name, at)
                self._correctness[record.row_index] = arm
            arm.state = record.to_state
            if record.to_state == CorrectnessState.TOPOLOGY:
                arm.rungs_done += 1
        elif isinstance(record, RungCompleted):
            arm = self._cells.get(record.cell_id)
            if arm is not None:
                arm.rungs_done = max(arm.rungs_done, record.rung_index + 1)
        if arm is None:
            return
        arm.at = at
        # One line per change of what the operator sees, not per record.
        if arm.shown != (arm.state, arm.rung):
            arm.shown = (arm.state, arm.rung)
            self.arm_changed(arm)

    def _open(self, row_index: int, arm: str, at: float) -> ArmProgress:
        row, number = self._rows.get(row_index, (f"row-{row_index}", row_index + 1))
        budgets = self._budgets
        deadline = budgets.cell_deadline(at) if budgets is not None else float("inf")
        return ArmProgress(row, number, arm, "opened", opened=at, deadline=deadline, at=at)

    # -- rendering (plain lines) --------------------------------------------------------------

    def started(self, run_dir: str) -> None:
        self._print(self.start_line(run_dir))

    def arm_changed(self, arm: ArmProgress) -> None:
        self._print(arm.line())

    def finished_row(
        self, number: int, row: str, status: str, detail: str, synthetic: bool, seconds: float
    ) -> None:
        self._print(
            f"row {number}/{self.total} {row}: {status}{detail}"
            f"{synthetic_mark(synthetic)} [{seconds:.1f}s]"
        )

    def note(self, text: str) -> None:
        """Something the operator must see (a signal, a failure): printed in every mode."""
        print(text, file=self.stream, flush=True)

    #: Whether the run's result lines go to stdout as text (not with JSON events).
    result_lines = True

    def finished(
        self, status: str, matrix: str | None, journal_head: str | None, exit_code: int
    ) -> None:
        """The run has ended; its result lines are printed by the caller (stdout)."""
        del status, matrix, journal_head, exit_code

    def close(self) -> None:
        pass

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)


class QuietRunProgress(RunProgress):
    """``--quiet``: no progress lines; notes (signals, failures) and the result still print."""

    def _print(self, text: str) -> None:
        del text


class JsonRunProgress(RunProgress):
    """``--json-events``: one JSON object per line on ``events`` (stdout), nothing on stderr.

    Events: ``run_started``, ``arm`` (row, arm, state, rung, rungs, elapsed_s,
    budget_left_s), ``row_finished``, ``note`` and, last, ``run_finished``.
    """

    def __init__(
        self, stream: TextIO, total: int, *, synthetic: bool = False, events: TextIO
    ) -> None:
        super().__init__(stream, total, synthetic=synthetic)
        self.events = EventLines(events)

    def started(self, run_dir: str) -> None:
        self.events.emit("run_started", run_dir=run_dir, rows=self.total, synthetic=self.synthetic)

    def arm_changed(self, arm: ArmProgress) -> None:
        self.events.emit("arm", **arm.event(self.total))

    def finished_row(
        self, number: int, row: str, status: str, detail: str, synthetic: bool, seconds: float
    ) -> None:
        self.events.emit(
            "row_finished",
            row=row,
            row_number=number,
            rows=self.total,
            status=status,
            reason=detail.strip(" ()") or None,
            synthetic=synthetic,
            elapsed_s=round(seconds, 3),
        )

    result_lines = False

    def note(self, text: str) -> None:
        super().note(text)
        self.events.emit("note", text=text)

    def finished(
        self, status: str, matrix: str | None, journal_head: str | None, exit_code: int
    ) -> None:
        self.events.emit(
            "run_finished",
            status=status,
            matrix=matrix,
            journal_head=journal_head,
            exit_code=exit_code,
            synthetic=self.synthetic,
        )


class RichRunProgress(RunProgress):
    """A live display on a terminal: a rows bar, then one line per arm of the current row
    (state, rung k of n, elapsed, budget left); finished rows scroll above it."""

    def __init__(self, stream: TextIO, total: int, *, synthetic: bool = False) -> None:
        super().__init__(stream, total, synthetic=synthetic)
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichBar

        self._console = Console(file=stream)
        self._bar: RichBar = RichBar(
            TextColumn("{task.description}"),
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            _budget_left_column(),
            console=self._console,
        )
        self._rows_task = self._bar.add_task("[bold]rows", total=total)
        self._arm_tasks: dict[int, TaskID] = {}

    def started(self, run_dir: str) -> None:
        self._bar.start()
        self._console.print(self.start_line(run_dir), markup=False)

    def arm_changed(self, arm: ArmProgress) -> None:
        key = id(arm)
        description = f"  {arm.row} {arm.arm}: {arm.state}"
        if key not in self._arm_tasks:
            # The task's own clock starts now, with the budget the journal gave the arm.
            self._arm_tasks[key] = self._bar.add_task(
                description, total=arm.rungs or None, budget=arm.deadline - arm.at
            )
        task = self._arm_tasks[key]
        self._bar.update(task, description=description, completed=arm.rungs_done)
        if arm.state == _DONE:
            self._bar.stop_task(task)
        # Drawn now, not at the refresh thread's next tick: a state that lasts less than a
        # tick is still shown once (and what is drawn does not depend on scheduling).
        self._bar.refresh()

    def finished_row(
        self, number: int, row: str, status: str, detail: str, synthetic: bool, seconds: float
    ) -> None:
        colour = {"completed": "green", "missing-model": "dim"}.get(status, "yellow")
        self._console.print(
            f"row {number}/{self.total} {row}: [{colour}]{status}[/{colour}]{detail}"
            f"{synthetic_mark(synthetic)} [{seconds:.1f}s]",
            markup=True,
            highlight=False,
        )
        for task in self._arm_tasks.values():
            self._bar.remove_task(task)
        self._arm_tasks.clear()
        self._bar.advance(self._rows_task)

    def note(self, text: str) -> None:
        self._console.print(text, markup=False)

    def close(self) -> None:
        self._bar.stop()


def _budget_left_column() -> Any:
    # Built on first use: rich is imported only when a terminal shows the display.
    from rich.progress import ProgressColumn
    from rich.text import Text

    class BudgetLeft(ProgressColumn):
        """The arm's budget left: its deadline's span less the time since it opened."""

        def render(self, task: Task) -> Text:
            budget = task.fields.get("budget")
            if not isinstance(budget, float) or budget == float("inf"):
                return Text("")
            left = max(budget - (task.elapsed or 0.0), 0.0)
            return Text(f"{left:.0f}s left", style="cyan")

    return BudgetLeft()


def run_progress_for(
    mode: Mode,
    stream: TextIO,
    total: int,
    *,
    synthetic: bool = False,
    events: TextIO | None = None,
) -> RunProgress:
    """The run's progress in ``mode``; JSON events go to ``events`` (default stdout)."""
    if mode == "rich":
        return RichRunProgress(stream, total, synthetic=synthetic)
    if mode == "quiet":
        return QuietRunProgress(stream, total, synthetic=synthetic)
    if mode == "json":
        target = sys.stdout if events is None else events
        return JsonRunProgress(stream, total, synthetic=synthetic, events=target)
    return RunProgress(stream, total, synthetic=synthetic)
