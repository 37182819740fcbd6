"""Old/new parity per rung and the row's observation order, pure (spec ``stage-server.md`` §5).

A rung's parity counts only when both owning cells were fully accepted (process, capture,
pins before and after) and both rungs completed and correlate with the planned rung; else it
is refused with ``custody_or_lifecycle_failure`` and the measurements stay as they are.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

from cache_family.schemas.arms import (
    COHORT_OPENAI,
    HOST_ARMS,
    NATIVE_SERIAL,
    SKIPPY_NEW,
    SKIPPY_OLD,
)
from cache_family.schemas.receipts import (
    PARITY_UNAVAILABLE,
    ArmObservation,
    CellReceipt,
    ObservationEntry,
    ParityVerdict,
    RungReceipt,
)

ARM_OLD: Final = SKIPPY_OLD.name
ARM_NEW: Final = SKIPPY_NEW.name
COHORT_PARITY: Final = "old-new-parity"
MAX_REQUESTS: Final = 4096
_DIGEST: Final = re.compile(r"[0-9a-f]{64}")


def _accepted_rung(cell: CellReceipt | None, index: int, concurrency: int) -> RungReceipt | None:
    if cell is None or cell.status != "completed" or not cell.accepted_for_parity:
        return None
    rungs = [r for r in cell.measurement.rungs if r.rung_index == index]
    if len(rungs) != 1:
        return None
    rung = rungs[0]
    if rung.concurrency != concurrency or rung.status != "completed":
        return None
    return rung


def _roster_problem(rung: RungReceipt) -> str | None:
    ids = [row.request_id for row in rung.rows]
    if not 1 <= rung.requested_requests <= MAX_REQUESTS:
        return f"requested_requests {rung.requested_requests} is outside 1..{MAX_REQUESTS}"
    if len(ids) != rung.requested_requests or len(set(ids)) != len(ids):
        return "the roster does not list every request id exactly once"
    if any(not 0 <= i < rung.requested_requests for i in ids):
        return "a request id is outside the roster"
    return None


def rung_parity(
    old: CellReceipt | None, new: CellReceipt | None, index: int, concurrency: int
) -> ParityVerdict:
    a, b = _accepted_rung(old, index, concurrency), _accepted_rung(new, index, concurrency)
    if a is None or b is None:
        return ParityVerdict(
            concurrency=concurrency,
            complete=False,
            matches=False,
            unavailable_reason=PARITY_UNAVAILABLE,
        )
    problem = _roster_problem(a) or _roster_problem(b)
    if problem is None:
        if old is None or new is None or old.cohort != new.cohort or old.cohort != COHORT_OPENAI:
            problem = "both rosters must be OpenAI cohorts"
        elif a.prompt_sha256 != b.prompt_sha256:
            problem = "the two rungs sent different prompts"
        elif a.output_tokens != b.output_tokens:
            problem = "the two rungs asked for different output lengths"
        elif {r.request_id for r in a.rows} != {r.request_id for r in b.rows}:
            problem = "the two rosters hold different request ids"
    if problem is not None:
        return ParityVerdict(concurrency=concurrency, complete=False, matches=False, error=problem)
    by_id = {row.request_id: row for row in b.rows}
    mismatch: list[int] = []
    first: list[int] = []
    unavailable: list[int] = []
    for row in sorted(a.rows, key=lambda r: r.request_id):
        other = by_id[row.request_id]
        digests = (
            row.content_sha256,
            row.first_chunk_sha256,
            other.content_sha256,
            other.first_chunk_sha256,
        )
        if (
            row.status != "completed"
            or other.status != "completed"
            or not all(isinstance(d, str) and _DIGEST.fullmatch(d) for d in digests)
        ):
            unavailable.append(row.request_id)
            continue
        if row.content_sha256 != other.content_sha256:
            mismatch.append(row.request_id)
        if row.first_chunk_sha256 != other.first_chunk_sha256:
            first.append(row.request_id)
    complete = not unavailable
    return ParityVerdict(
        concurrency=concurrency,
        complete=complete,
        matches=complete and not mismatch and not first,
        comparable_requests=len(a.rows) - len(unavailable),
        mismatch_request_ids=tuple(mismatch),
        first_generated_mismatch_request_ids=tuple(first),
        unavailable_request_ids=tuple(unavailable),
    )


def row_parity(
    planned_rungs: Sequence[int],
    old: CellReceipt | None,
    new: CellReceipt | None,
) -> tuple[ParityVerdict, ...]:
    """Parity of every planned rung (concurrencies in ladder order)."""
    return tuple(rung_parity(old, new, i, c) for i, c in enumerate(planned_rungs))


def observation_order(
    observations: Sequence[ArmObservation], parity: Sequence[ParityVerdict]
) -> tuple[ObservationEntry, ...]:
    """The serial baseline, then per rung each concurrent arm in run order, then parity."""
    by_arm = {o.arm: o for o in observations}
    out: list[ObservationEntry] = []
    serial = by_arm.get(NATIVE_SERIAL.name)
    if serial is not None:
        out.append(
            ObservationEntry(
                cohort=NATIVE_SERIAL.name,
                concurrency=1,
                status=serial.status,
                cell_id=serial.cell_id,
            )
        )
    ladder = sorted(
        {r.concurrency for o in observations if o.arm != NATIVE_SERIAL.name for r in o.rungs}
        | {p.concurrency for p in parity}
    )
    for concurrency in ladder:
        for arm in (a.name for a in HOST_ARMS if not a.serial):
            observation = by_arm.get(arm)
            if observation is None:
                continue
            rung = next((r for r in observation.rungs if r.concurrency == concurrency), None)
            out.append(
                ObservationEntry(
                    cohort=arm,
                    concurrency=concurrency,
                    status=rung.status if rung is not None else observation.status,
                    cell_id=observation.cell_id,
                )
            )
        verdict = next((p for p in parity if p.concurrency == concurrency), None)
        if verdict is not None:
            out.append(
                ObservationEntry(cohort=COHORT_PARITY, concurrency=concurrency, parity=verdict)
            )
    return tuple(out)
