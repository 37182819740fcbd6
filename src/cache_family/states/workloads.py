"""Pure planning and verdicts of the cache workloads the workload file chooses.

A prefix-overlap point is accepted when the reuse the server reported is within max(0.5 pp, 100
x page / mean prompt tokens) of the designed ratio (the shared prefix rounded down to what the
family's reuse rule can reuse); the 0 % point is the control and must report no reuse at all.
Sessions live in ``sessions.py``, open-loop schedules in ``arrivals.py``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Final

import msgspec

from cache_family.errors import Refused
from cache_family.schemas.arms import MeasurementKind
from cache_family.schemas.measurement import ReuseRule
from cache_family.schemas.refusal_codes import RefusalCode
from cache_family.schemas.workload import WorkloadFile
from cache_family.states.cache_reuse import (
    CHECKPOINT_TAIL,
    DEFAULT_N_UBATCH,
    checkpoints,
    expected_cached_tokens,
    priming_prompt_tokens,
)
from cache_family.states.chat_pieces import CHAT_ALPHABET, CHAT_PIECES_CODES, PiecesSource

#: The smallest band a point is judged by (percentage points), as in SGLang's benchmark.
MIN_BAND_PP: Final = 0.5
#: llama-server reuses its prompt cache token by token: its page is one token.
LLAMA_SERVER_PAGE_TOKENS: Final = 1


def seeded_random(seed: int) -> random.Random:
    # Reproducible draws from a journaled seed (orders, schedules, prompts), never secrets.
    return random.Random(seed)  # noqa: S311


def _codes(*codes: RefusalCode) -> Mapping[str, RefusalCode]:
    return MappingProxyType({c.code: c for c in codes})


#: Why a measured point or rate is refused (receipts carry the code and both figures).
WORKLOAD_VERDICT_CODES: Final = _codes(
    RefusalCode(
        "workload.overlap.no_rule",
        "the model's architecture has no known reuse rule, so no prefix can be designed",
        "add the architecture to states/cache_reuse.py",
    ),
    RefusalCode(
        "workload.overlap.nothing_shared",
        "sharing was asked for, but the design shares nothing the server's reuse rule reuses",
        "choose longer prompts or higher ratios, or a dialect whose prompts the design cuts",
    ),
    RefusalCode(
        "workload.reuse.server_disagrees",
        "the server's reuse on the cell's probe matched no reuse rule known for any family",
        "see the probe's steps in the journal: the server reuses otherwise than llama-server",
    ),
    RefusalCode(
        "workload.sessions.reuse_short",
        "a later turn reused less than the reuse rule expects, with the cache not full",
        "the rule disagrees with the server: nothing could have been evicted",
    ),
    RefusalCode(
        "workload.overlap.outside_band",
        "the reuse the server reported misses the designed ratio by more than the band",
        "check the server's cache settings (slots, --cache-ram) against the prefix groups",
    ),
    RefusalCode(
        "workload.overlap.control_reused",
        "the 0 % control point reported reused tokens",
        "the prompts of the control share a prefix with something the server held",
    ),
    RefusalCode(
        "workload.overlap.nothing_measured",
        "no measured request of the point completed with the server's accounting",
        "see the point's failed requests",
    ),
    RefusalCode(
        "workload.overlap.vocabulary",
        "the vocabulary has too few tokens to start every prompt differently",
        "use fewer groups or requests per sweep",
    ),
    RefusalCode(
        "workload.stopped",
        "the workload stopped before this point's plan was sent (cancelled, out of time or "
        "the host gone): what it sent is kept, the point is not judged",
        "resume the run (`cache-family run --resume RUN_DIR`): its row runs again afresh",
    ),
    RefusalCode(
        "workload.chat.text_not_one_token_per_character",
        "the chat server counted the design's text other than one prompt token per character",
        "the chat dialect designs prompts for a byte-token vocabulary (the zoo's); use the "
        "native arm for this model",
    ),
    RefusalCode(
        "workload.prompt.token_count_mismatch",
        "the server counted a prompt's tokens otherwise than the design (the text or ids it was "
        "sent are not the designed tokens on this server)",
        "see the requests' designed_prompt_tokens against prompt_tokens; for a chat dialect, "
        "the cell's chat template record",
    ),
    RefusalCode(
        "workload.chat.no_usage",
        "the chat server's reply gave no usage.prompt_tokens and cached_tokens to judge by",
        "the chat dialect judges reuse by the server's own counts: serve them",
    ),
    RefusalCode(
        "workload.arrivals.in_flight_growing",
        "over-saturated: requests in flight kept growing over the window",
        "the server cannot sustain this rate; lower rates are the sustained ones",
    ),
    RefusalCode(
        "workload.arrivals.sender_late",
        "over-saturated: the sender fell behind its schedule by more than the limit",
        "the client cannot keep this rate; lower it or give the client a CPU of its own",
    ),
)


# --- prefix overlap ----------------------------------------------------------------------------


class PrefixDesign(msgspec.Struct, frozen=True, kw_only=True):
    """One point of an overlap sweep, as designed for one reuse rule."""

    hit_ratio_pct: int
    prompt_tokens: int
    rule: ReuseRule
    # floor(hit ratio x L): what an attention model with token pages would reuse.
    requested_prefix_tokens: int
    # The prefix the group's prompts share: the request rounded down to what the rule reuses.
    shared_prefix_tokens: int
    # What the rule lets the server reuse of that prefix (a checkpoint for recurrent models).
    reusable_tokens: int
    # The group's priming prompt's length (0: ``prompt_tokens``): cut so that the server
    # checkpoints it at the shared prefix, for a checkpoint family.
    priming_prompt_tokens: int = 0
    # A priming request goes before every measured one (not once per group): within its
    # window a sliding-window slot resumes a token before each checkpoint it restores and
    # checkpoints again there, so a group's requests would each reuse one token less.
    reprimed: bool = False

    @property
    def priming_tokens(self) -> int:
        return self.priming_prompt_tokens or self.prompt_tokens

    @property
    def designed_ratio_pct(self) -> float:
        return 100.0 * self.reusable_tokens / self.prompt_tokens


def design_prefix(
    rule: ReuseRule | None,
    prompt_tokens: int,
    hit_ratio_pct: int,
    *,
    n_ubatch: int = DEFAULT_N_UBATCH,
    place_checkpoint: bool = False,
    sliding_window: int | None = None,
) -> PrefixDesign:
    """The shared prefix of a ``prompt_tokens`` prompt for a designed hit ratio.

    ``place_checkpoint`` (llama-server's ``/completion``, where the design cuts every prompt
    to the token): a checkpoint family's group primes with a prompt cut so that the server
    checkpoints it exactly at the requested prefix, which the group's measured prompts then
    reuse whole (``priming_prompt_tokens``); a sliding-window family sharing less than its
    window primes before every measured request. Otherwise every prompt of a group is
    ``prompt_tokens`` long (the priming one too), so a measured request's previous prompt
    placed its checkpoints at the same marks, and the prefix is rounded down to the last of
    them: the rule's reuse of the shared prefix is the same for every request of the point
    (and may be nothing at all)."""
    if rule is None:
        raise Refused.one(
            "workload.overlap.no_rule",
            "$.prefix_overlap",
            "no reuse rule is known for the model's architecture",
            WORKLOAD_VERDICT_CODES["workload.overlap.no_rule"].hint,
        )
    if prompt_tokens < 2 or not 0 <= hit_ratio_pct < 100:
        raise ValueError("a prompt of at least 2 tokens and a hit ratio in 0..99 %")
    requested = prompt_tokens * hit_ratio_pct // 100
    # At least one prompt token is always evaluated.
    shared = min(requested, prompt_tokens - 1)
    if place_checkpoint and rule != "exact-prefix":
        # The priming prompt (the prefix and its tail) stays within the prompt's length.
        tail = priming_prompt_tokens(rule, 1, prompt_tokens) - 1
        shared = min(shared, prompt_tokens - tail)
    if place_checkpoint and rule != "exact-prefix" and shared > 0:
        priming = priming_prompt_tokens(rule, shared, prompt_tokens)
        return PrefixDesign(
            hit_ratio_pct=hit_ratio_pct,
            prompt_tokens=prompt_tokens,
            rule=rule,
            requested_prefix_tokens=requested,
            shared_prefix_tokens=shared,
            # The checkpoint ends inside the shared prefix; past a sliding window the slot
            # still holds the prefix itself: the whole prefix either way (an unknown window
            # is taken as longer than the prompt: the checkpoint's figure).
            reusable_tokens=expected_cached_tokens(
                rule,
                prompt_tokens=prompt_tokens,
                common_prefix=shared,
                previous_prompt_tokens=priming,
                n_ubatch=n_ubatch,
                sliding_window=sliding_window if sliding_window is not None else prompt_tokens,
            ),
            priming_prompt_tokens=priming,
            # Within the window every checkpoint is restored a token short, and each measured
            # request checkpoints where it resumed: primed again, each reuses the prefix
            # whole. Past it a request checkpointed again is no longer usable (its oldest
            # window position is gone) and priming again would replace the good one, while
            # the slot's own window or the first priming's checkpoint serves the prefix
            # whole (Gemma 3 270M, window 512: 256 of 512 primed once reused 256, 255, 254;
            # primed each time 256 each; 512 of 1,024 primed each time fell to 1).
            reprimed=rule == "checkpoint-swa"
            and (sliding_window is None or shared < sliding_window),
        )
    if rule != "exact-prefix":
        # Reuse lands on a checkpoint of the previous prompt: share exactly up to the last
        # checkpoint the request reaches, nothing past it (it would not be reused).
        marks = [
            m
            for m in checkpoints(prompt_tokens, n_ubatch)
            if m <= shared
            and expected_cached_tokens(
                rule,
                prompt_tokens=prompt_tokens,
                common_prefix=m,
                previous_prompt_tokens=prompt_tokens,
                n_ubatch=n_ubatch,
            )
            > 0
        ]
        shared = marks[-1] if marks else 0
    reusable = expected_cached_tokens(
        rule,
        prompt_tokens=prompt_tokens,
        common_prefix=shared,
        previous_prompt_tokens=prompt_tokens,
        n_ubatch=n_ubatch,
    )
    return PrefixDesign(
        hit_ratio_pct=hit_ratio_pct,
        prompt_tokens=prompt_tokens,
        rule=rule,
        requested_prefix_tokens=requested,
        shared_prefix_tokens=shared,
        reusable_tokens=reusable,
    )


def nothing_shared(design: PrefixDesign) -> bool:
    """Sharing was asked for (a ratio above 0) but the design shares nothing the rule reuses:
    such a point measures nothing and is refused (``workload.overlap.nothing_shared``), never
    sent and accepted."""
    return design.hit_ratio_pct > 0 and design.reusable_tokens == 0


class PlannedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One request of an overlap point, in send order."""

    position: int
    group: int
    # The request's place in its group (priming requests: -1).
    member: int
    priming: bool


def overlap_order(
    groups: int, requests: int, seed: int, *, reprimed: bool = False
) -> tuple[PlannedRequest, ...]:
    """One priming request per group (group order), then ``requests`` measured ones, N/G per
    group, in an order drawn from ``seed`` (the same seed, the same order); ``reprimed``: the
    same measured order, each measured request right after a priming one of its group."""
    if groups < 1 or requests < groups or requests % groups:
        raise ValueError("requests must be a positive multiple of groups")
    per_group = requests // groups
    measured = [(group, member) for group in range(groups) for member in range(per_group)]
    seeded_random(seed).shuffle(measured)
    if reprimed:
        pairs: list[PlannedRequest] = []
        for group, member in measured:
            pairs.append(PlannedRequest(position=len(pairs), group=group, member=-1, priming=True))
            pairs.append(
                PlannedRequest(position=len(pairs), group=group, member=member, priming=False)
            )
        return tuple(pairs)
    order = [
        PlannedRequest(position=group, group=group, member=-1, priming=True)
        for group in range(groups)
    ]
    order += [
        PlannedRequest(position=groups + i, group=group, member=member, priming=False)
        for i, (group, member) in enumerate(measured)
    ]
    return tuple(order)


class FreshStarts:
    """Distinct token ids, drawn without replacement from a seeded permutation of the
    vocabulary: each group prefix and each request's own part starts with one, so two prompts
    share exactly what they were designed to share (never a token more by chance), within a
    point and across the points of a sweep."""

    def __init__(self, vocabulary_size: int, seed: int) -> None:
        self._order = list(range(vocabulary_size))
        seeded_random(seed).shuffle(self._order)
        self._next = 0

    def take(self) -> int:
        if self._next >= len(self._order):
            raise Refused.one(
                "workload.overlap.vocabulary",
                "$.prefix_overlap",
                f"more prompts than the {len(self._order)} distinct first tokens",
                WORKLOAD_VERDICT_CODES["workload.overlap.vocabulary"].hint,
            )
        token = self._order[self._next]
        self._next += 1
        return token


def overlap_prompts(
    design: PrefixDesign,
    order: Sequence[PlannedRequest],
    *,
    vocabulary_size: int,
    seed: int,
    starts: FreshStarts,
) -> list[list[int]]:
    """Token ids of every request of a point, in ``order``: the group's prefix, then the
    request's own tokens (its first from ``starts``), a priming request as long as the design
    primes. Token ids below ``vocabulary_size``."""
    rng = seeded_random(seed)
    groups = sorted({request.group for request in order})
    shared = design.shared_prefix_tokens
    prefixes: dict[int, list[int]] = {}
    for group in groups:
        prefixes[group] = (
            [starts.take(), *(rng.randrange(vocabulary_size) for _ in range(shared - 1))]
            if shared
            else []
        )
    return [
        [
            *prefixes[request.group],
            starts.take(),
            *(
                rng.randrange(vocabulary_size)
                for _ in range(
                    (design.priming_tokens if request.priming else design.prompt_tokens)
                    - shared
                    - 1
                )
            ),
        ]
        for request in order
    ]


# --- prefix overlap in a chat dialect (a stage server: OpenAI chat, text prompts) ---------------

#: The calibration's shorter message, in design ids (the longer one is twice as long).
CHAT_PROBE_CHARACTERS: Final = 16


#: Context room a stage host's slot keeps for the chat template around each message (a
#: capacity, never a length the design relies on: lengths are the server's counts).
CHAT_TEMPLATE_ROOM_PER_MESSAGE: Final = 32


#: The chat template's calibration sends two messages, each with a first character of its own.
CHAT_CALIBRATION_MESSAGES: Final = 2


def chat_starts_needed(
    workloads: WorkloadFile, kind: MeasurementKind, trace_distinct_ids: int | None = None
) -> int:
    """The distinct first characters a chat-dialect workload draws at most. Overlap: the
    calibration's two messages, then per point a prefix per group and one per request,
    priming ones included (one per group, or one per measured request where a sliding
    window's design primes before each); sessions: the system prompt and each user's
    context; trace: one per distinct hash id of the window (``trace_distinct_ids``, as
    preparation counted them; 0 when not counted), then the calibration's two."""
    overlap, sessions = workloads.prefix_overlap, workloads.multi_turn
    if kind == MeasurementKind.PREFIX_OVERLAP and overlap is not None:
        primings = max(overlap.groups, overlap.requests)
        per_point = overlap.groups + overlap.requests + primings
        return CHAT_CALIBRATION_MESSAGES + len(overlap.hit_ratios_pct) * per_point
    if kind == MeasurementKind.SESSIONS and sessions is not None:
        return 1 + sessions.users
    if kind == MeasurementKind.TRACE and workloads.trace is not None and trace_distinct_ids:
        return trace_distinct_ids + CHAT_CALIBRATION_MESSAGES
    return 0


def chat_text(ids: Sequence[int]) -> str:
    """Token-design ids (below ``len(CHAT_ALPHABET)``) as the message text that carries them."""
    return "".join(CHAT_ALPHABET[i] for i in ids)


class ChatTemplate(msgspec.Struct, frozen=True, kw_only=True):
    """What a chat server's template adds around one user message, as the server counted
    it: ``tokens`` beyond the message's own, and ``reused_tokens``, what two prompts that share
    nothing of their messages still share through the template (its head, as the family's
    rule reuses it: the whole head for plain attention, nothing for a checkpoint rule)."""

    tokens: int
    reused_tokens: int
    # The template's tokens before the message (the rest follow it), where the host rendered
    # and tokenized its wrapper; None: not known, and no design may rely on the split.
    head_tokens: int | None = None


def chat_template(
    short: tuple[int, int],
    long: tuple[int, int],
    *,
    short_characters: int,
    reused_tokens: int,
    source: PiecesSource = "byte-alphabet",
) -> ChatTemplate:
    """The template from two calibration messages on one slot, ``short`` then ``long``
    (twice as long, its first piece another), each (design ids, the server's prompt tokens);
    ``reused_tokens``: the cached tokens the server reported for ``long``. Refused unless the
    server counted one token per added piece (``source``: the pieces' kind, which names the
    code: ``workload.chat.text_not_one_token_per_character`` for the byte alphabet,
    ``workload.chat.not_token_exact`` for word pieces)."""
    (short_chars, short_tokens), (long_chars, long_tokens) = short, long
    if short_chars != short_characters or long_tokens - short_tokens != long_chars - short_chars:
        if source == "byte-alphabet":
            code = "workload.chat.text_not_one_token_per_character"
            hint = WORKLOAD_VERDICT_CODES[code].hint
            unit = "characters"
        else:
            code, unit = "workload.chat.not_token_exact", "word pieces"
            hint = CHAT_PIECES_CODES[code].hint
        raise Refused.one(
            code,
            "$.prefix_overlap",
            f"{short_chars} and {long_chars} {unit} were {short_tokens} and "
            f"{long_tokens} prompt tokens",
            hint,
        )
    return ChatTemplate(tokens=short_tokens - short_chars, reused_tokens=reused_tokens)


def design_chat_prefix(
    rule: ReuseRule | None,
    prompt_tokens: int,
    hit_ratio_pct: int,
    template: ChatTemplate,
    *,
    n_ubatch: int = DEFAULT_N_UBATCH,
    sliding_window: int | None = None,
) -> PrefixDesign:
    """The design of a point whose prompts the server counts ``prompt_tokens`` long, the
    template's tokens included, in the message's terms: ``prompt_tokens`` of the design is the
    message's (the prompt less the template), its prefix and reuse beyond what the template
    alone shares. Plain attention: the message's prefix, as ``design_prefix`` of the message.

    A checkpoint rule reuses a checkpoint of the slot's earlier prompt. Where the template's
    head is known (the host rendered its wrapper), the common prefix is the head and the
    message's shared part, and the design places the checkpoint there as ``/completion`` does:
    past a known sliding window the slot reuses the common prefix itself, nothing to place;
    otherwise a priming message cut so that the earlier of the server's two checkpoints of
    the whole priming prompt lands on the common prefix (the later one lies past what any
    other prompt shares: in the priming message's own tokens or the template's tail), where
    it fits in the prompt's length. Failing both,
    or with the head unknown, the whole prompt's own checkpoints: its design rounded down to
    them, the shared part put into the message."""
    message = prompt_tokens - template.tokens
    if rule == "exact-prefix" or rule is None:
        return design_prefix(rule, message, hit_ratio_pct, n_ubatch=n_ubatch)
    requested = message * hit_ratio_pct // 100
    head = template.head_tokens
    window = sliding_window if rule == "checkpoint-swa" else None
    shared = min(requested, message - 1)
    if head is not None and shared > 0:
        common = head + shared
        priming_whole = priming_prompt_tokens(rule, common, prompt_tokens) + n_ubatch
        past_window = window is not None and common > window
        if past_window or priming_whole - template.tokens <= message:
            priming = 0 if past_window else priming_whole - template.tokens
            reused = expected_cached_tokens(
                rule,
                prompt_tokens=prompt_tokens,
                common_prefix=common,
                previous_prompt_tokens=prompt_tokens if past_window else priming_whole,
                n_ubatch=n_ubatch,
                # An unknown window is taken as longer than the prompt, as for /completion.
                sliding_window=window if window is not None else prompt_tokens,
            )
            return PrefixDesign(
                hit_ratio_pct=hit_ratio_pct,
                prompt_tokens=message,
                rule=rule,
                requested_prefix_tokens=requested,
                shared_prefix_tokens=shared,
                reusable_tokens=max(0, reused - template.reused_tokens),
                priming_prompt_tokens=priming,
                reprimed=rule == "checkpoint-swa" and not past_window,
            )
    whole = design_prefix(rule, prompt_tokens, hit_ratio_pct, n_ubatch=n_ubatch)
    fits = whole.shared_prefix_tokens + template.tokens < prompt_tokens - CHECKPOINT_TAIL
    shared = whole.shared_prefix_tokens if fits else 0
    reusable = whole.reusable_tokens if fits and shared else 0
    # Nothing of the message shared: what the head alone reuses (past a short window, say)
    # is the template's, which its calibration measured, not the point's.
    if head is not None and shared:
        reusable = expected_cached_tokens(
            rule,
            prompt_tokens=prompt_tokens,
            common_prefix=head + shared,
            n_ubatch=n_ubatch,
            sliding_window=window,
        )
    return PrefixDesign(
        hit_ratio_pct=hit_ratio_pct,
        prompt_tokens=message,
        rule=rule,
        requested_prefix_tokens=requested,
        shared_prefix_tokens=shared,
        reusable_tokens=max(0, reusable - template.reused_tokens),
    )


def acceptance_band_pp(
    mean_prompt_tokens: float, page_tokens: int = LLAMA_SERVER_PAGE_TOKENS
) -> float:
    """SGLang's tolerance: max(0.5 pp, 100 x page size / mean prompt tokens)."""
    if mean_prompt_tokens <= 0:
        return math.inf
    return max(MIN_BAND_PP, 100.0 * page_tokens / mean_prompt_tokens)


def token_count_mismatches(counts: Sequence[tuple[int, int | None, int | None]]) -> tuple[int, ...]:
    """Positions of the requests, each (position, designed tokens, the server's prompt
    tokens), whose server count is not the designed one; a request without either is not
    judged (not designed to a count, or not answered)."""
    return tuple(
        position
        for position, designed, counted in counts
        if designed is not None and counted is not None and designed != counted
    )


class OverlapVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """A measured overlap point against its design (None figures: nothing was measured)."""

    hit_ratio_pct: int
    designed_ratio_pct: float
    achieved_ratio_pct: float | None
    band_pp: float | None
    measured_requests: int
    accepted: bool
    refusal: str | None = None


def overlap_verdict(
    design: PrefixDesign,
    measured: Sequence[tuple[int, int]],
    *,
    page_tokens: int = LLAMA_SERVER_PAGE_TOKENS,
) -> OverlapVerdict:
    """Judge a point from its measured requests' (prompt tokens, cached tokens), both as the
    server reported them. The control (0 %) is accepted only when nothing was reused."""
    designed = design.designed_ratio_pct
    if not measured:
        return OverlapVerdict(
            hit_ratio_pct=design.hit_ratio_pct,
            designed_ratio_pct=designed,
            achieved_ratio_pct=None,
            band_pp=None,
            measured_requests=0,
            accepted=False,
            refusal="workload.overlap.nothing_measured",
        )
    prompt = sum(p for p, _ in measured)
    cached = sum(c for _, c in measured)
    achieved = 100.0 * cached / prompt if prompt else 0.0
    band = acceptance_band_pp(prompt / len(measured), page_tokens)
    refusal: str | None = None
    if design.hit_ratio_pct == 0:
        if cached:
            refusal = "workload.overlap.control_reused"
    elif abs(achieved - designed) > band:
        refusal = "workload.overlap.outside_band"
    return OverlapVerdict(
        hit_ratio_pct=design.hit_ratio_pct,
        designed_ratio_pct=designed,
        achieved_ratio_pct=achieved,
        band_pp=band,
        measured_requests=len(measured),
        accepted=refusal is None,
        refusal=refusal,
    )
