"""How much of a prompt llama-server should serve from its cache, and each rung's verdict.

Rules (``../spec/llama-cpp-facts.md``): ``exact-prefix`` reuses the whole common prefix but
always evaluates at least one token; ``checkpoint`` (recurrent, hybrid) restores the last
context checkpoint inside the common prefix (taken at ``n - 4 - n_ubatch`` and ``n - 4``);
``checkpoint-swa`` the same, one token fewer. A slot's first request of a cell expects 0; a RAM
cache hit on it still counts.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Final

import msgspec

from cache_family.schemas.measurement import CacheExpectation, CacheTally, RequestRow, ReuseRule
from cache_family.schemas.receipts import CacheVerdict

#: llama-server's default ``-ub`` (the cell never passes one).
DEFAULT_N_UBATCH: Final = 512
#: The server checkpoints this many tokens before a prompt's end (and n_ubatch more).
CHECKPOINT_TAIL: Final = 4

# llama.cpp ``general.architecture`` names, by how the server reuses their prompt cache.
PLAIN_ATTENTION: Final = frozenset(
    {
        "llama",
        "qwen2",
        "qwen2moe",
        "qwen3",
        "qwen3moe",
        "deepseek2",
        "glm4",
        "glm4moe",
        "olmo",
        "olmo2",
        "olmoe",
        "minimax-m2",
        "gemma",
        "granite",
        "starcoder2",
        "stablelm",
        "phi2",
    }
)
SLIDING_WINDOW: Final = frozenset({"gemma2", "gemma3", "gemma3n", "gemma4", "cohere2", "gpt-oss"})
RECURRENT_OR_HYBRID: Final = frozenset(
    {
        "mamba",
        "mamba2",
        "rwkv6",
        "rwkv6qwen2",
        "rwkv7",
        "arwkv7",
        "jamba",
        "falcon-h1",
        "granitehybrid",
        "lfm2",
        "plamo2",
        "nemotron_h",
        "qwen3next",
    }
)


def reuse_rule(architecture: str | None) -> ReuseRule | None:
    """The rule for a GGUF ``general.architecture``; None for one the table does not know."""
    if architecture in PLAIN_ATTENTION:
        return "exact-prefix"
    if architecture in RECURRENT_OR_HYBRID:
        return "checkpoint"
    if architecture in SLIDING_WINDOW:
        return "checkpoint-swa"
    return None


def cache_expectation(
    architecture: str | None, lanes: int | None, sliding_window: int | None = None
) -> CacheExpectation:
    """What a cell serving this architecture on ``lanes`` slots journals when it opens
    (``sliding_window``: the model header's, for a sliding-window family)."""
    rule = reuse_rule(architecture)
    return CacheExpectation(
        architecture=architecture,
        rule=rule,
        n_ubatch=DEFAULT_N_UBATCH,
        lanes=lanes,
        sliding_window=sliding_window if rule == "checkpoint-swa" else None,
    )


def block_expectation(block_size: int, lanes: int | None) -> CacheExpectation:
    """What a cell of a block-reusing server journals when it opens: its declared block size,
    whatever the model's architecture (the server's own cache decides, not llama.cpp's)."""
    return CacheExpectation(
        architecture=None,
        rule="block",
        n_ubatch=DEFAULT_N_UBATCH,
        lanes=lanes,
        block_size=block_size,
    )


def checkpoints(prompt_tokens: int, n_ubatch: int = DEFAULT_N_UBATCH) -> tuple[int, ...]:
    """Token counts at which the server checkpoints a prompt of ``prompt_tokens``, ascending."""
    marks = (prompt_tokens - CHECKPOINT_TAIL - n_ubatch, prompt_tokens - CHECKPOINT_TAIL)
    return tuple(mark for mark in marks if mark > 0)


def expected_cached_tokens(
    rule: ReuseRule,
    *,
    prompt_tokens: int,
    common_prefix: int,
    previous_prompt_tokens: int | None = None,
    n_ubatch: int = DEFAULT_N_UBATCH,
    sliding_window: int | None = None,
    block_size: int | None = None,
) -> int:
    """Cached tokens a warm request should get: ``prompt_tokens`` long, sharing
    ``common_prefix`` tokens with the slot's previous prompt (``previous_prompt_tokens`` long,
    which placed the checkpoints; default: the same prompt again).

    With the model's ``sliding_window`` known, a sliding-window family follows llama-server
    to the token: a slot still holding the window of its last prompt (a common prefix past
    the window) reuses the prefix itself, as plain attention does; within the window the
    server restores a checkpoint, which it may use as long as the checkpoint's last position
    lies inside the common prefix (a checkpoint taken after ``n`` tokens ends at position
    ``n - 1``), and resumes one token before it. Without the window the older, cautious rule
    (a checkpoint inside the prefix, less one token) judges, as runs journaled before it did.
    A block server reuses the whole ``block_size`` blocks of that usable prefix.
    """
    usable = max(min(common_prefix, prompt_tokens - 1), 0)
    if rule == "exact-prefix":
        return usable
    if rule == "block":
        # Whole blocks of the usable prefix; a server without a declared size promises none.
        return usable - usable % block_size if block_size else 0
    window_known = rule == "checkpoint-swa" and sliding_window is not None
    if window_known and usable > (sliding_window or 0):
        return usable
    previous = prompt_tokens if previous_prompt_tokens is None else previous_prompt_tokens
    reach = usable + 1 if window_known else usable
    inside = [mark for mark in checkpoints(previous, n_ubatch) if mark <= reach]
    if not inside:
        return 0
    return inside[-1] - 1 if rule == "checkpoint-swa" else inside[-1]


def priming_prompt_tokens(rule: ReuseRule, shared_prefix: int, prompt_tokens: int) -> int:
    """How long a group's priming prompt is cut so that the server's checkpoint of it lands
    on the ``shared_prefix`` its measured prompts then share (llama-server checkpoints a
    prompt ``CHECKPOINT_TAIL`` tokens before its end). A recurrent checkpoint is usable up to
    its own end: the prefix plus the tail. A sliding-window one resumes a token before the
    checkpoint: one token more. Plain attention reuses any prefix: the prompt's own length."""
    if rule == "exact-prefix" or shared_prefix <= 0:
        return prompt_tokens
    return shared_prefix + CHECKPOINT_TAIL + (1 if rule == "checkpoint-swa" else 0)


def rule_text(expectation: CacheExpectation) -> str:
    """What the receipt says the verdict was judged by."""
    arch = expectation.architecture or "unknown"
    if expectation.rule is None:
        return f"no reuse rule for architecture {arch}: hits not judged"
    if expectation.rule == "exact-prefix":
        how = "plain attention: the common prefix, all but the last prompt token"
    elif expectation.rule == "block":
        how = (
            f"the server's blocks of {expectation.block_size} tokens: the whole blocks of the "
            "common prefix, all but the last prompt token"
        )
    elif expectation.sliding_window is not None:
        how = (
            f"sliding-window of {expectation.sliding_window} tokens (the model header's): a "
            "common prefix past the window whole, all but the last prompt token; within it "
            f"the last context checkpoint (len-{CHECKPOINT_TAIL}-n_ubatch, len-{CHECKPOINT_TAIL}; "
            f"n_ubatch {expectation.n_ubatch}) ending inside the common prefix, less one token"
        )
    else:
        kind = "sliding-window" if expectation.rule == "checkpoint-swa" else "recurrent/hybrid"
        how = (
            f"{kind}: the last context checkpoint (len-{CHECKPOINT_TAIL}-n_ubatch, "
            f"len-{CHECKPOINT_TAIL}; n_ubatch {expectation.n_ubatch}, llama-server's default) "
            "inside the common prefix"
        )
        if expectation.rule == "checkpoint-swa":
            how += ", less one token"
    return f"{expectation.rule} ({arch}, {how}); a slot's first request is cold"


def accounting(row: RequestRow) -> tuple[int, int, int | None] | None:
    """(prompt tokens, cached tokens, slot) the server reported for a completed request."""
    if row.status != "completed":
        return None
    timings = row.timings
    prompt = row.prompt_tokens if row.prompt_tokens is not None else row.tokens_evaluated
    cached = row.cached_tokens
    if cached is None and timings is not None:
        cached = timings.cache_n
    if prompt is None or cached is None:
        return None
    return prompt, cached, row.slot_id


def rung_verdicts(
    expectation: CacheExpectation, rungs: Sequence[Sequence[RequestRow]]
) -> list[CacheVerdict]:
    """One verdict per rung of one cell, rungs in ladder order, from their rows."""
    tallies = []
    for rows in rungs:
        tally = CacheTallier(expectation)
        for row in rows:
            tally.add(row)
        tallies.append(tally.tally())
    return verdicts_of_tallies(expectation, tallies)


class CacheTallier:
    """A rung's ``CacheTally``, one row at a time (the rows are never kept): the count of
    judged requests and hits, the lowest expectation, and per slot the two lowest cached
    counts (a new slot's lowest is its cold request; the next is its lowest warm one)."""

    def __init__(self, expectation: CacheExpectation | None) -> None:
        self.rule = expectation.rule if expectation is not None else None
        self.n_ubatch = expectation.n_ubatch if expectation is not None else DEFAULT_N_UBATCH
        self.sliding_window = expectation.sliding_window if expectation is not None else None
        block = expectation.block_size if expectation is not None else msgspec.UNSET
        self.block_size = block if isinstance(block, int) else None
        self.keep = (expectation.lanes or 0) + 1 if expectation is not None else 1
        self.seen = self.hits = 0
        self.expected_min: int | None = None
        self.slotted = True
        self.slots: dict[int, list[int]] = {}
        self.lowest: list[int] = []

    def add(self, row: RequestRow) -> None:
        found = accounting(row)
        if found is None or self.rule is None:
            return
        prompt, cached, slot = found
        expected = expected_cached_tokens(
            self.rule,
            prompt_tokens=prompt,
            common_prefix=prompt,
            n_ubatch=self.n_ubatch,
            sliding_window=self.sliding_window,
            block_size=self.block_size,
        )
        self.seen += 1
        self.hits += cached >= expected
        if self.expected_min is None or expected < self.expected_min:
            self.expected_min = expected
        if slot is None:
            self.slotted = False
        else:
            self.slots[slot] = _two_lowest(self.slots.get(slot, []), cached)
        if len(self.lowest) < self.keep or cached < self.lowest[-1]:
            bisect.insort(self.lowest, cached)
            del self.lowest[self.keep :]

    def tally(self) -> CacheTally | None:
        """None without a reuse rule (hits are not judged)."""
        if self.rule is None:
            return None
        return CacheTally(
            seen=self.seen,
            hits=self.hits,
            expected_min=self.expected_min,
            slotted=self.slotted,
            slots=tuple(
                (slot, lows[0], lows[1] if len(lows) > 1 else None)
                for slot, lows in sorted(self.slots.items())
            ),
            lowest=tuple(self.lowest),
        )


def _two_lowest(lows: list[int], value: int) -> list[int]:
    return sorted([*lows, value])[:2]


def verdicts_of_tallies(
    expectation: CacheExpectation, tallies: Sequence[CacheTally | None]
) -> list[CacheVerdict]:
    """One verdict per rung of one cell, rungs in ladder order (slots stay warm across rungs).

    Every request of a cell sends the same prompt, so its designed shared prefix is all of it.
    Per slot the cell has not used before, the request with the fewest cached tokens is taken
    as that slot's cold one; without slot ids, the first ``lanes`` requests of the cell may
    be cold (and without lanes either, hits are not judged).
    """
    text = rule_text(expectation)
    used: set[int] = set()
    cold_left = expectation.lanes
    verdicts: list[CacheVerdict] = []
    for tally in tallies:
        if expectation.rule is None or tally is None or not tally.seen:
            verdicts.append(CacheVerdict(rule=text))
            continue
        warm_lows: list[int | None]
        if tally.slotted:
            warm_lows = []
            cold = 0
            for slot, lowest, second in tally.slots:
                if slot in used:
                    warm_lows.append(lowest)
                else:
                    used.add(slot)
                    cold += 1
                    warm_lows.append(second)
        elif cold_left is not None:
            cold = min(cold_left, tally.seen)
            cold_left -= cold
            warm_lows = [tally.lowest[cold] if cold < tally.seen else None]
        else:
            verdicts.append(CacheVerdict(rule=text))
            continue
        expected_hits = tally.seen - cold
        verdicts.append(
            CacheVerdict(
                expected_hits=expected_hits,
                observed_hits=tally.hits,
                expected_cached_tokens=tally.expected_min,
                observed_cached_tokens_min=min(
                    (low for low in warm_lows if low is not None), default=None
                ),
                shortfall=tally.hits < expected_hits,
                rule=text,
            )
        )
    return verdicts


# --- the reuse probe: the header's rule, checked against the server ----------------------------

#: Every rule a probe may find the server following, the header's first.
PROBE_RULES: Final[tuple[ReuseRule, ...]] = ("exact-prefix", "checkpoint-swa", "checkpoint")


class ProbeShape(msgspec.Struct, frozen=True, kw_only=True):
    """One probe request on one slot: its length, the slot's previous prompt's, and what the
    two share (the request's tokens are drawn fresh besides)."""

    prompt_tokens: int
    previous_prompt_tokens: int
    common_prefix: int


def probe_shapes(rule: ReuseRule, prompt_tokens: int) -> tuple[ProbeShape, ...]:
    """A cell's probe at its own prompt length ``n``: a cold prompt; the same prompt again
    (what a ladder's warm request gets: the families differ here, and a sliding window within
    or past ``n``); a priming prompt sharing nothing, cut as ``rule``'s overlap designs cut it
    for half of ``n``; and a prompt sharing that half (what an overlap point relies on)."""
    half = prompt_tokens // 2
    priming = priming_prompt_tokens(rule, half, prompt_tokens)
    return (
        ProbeShape(prompt_tokens=prompt_tokens, previous_prompt_tokens=0, common_prefix=0),
        ProbeShape(
            prompt_tokens=prompt_tokens,
            previous_prompt_tokens=prompt_tokens,
            common_prefix=prompt_tokens,
        ),
        ProbeShape(prompt_tokens=priming, previous_prompt_tokens=prompt_tokens, common_prefix=0),
        ProbeShape(prompt_tokens=prompt_tokens, previous_prompt_tokens=priming, common_prefix=half),
    )


def probe_prompts(
    shapes: Sequence[ProbeShape], fresh: Callable[[int], list[int]]
) -> list[list[int]]:
    """The token ids of ``probe_shapes``' requests, from ``fresh(n)``: ``n`` ids starting with
    one no other prompt starts with. The cold prompt goes twice; the last two share a prefix."""
    cold, _, priming, shared = shapes
    first = fresh(cold.prompt_tokens)
    prefix = fresh(shared.common_prefix)
    return [
        first,
        first,
        [*prefix, *fresh(priming.prompt_tokens - len(prefix))],
        [*prefix, *fresh(shared.prompt_tokens - len(prefix))],
    ]


def probe_expected(
    rule: ReuseRule, shape: ProbeShape, *, n_ubatch: int, sliding_window: int | None
) -> int:
    """What ``rule`` expects the server to reuse of one probe request."""
    return expected_cached_tokens(
        rule,
        prompt_tokens=shape.prompt_tokens,
        common_prefix=shape.common_prefix,
        previous_prompt_tokens=shape.previous_prompt_tokens or shape.prompt_tokens,
        n_ubatch=n_ubatch,
        sliding_window=sliding_window,
    )


def probed_rule(
    header_rule: ReuseRule | None,
    observed: Sequence[tuple[ProbeShape, int | None]],
    *,
    n_ubatch: int = DEFAULT_N_UBATCH,
    sliding_window: int | None = None,
) -> ReuseRule | None:
    """The rule a cell's verdicts use: the header's when the server reused exactly what it
    expects at every probe request, else the first other rule that does, else None (the
    server follows no known rule). A probe with a failed request (None) checks nothing: the
    header's rule stands."""
    if header_rule is None or any(cached is None for _, cached in observed):
        return header_rule
    for rule in (header_rule, *(r for r in PROBE_RULES if r != header_rule)):
        window = sliding_window if rule == "checkpoint-swa" else None
        if all(
            cached == probe_expected(rule, shape, n_ubatch=n_ubatch, sliding_window=window)
            for shape, cached in observed
        ):
            return rule
    return None
