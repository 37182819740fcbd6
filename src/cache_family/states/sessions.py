"""Pure planning and verdicts of the multi-turn sessions workload: each turn's prompt, its
expected reuse under the server's rule, and evidence before an eviction is claimed.

The expected reuse of a turn is the session's earlier tokens as the rule allows; the first turn
whose reuse falls short is the eviction turn.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import msgspec

from cache_family.schemas.measurement import ReuseRule
from cache_family.schemas.workload import MultiTurn
from cache_family.states.cache_reuse import (
    DEFAULT_N_UBATCH,
    expected_cached_tokens,
)
from cache_family.states.workloads import (
    LLAMA_SERVER_PAGE_TOKENS,
    FreshStarts,
    acceptance_band_pp,
    seeded_random,
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


def turn_reuse(
    rule: ReuseRule,
    previous_prompt_tokens: int,
    answer_tokens: int,
    *,
    sliding_window: int | None = None,
    n_ubatch: int = DEFAULT_N_UBATCH,
) -> int:
    """What a later turn on the session's own slot reuses: the slot holds the previous prompt
    and its answer but the answer's last token (sampled, never evaluated), which plain
    attention and recurrent or hybrid families reuse whole (checked on the zoo's llama and
    qwen3next). A sliding-window family reuses that whole only past its window (the slot
    still holds the window); within it the server restores its checkpoint of the previous
    prompt, ``CHECKPOINT_TAIL`` tokens before its end, less one token (on Gemma 3 270M, window
    512: 107 of a 119-token session). The window unknown (``None``): the whole session, as
    before the window was read."""
    held = previous_prompt_tokens + answer_tokens - 1
    if rule != "checkpoint-swa" or sliding_window is None:
        return held
    return expected_cached_tokens(
        rule,
        prompt_tokens=held + 1,
        common_prefix=held,
        previous_prompt_tokens=previous_prompt_tokens,
        n_ubatch=n_ubatch,
        sliding_window=sliding_window,
    )


def session_plan(
    spec: MultiTurn, rule: ReuseRule | None, *, sliding_window: int | None = None
) -> tuple[SessionTurn, ...]:
    """Every (user, turn) in a seeded interleaving (each user's turns in order), with the
    reuse each turn should get when each user keeps a slot of its own (the request names
    it): ``turn_reuse`` of the previous turn. A first turn lands on a fresh slot: cold.
    Without a rule nothing is expected (hits are not judged)."""
    rng = seeded_random(spec.seed)
    next_turn = [0] * spec.users
    waiting = list(range(spec.users))
    plan: list[SessionTurn] = []
    while waiting:
        user = waiting[rng.randrange(len(waiting))]
        turn = next_turn[user]
        prompt = session_prompt_tokens(spec, turn)
        expected = 0
        if rule is not None and turn > 0:
            expected = turn_reuse(
                rule,
                session_prompt_tokens(spec, turn - 1),
                spec.answer_tokens,
                sliding_window=sliding_window,
            )
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
    rng = seeded_random(spec.seed)

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


def shortfall_turns(
    turns: Sequence[TurnReuse], page_tokens: int = LLAMA_SERVER_PAGE_TOKENS
) -> Iterator[int]:
    """The turn indices after the first whose reuse falls short of the expected by more than
    the acceptance band, in order."""
    for item in turns:
        if item.turn == 0 or not item.requests or not item.prompt_tokens:
            continue
        band = acceptance_band_pp(item.prompt_tokens / item.requests, page_tokens)
        shortfall = 100.0 * (item.expected_reused_tokens - item.achieved_reused_tokens)
        if shortfall / item.prompt_tokens > band:
            yield item.turn


def eviction_turn(
    turns: Sequence[TurnReuse], page_tokens: int = LLAMA_SERVER_PAGE_TOKENS
) -> int | None:
    """The first turn index after the first whose reuse falls short of the expected by more
    than the acceptance band; None if none does. Without the cache's size (journals from
    before it was recorded) every such shortfall was taken for an eviction; with it, see
    ``session_findings``."""
    return next(shortfall_turns(turns, page_tokens), None)


class SessionCapacity(msgspec.Struct, frozen=True, kw_only=True):
    """What the host's cache holds: its slots and each slot's context, in tokens."""

    slots: int
    slot_context_tokens: int


class SessionFindings(msgspec.Struct, frozen=True, kw_only=True):
    """A session workload's reuse, judged: ``eviction_turn`` the first short turn where the
    cache was full (more sessions than slots, or a session past its slot's context), and
    ``shortfall_turn`` the first short turn where it was not (the rule disagrees with the
    server: nothing could have been evicted)."""

    eviction_turn: int | None
    shortfall_turn: int | None


def session_findings(
    turns: Sequence[TurnReuse],
    *,
    users: int,
    capacity: SessionCapacity,
    held_tokens_by_turn: Mapping[int, int],
    page_tokens: int = LLAMA_SERVER_PAGE_TOKENS,
) -> SessionFindings:
    """Short turns split by the evidence of an eviction: ``held_tokens_by_turn`` maps a turn
    index to the longest session a slot held by then (a prompt and its answer)."""
    eviction: int | None = None
    shortfall: int | None = None
    shared_slots = users > capacity.slots
    for turn in shortfall_turns(turns, page_tokens):
        held = held_tokens_by_turn.get(turn, 0)
        if shared_slots or held > capacity.slot_context_tokens:
            eviction = turn if eviction is None else eviction
        else:
            shortfall = turn if shortfall is None else shortfall
    return SessionFindings(eviction_turn=eviction, shortfall_turn=shortfall)
