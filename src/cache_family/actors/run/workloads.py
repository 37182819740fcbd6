"""The work of a workload cell's ``workload`` state: one runner per measurement kind."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import trio

from cache_family.actors.run.chat_text import (
    ConversationOverheads,
    RenderedWrapper,
    conversation_overheads,
    read_model_text,
    refuse_count,
    render_wrapper,
)
from cache_family.actors.run.context import is_cancellation
from cache_family.actors.run.open_loop import (
    RateStage,
    load_exchange,
    run_rates,
)
from cache_family.actors.run.server_metrics import Reading
from cache_family.actors.run.workload_dialects import (
    SessionTurnSender,
    WorkloadHost,
    WorkloadHostLost,
    check_host,
    send_chat,
    send_completion,
    vocabulary_size,
)
from cache_family.errors import Refused
from cache_family.schemas.arms import MeasurementKind
from cache_family.schemas.measurement import ReuseRule
from cache_family.schemas.workload import MultiTurn
from cache_family.schemas.workload_records import (
    ChatTemplateMeasured,
    OpenLoopStageMeasured,
    OverlapPointMeasured,
    ReuseProbed,
    ReuseProbeStep,
    SessionsMeasured,
    WorkloadOpened,
    WorkloadRequest,
    WorkloadStopped,
)
from cache_family.states.cache_reuse import (
    DEFAULT_N_UBATCH,
    probe_prompts,
    probe_shapes,
    probed_rule,
    reuse_rule,
)
from cache_family.states.chat_pieces import BYTE_ALPHABET, ChatPieces
from cache_family.states.server_metrics import TokenSummer
from cache_family.states.sessions import (
    SessionTurn,
    session_plan,
    session_prompt_tokens,
    session_tokens,
)
from cache_family.states.workloads import (
    CHAT_PROBE_CHARACTERS,
    ChatTemplate,
    FreshStarts,
    PrefixDesign,
    chat_template,
    design_chat_prefix,
    design_prefix,
    nothing_shared,
    overlap_order,
    overlap_prompts,
)


async def _metrics_before(host: WorkloadHost) -> Reading | None:
    return await host.metrics.before() if host.metrics is not None else None


async def _metrics_after(
    host: WorkloadHost, before: Reading | None, kind: MeasurementKind, index: int, sent: list[Any]
) -> None:
    """Journal the point's server counters beside the client's sums of its requests."""
    if host.metrics is None or before is None:
        return
    summer = TokenSummer()
    summer.add_requests(sent)
    await host.metrics.after(before, kind.value, index, summer.sums())


def _stop_reason(exc: BaseException) -> str:
    if is_cancellation(exc):
        return "cancelled"
    return "host-exited" if isinstance(exc, WorkloadHostLost) else "fault"


async def _stopped(
    host: WorkloadHost, kind: MeasurementKind, reason: str, point: int | None, sent: int
) -> None:
    """Journal where the workload stopped (shielded: it runs as a cancellation unwinds)."""
    with trio.CancelScope(shield=True):
        await host.journal(
            WorkloadStopped(
                cell_id=host.cell_id, kind=kind.value, reason=reason, point_index=point, sent=sent
            )
        )


@asynccontextmanager
async def _stops_before_any_point(host: WorkloadHost, kind: MeasurementKind) -> AsyncIterator[None]:
    """A stop while the workload opens (journals ``workload_opened``, asks the vocabulary,
    calibrates the chat template) is journaled too: nothing sent, no point named."""
    try:
        yield
    except BaseException as exc:
        await _stopped(host, kind, _stop_reason(exc), None, 0)
        raise


def _measured_template(
    host: WorkloadHost,
    pieces: ChatPieces,
    template_source: str,
    rendered: RenderedWrapper | str,
    template: ChatTemplate | None,
    overheads: ConversationOverheads | None = None,
) -> ChatTemplateMeasured:
    wrapper = rendered if isinstance(rendered, RenderedWrapper) else None
    return ChatTemplateMeasured(
        cell_id=host.cell_id,
        pieces=pieces.source,
        piece_count=pieces.size,
        template_source=template_source,
        template_tokens=template.tokens if template else None,
        template_reused_tokens=template.reused_tokens if template else None,
        rendered_head=wrapper.head if wrapper else None,
        rendered_tail=wrapper.tail if wrapper else None,
        head_tokens=wrapper.head_tokens if wrapper else None,
        tail_tokens=wrapper.tail_tokens if wrapper else None,
        checked_by="tokenize" if wrapper else "counts",
        unrendered_reason=None if wrapper else str(rendered),
        session_first_turn_tokens=overheads.first if overheads else None,
        session_later_turn_tokens=overheads.later if overheads else None,
    )


async def _chat_template(
    host: WorkloadHost, pieces: ChatPieces, template_source: str, starts: FreshStarts, seed: int
) -> ChatTemplate:
    """Two messages on slot 0 sharing nothing, the second twice as long: what the server
    counted for each gives the template's tokens, and its reuse of the second what the
    template alone lets two prompts share. Where the host renders and tokenizes, the first
    message is also checked token for token inside its wrapper, and the server's count of it
    must be that tokenization's. Journaled (``chat_template``) once measured."""
    rng = random.Random(seed)  # noqa: S311 -- reproducible probe text, not a secret
    counted: list[tuple[int, int]] = []
    cached = 0
    rendered: RenderedWrapper | str = "not rendered"
    for length in (CHAT_PROBE_CHARACTERS, 2 * CHAT_PROBE_CHARACTERS):
        ids = [starts.take(), *(rng.randrange(pieces.size) for _ in range(length - 1))]
        text = pieces.text(ids)
        if length == CHAT_PROBE_CHARACTERS:
            rendered = await render_wrapper(
                host.http, host.base_url, text, pieces, ids, "$.prefix_overlap"
            )
        answer = await send_chat(host, text, 1, 0)
        reply = answer.request(-1)
        if reply.prompt_tokens is None or reply.cached_tokens is None:
            raise Refused.one(
                "workload.chat.no_usage",
                "$.prefix_overlap",
                f"the chat server's reply gave no usage.prompt_tokens and "
                f"prompt_tokens_details.cached_tokens ({answer.error or 'no error'})",
                "the chat dialect judges reuse by the server's own counts: serve them",
            )
        if (
            isinstance(rendered, RenderedWrapper)
            and length == CHAT_PROBE_CHARACTERS
            and reply.prompt_tokens != rendered.prompt_tokens
        ):
            raise refuse_count(
                "$.prefix_overlap",
                rendered.prompt_tokens,
                reply.prompt_tokens,
                "the calibration's first message",
            )
        counted.append((length, reply.prompt_tokens))
        cached = reply.cached_tokens
    template = chat_template(
        counted[0],
        counted[1],
        short_characters=CHAT_PROBE_CHARACTERS,
        reused_tokens=cached,
        source=pieces.source,
    )
    await host.journal(_measured_template(host, pieces, template_source, rendered, template))
    if (
        isinstance(rendered, RenderedWrapper)
        and rendered.head_tokens + rendered.tail_tokens == template.tokens
    ):
        # The split the design may place a checkpoint by: only when it is the server's count.
        return msgspec.structs.replace(template, head_tokens=rendered.head_tokens)
    return template


async def _opened(
    host: WorkloadHost, kind: MeasurementKind, spec_json: str, pieces: ChatPieces | None = None
) -> int:
    rule = reuse_rule(host.architecture)
    # A chat dialect's prompts are text in the model's pieces (``states/chat_pieces.py``).
    vocabulary = pieces.size if pieces is not None else await vocabulary_size(host)
    await host.journal(
        WorkloadOpened(
            cell_id=host.cell_id,
            kind=kind.value,
            spec_json=spec_json,
            workloads_sha256=host.workloads_sha256,
            architecture=host.architecture,
            rule=rule,
            vocabulary_size=vocabulary,
        )
    )
    return vocabulary


async def _probe(
    host: WorkloadHost, starts: FreshStarts, vocabulary: int, seed: int, prompt_tokens: int
) -> ReuseRule | None:
    """The rule the workload's verdicts use: the model header's (its architecture's rule, its
    sliding window), checked on slot 0 with a few prompts of known prefixes drawn fresh
    (``states.cache_reuse.probe_shapes``) and journaled. A chat host designs no token-cut
    prompts: its rule is the header's, unprobed."""
    header = reuse_rule(host.architecture)
    if host.speaks.writes_text or header is None:
        return header
    rng = random.Random(seed)  # noqa: S311 -- reproducible probe prompts, not a secret

    def fresh(length: int) -> list[int]:
        return [starts.take(), *(rng.randrange(vocabulary) for _ in range(length - 1))]

    shapes = probe_shapes(header, prompt_tokens)
    prompts = probe_prompts(shapes, fresh)
    steps: list[ReuseProbeStep] = []
    for shape, prompt in zip(shapes, prompts, strict=True):
        answer = await send_completion(host, prompt, 1, 0, exact=False)
        check_host(host, answer)
        sent = answer.request(-1)
        steps.append(
            ReuseProbeStep(
                prompt_tokens=shape.prompt_tokens,
                previous_prompt_tokens=shape.previous_prompt_tokens,
                common_prefix=shape.common_prefix,
                cached_tokens=sent.cached_tokens,
                error=sent.error,
            )
        )
    rule = probed_rule(
        header,
        [(shape, step.cached_tokens) for shape, step in zip(shapes, steps, strict=True)],
        n_ubatch=DEFAULT_N_UBATCH,
        sliding_window=host.sliding_window,
    )
    await host.journal(
        ReuseProbed(
            cell_id=host.cell_id,
            header_rule=header,
            sliding_window=host.sliding_window,
            n_ubatch=DEFAULT_N_UBATCH,
            steps=tuple(steps),
            rule=rule,
        )
    )
    return rule


def _refused_design(
    host: WorkloadHost, design: PrefixDesign, groups: int, seed: int, code: str
) -> OverlapPointMeasured:
    """A point refused as designed: journaled with its design, nothing sent."""
    return OverlapPointMeasured(
        cell_id=host.cell_id,
        hit_ratio_pct=design.hit_ratio_pct,
        prompt_tokens=design.prompt_tokens,
        rule=design.rule,
        requested_prefix_tokens=design.requested_prefix_tokens,
        shared_prefix_tokens=design.shared_prefix_tokens,
        reusable_tokens=design.reusable_tokens,
        groups=groups,
        seed=seed,
        priming_prompt_tokens=design.priming_prompt_tokens,
        reprimed=design.reprimed,
        design_refusal=code,
    )


async def run_overlap(host: WorkloadHost) -> bool:
    spec = host.workloads.prefix_overlap
    assert spec is not None  # planned only when chosen
    kind = MeasurementKind.PREFIX_OVERLAP
    async with _stops_before_any_point(host, kind):
        text = await read_model_text(host.model_path) if host.speaks.writes_text else None
        pieces = text.pieces if text is not None else BYTE_ALPHABET
        vocabulary = await _opened(
            host, kind, spec.model_dump_json(), pieces if text is not None else None
        )
        header = reuse_rule(host.architecture)
        if header is None:
            return True  # nothing can be designed: the receipt says unmeasured
        starts = FreshStarts(vocabulary, spec.seed)
        rule = await _probe(host, starts, vocabulary, spec.seed, spec.prompt_tokens)
        template = None
        if text is not None:
            template = await _chat_template(host, pieces, text.template_source, starts, spec.seed)
    for index, ratio in enumerate(spec.hit_ratios_pct):
        if rule is None:
            # The server follows no known rule: nothing can be designed for it.
            unknown = PrefixDesign(
                hit_ratio_pct=ratio,
                prompt_tokens=spec.prompt_tokens,
                rule=header,
                requested_prefix_tokens=spec.prompt_tokens * ratio // 100,
                shared_prefix_tokens=0,
                reusable_tokens=0,
            )
            code = "workload.reuse.server_disagrees"
            await host.journal(_refused_design(host, unknown, spec.groups, spec.seed + ratio, code))
            continue
        if template is None:
            design = design_prefix(
                rule,
                spec.prompt_tokens,
                ratio,
                place_checkpoint=True,
                sliding_window=host.sliding_window,
            )
        else:
            design = design_chat_prefix(
                rule, spec.prompt_tokens, ratio, template, sliding_window=host.sliding_window
            )
        if nothing_shared(design):
            code = "workload.overlap.nothing_shared"
            await host.journal(_refused_design(host, design, spec.groups, spec.seed + ratio, code))
            continue
        order = overlap_order(spec.groups, spec.requests, spec.seed, reprimed=design.reprimed)
        prompts = overlap_prompts(
            design, order, vocabulary_size=vocabulary, seed=spec.seed + ratio, starts=starts
        )
        sent: list[WorkloadRequest] = []
        stop: str | None = None
        before: Reading | None = None
        try:
            # Inside the point: a stop while the host's metrics are read stops the point.
            before = await _metrics_before(host)
            for planned, prompt in zip(order, prompts, strict=True):
                if trio.current_time() >= host.deadline:
                    stop = "deadline"
                    break
                answer = await host.speaks.send(
                    host, prompt, spec.output_tokens, planned.group, pieces
                )
                sent.append(
                    answer.request(
                        planned.position,
                        group=planned.group,
                        turn=-1 if planned.priming else 0,
                        priming=planned.priming,
                        designed_prompt_tokens=len(prompt) + (template.tokens if template else 0),
                    )
                )
                check_host(host, answer)
            await _metrics_after(host, before, kind, index, sent)
        except BaseException as exc:
            stop = _stop_reason(exc)
            raise
        finally:
            # The point as far as it went, also when a stop unwinds through here.
            with trio.CancelScope(shield=stop is not None):
                await host.journal(
                    OverlapPointMeasured(
                        cell_id=host.cell_id,
                        hit_ratio_pct=ratio,
                        prompt_tokens=design.prompt_tokens,
                        rule=design.rule,
                        requested_prefix_tokens=design.requested_prefix_tokens,
                        shared_prefix_tokens=design.shared_prefix_tokens,
                        reusable_tokens=design.reusable_tokens,
                        groups=spec.groups,
                        seed=spec.seed + ratio,
                        requests=tuple(sent),
                        template_tokens=template.tokens if template else 0,
                        template_reused_tokens=template.reused_tokens if template else 0,
                        priming_prompt_tokens=design.priming_prompt_tokens,
                        reprimed=design.reprimed,
                    )
                )
                if stop is not None:
                    await _stopped(host, kind, stop, index, len(sent))
        if stop is not None:
            return False
    return True


async def _send_sessions(
    host: WorkloadHost, spec: MultiTurn, plan: Sequence[SessionTurn], turn: SessionTurnSender
) -> bool:
    """The sessions loop of every dialect: the plan's turns in order (the think time between
    them, none sent past the deadline), each sent by the dialect's ``turn``; the server's
    counters read around them all; the record journaled as far as it went, also when a stop
    unwinds."""
    kind = MeasurementKind.SESSIONS
    sent: list[WorkloadRequest] = []
    stop: str | None = None
    before: Reading | None = None
    try:
        before = await _metrics_before(host)
        for item in plan:
            if item.position and spec.think_time_ms:
                await trio.sleep(spec.think_time_ms / 1000)
            if trio.current_time() >= host.deadline:
                stop = "deadline"
                break
            answer, request = await turn(item)
            sent.append(request)
            check_host(host, answer)
        await _metrics_after(host, before, kind, 0, sent)
    except BaseException as exc:
        stop = _stop_reason(exc)
        raise
    finally:
        with trio.CancelScope(shield=stop is not None):
            await host.journal(_sessions_record(host, spec, sent))
            if stop is not None:
                await _stopped(host, kind, stop, None, len(sent))
    return stop is None


def _sessions_record(
    host: WorkloadHost, spec: MultiTurn, sent: list[WorkloadRequest]
) -> SessionsMeasured:
    return SessionsMeasured(
        cell_id=host.cell_id,
        users=spec.users,
        turns=spec.turns,
        seed=spec.seed,
        think_time_ms=spec.think_time_ms,
        requests=tuple(sent),
        slots=host.slots,
        slot_context_tokens=host.slot_context_tokens,
        sliding_window=host.sliding_window,
        answer_tokens=spec.answer_tokens,
    )


async def run_sessions(host: WorkloadHost) -> bool:
    spec = host.workloads.multi_turn
    assert spec is not None
    kind = MeasurementKind.SESSIONS
    overheads: ConversationOverheads | None = None
    async with _stops_before_any_point(host, kind):
        text = await read_model_text(host.model_path) if host.speaks.writes_text else None
        vocabulary = await _opened(
            host, kind, spec.model_dump_json(), text.pieces if text is not None else None
        )
        starts = FreshStarts(vocabulary, spec.seed)
        rule = reuse_rule(host.architecture)
        first = session_prompt_tokens(spec, 0)
        if text is None and first > 1:
            # The probe draws from the sessions' own pool: no session shares its prompts.
            rule = await _probe(host, starts, vocabulary, spec.seed, first)
        if text is not None:
            # The template as rendered around a probe message (no generation, no slot used).
            probe = list(range(min(CHAT_PROBE_CHARACTERS, text.pieces.size)))
            rendered = await render_wrapper(
                host.http,
                host.base_url,
                text.pieces.text(probe),
                text.pieces,
                probe,
                "$.multi_turn",
            )
            found = await conversation_overheads(
                host.http, host.base_url, text.pieces, system=spec.system_prompt_tokens > 0
            )
            overheads = found if isinstance(found, ConversationOverheads) else None
            await host.journal(
                _measured_template(
                    host, text.pieces, text.template_source, rendered, None, overheads
                )
            )
    # A chat host's rule is the architecture's (no probe: its template's tokens count too).
    tokens = session_tokens(spec, vocabulary_size=vocabulary, starts=starts)
    plan = session_plan(spec, rule, sliding_window=host.sliding_window)
    pieces = text.pieces if text is not None else None
    turns = host.speaks.turns(host, spec, tokens, pieces, overheads)
    return await _send_sessions(host, spec, plan, turns)


async def run_open_loop(host: WorkloadHost) -> bool:
    spec = host.workloads.open_loop
    assert spec is not None
    kind = MeasurementKind.OPEN_LOOP
    async with _stops_before_any_point(host, kind):
        await _opened(
            host, kind, spec.model_dump_json(), BYTE_ALPHABET if host.speaks.writes_text else None
        )
    exchange = load_exchange(
        host.base_url,
        host.prompt_text,
        output_tokens=spec.output_tokens,
        request_timeout_ms=host.request_timeout_ms,
        dialect=host.dialect,
        model_id=host.model_id,
        client=host.http,
        ignore_eos=host.ignore_eos,
    )
    journaled: list[RateStage] = []
    # A stage is journaled as it ends, so a stop keeps the stages before it.
    rate_index = 0
    # The metrics read as the last stage ended (stages follow each other with nothing sent
    # in between: one read closes a stage and opens the next).
    reading: Reading | None = None

    async def journal_stage(stage: RateStage) -> None:
        nonlocal rate_index, reading
        seed: int | None = None
        if stage.kind == "rate":
            seed, rate_index = spec.seed + rate_index, rate_index + 1
        await host.journal(_stage_record(host, stage, seed))
        journaled.append(stage)
        if host.metrics is None or reading is None or stage.interrupted or stage.skipped_because:
            return
        # A rate's rows are kept; a closed-loop stage keeps only its count (no client sums).
        summer: TokenSummer | None = None
        if stage.outcome is not None:
            summer = TokenSummer()
            for row in stage.outcome.rows:
                summer.add_row(row)
        index = len(journaled) - 1
        client = summer.sums() if summer is not None else None
        reading = await host.metrics.after(reading, kind.value, index, client)

    try:
        reading = await _metrics_before(host)
        stages = await run_rates(spec, exchange, deadline=host.deadline, on_stage=journal_stage)
    except BaseException as exc:
        # The stopped stage: the rate cut short (journaled as far as it went), else the
        # closed-loop stage that was running (nothing of it journaled).
        cut = bool(journaled) and journaled[-1].interrupted
        point = len(journaled) - 1 if cut else len(journaled)
        outcome = journaled[-1].outcome if cut else None
        await _stopped(host, kind, _stop_reason(exc), point, outcome.launched if outcome else 0)
        raise
    for index, stage in enumerate(stages):
        if stage.outcome is not None and stage.outcome.stop_reason == "load.deadline":
            await _stopped(host, kind, "deadline", index, stage.outcome.launched)
            return False
    return True


def _stage_record(host: WorkloadHost, stage: RateStage, seed: int | None) -> OpenLoopStageMeasured:
    spec = host.workloads.open_loop
    assert spec is not None
    outcome = stage.outcome
    if outcome is None:
        return OpenLoopStageMeasured(
            cell_id=host.cell_id,
            stage=stage.kind,
            pattern=spec.pattern,
            burstiness=spec.burstiness,
            seed=seed,
            target_rate_per_s=stage.target_rate_per_s,
            measured_rate_per_s=stage.measured_rate_per_s,
            completed=stage.completed,
            skipped_because=stage.skipped_because,
        )
    lateness, fit = outcome.lateness, outcome.fit
    return OpenLoopStageMeasured(
        cell_id=host.cell_id,
        stage=stage.kind,
        pattern=spec.pattern,
        burstiness=spec.burstiness,
        seed=seed,
        target_rate_per_s=stage.target_rate_per_s,
        scheduled=outcome.scheduled,
        launched=outcome.launched,
        completed=sum(1 for row in outcome.rows if row.status == "completed"),
        achieved_rate_per_s=outcome.achieved_rate_per_s,
        lateness_p50_ms=lateness.p50_ms if lateness else None,
        lateness_p99_ms=lateness.p99_ms if lateness else None,
        lateness_max_ms=lateness.max_ms if lateness else None,
        fit_statistic=fit.statistic if fit else None,
        fit_value=fit.value if fit else None,
        fit_p_value=fit.p_value if fit else None,
        completed_per_s=outcome.completed_per_s,
        stop_reason=outcome.stop_reason,
        stop_detail=outcome.saturation.detail if outcome.saturation else None,
    )
