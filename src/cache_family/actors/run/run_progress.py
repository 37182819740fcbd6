"""What the matrix supervisor tells whoever shows a run's progress: a protocol defined beside
the run (the console implements it), so the run never imports the console that draws it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, Protocol

if TYPE_CHECKING:
    from cache_family.schemas.journal import Record
    from cache_family.schemas.prepared import PreparedRow
    from cache_family.schemas.row_result import RowResult
    from cache_family.states.budgets import Budgets

SYNTHETIC_MARK: Final = " (synthetic)"


def synthetic_mark(synthetic: bool) -> str:
    """ " (synthetic)" after a line about a synthetic row or run, else nothing."""
    return SYNTHETIC_MARK if synthetic else ""


class RunProgressSink(Protocol):
    """Receives the run's events: every journaled record (the journal's tap), rows starting
    and ending, and notes the operator must see (a signal, a failure)."""

    def start(self, run_dir: str, budgets: Budgets | None = None) -> None: ...

    def row_started(self, row: PreparedRow) -> None: ...

    def row_finished(self, row: PreparedRow, result: RowResult, seconds: float) -> None: ...

    def record(self, record: Record, mono_ns: int) -> None: ...

    def note(self, text: str) -> None: ...

    def close(self) -> None: ...


class SilentRunProgress:
    """Shows nothing: a supervisor started without a display (a test that reads only files)."""

    def start(self, run_dir: str, budgets: Budgets | None = None) -> None:
        del run_dir, budgets

    def row_started(self, row: PreparedRow) -> None:
        del row

    def row_finished(self, row: PreparedRow, result: RowResult, seconds: float) -> None:
        del row, result, seconds

    def record(self, record: Record, mono_ns: int) -> None:
        del record, mono_ns

    def note(self, text: str) -> None:
        del text

    def close(self) -> None:
        pass
