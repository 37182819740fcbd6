"""A trace replay's receipt, folded from its journal records: every request judged against
what the trace designed (``states/trace.py``), the totals, the efficiency over the replay's
time and the requests whose reuse was lost, each naming the request that last sent it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from cache_family.schemas.workload_records import (
    TraceEfficiencyBin,
    TraceLoss,
    TraceReceipt,
    TraceReplayed,
    TraceRequestReceipt,
    TraceRequestReplayed,
)
from cache_family.states.trace import DesignedReuse, request_verdict, total_efficiency

#: Slices of the replay's time the efficiency is shown over.
EFFICIENCY_BINS: Final = 10
COUNT_MISMATCH: Final = "workload.prompt.token_count_mismatch"
OVER_CLAIMED: Final = "trace.reuse.over_claimed"


def _judged(
    replayed: TraceReplayed, sent: TraceRequestReplayed
) -> tuple[TraceRequestReceipt, bool]:
    """The request's row, and whether its reuse was lost."""
    request = sent.request
    lateness = None if sent.sent_s is None else (sent.sent_s - sent.scheduled_s) * 1000
    designed_prompt = (request.designed_prompt_tokens if request else None) or 0
    achieved: int | None = None
    verdict: str | None
    lost = False
    if request is None:
        verdict = "not-launched"
    elif request.status != "completed" or request.cached_tokens is None:
        verdict = "failed"
    elif request.prompt_tokens != request.designed_prompt_tokens:
        verdict = COUNT_MISMATCH
    else:
        achieved = max(0, request.cached_tokens - replayed.template_reused_tokens)
        judged = request_verdict(
            DesignedReuse(
                infinite_tokens=sent.designed_infinite_tokens,
                lru_tokens=sent.designed_lru_tokens,
                shared_blocks=sent.shared_blocks,
                last_sender=sent.last_sender,
            ),
            achieved,
            replayed.granularity_tokens,
            sent.reachable_tokens,
        )
        verdict, lost = judged.code, judged.lost
    row = TraceRequestReceipt(
        index=sent.index,
        line=sent.line,
        scheduled_s=sent.scheduled_s,
        lateness_ms=lateness,
        prompt_tokens=designed_prompt - replayed.template_tokens,
        designed_infinite_tokens=sent.designed_infinite_tokens,
        designed_lru_tokens=sent.designed_lru_tokens,
        achieved_tokens=achieved,
        prompt_ms=request.prompt_ms if request else None,
        verdict=verdict,
        last_sender=sent.last_sender,
    )
    return row, lost


def efficiency_over_time(
    rows: Sequence[TraceRequestReceipt], bins: int = EFFICIENCY_BINS
) -> tuple[TraceEfficiencyBin, ...]:
    """Achieved over designed tokens of the requests scheduled in each of ``bins`` equal
    slices of the replay's time (one slice when the whole window is due at once)."""
    if not rows:
        return ()
    end = max(r.scheduled_s for r in rows)
    count = bins if end > 0 else 1
    width = end / count if end > 0 else 0.0
    out: list[TraceEfficiencyBin] = []
    for at in range(count):
        low = at * width
        high = end if at == count - 1 else (at + 1) * width
        inside = [
            r
            for r in rows
            if (low <= r.scheduled_s < high) or (at == count - 1 and r.scheduled_s == high)
        ]
        measured = [r for r in inside if r.achieved_tokens is not None]
        designed = sum(r.designed_infinite_tokens for r in measured)
        achieved = sum(r.achieved_tokens or 0 for r in measured)
        out.append(
            TraceEfficiencyBin(
                from_s=low,
                until_s=high,
                requests=len(inside),
                designed_tokens=designed,
                achieved_tokens=achieved,
                efficiency=achieved / designed if designed else None,
            )
        )
    return tuple(out)


def trace_receipt(
    replayed: TraceReplayed, sent: Sequence[TraceRequestReplayed], *, stopped: bool = False
) -> TraceReceipt:
    """The replay judged: refused when the server claimed more reuse than designed or counted
    a prompt otherwise than designed; ``workload.stopped`` when the replay ended early."""
    rows: list[TraceRequestReceipt] = []
    losses: list[TraceLoss] = []
    for record in sorted(sent, key=lambda r: r.index):
        row, lost = _judged(replayed, record)
        rows.append(row)
        if lost and row.achieved_tokens is not None:
            losses.append(
                TraceLoss(
                    index=row.index,
                    designed_tokens=row.designed_infinite_tokens,
                    achieved_tokens=row.achieved_tokens,
                    last_sender=row.last_sender,
                )
            )
    measured = [r for r in rows if r.achieved_tokens is not None]
    over = tuple(r.index for r in rows if r.verdict == OVER_CLAIMED)
    mismatched = tuple(r.index for r in rows if r.verdict == COUNT_MISMATCH)
    refusal = None
    if stopped:
        refusal = "workload.stopped"
    elif replayed.stop_reason is not None:
        refusal = replayed.stop_reason  # over-saturated: the rest of the window was not sent
    elif mismatched:
        refusal = COUNT_MISMATCH
    elif over:
        refusal = OVER_CLAIMED
    lru = [r.designed_lru_tokens for r in measured]
    return TraceReceipt(
        replay=replayed,
        requests=tuple(rows),
        measured_requests=len(measured),
        failed_requests=sum(1 for r in rows if r.verdict == "failed"),
        prompt_tokens=sum(r.prompt_tokens for r in measured),
        designed_infinite_tokens=sum(r.designed_infinite_tokens for r in measured),
        designed_lru_tokens=None if None in lru else sum(x or 0 for x in lru),
        achieved_tokens=sum(r.achieved_tokens or 0 for r in measured),
        efficiency=total_efficiency((r.designed_infinite_tokens, r.achieved_tokens) for r in rows),
        efficiency_over_time=efficiency_over_time(rows),
        losses=tuple(losses),
        over_claimed=over,
        token_count_mismatches=mismatched,
        refusal=refusal,
    )
