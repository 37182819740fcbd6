"""The stalled-client check over a run directory: every streamed request of its ladder arms
(native and stage servers), its client figures judged against the server's own timings."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from msgspec import UnsetType

from cache_family.report.run import ArmView, read_run
from cache_family.schemas.measurement import RequestRow
from cache_family.schemas.request_rows import stream_rows
from cache_family.states.first_token import suspect_client_figures


@dataclass(frozen=True, slots=True)
class SuspectRequest:
    cell: str
    rung_index: int
    request_id: int
    why: str
    faked: bool


@dataclass(slots=True)
class FirstTokenCheck:
    """What the check found: the completed streamed requests, those whose first token was
    not observable (by reason), and those whose client figures are suspect."""

    requests: int = 0
    observed: int = 0
    # Requests whose server timed every event.
    per_event: int = 0
    unobserved: Counter[str] = field(default_factory=Counter)
    suspects: list[SuspectRequest] = field(default_factory=list)

    @property
    def faked(self) -> list[SuspectRequest]:
        """The suspects the server's own timings show a stalled client faked."""
        return [s for s in self.suspects if s.faked]

    def add(self, cell: str, rung_index: int, row: RequestRow) -> None:
        if row.status != "completed":
            return
        self.requests += 1
        self.per_event += not isinstance(row.first_token_timings, UnsetType)
        if isinstance(row.ttft_unobserved, UnsetType):
            self.observed += 1
        else:
            self.unobserved[row.ttft_unobserved] += 1
        suspect = suspect_client_figures(row)
        if suspect is not None:
            self.suspects.append(
                SuspectRequest(cell, rung_index, row.request_id, suspect.why, suspect.faked)
            )

    def lines(self) -> list[str]:
        unobserved = ", ".join(f"{n} {why}" for why, n in sorted(self.unobserved.items()))
        out = [
            f"{self.requests} streamed requests ({self.per_event} with the server's per-event "
            f"timings): {self.observed} observed, not observable: {unobserved or 'none'}",
            f"suspect client figures (TTFT >= 95% of elapsed or TPOT < 1/10 of the server's): "
            f"{len(self.suspects)}, faked by a stalled client: {len(self.faked)}",
        ]
        out += [
            f"  {s.cell} rung {s.rung_index} request {s.request_id}: {s.why}"
            f"{' (faked)' if s.faked else ''}"
            for s in self.suspects
        ]
        return out


def _arm_rows(root: str, arm: ArmView) -> Iterator[tuple[int, RequestRow]]:
    cell = arm.cell
    if cell is None or arm.cell_path is None:
        return
    for rung in cell.measurement.rungs:
        for row in rung.rows:
            yield rung.rung_index, row
    rows_file = cell.measurement.rows_file
    if rows_file is not None:
        path = os.path.join(root, os.path.dirname(arm.cell_path), rows_file.path)
        for line in stream_rows(path, rows_file):
            yield line.rung_index, line.row


def check_first_tokens(run_dir: str) -> FirstTokenCheck:
    """Every streamed request of the run's ladder arms, checked (refuses an unreadable run
    as the report does)."""
    check = FirstTokenCheck()
    root = os.path.abspath(run_dir)
    for view in read_run(root).rows:
        for arm in view.arms:
            if not arm.concurrent:
                continue
            for rung_index, row in _arm_rows(root, arm):
                check.add(arm.cell_path or arm.arm, rung_index, row)
    return check
