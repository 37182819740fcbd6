"""The run's budgets and the deadlines derived from them; each derived deadline is never later
than its parent's (budgets only shrink)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

# The cell's own work (hashing, startup, requests) ends this long before the cell deadline, so
# that a request cut by the budget is still recorded by the load actor itself (with its elapsed
# time) and the cell reaches cleanup on its own rather than by cancellation.
MEASUREMENT_RESERVE_SECONDS: Final = 2.0


@dataclass(frozen=True, slots=True)
class Budgets:
    """The run's three budgets; each derived deadline is never later than its parent's."""

    run_deadline: float  # trio time
    cell_seconds: float
    request_timeout_ms: int

    def cell_deadline(self, now: float) -> float:
        return min(self.run_deadline, now + self.cell_seconds)

    @staticmethod
    def work_deadline(cell_deadline: float, now: float) -> float:
        """When the cell's measured work must end: the reserve before its deadline."""
        return max(cell_deadline - MEASUREMENT_RESERVE_SECONDS, now)

    @staticmethod
    def request_deadline(cell_deadline: float, started: float, request_timeout_ms: int) -> float:
        return min(cell_deadline, started + request_timeout_ms / 1000)

    @staticmethod
    def startup_seconds(cell_deadline: float, now: float, profile_startup: float) -> float:
        return max(min(profile_startup, cell_deadline - now), 0.001)
