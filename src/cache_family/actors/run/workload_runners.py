"""The one runner of each workload measurement kind (the cell's ``run-workload`` action)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Final

from cache_family.actors.run.trace_replay import run_trace
from cache_family.actors.run.workload_dialects import WorkloadHost
from cache_family.actors.run.workloads import (
    run_open_loop,
    run_overlap,
    run_sessions,
)
from cache_family.schemas.arms import MeasurementKind

Runner = Callable[[WorkloadHost], Awaitable[bool]]

WORKLOAD_RUNNERS: Final[Mapping[MeasurementKind, Runner]] = {
    MeasurementKind.PREFIX_OVERLAP: run_overlap,
    MeasurementKind.SESSIONS: run_sessions,
    MeasurementKind.OPEN_LOOP: run_open_loop,
    MeasurementKind.TRACE: run_trace,
}
