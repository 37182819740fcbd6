"""The fold of one workload cell's journal lines into ``workload.json`` (scope ``workload``).

The verdicts are computed here, with the planning modules' own rules, from what the records say
the server reported (the 0 % overlap control must reuse nothing), so replay re-folds every
``workload.json`` byte for byte.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

import msgspec

from cache_family.schemas.arms import ARM_BY_NAME
from cache_family.schemas.host_kinds import host_kind_facts
from cache_family.schemas.journal import (
    CellOpened,
    JournalLine,
    ReceiptPublished,
    RunStarted,
    ServerMetricsRead,
)
from cache_family.schemas.server_metrics import ServerMetricsPoint
from cache_family.schemas.workload_records import (
    ChatTemplateMeasured,
    OpenLoopStageMeasured,
    OverlapPointMeasured,
    OverlapPointReceipt,
    ReuseProbed,
    SessionsMeasured,
    SessionsReceipt,
    TraceReceipt,
    TraceReplayed,
    TraceRequestReplayed,
    TurnReceipt,
    WorkloadOpened,
    WorkloadReceipt,
    WorkloadRequest,
    WorkloadStopped,
    encode_workload_receipt,
)
from cache_family.states.fold import JournalIndex, lines_through
from cache_family.states.metrics import percentile
from cache_family.states.server_metrics import verdict_of
from cache_family.states.sessions import (
    SessionCapacity,
    SessionTurn,
    eviction_turn,
    reuse_by_turn,
    session_findings,
)
from cache_family.states.trace_fold import trace_receipt
from cache_family.states.workloads import PrefixDesign, overlap_verdict, token_count_mismatches

SCOPE_WORKLOAD: Final = "workload"
#: The refusal of an overlap point the workload stopped in (``states/workloads.py``).
STOPPED: Final = "workload.stopped"
#: The refusal of a point or sessions whose prompts the server counted otherwise than designed.
COUNT_MISMATCH: Final = "workload.prompt.token_count_mismatch"


def _p50(values: Sequence[float]) -> float | None:
    return percentile(values, 50) if values else None


def _answered(request: WorkloadRequest) -> bool:
    return (
        request.status == "completed"
        and request.prompt_tokens is not None
        and request.cached_tokens is not None
    )


def _mismatches(requests: Sequence[WorkloadRequest]) -> tuple[int, ...]:
    return token_count_mismatches(
        [(r.position, r.designed_prompt_tokens, r.prompt_tokens) for r in requests]
    )


def overlap_point(record: OverlapPointMeasured, *, samples: bool = False) -> OverlapPointReceipt:
    """A point judged from its measured (not priming) requests' server figures, less what a
    chat template adds (``samples``: the receipt lists each request's prompt time). A point
    refused as designed sent nothing: it carries its design and its code."""
    if record.design_refusal is not None:
        return OverlapPointReceipt(
            hit_ratio_pct=record.hit_ratio_pct,
            prompt_tokens=record.prompt_tokens,
            shared_prefix_tokens=record.shared_prefix_tokens,
            reusable_tokens=record.reusable_tokens,
            designed_ratio_pct=100.0 * record.reusable_tokens / record.prompt_tokens
            if record.prompt_tokens
            else 0.0,
            achieved_ratio_pct=None,
            band_pp=None,
            measured_requests=0,
            failed_requests=0,
            accepted=False,
            refusal=record.design_refusal,
        )
    design = PrefixDesign(
        hit_ratio_pct=record.hit_ratio_pct,
        prompt_tokens=record.prompt_tokens,
        rule=record.rule,  # type: ignore[arg-type]  # journaled from a ReuseRule
        requested_prefix_tokens=record.requested_prefix_tokens,
        shared_prefix_tokens=record.shared_prefix_tokens,
        reusable_tokens=record.reusable_tokens,
        priming_prompt_tokens=record.priming_prompt_tokens,
        reprimed=record.reprimed,
    )
    measured = [r for r in record.requests if not r.priming]
    answered = [r for r in measured if _answered(r)]
    verdict = overlap_verdict(
        design,
        [
            (
                (r.prompt_tokens or 0) - record.template_tokens,
                max(0, (r.cached_tokens or 0) - record.template_reused_tokens),
            )
            for r in answered
        ],
    )
    times = [r.prompt_ms for r in answered if r.prompt_ms is not None]
    mismatched = _mismatches(record.requests)
    return OverlapPointReceipt(
        hit_ratio_pct=record.hit_ratio_pct,
        prompt_tokens=record.prompt_tokens,
        shared_prefix_tokens=record.shared_prefix_tokens,
        reusable_tokens=record.reusable_tokens,
        designed_ratio_pct=verdict.designed_ratio_pct,
        achieved_ratio_pct=verdict.achieved_ratio_pct,
        band_pp=verdict.band_pp,
        measured_requests=verdict.measured_requests,
        failed_requests=len(measured) - len(answered),
        accepted=verdict.accepted and len(answered) == len(measured) and not mismatched,
        refusal=(COUNT_MISMATCH if mismatched else None)
        or verdict.refusal
        or (None if len(answered) == len(measured) else "workload.overlap.nothing_measured"),
        prompt_ms_p50=_p50(times),
        prompt_ms=tuple(times) if samples else msgspec.UNSET,
        token_count_mismatches=mismatched or msgspec.UNSET,
    )


def sessions_receipt(record: SessionsMeasured, *, samples: bool = False) -> SessionsReceipt:
    """Reuse and prompt time by turn index (``samples``: each turn lists its prompt times)."""
    plan = [
        SessionTurn(
            position=r.position,
            user=r.group,
            turn=r.turn,
            prompt_tokens=r.prompt_tokens or 0,
            expected_reused_tokens=r.expected_reused_tokens or 0,
        )
        for r in record.requests
    ]
    answered = {r.position: r for r in record.requests if _answered(r)}
    turns = reuse_by_turn(
        plan,
        {p: (r.prompt_tokens or 0, r.cached_tokens or 0) for p, r in answered.items()},
    )
    prompt_ms: dict[int, list[float]] = {}
    for request in answered.values():
        if request.prompt_ms is not None:
            prompt_ms.setdefault(request.turn, []).append(request.prompt_ms)
    evicted = eviction_turn(turns)
    shortfall: int | msgspec.UnsetType | None = msgspec.UNSET
    refusal: str | msgspec.UnsetType | None = msgspec.UNSET
    if record.slots is not None and record.slot_context_tokens is not None:
        # The cache's size is known: a short turn is an eviction only where it was full.
        held = {
            t.turn: max(
                (
                    (r.prompt_tokens or 0) + record.answer_tokens
                    for r in answered.values()
                    if r.turn <= t.turn
                ),
                default=0,
            )
            for t in turns
        }
        findings = session_findings(
            turns,
            users=record.users,
            capacity=SessionCapacity(
                slots=record.slots, slot_context_tokens=record.slot_context_tokens
            ),
            held_tokens_by_turn=held,
        )
        evicted, shortfall = findings.eviction_turn, findings.shortfall_turn
        refusal = "workload.sessions.reuse_short" if shortfall is not None else None
    return SessionsReceipt(
        users=record.users,
        turns=record.turns,
        seed=record.seed,
        by_turn=tuple(
            TurnReceipt(
                turn=t.turn,
                requests=t.requests,
                prompt_tokens=t.prompt_tokens,
                expected_reused_tokens=t.expected_reused_tokens,
                achieved_reused_tokens=t.achieved_reused_tokens,
                prompt_ms_p50=_p50(prompt_ms.get(t.turn, [])),
                prompt_ms=tuple(prompt_ms.get(t.turn, ())) if samples else msgspec.UNSET,
            )
            for t in turns
        ),
        eviction_turn=evicted,
        failed_requests=len(record.requests) - len(answered),
        token_count_mismatches=_mismatches(record.requests) or msgspec.UNSET,
        shortfall_turn=shortfall,
        refusal=refusal,
    )


def _stage(cell: CellOpened | None) -> bool:
    """The cell's host kind lists per-request prompt times in its receipt (a stage server's)."""
    arm = ARM_BY_NAME.get(cell.arm) if cell is not None else None
    if arm is None or arm.host_kind is None:
        return False
    return host_kind_facts(arm.host_kind).receipt_lists_prompt_times


def fold_workload(
    lines: Iterable[JournalLine], cell_id: str, *, through_seq: int | None = None
) -> WorkloadReceipt:
    """``workload.json`` of ``cell_id`` from the lines up to ``through_seq``."""
    run: RunStarted | None = None
    cell: CellOpened | None = None
    opened: WorkloadOpened | None = None
    points: list[OverlapPointReceipt] = []
    sessions: SessionsReceipt | None = None
    stages: list[OpenLoopStageMeasured] = []
    stopped: WorkloadStopped | None = None
    template: ChatTemplateMeasured | msgspec.UnsetType = msgspec.UNSET
    probe: ReuseProbed | None = None
    replayed: TraceReplayed | None = None
    trace_requests: list[TraceRequestReplayed] = []
    server_metrics: list[ServerMetricsPoint] = []
    last = 0
    for line in lines_through(lines, through_seq):
        last = max(last, line.seq)
        record = line.record
        if isinstance(record, RunStarted):
            run = record
        elif getattr(record, "cell_id", None) != cell_id:
            continue
        elif isinstance(record, CellOpened):
            cell = record
        elif isinstance(record, WorkloadOpened):
            opened = record
        elif isinstance(record, ChatTemplateMeasured):
            template = record
        elif isinstance(record, ReuseProbed):
            probe = record
        elif isinstance(record, OverlapPointMeasured):
            points.append(overlap_point(record, samples=_stage(cell)))
        elif isinstance(record, SessionsMeasured):
            sessions = sessions_receipt(record, samples=_stage(cell))
        elif isinstance(record, OpenLoopStageMeasured):
            stages.append(record)
        elif isinstance(record, TraceRequestReplayed):
            trace_requests.append(record)
        elif isinstance(record, TraceReplayed):
            replayed = record
        elif isinstance(record, WorkloadStopped):
            stopped = record
        elif isinstance(record, ServerMetricsRead) and record.scope != "rung":
            server_metrics.append(
                ServerMetricsPoint(
                    scope=record.scope, index=record.index, metrics=verdict_of(record)
                )
            )
    trace: TraceReceipt | None = None
    if replayed is not None:
        trace = trace_receipt(replayed, trace_requests, stopped=stopped is not None)
    if stopped is not None and stopped.point_index is not None and points:
        # The stopped point sent only part of its plan: it is named, not judged.
        at = stopped.point_index
        if 0 <= at < len(points):
            points[at] = msgspec.structs.replace(points[at], accepted=False, refusal=STOPPED)
    saturated = next(
        (s.target_rate_per_s for s in stages if s.stop_reason and s.skipped_because is None),
        None,
    )
    status = "unmeasured"
    if points or sessions is not None or stages or trace is not None:
        refused = any(not p.accepted for p in points)
        if trace is not None and trace.refusal is not None:
            refused = True
        if sessions is not None and (
            sessions.failed_requests or sessions.token_count_mismatches or sessions.refusal
        ):
            refused = True
        if probe is not None and probe.rule is None and probe.header_rule is not None:
            refused = True  # the server follows no known rule
        status = "refused" if refused else "accepted"
    if stopped is not None:
        status = "incomplete"
    synthetic = bool((cell is not None and cell.synthetic) or (run and run.catalog_synthetic))
    return WorkloadReceipt(
        cell_id=cell_id,
        arm=cell.arm if cell is not None else None,
        kind=opened.kind if opened is not None else None,
        status=status,
        synthetic=synthetic,
        architecture=opened.architecture if opened is not None else None,
        rule=probe.rule if probe is not None else opened.rule if opened is not None else None,
        spec_json=opened.spec_json if opened is not None else None,
        overlap=tuple(points),
        sessions=sessions,
        open_loop=tuple(stages),
        over_saturated_at_per_s=saturated,
        journal_through_seq=through_seq if through_seq is not None else last,
        chat_template=template,
        reuse_probe=probe if probe is not None else msgspec.UNSET,
        trace=trace if trace is not None else msgspec.UNSET,
        server_metrics=tuple(server_metrics) if server_metrics else msgspec.UNSET,
    )


def workload_bytes(index: JournalIndex, cell_id: str, through_seq: int) -> bytes:
    return encode_workload_receipt(
        fold_workload(index.lines_for_cell(cell_id), cell_id, through_seq=through_seq)
    )


def refold_workload(index: JournalIndex, published: ReceiptPublished) -> bytes:
    """A workload cell's ``workload.json`` again, from the journal through its publication."""
    assert published.cell_id is not None
    return workload_bytes(index, published.cell_id, published.through_seq)
