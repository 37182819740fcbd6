"""The journal records a workload cell writes, and the receipt folded from them
(``workload.json`` beside the cell's ``cell.json``, folded by ``states/workload_fold.py``).

Records carry what was sent and what the server reported, never a verdict: the fold judges, so
replay reproduces every verdict byte for byte.
"""

from __future__ import annotations

from typing import ClassVar, Final

import msgspec

from cache_family.schemas.server_metrics import ServerMetricsPoint


class _WorkloadRecord(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", forbid_unknown_fields=True
):
    # Fsynced as written, although they are measurements: one record holds a whole point (a
    # hit ratio's requests, every turn, a rate's stage), minutes of work on a real host, and
    # the cell writes no state change until the workload ends, so a run killed outright would
    # otherwise lose every point before the kill. A few fsyncs a workload.
    durable: ClassVar[bool] = True


class WorkloadRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One request of a workload as sent and answered (the server's own figures)."""

    position: int
    status: str  # completed | failed
    # Overlap: the prefix group; sessions: the user.
    group: int = 0
    # Sessions: the turn index (0 first); overlap: -1 for a group's priming request.
    turn: int = 0
    priming: bool = False
    # What the server reported: prompt tokens evaluated and how many it served from its cache.
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    # Sessions: the tokens the plan expects reused (the session's earlier tokens).
    expected_reused_tokens: int | None = None
    # The server's prompt processing time (``timings.prompt_ms``): the request's time to its
    # first token, as the server measured it; and the client's whole exchange.
    prompt_ms: float | None = None
    elapsed_ms: float | None = None
    slot_id: int | None = None
    error: str | None = None
    # The prompt tokens the client designed this request to be, as the server should count
    # them (ids sent; a chat message's pieces plus its measured template): the fold refuses a
    # point whose server count differs. None: not designed to a count (not checked).
    designed_prompt_tokens: int | None = None


class WorkloadOpened(_WorkloadRecord, tag="workload_opened", frozen=True, kw_only=True):
    """A workload cell's plan: its kind, the section of the workload file it runs (JSON, as
    pinned) and the facts its design was drawn from."""

    cell_id: str
    kind: str
    spec_json: str
    workloads_sha256: str = ""
    architecture: str | None = None
    # The family's reuse rule (``states/cache_reuse.py``); None: unknown, nothing designed.
    rule: str | None = None
    # The host's vocabulary size (its ``n_vocab``), whose ids the prompts are drawn from.
    vocabulary_size: int | None = None


class OverlapPointMeasured(_WorkloadRecord, tag="overlap_point", frozen=True, kw_only=True):
    """One designed hit ratio of an overlap sweep, as designed and as sent."""

    cell_id: str
    hit_ratio_pct: int
    prompt_tokens: int
    rule: str
    requested_prefix_tokens: int
    shared_prefix_tokens: int
    reusable_tokens: int
    groups: int
    seed: int
    requests: tuple[WorkloadRequest, ...] = ()
    # A chat dialect's template, as the cell's calibration measured it (0 on llama-server's
    # /completion, which has none): the design above is of the message, and each request's
    # figures (the server's, of the whole prompt) are judged less these.
    template_tokens: int = 0
    template_reused_tokens: int = 0
    # The group's priming prompts' length (0: ``prompt_tokens``), cut so that the server
    # checkpoints them at the shared prefix; ``reprimed``: one before every measured request.
    priming_prompt_tokens: int = 0
    reprimed: bool = False
    # Why the point was refused as designed, nothing sent (``workload.overlap.nothing_shared``:
    # sharing asked for, none designed); None: it was sent.
    design_refusal: str | None = None


class ReuseProbeStep(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One request of a reuse probe, on one slot: its length, the slot's previous prompt's
    length and what the two share, and the tokens the server reported reused."""

    prompt_tokens: int
    previous_prompt_tokens: int
    common_prefix: int
    # None: the request failed (its error is in ``error``).
    cached_tokens: int | None = None
    error: str | None = None


class ReuseProbed(_WorkloadRecord, tag="reuse_probed", frozen=True, kw_only=True):
    """What the server reused of a few prompts of known prefixes, sent as the workload opened,
    and the reuse rule its verdicts use: the model header's (its architecture's rule, its
    sliding window) when the server agreed with it on every step, else the first other rule
    that did, else none (``workload.reuse.server_disagrees``: nothing is designed)."""

    cell_id: str
    header_rule: str | None
    sliding_window: int | None
    n_ubatch: int
    steps: tuple[ReuseProbeStep, ...] = ()
    rule: str | None = None


class ChatTemplateMeasured(_WorkloadRecord, tag="chat_template", frozen=True, kw_only=True):
    """What a chat dialect's cell wraps its messages in and writes them with, measured on the
    host before the first designed request: the text pieces of the design, the template
    (the model's own, or the server's fallback when the GGUF carries none), its tokens around
    one user message as the server counted them, and the wrapper as the server rendered it
    (``/apply-template``) where it serves that."""

    cell_id: str
    # byte-alphabet (one character per design token, the zoo's byte vocabulary) or
    # word-pieces (the model's own word tokens, ``states/chat_pieces.py``).
    pieces: str
    piece_count: int
    # model: the GGUF's ``tokenizer.chat_template``; server-fallback: the GGUF has none, the
    # server applies its own (llama-server: ChatML).
    template_source: str
    # The calibration's counts (overlap): tokens the template adds to one user message, and
    # what two messages sharing nothing still reused through it. None: not calibrated.
    template_tokens: int | None = None
    template_reused_tokens: int | None = None
    # The rendered prompt around one user message: before it and after it (the generation
    # prompt included), and their tokens by the server's /tokenize. None: not served.
    rendered_head: str | None = None
    rendered_tail: str | None = None
    head_tokens: int | None = None
    tail_tokens: int | None = None
    # tokenize: the server's /tokenize gave the designed tokens back inside the rendered
    # wrapper; counts: only the server's prompt token counts checked the design.
    checked_by: str = "counts"
    # Why the wrapper was not rendered (the host serves no /apply-template or /tokenize).
    unrendered_reason: str | None = None
    # Sessions: what the template adds to a first turn beyond its pieces, and to each later
    # turn beyond the answer before it and the question's pieces (rendered probe
    # conversations, tokenized by the server). None: not measured (overlap, or not served).
    session_first_turn_tokens: int | None = None
    session_later_turn_tokens: int | None = None


class SessionsMeasured(_WorkloadRecord, tag="sessions_measured", frozen=True, kw_only=True):
    """Every turn of a multi-turn workload in the seeded order it was sent."""

    cell_id: str
    users: int
    turns: int
    seed: int
    think_time_ms: float = 0.0
    requests: tuple[WorkloadRequest, ...] = ()
    # The host's cache: its slots and each slot's context in tokens (None: not recorded, a
    # run from before evictions needed evidence), and the model's sliding window the turns'
    # expected reuse was planned with.
    slots: int | None = None
    slot_context_tokens: int | None = None
    sliding_window: int | None = None
    # Each turn's answer tokens (the spec's): a slot holds a turn's prompt and its answer.
    answer_tokens: int = 0


class OpenLoopStageMeasured(_WorkloadRecord, tag="open_loop_stage", frozen=True, kw_only=True):
    """One stage of an open-loop workload: a closed-loop rate measurement of a sweep, one
    target rate sent on its drawn schedule, or a rate skipped after over-saturation."""

    cell_id: str
    stage: str  # synchronous | throughput | rate
    pattern: str
    burstiness: float | None = None
    # The seed the rate's schedule was drawn from (the workload's seed + the rate's index).
    seed: int | None = None
    target_rate_per_s: float | None = None
    measured_rate_per_s: float | None = None
    scheduled: int = 0
    launched: int = 0
    completed: int = 0
    achieved_rate_per_s: float | None = None
    lateness_p50_ms: float | None = None
    lateness_p99_ms: float | None = None
    lateness_max_ms: float | None = None
    fit_statistic: str | None = None
    fit_value: float | None = None
    fit_p_value: float | None = None
    completed_per_s: float | None = None
    stop_reason: str | None = None
    stop_detail: str | None = None
    skipped_because: str | None = None


class WorkloadStopped(_WorkloadRecord, tag="workload_stopped", frozen=True, kw_only=True):
    """A workload that ended before its plan did, journaled after the records of what it
    measured (the stopped point's own record first, with the requests it did send, when it
    had sent any): the fold lowers the receipt to ``incomplete`` and names the point."""

    cell_id: str
    kind: str
    # cancelled: the cell was stopped (a signal or its hard deadline: the cell's own
    # cancellation or deadline record says which); deadline: the cell's work deadline came
    # first; host-exited: the host was gone when a request failed; fault: anything else.
    reason: str
    # The stopped point, in the order the workload journals its points: overlap, the index
    # of its hit ratio; open loop, the index of its stage; sessions (one record), None.
    point_index: int | None = None
    # The requests of the stopped point that were sent (and journaled) before it stopped.
    sent: int = 0
    detail: str = ""


class TraceRequestReplayed(_WorkloadRecord, tag="trace_request", frozen=True, kw_only=True):
    """One request of a trace replay as designed, sent and answered: its window index and
    trace line, when it was due and sent (seconds from the replay's start; None: not sent),
    what the trace lets it reuse of the replay before it (scaled tokens: an infinite cache,
    an LRU of the declared capacity) and the earlier request that last sent those blocks,
    and the server's figures (``request``)."""

    # Buffered, not fsynced one by one: a replay sends hundreds a second; its
    # ``trace_replayed`` record, fsynced, closes them.
    durable: ClassVar[bool] = False

    cell_id: str
    index: int
    line: int
    scheduled_s: float
    sent_s: float | None = None
    output_tokens: int = 0
    shared_blocks: int = 0
    designed_infinite_tokens: int = 0
    designed_lru_tokens: int | None = None
    last_sender: int | None = None
    request: WorkloadRequest | None = None
    # The most it could have reused of the requests sent before it was answered (requests due
    # together reach the server in any order); None: not answered, or a replay from before.
    reachable_tokens: int | None = None


class TraceReplayed(_WorkloadRecord, tag="trace_replayed", frozen=True, kw_only=True):
    """A trace replay as it ended: the trace (path, pinned SHA-256, format, the block size its
    ids were written with), the window and the scaling, the capacity its LRU design assumed,
    the reuse granularity its verdicts allow, and what the sender did (lateness, the stop)."""

    cell_id: str
    path: str
    sha256: str
    format: str
    block_tokens: int
    tokens_per_block: int
    time_scale: float
    output_tokens_cap: int
    window_json: str
    requests: int
    distinct_ids: int
    lru_capacity_tokens: int | None = None
    granularity_tokens: int = 1
    launched: int = 0
    completed: int = 0
    lateness_p50_ms: float | None = None
    lateness_p99_ms: float | None = None
    lateness_max_ms: float | None = None
    stop_reason: str | None = None
    stop_detail: str | None = None
    # A chat dialect's template, as the cell's calibration measured it (0 on /completion):
    # the tokens it adds to each message, and what two messages sharing nothing still reuse
    # through it. The design is of the message; the server's counts are judged less these.
    template_tokens: int = 0
    template_reused_tokens: int = 0


# --- the receipt ---------------------------------------------------------------------------------


class OverlapPointReceipt(msgspec.Struct, frozen=True, kw_only=True):
    hit_ratio_pct: int
    prompt_tokens: int
    shared_prefix_tokens: int
    reusable_tokens: int
    designed_ratio_pct: float
    achieved_ratio_pct: float | None
    band_pp: float | None
    measured_requests: int
    failed_requests: int
    accepted: bool
    refusal: str | None = None
    # Median server prompt time of the measured requests (None: none completed).
    prompt_ms_p50: float | None = None
    # A stage arm's measured requests' server prompt times, in send order (the report's
    # old-against-new interval); left out of a native arm's receipt (UNSET: not encoded).
    prompt_ms: tuple[float, ...] | msgspec.UnsetType = msgspec.UNSET
    # Positions of the point's requests (priming ones too) the server counted otherwise than
    # designed (the point is refused ``workload.prompt.token_count_mismatch``); UNSET: none.
    token_count_mismatches: tuple[int, ...] | msgspec.UnsetType = msgspec.UNSET


class TurnReceipt(msgspec.Struct, frozen=True, kw_only=True):
    turn: int
    requests: int
    prompt_tokens: int
    expected_reused_tokens: int
    achieved_reused_tokens: int
    prompt_ms_p50: float | None = None
    # A stage arm's requests' server prompt times at this turn index, in send order (the
    # report's old-against-new interval); left out of a native arm's receipt.
    prompt_ms: tuple[float, ...] | msgspec.UnsetType = msgspec.UNSET


class SessionsReceipt(msgspec.Struct, frozen=True, kw_only=True):
    users: int
    turns: int
    seed: int
    by_turn: tuple[TurnReceipt, ...]
    # The first turn whose reuse fell short of the session so far (the server evicted it);
    # with the cache's size recorded, only where the cache was full.
    eviction_turn: int | None
    failed_requests: int
    # Positions of turns the server counted otherwise than designed (the sessions are refused
    # ``workload.prompt.token_count_mismatch``); UNSET: none.
    token_count_mismatches: tuple[int, ...] | msgspec.UnsetType = msgspec.UNSET
    # The first turn that fell short where the cache was not full, and the refusal it brings
    # (``workload.sessions.reuse_short``); left out of receipts from before the evidence.
    shortfall_turn: int | msgspec.UnsetType | None = msgspec.UNSET
    refusal: str | msgspec.UnsetType | None = msgspec.UNSET


class TraceRequestReceipt(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One replayed request, judged (a row of a compact table: ``array_like``)."""

    index: int
    line: int
    scheduled_s: float
    lateness_ms: float | None
    prompt_tokens: int
    designed_infinite_tokens: int
    designed_lru_tokens: int | None
    achieved_tokens: int | None
    prompt_ms: float | None
    # Why the request has no verdict or what it is: trace.reuse.over_claimed,
    # workload.prompt.token_count_mismatch, failed, not-launched; None: judged, in bounds.
    verdict: str | None
    # The earlier request that last sent the blocks the infinite cache would serve.
    last_sender: int | None


class TraceLoss(msgspec.Struct, frozen=True, kw_only=True):
    """A request that reused less than its design by more than the granularity, and the
    earlier request that last sent the blocks it lost."""

    index: int
    designed_tokens: int
    achieved_tokens: int
    last_sender: int | None


class TraceEfficiencyBin(msgspec.Struct, frozen=True, kw_only=True):
    """Achieved over designed reuse of the requests scheduled in one slice of replay time."""

    from_s: float
    until_s: float
    requests: int
    designed_tokens: int
    achieved_tokens: int
    efficiency: float | None


class TraceReceipt(msgspec.Struct, frozen=True, kw_only=True):
    """A trace replay, judged request by request."""

    replay: TraceReplayed
    requests: tuple[TraceRequestReceipt, ...]
    measured_requests: int
    failed_requests: int
    prompt_tokens: int
    designed_infinite_tokens: int
    designed_lru_tokens: int | None
    achieved_tokens: int
    # Achieved over designed (infinite cache) tokens of the measured requests.
    efficiency: float | None
    efficiency_over_time: tuple[TraceEfficiencyBin, ...]
    losses: tuple[TraceLoss, ...]
    over_claimed: tuple[int, ...]
    token_count_mismatches: tuple[int, ...]
    refusal: str | None = None


class WorkloadReceipt(msgspec.Struct, frozen=True, kw_only=True):
    """``workload.json``: one workload cell's measurement, judged."""

    cell_id: str
    arm: str | None
    kind: str | None
    # accepted: every point within its band (or nothing to judge); refused: a point missed
    # it (each point names its code and both figures); incomplete: the workload stopped
    # before its plan (a cancellation, the deadline, the host gone: ``workload_stopped``);
    # unmeasured: nothing was measured.
    status: str
    synthetic: bool
    architecture: str | None = None
    rule: str | None = None
    spec_json: str | None = None
    overlap: tuple[OverlapPointReceipt, ...] = ()
    sessions: SessionsReceipt | None = None
    open_loop: tuple[OpenLoopStageMeasured, ...] = ()
    # The first open-loop rate the server could not sustain, with the rule that stopped it.
    over_saturated_at_per_s: float | None = None
    journal_through_seq: int = 0
    # A chat dialect's template and text pieces as the cell measured them (left out of a
    # native cell's receipt: UNSET, not encoded).
    chat_template: ChatTemplateMeasured | msgspec.UnsetType = msgspec.UNSET
    # The cell's reuse probe, when it ran one (``rule`` above is then the probed rule).
    reuse_probe: ReuseProbed | msgspec.UnsetType = msgspec.UNSET
    # A trace replay's receipt (left out of every other cell's: UNSET, not encoded).
    trace: TraceReceipt | msgspec.UnsetType = msgspec.UNSET
    # The host's own Prometheus counters of each point, labelled as the server's, beside the
    # client's sums of its requests (left out when none was read: UNSET, not encoded).
    server_metrics: tuple[ServerMetricsPoint, ...] | msgspec.UnsetType = msgspec.UNSET


WORKLOAD_RECEIPT_NAME: Final = "workload.json"
_ENCODER: Final = msgspec.json.Encoder(order="deterministic")


def encode_workload_receipt(receipt: WorkloadReceipt) -> bytes:
    """Canonical bytes: deterministic order, indent 2, trailing newline (as every receipt)."""
    return msgspec.json.format(_ENCODER.encode(receipt), indent=2) + b"\n"


def decode_workload_receipt(data: bytes) -> WorkloadReceipt:
    return msgspec.json.decode(data, type=WorkloadReceipt)


WORKLOAD_RECORDS: Final = (
    WorkloadOpened,
    ChatTemplateMeasured,
    ReuseProbed,
    OverlapPointMeasured,
    SessionsMeasured,
    OpenLoopStageMeasured,
    WorkloadStopped,
    TraceRequestReplayed,
    TraceReplayed,
)
