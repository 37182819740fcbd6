"""Pure planning and verdicts of the cache workloads the workload file chooses."""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import count, islice, pairwise, takewhile
from types import MappingProxyType
from typing import Final, Literal

import msgspec

from cache_family.errors import Refused
from cache_family.schemas.arms import MeasurementKind
from cache_family.schemas.measurement import ReuseRule
from cache_family.schemas.refusal_codes import RefusalCode
from cache_family.schemas.workload import REQUESTS_MAX, MultiTurn, OverSaturation, WorkloadFile
from cache_family.states.cache_reuse import (
    CHECKPOINT_TAIL,
    DEFAULT_N_UBATCH,
    checkpoints,
    expected_cached_tokens,
)
from cache_family.states.chat_pieces import CHAT_ALPHABET, CHAT_PIECES_CODES, PiecesSource
from cache_family.states.metrics import percentile

ArrivalPattern = Literal["constant", "poisson", "gamma"]
SaturationCode = Literal["workload.arrivals.in_flight_growing", "workload.arrivals.sender_late"]

#: The smallest band a point is judged by (percentage points), as in SGLang's benchmark.
MIN_BAND_PP: Final = 0.5
#: The most sends one open-loop rate's schedule holds: the bound preparation checks explicit
#: rates against (a rate x its duration), and the cap of a sweep's measured rates.
SENDS_MAX: Final = REQUESTS_MAX
#: llama-server reuses its prompt cache token by token: its page is one token.
LLAMA_SERVER_PAGE_TOKENS: Final = 1


def _seeded(seed: int) -> random.Random:
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

    @property
    def designed_ratio_pct(self) -> float:
        return 100.0 * self.reusable_tokens / self.prompt_tokens


def design_prefix(
    rule: ReuseRule | None,
    prompt_tokens: int,
    hit_ratio_pct: int,
    *,
    n_ubatch: int = DEFAULT_N_UBATCH,
) -> PrefixDesign:
    """The shared prefix of a ``prompt_tokens`` prompt for a designed hit ratio.

    Every prompt of a group is ``prompt_tokens`` long (the priming one too), so a measured
    request's previous prompt placed its checkpoints at the same marks: the rule's reuse of
    the shared prefix is the same for every request of the point.
    """
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


class PlannedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One request of an overlap point, in send order."""

    position: int
    group: int
    # The request's place in its group (priming requests: -1).
    member: int
    priming: bool


def overlap_order(groups: int, requests: int, seed: int) -> tuple[PlannedRequest, ...]:
    """One priming request per group (group order), then ``requests`` measured ones, N/G per
    group, in an order drawn from ``seed`` (the same seed, the same order)."""
    if groups < 1 or requests < groups or requests % groups:
        raise ValueError("requests must be a positive multiple of groups")
    per_group = requests // groups
    measured = [(group, member) for group in range(groups) for member in range(per_group)]
    _seeded(seed).shuffle(measured)
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
        _seeded(seed).shuffle(self._order)
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
    request's own tokens (its first from ``starts``). Token ids below ``vocabulary_size``."""
    rng = _seeded(seed)
    groups = sorted({request.group for request in order})
    shared = design.shared_prefix_tokens
    prefixes: dict[int, list[int]] = {}
    for group in groups:
        prefixes[group] = (
            [starts.take(), *(rng.randrange(vocabulary_size) for _ in range(shared - 1))]
            if shared
            else []
        )
    own = design.prompt_tokens - shared
    return [
        [
            *prefixes[request.group],
            starts.take(),
            *(rng.randrange(vocabulary_size) for _ in range(own - 1)),
        ]
        for request in order
    ]


# --- prefix overlap in a chat dialect (a stage server: OpenAI chat, text prompts) ---------------

#: The calibration's shorter message, in design ids (the longer one is twice as long).
CHAT_PROBE_CHARACTERS: Final = 16


#: Context room a stage host's slot keeps for the chat template around each message (a
#: capacity, never a length the design relies on: lengths are the server's counts).
CHAT_TEMPLATE_ROOM_PER_MESSAGE: Final = 32


def chat_starts_needed(workloads: WorkloadFile, kind: MeasurementKind) -> int:
    """The distinct first characters a chat-dialect workload draws at most. Overlap: the
    calibration's two messages, then per point a prefix per group and one per request
    (priming ones included); sessions: the system prompt and each user's context."""
    overlap, sessions = workloads.prefix_overlap, workloads.multi_turn
    if kind == MeasurementKind.PREFIX_OVERLAP and overlap is not None:
        return 2 + len(overlap.hit_ratios_pct) * (2 * overlap.groups + overlap.requests)
    if kind == MeasurementKind.SESSIONS and sessions is not None:
        return 1 + sessions.users
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
) -> PrefixDesign:
    """The design of a point whose prompts the server counts ``prompt_tokens`` long, the
    template's tokens included, in the message's terms: ``prompt_tokens`` of the design is the
    message's (the prompt less the template), its prefix and reuse beyond what the template
    alone shares. Plain attention: the message's prefix, as ``design_prefix`` of the message.
    A checkpoint rule reuses a checkpoint of the whole earlier prompt: the whole prompt's
    design, its shared part put into the message (the template's head in front carries the
    common prefix past the checkpoint by the head only, short of the next one)."""
    message = prompt_tokens - template.tokens
    if rule == "exact-prefix" or rule is None:
        return design_prefix(rule, message, hit_ratio_pct, n_ubatch=n_ubatch)
    whole = design_prefix(rule, prompt_tokens, hit_ratio_pct, n_ubatch=n_ubatch)
    fits = whole.shared_prefix_tokens + template.tokens < prompt_tokens - CHECKPOINT_TAIL
    shared = whole.shared_prefix_tokens if fits else 0
    reusable = whole.reusable_tokens if fits else 0
    return PrefixDesign(
        hit_ratio_pct=hit_ratio_pct,
        prompt_tokens=message,
        rule=rule,
        requested_prefix_tokens=message * hit_ratio_pct // 100,
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


# --- multi-turn sessions -----------------------------------------------------------------------


class SessionTurn(msgspec.Struct, frozen=True, kw_only=True):
    """One turn of one user's session, in send order."""

    position: int
    user: int
    turn: int
    prompt_tokens: int
    # Tokens the server should serve from its cache: the session's earlier tokens but the
    # last answer token (sampled, never evaluated); a first turn is cold.
    expected_reused_tokens: int


def session_prompt_tokens(spec: MultiTurn, turn: int) -> int:
    """System prompt + user context + (question + answer) per earlier turn + this question."""
    return (
        spec.system_prompt_tokens
        + spec.user_context_tokens
        + turn * (spec.question_tokens + spec.answer_tokens)
        + spec.question_tokens
    )


def session_plan(spec: MultiTurn, rule: ReuseRule | None) -> tuple[SessionTurn, ...]:
    """Every (user, turn) in a seeded interleaving (each user's turns in order), with the
    reuse each turn should get when each user keeps a slot of its own (the request names
    it): the slot holds the session as the server left it after the last answer, which every
    family, recurrent and hybrid too, reuses whole, less the answer's last token (checked on
    the zoo's llama and qwen3next). A first turn lands on a fresh slot: cold. Without a rule
    nothing is expected (hits are not judged)."""
    rng = _seeded(spec.seed)
    next_turn = [0] * spec.users
    waiting = list(range(spec.users))
    plan: list[SessionTurn] = []
    while waiting:
        user = waiting[rng.randrange(len(waiting))]
        turn = next_turn[user]
        prompt = session_prompt_tokens(spec, turn)
        expected = 0
        if rule is not None and turn > 0:
            expected = session_prompt_tokens(spec, turn - 1) + spec.answer_tokens - 1
        plan.append(
            SessionTurn(
                position=len(plan),
                user=user,
                turn=turn,
                prompt_tokens=prompt,
                expected_reused_tokens=expected,
            )
        )
        next_turn[user] += 1
        if next_turn[user] == spec.turns:
            waiting.remove(user)
    return tuple(plan)


class SessionTokens(msgspec.Struct, frozen=True, kw_only=True):
    """The token ids a session workload sends besides the answers (which the server gives):
    one system prompt for all, one context per user, one question per (user, turn)."""

    system: tuple[int, ...]
    contexts: tuple[tuple[int, ...], ...]
    questions: tuple[tuple[tuple[int, ...], ...], ...]

    def first_prompt(self, user: int) -> list[int]:
        return [*self.system, *self.contexts[user], *self.questions[user][0]]


def session_tokens(spec: MultiTurn, *, vocabulary_size: int, starts: FreshStarts) -> SessionTokens:
    """Seeded token ids; the system prompt and every user context begin with a distinct
    token, so sessions share exactly the system prompt."""
    rng = _seeded(spec.seed)

    def part(length: int, *, fresh: bool) -> tuple[int, ...]:
        if not length:
            return ()
        first = starts.take() if fresh else rng.randrange(vocabulary_size)
        return (first, *(rng.randrange(vocabulary_size) for _ in range(length - 1)))

    return SessionTokens(
        system=part(spec.system_prompt_tokens, fresh=True),
        contexts=tuple(part(spec.user_context_tokens, fresh=True) for _ in range(spec.users)),
        questions=tuple(
            tuple(part(spec.question_tokens, fresh=False) for _ in range(spec.turns))
            for _ in range(spec.users)
        ),
    )


class TurnReuse(msgspec.Struct, frozen=True, kw_only=True):
    """Expected and achieved reuse of one turn index, over every user."""

    turn: int
    requests: int
    prompt_tokens: int
    expected_reused_tokens: int
    achieved_reused_tokens: int


def reuse_by_turn(
    plan: Sequence[SessionTurn], achieved: Mapping[int, tuple[int, int]]
) -> tuple[TurnReuse, ...]:
    """Sum per turn index; ``achieved`` maps a plan position to the server's (prompt tokens,
    cached tokens); positions without an answer are left out of both sides."""
    by_turn: dict[int, list[int]] = {}
    for item in plan:
        found = achieved.get(item.position)
        if found is None:
            continue
        sums = by_turn.setdefault(item.turn, [0, 0, 0, 0])
        sums[0] += 1
        sums[1] += found[0]
        sums[2] += item.expected_reused_tokens
        sums[3] += found[1]
    return tuple(
        TurnReuse(
            turn=turn,
            requests=s[0],
            prompt_tokens=s[1],
            expected_reused_tokens=s[2],
            achieved_reused_tokens=s[3],
        )
        for turn, s in sorted(by_turn.items())
    )


def eviction_turn(
    turns: Sequence[TurnReuse], page_tokens: int = LLAMA_SERVER_PAGE_TOKENS
) -> int | None:
    """The first turn index after the first whose reuse falls short of the expected by more
    than the acceptance band (the server no longer held the sessions); None if none does."""
    for item in turns:
        if item.turn == 0 or not item.requests or not item.prompt_tokens:
            continue
        band = acceptance_band_pp(item.prompt_tokens / item.requests, page_tokens)
        shortfall = 100.0 * (item.expected_reused_tokens - item.achieved_reused_tokens)
        if shortfall / item.prompt_tokens > band:
            return item.turn
    return None


# --- open-loop arrivals ------------------------------------------------------------------------


def _check_rate(pattern: ArrivalPattern, rate: float, burstiness: float | None) -> None:
    if not rate > 0 or not math.isfinite(rate):
        raise ValueError(f"rate {rate} is not a positive finite number")
    if (pattern == "gamma") != (burstiness is not None):
        raise ValueError("burstiness goes with the gamma pattern, and only with it")
    if burstiness is not None and not burstiness > 0:
        raise ValueError(f"burstiness {burstiness} is not positive")


def _gaps(
    pattern: ArrivalPattern, rate: float, burstiness: float | None, seed: int
) -> Iterator[float]:
    _check_rate(pattern, rate, burstiness)
    rng = _seeded(seed)
    while True:
        if pattern == "constant":
            yield 1.0 / rate
        elif pattern == "poisson":
            yield rng.expovariate(rate)
        else:
            assert burstiness is not None
            # vLLM's convention: shape = burstiness, mean 1 / rate.
            yield rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def arrival_times(
    pattern: ArrivalPattern, rate: float, *, seed: int, burstiness: float | None = None
) -> Iterator[float]:
    """Send offsets in seconds from the start, first at 0, ascending, without end: drawn one
    at a time, so what a caller holds is what it took, never duration x rate of them."""
    gaps = _gaps(pattern, rate, burstiness, seed)
    now = 0.0
    for index in count():
        # Constant offsets are i / rate exactly, not a sum that drifts by rounding.
        if index:
            now = index / rate if pattern == "constant" else now + next(gaps)
        yield now


def arrival_schedule(
    pattern: ArrivalPattern,
    rate: float,
    *,
    seed: int,
    requests: int | None = None,
    duration_s: float | None = None,
    burstiness: float | None = None,
) -> tuple[float, ...]:
    """The first ``requests`` of :func:`arrival_times`, or every one before ``duration_s``;
    never more than ``SENDS_MAX`` (a sweep's measured rates are known only at run time;
    preparation refuses explicit rates whose duration would send more). The same arguments
    give the same schedule."""
    if (requests is None) == (duration_s is None):
        raise ValueError("give requests or duration_s")
    _check_rate(pattern, rate, burstiness)
    times = arrival_times(pattern, rate, seed=seed, burstiness=burstiness)
    if duration_s is not None:
        times = takewhile(lambda at: at < duration_s, times)
    return tuple(islice(times, min(requests or SENDS_MAX, SENDS_MAX)))


def inter_arrivals(times: Sequence[float]) -> list[float]:
    return [b - a for a, b in pairwise(times)]


def gap_cdf(
    pattern: ArrivalPattern, rate: float, burstiness: float | None = None
) -> Callable[[float], float]:
    """The distribution function of the inter-arrival times the pattern draws."""
    _check_rate(pattern, rate, burstiness)
    if pattern == "constant":
        gap = 1.0 / rate
        return lambda x: 1.0 if x >= gap else 0.0
    if pattern == "poisson":
        return lambda x: 1.0 - math.exp(-rate * x) if x > 0 else 0.0
    assert burstiness is not None
    shape, scale = burstiness, 1.0 / (rate * burstiness)
    return lambda x: regularized_lower_gamma(shape, x / scale) if x > 0 else 0.0


def regularized_lower_gamma(a: float, x: float) -> float:
    """P(a, x), the gamma distribution function of shape ``a`` at ``x`` (unit scale): the
    series below a + 1, Lentz's continued fraction for the complement above."""
    if x <= 0:
        return 0.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return min(1.0, total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        step = d * c
        h *= step
        if abs(step - 1) < 1e-15:
            break
    return max(0.0, 1.0 - math.exp(log_front) * h)


def ks_statistic(samples: Sequence[float], cdf: Callable[[float], float]) -> float:
    """The Kolmogorov-Smirnov distance between the samples' empirical distribution and
    ``cdf``: the largest gap between the two step-wise, on either side of each sample."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    n = len(ordered)
    return max(max((i + 1) / n - cdf(x), cdf(x) - i / n) for i, x in enumerate(ordered))


def ks_p_value(statistic: float, samples: int) -> float:
    """The asymptotic Kolmogorov probability of a distance this large or larger (with
    Stephens' small-sample correction)."""
    if samples < 1:
        raise ValueError("no samples")
    root = math.sqrt(samples)
    lam = (root + 0.12 + 0.11 / root) * statistic
    if lam < 0.2:
        return 1.0
    total = 0.0
    for k in range(1, 101):
        term = 2 * (-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam)
        total += term
        if abs(term) < 1e-12:
            break
    return min(1.0, max(0.0, total))


class GoodnessOfFit(msgspec.Struct, frozen=True, kw_only=True):
    """How well sent inter-arrival times follow the drawn distribution.

    Constant arrivals have no spread to test against: their figure is the largest gap error
    relative to the target gap, and ``p_value`` is None."""

    statistic: Literal["kolmogorov-smirnov", "max-relative-gap-error"]
    value: float
    samples: int
    p_value: float | None


def goodness_of_fit(
    pattern: ArrivalPattern,
    rate: float,
    send_times: Sequence[float],
    burstiness: float | None = None,
) -> GoodnessOfFit | None:
    """The fit of the times requests were sent; None with fewer than two sends."""
    gaps = inter_arrivals(send_times)
    if not gaps:
        return None
    if pattern == "constant":
        target = 1.0 / rate
        worst = max(abs(gap - target) for gap in gaps) / target
        return GoodnessOfFit(
            statistic="max-relative-gap-error", value=worst, samples=len(gaps), p_value=None
        )
    value = ks_statistic(gaps, gap_cdf(pattern, rate, burstiness))
    return GoodnessOfFit(
        statistic="kolmogorov-smirnov",
        value=value,
        samples=len(gaps),
        p_value=ks_p_value(value, len(gaps)),
    )


class Lateness(msgspec.Struct, frozen=True, kw_only=True):
    """How late sends were against their schedule, in milliseconds (nearest rank below)."""

    sends: int
    p50_ms: float
    p99_ms: float
    max_ms: float


def lateness(scheduled: Sequence[float], sent: Sequence[float]) -> Lateness | None:
    """Per send, its time minus its scheduled time (seconds in, milliseconds out)."""
    if len(scheduled) != len(sent):
        raise ValueError("one send time per scheduled time")
    late = [(s - planned) * 1000 for planned, s in zip(scheduled, sent, strict=True)]
    if not late:
        return None
    p50, p99 = percentile(late, 50), percentile(late, 99)
    assert p50 is not None and p99 is not None
    return Lateness(sends=len(late), p50_ms=p50, p99_ms=p99, max_ms=max(late))


def achieved_rate(send_times: Sequence[float]) -> float | None:
    """Sends per second over the span from the first send to the last (None below two)."""
    if len(send_times) < 2:
        return None
    span = send_times[-1] - send_times[0]
    return (len(send_times) - 1) / span if span > 0 else None


class Saturation(msgspec.Struct, frozen=True, kw_only=True):
    """Why an open-loop rate stopped early, with the evidence."""

    code: SaturationCode
    send_index: int
    in_flight: int
    lateness_ms: float
    detail: str


class SaturationWatch:
    """The over-saturation stop rule, fed one observation per send.

    Saturated when the queue grows without bound: over the last ``window`` sends the mean
    in-flight count rises from each quarter of the window to the next, every count of the
    last quarter is above every count of the first, the count rose by at least
    ``min_growth_per_send`` a send on average (first quarter's mean to last's), and the latest
    count is at least ``min_in_flight``. Quarters, each above the last and apart, so that
    neither a Poisson burst nor the start of a stall the queue recovers from (a jump at the
    end of a flat window) is taken for growth; growth per send, not a ratio, since a queue
    that grows without bound adds the same share of each send however long it already is.
    Only windows sent after the first answer ended are judged: until then every send adds one
    in flight (the ramp to the steady ``rate x latency``), and a server that answers nothing
    is caught by ``max_in_flight``. Also saturated when a send is more than
    ``max_lateness_ms`` behind its schedule (the sender cannot keep the rate)."""

    def __init__(self, rule: OverSaturation) -> None:
        self.rule = rule
        self._in_flight: deque[int] = deque(maxlen=rule.window)
        self._sends = 0
        # Sends observed when the first answer ended (None: none has yet).
        self._first_answer_after: int | None = None

    def __repr__(self) -> str:
        return f"<SaturationWatch sends={self._sends} window={list(self._in_flight)[-4:]}>"

    def answered(self) -> None:
        """A request ended (whatever its status)."""
        if self._first_answer_after is None:
            self._first_answer_after = self._sends

    def observe(self, in_flight: int, lateness_s: float) -> Saturation | None:
        index = self._sends
        self._sends += 1
        self._in_flight.append(in_flight)
        late_ms = lateness_s * 1000
        if late_ms > self.rule.max_lateness_ms:
            return Saturation(
                code="workload.arrivals.sender_late",
                send_index=index,
                in_flight=in_flight,
                lateness_ms=late_ms,
                detail=f"send {index} was {late_ms:.1f} ms late "
                f"(limit {self.rule.max_lateness_ms:g} ms)",
            )
        if in_flight > self.rule.max_in_flight:
            return Saturation(
                code="workload.arrivals.in_flight_growing",
                send_index=index,
                in_flight=in_flight,
                lateness_ms=late_ms,
                detail=f"{in_flight} requests in flight, more than {self.rule.max_in_flight}",
            )
        window = self._in_flight
        ramped = (
            self._first_answer_after is not None
            and self._sends - self.rule.window >= self._first_answer_after
        )
        if not ramped or len(window) < self.rule.window or in_flight < self.rule.min_in_flight:
            return None
        quarter = len(window) // 4
        seen = list(window)[len(window) - 4 * quarter :]
        means = [sum(seen[i * quarter : (i + 1) * quarter]) / quarter for i in range(4)]
        rising = all(b > a for a, b in pairwise(means))
        # Apart, not only on average: the last quarter's fewest above the first quarter's most.
        apart = min(seen[-quarter:]) > max(seen[:quarter])
        # The quarters' centres lie 3 quarters of the window apart.
        per_send = (means[-1] - means[0]) / (3 * quarter)
        if rising and apart and per_send >= self.rule.min_growth_per_send:
            return Saturation(
                code="workload.arrivals.in_flight_growing",
                send_index=index,
                in_flight=in_flight,
                lateness_ms=late_ms,
                detail=f"in flight rose {per_send:.2f} a send over the last {len(seen)} sends "
                "(quarter means " + ", ".join(f"{m:.1f}" for m in means) + f"; now {in_flight})",
            )
        return None


def sweep_rates(synchronous_rate: float, throughput_rate: float, points: int) -> tuple[float, ...]:
    """GuideLLM's sweep: ``points`` rates evenly spaced strictly between the rate measured one
    request at a time and the rate measured as fast as possible (none if there is no room)."""
    if points < 1 or not synchronous_rate < throughput_rate:
        return ()
    step = (throughput_rate - synchronous_rate) / (points + 1)
    return tuple(synchronous_rate + step * (i + 1) for i in range(points))
