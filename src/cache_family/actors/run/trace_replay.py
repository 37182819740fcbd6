"""The trace workload's runner: a recorded trace's window, scaled, sent open-loop on its own
timestamps by the open-loop sender, each request's reuse journaled beside its design."""

from __future__ import annotations

import json
from collections.abc import Sequence

import trio

from cache_family.actors.audit.trace_file import read_trace, trace_scaling
from cache_family.actors.run.chat_text import read_model_text
from cache_family.actors.run.open_loop import OpenLoopOutcome, OpenLoopSender
from cache_family.actors.run.server_metrics import Reading
from cache_family.actors.run.workload_dialects import (
    WorkloadHost,
    WorkloadHostLost,
    check_host,
)
from cache_family.actors.run.workloads import (
    _chat_template,
    _metrics_after,
    _metrics_before,
    _opened,
    _stop_reason,
    _stopped,
    _stops_before_any_point,
)
from cache_family.schemas.arms import MeasurementKind
from cache_family.schemas.measurement import RequestRow
from cache_family.schemas.workload import TraceReplay
from cache_family.schemas.workload_records import (
    TraceReplayed,
    TraceRequestReplayed,
    WorkloadRequest,
)
from cache_family.states.arrivals import SaturationWatch
from cache_family.states.trace import (
    DesignedReuse,
    TracePrompts,
    TraceRequest,
    TraceScaling,
    check_context,
    designed_reuse,
    reachable_reuse,
    refuse,
)
from cache_family.states.workloads import LLAMA_SERVER_PAGE_TOKENS, ChatTemplate

#: Let the server choose the slot (llama-server: the one whose prompt shares the most).
ANY_SLOT = -1


def _window_json(spec: TraceReplay) -> str:
    return json.dumps(
        {"first": spec.first, "from_ms": spec.from_ms, "until_ms": spec.until_ms},
        sort_keys=True,
    )


def _request_records(
    host: WorkloadHost,
    requests: Sequence[TraceRequest],
    offsets: Sequence[float],
    designs: Sequence[DesignedReuse],
    scaling: TraceScaling,
    outcome: OpenLoopOutcome,
    answers: dict[int, WorkloadRequest],
) -> list[TraceRequestReplayed]:
    sent = {stamp.index: stamp.sent_s for stamp in outcome.sends}
    sent_s = [sent.get(index) for index in range(len(requests))]
    answered_s: list[float | None] = []
    for index, sent_at in enumerate(sent_s):
        answer = answers.get(index)
        done = answer is not None and answer.status == "completed"
        elapsed = answer.elapsed_ms if answer is not None else None
        answered_s.append(
            sent_at + elapsed / 1000 if done and sent_at is not None and elapsed else None
        )
    reachable = reachable_reuse(requests, scaling, sent_s, answered_s)
    return [
        TraceRequestReplayed(
            cell_id=host.cell_id,
            index=index,
            line=request.line,
            scheduled_s=offsets[index],
            sent_s=sent.get(index),
            output_tokens=scaling.output_tokens(request),
            shared_blocks=design.shared_blocks,
            designed_infinite_tokens=design.infinite_tokens,
            designed_lru_tokens=design.lru_tokens,
            last_sender=design.last_sender,
            request=answers.get(index),
            reachable_tokens=reachable[index],
        )
        for index, (request, design) in enumerate(zip(requests, designs, strict=True))
    ]


async def run_trace(host: WorkloadHost) -> bool:
    spec = host.workloads.trace
    assert spec is not None  # planned only when chosen
    kind = MeasurementKind.TRACE
    scaling = trace_scaling(spec)
    template: ChatTemplate | None = None
    async with _stops_before_any_point(host, kind):
        requests, sha256 = await trio.to_thread.run_sync(read_trace, spec)
        if spec.sha256 is not None and sha256 != spec.sha256:
            raise refuse(
                "trace.pin_mismatch",
                None,
                f"{spec.path} has SHA-256 {sha256}, preparation pinned {spec.sha256}",
            )
        text = await read_model_text(host.model_path) if host.speaks.writes_text else None
        pieces = text.pieces if text is not None else None
        vocabulary = await _opened(host, kind, spec.model_dump_json(), pieces)
        prompts = TracePrompts(requests, scaling, trace_sha256=sha256, vocabulary_size=vocabulary)
        if text is not None:
            template = await _chat_template(
                host, text.pieces, text.template_source, prompts.starts, 0
            )
        if host.slot_context_tokens is not None:
            room = template.tokens if template is not None else 0
            check_context(requests, scaling, host.slot_context_tokens - room)
    capacity = spec.lru_capacity_tokens
    if capacity is None and host.slots and host.slot_context_tokens:
        capacity = host.slots * host.slot_context_tokens
    designs = designed_reuse(requests, scaling, capacity)
    await trio.to_thread.run_sync(prompts.draw_blocks, requests)
    offsets = scaling.send_offsets(requests)
    answers: dict[int, WorkloadRequest] = {}
    template_tokens = template.tokens if template is not None else 0
    # A request failed with the host gone: the replay stops as every workload's point does.
    lost: WorkloadHostLost | None = None
    replay = trio.CancelScope()

    async def exchange(index: int) -> RequestRow:
        nonlocal lost
        request = requests[index]
        prompt = prompts.prompt(request)
        answer = await host.speaks.send(
            host, prompt, scaling.output_tokens(request), ANY_SLOT, pieces
        )
        sent = answer.request(index, designed_prompt_tokens=len(prompt) + template_tokens)
        answers[index] = sent
        try:
            check_host(host, answer)
        except WorkloadHostLost as gone:
            # Raised here it would leave the sender inside its nursery's exception group: the
            # replay is cut from outside instead, and the loss raised once it is journaled.
            lost = lost or gone
            replay.cancel()
        return RequestRow(request_id=index, status="completed" if answer.reply else "failed")

    span = offsets[-1] if offsets else 0.0
    sender = OpenLoopSender(
        offsets,
        exchange,
        target_rate_per_s=(len(offsets) - 1) / span if span > 0 else float(len(offsets)),
        pattern=None,
        watch=SaturationWatch(spec.over_saturation),
        deadline=host.deadline,
    )
    stop: str | None = None
    outcome: OpenLoopOutcome | None = None
    before: Reading | None = None

    async def replayed() -> OpenLoopOutcome:
        ended: OpenLoopOutcome | None = None
        with replay:
            ended = await sender.run()
        if lost is not None:
            raise lost
        assert ended is not None  # only the host's loss cuts the replay from outside
        return ended

    try:
        # The host's own counters around the whole replay: one point.
        before = await _metrics_before(host)
        outcome = await replayed()
        await _metrics_after(host, before, kind, 0, list(answers.values()))
    except BaseException as exc:
        stop = _stop_reason(exc)
        raise
    finally:
        # Every request of the window as far as the replay went, also when a stop unwinds.
        with trio.CancelScope(shield=stop is not None):
            ended = outcome if outcome is not None else sender.outcome()
            for record in _request_records(
                host, requests, offsets, designs, scaling, ended, answers
            ):
                await host.journal(record)
            late = ended.lateness
            await host.journal(
                TraceReplayed(
                    cell_id=host.cell_id,
                    path=spec.path,
                    sha256=sha256,
                    format=spec.format,
                    block_tokens=spec.block_tokens,
                    tokens_per_block=spec.tokens_per_block,
                    time_scale=spec.time_scale,
                    output_tokens_cap=spec.output_tokens_cap,
                    window_json=_window_json(spec),
                    requests=len(requests),
                    distinct_ids=prompts.distinct_ids,
                    lru_capacity_tokens=capacity,
                    granularity_tokens=LLAMA_SERVER_PAGE_TOKENS,
                    launched=ended.launched,
                    completed=sum(1 for a in answers.values() if a.status == "completed"),
                    lateness_p50_ms=late.p50_ms if late else None,
                    lateness_p99_ms=late.p99_ms if late else None,
                    lateness_max_ms=late.max_ms if late else None,
                    stop_reason=ended.stop_reason,
                    stop_detail=ended.saturation.detail if ended.saturation else None,
                    template_tokens=template_tokens,
                    template_reused_tokens=template.reused_tokens if template else 0,
                )
            )
            if stop is not None:
                await _stopped(host, kind, stop, 0, ended.launched)
    if outcome.stop_reason == "load.deadline":
        await _stopped(host, kind, "deadline", 0, outcome.launched)
        return False
    return True


__all__ = ["run_trace"]
