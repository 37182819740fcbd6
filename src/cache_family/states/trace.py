"""Pure core of trace replay: a Mooncake-format line checked, a window of requests chosen,
scaled to ``tokens_per_block`` and a time scale, written as token-exact prompts, and each
request's designed reuse (infinite cache, LRU of a token capacity) judged against what the
server reported. The file itself is read by ``system/trace_file.py``."""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

import msgspec

from cache_family.errors import Refused
from cache_family.schemas.refusal_codes import trace_hint
from cache_family.states.workloads import FreshStarts, seeded_random

#: The block size the public Mooncake traces were written with (tokens per hash id).
MOONCAKE_BLOCK_TOKENS: Final = 512
#: A Mooncake line of a 128k-token prompt holds 256 ids (under 2 KiB): 64 KiB is no real line.
TRACE_LINE_MAX_BYTES: Final = 64 * 1024
#: The bundled hour is 3 MB; a day of a busy service fits well under this.
TRACE_FILE_MAX_BYTES: Final = 512 * 1024 * 1024
#: Where a trace's refusals point in the workload file.
TRACE_JSON_PATH: Final = "$.trace"

TraceVerdictCode = Literal["trace.reuse.over_claimed"]


def refuse(code: str, line: int | None, message: str) -> Refused:
    """A trace refusal naming its line (1-based) where there is one."""
    where = f"line {line}: " if line is not None else ""
    return Refused.one(code, TRACE_JSON_PATH, where + message, trace_hint(code))


class _MooncakeLine(msgspec.Struct, frozen=True):
    # Other members (a session id, a model name) are allowed: they are not what is replayed.
    timestamp: int | float
    input_length: int
    output_length: int
    hash_ids: list[int]


_LINE_DECODER: Final = msgspec.json.Decoder(_MooncakeLine)


class TraceRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One request of a trace as written: its line (1-based), its timestamp (ms since the
    trace's first request), its lengths in tokens and its block hash ids."""

    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class MooncakeLines:
    """Checks a Mooncake trace one line at a time, in file order: the line's shape, its
    timestamp against the line before it, and its ``hash_ids`` count against the block
    size the trace was written with. Blank lines are skipped (a file's final newline)."""

    def __init__(self, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> None:
        if block_tokens < 1:
            raise ValueError("a block holds at least one token")
        self.block_tokens = block_tokens
        self._previous_ms: float | None = None

    def __repr__(self) -> str:
        return f"<MooncakeLines block={self.block_tokens} last_ms={self._previous_ms}>"

    def check(self, number: int, raw: bytes) -> TraceRequest | None:
        if len(raw) > TRACE_LINE_MAX_BYTES:
            raise refuse(
                "trace.line.too_long",
                number,
                f"{len(raw)} bytes, more than the {TRACE_LINE_MAX_BYTES}-byte limit",
            )
        if not raw.strip():
            return None
        try:
            found = _LINE_DECODER.decode(raw)
        except msgspec.DecodeError as exc:
            raise refuse("trace.line.malformed", number, str(exc)) from None
        if not math.isfinite(found.timestamp):
            raise refuse("trace.line.malformed", number, "timestamp is not a finite number")
        if found.input_length < 1 or found.output_length < 0:
            raise refuse(
                "trace.line.malformed",
                number,
                f"input_length {found.input_length} (at least 1) or output_length "
                f"{found.output_length} (at least 0) out of range",
            )
        if any(i < 0 for i in found.hash_ids):
            raise refuse("trace.line.malformed", number, "a hash id is negative")
        if found.timestamp < 0:
            raise refuse(
                "trace.timestamp.negative", number, f"timestamp {found.timestamp:g} ms is negative"
            )
        if self._previous_ms is not None and found.timestamp < self._previous_ms:
            raise refuse(
                "trace.timestamp.decreasing",
                number,
                f"timestamp {found.timestamp:g} ms is before the line above's "
                f"{self._previous_ms:g} ms",
            )
        blocks = -(-found.input_length // self.block_tokens)
        if len(found.hash_ids) != blocks:
            raise refuse(
                "trace.hash_ids.count",
                number,
                f"{len(found.hash_ids)} hash ids for input_length {found.input_length}: "
                f"ceil({found.input_length} / {self.block_tokens}) is {blocks}",
            )
        self._previous_ms = float(found.timestamp)
        return TraceRequest(
            line=number,
            timestamp_ms=float(found.timestamp),
            input_length=found.input_length,
            output_length=found.output_length,
            hash_ids=tuple(found.hash_ids),
        )


# --- the window and the scaling ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceWindow:
    """Which requests are replayed: the first ``first`` of the file, or those whose timestamp
    lies in ``from_ms``..<``until_ms`` (both bounds optional)."""

    first: int | None = None
    from_ms: float | None = None
    until_ms: float | None = None

    def __post_init__(self) -> None:
        if self.first is not None and (self.from_ms is not None or self.until_ms is not None):
            raise ValueError("a window is the first requests or a time range, not both")

    def holds(self, taken: int, request: TraceRequest) -> bool:
        if self.first is not None:
            return taken < self.first
        at = request.timestamp_ms
        return (self.from_ms is None or at >= self.from_ms) and (
            self.until_ms is None or at < self.until_ms
        )

    def past(self, taken: int, request: TraceRequest) -> bool:
        """Nothing after this request can be in the window (timestamps never decrease)."""
        if self.first is not None:
            return taken >= self.first
        return self.until_ms is not None and request.timestamp_ms >= self.until_ms


@dataclass(frozen=True, slots=True)
class TraceScaling:
    """How a trace is made to fit a host: each ``block_tokens`` block of a prompt becomes
    ``tokens_per_block`` tokens (a partial last block in proportion, rounded up), replay
    seconds are trace seconds times ``time_scale`` (0.1: ten times faster), and each
    request asks for its ``output_length`` capped at ``output_tokens_cap`` (at least 1)."""

    tokens_per_block: int
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    time_scale: float = 1.0
    output_tokens_cap: int = 16

    def __post_init__(self) -> None:
        if self.tokens_per_block < 1 or self.block_tokens < 1 or self.output_tokens_cap < 1:
            raise ValueError("block sizes and the output cap are at least 1")
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ValueError("the time scale is a positive finite number")

    def block_lengths(self, request: TraceRequest) -> tuple[int, ...]:
        """The scaled tokens of each of the request's blocks, in order."""
        blocks = len(request.hash_ids)
        last = request.input_length - (blocks - 1) * self.block_tokens
        scaled_last = -(-last * self.tokens_per_block // self.block_tokens)
        return (self.tokens_per_block,) * (blocks - 1) + (scaled_last,)

    def prompt_tokens(self, request: TraceRequest) -> int:
        return sum(self.block_lengths(request))

    def output_tokens(self, request: TraceRequest) -> int:
        return max(1, min(request.output_length, self.output_tokens_cap))

    def send_offsets(self, requests: Sequence[TraceRequest]) -> tuple[float, ...]:
        """Each request's send time in seconds from the window's first request."""
        if not requests:
            return ()
        start = requests[0].timestamp_ms
        return tuple((r.timestamp_ms - start) / 1000 * self.time_scale for r in requests)


def check_context(
    requests: Iterable[TraceRequest], scaling: TraceScaling, context_tokens: int
) -> None:
    """Refuse the first request whose scaled prompt and answer do not fit one slot."""
    for request in requests:
        needed = scaling.prompt_tokens(request) + scaling.output_tokens(request)
        if needed > context_tokens:
            raise refuse(
                "trace.length.beyond_context",
                request.line,
                f"{scaling.prompt_tokens(request)} prompt tokens (input_length "
                f"{request.input_length} scaled to {scaling.tokens_per_block} a block) and "
                f"{scaling.output_tokens(request)} answer tokens exceed the host's "
                f"{context_tokens}-token context",
            )


# --- token-exact prompts -------------------------------------------------------------------------


def distinct_ids(requests: Iterable[TraceRequest]) -> int:
    """The distinct hash ids of a window: the first tokens its prompts need, one each."""
    return len({i for r in requests for i in r.hash_ids})


def _seed_of(trace_sha256: str, salt: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{trace_sha256}/{salt}".encode()).digest()[:8], "big")


class TracePrompts:
    """Token ids of a window's prompts: each hash id is one fixed block of ``tokens_per_block``
    ids (the same in every request), a request's prompt its blocks in order with the last cut
    to its scaled length. A block's first id comes from a permutation of the vocabulary seeded
    by the trace's SHA-256, one per distinct hash id in order of first use in the window, so
    distinct ids never share a first token and two prompts share exactly the blocks their ids
    share; the rest of a block is drawn from a seed of the id and the trace's SHA-256."""

    def __init__(
        self,
        requests: Sequence[TraceRequest],
        scaling: TraceScaling,
        *,
        trace_sha256: str,
        vocabulary_size: int,
    ) -> None:
        distinct = distinct_ids(requests)
        if distinct > vocabulary_size:
            raise refuse(
                "trace.vocabulary",
                None,
                f"the window uses {distinct} distinct hash ids, the host's vocabulary gives "
                f"{vocabulary_size} distinct first tokens",
            )
        self.scaling = scaling
        self.trace_sha256 = trace_sha256
        self.vocabulary_size = vocabulary_size
        # What is left of the pool starts anything else sent on the host (a chat template's
        # calibration), so that nothing else shares a first token with a block.
        self.starts = FreshStarts(vocabulary_size, _seed_of(trace_sha256, "first-tokens"))
        self._first: dict[int, int] = {}
        for request in requests:
            for hash_id in request.hash_ids:
                if hash_id not in self._first:
                    self._first[hash_id] = self.starts.take()
        self._blocks: dict[int, tuple[int, ...]] = {}

    @property
    def distinct_ids(self) -> int:
        return len(self._first)

    def __repr__(self) -> str:
        return (
            f"<TracePrompts ids={len(self._first)} B={self.scaling.tokens_per_block} "
            f"vocabulary={self.vocabulary_size}>"
        )

    def block(self, hash_id: int) -> tuple[int, ...]:
        found = self._blocks.get(hash_id)
        if found is None:
            rng = seeded_random(_seed_of(self.trace_sha256, str(hash_id)))
            rest = (
                rng.randrange(self.vocabulary_size) for _ in range(1, self.scaling.tokens_per_block)
            )
            found = self._blocks[hash_id] = (self._first[hash_id], *rest)
        return found

    def draw_blocks(self, requests: Iterable[TraceRequest]) -> None:
        """Draw every block of ``requests`` now (a replay does it before its first send: drawn
        at send time, the blocks of a burst of new prompts made the sender late)."""
        for request in requests:
            for hash_id in request.hash_ids:
                self.block(hash_id)

    def prompt(self, request: TraceRequest) -> list[int]:
        ids: list[int] = []
        for hash_id, length in zip(
            request.hash_ids, self.scaling.block_lengths(request), strict=True
        ):
            ids.extend(self.block(hash_id)[:length])
        return ids


# --- designed reuse ------------------------------------------------------------------------------


class DesignedReuse(msgspec.Struct, frozen=True, kw_only=True):
    """What the trace lets a request reuse of what the replay sent before it, in scaled
    tokens: under an infinite cache, and under an LRU cache of a token capacity (None: no
    capacity declared). ``last_sender``: the earlier request (window index) that last sent
    the deepest block the infinite cache would serve; None when nothing is shared."""

    infinite_tokens: int
    lru_tokens: int | None
    shared_blocks: int
    last_sender: int | None


@dataclass(slots=True)
class _Node:
    # The most tokens of this block any request sent (tokens_per_block once one went past it).
    tokens: int
    last_sender: int


@dataclass(slots=True)
class ReuseLedger:
    """Designed reuse, request by request in send order. A block is a node of the trie of
    leading id sequences: a request reuses the leading blocks an earlier request sent, each
    up to the tokens both sent of it, stopping after the first block either sent only part
    of. The LRU cache holds blocks by node; a request touches its blocks last to first, so a
    prompt's leading blocks are the last to go, as in the paged caches whose tails are freed
    first."""

    lru_capacity_tokens: int | None = None
    _nodes: dict[tuple[int, int], int] = field(default_factory=dict)
    _data: list[_Node] = field(default_factory=list)
    _lru: OrderedDict[int, int] = field(default_factory=OrderedDict)
    _lru_tokens: int = 0

    def _walk(
        self, hash_ids: Sequence[int], lengths: Sequence[int], *, lru: bool
    ) -> tuple[int, int, int | None]:
        parent = -1
        total = blocks = 0
        sender: int | None = None
        for hash_id, own in zip(hash_ids, lengths, strict=True):
            node = self._nodes.get((parent, hash_id))
            if node is None:
                break
            held = self._lru.get(node) if lru else self._data[node].tokens
            if held is None:
                break
            shared = min(own, held)
            total, blocks, sender = total + shared, blocks + 1, self._data[node].last_sender
            # Past a block only when both sent all of it: a partial block ends a prompt.
            if own != held:
                break
            parent = node
        return total, blocks, sender

    def admit(self, index: int, hash_ids: Sequence[int], lengths: Sequence[int]) -> DesignedReuse:
        """The request's designed reuse, then the request itself recorded as sent."""
        infinite, blocks, sender = self._walk(hash_ids, lengths, lru=False)
        lru_tokens: int | None = None
        if self.lru_capacity_tokens is not None:
            lru_tokens = self._walk(hash_ids, lengths, lru=True)[0]
        path: list[tuple[int, int]] = []
        parent = -1
        for hash_id, own in zip(hash_ids, lengths, strict=True):
            node = self._nodes.get((parent, hash_id))
            if node is None:
                node = self._nodes[(parent, hash_id)] = len(self._data)
                self._data.append(_Node(tokens=own, last_sender=index))
            else:
                entry = self._data[node]
                entry.tokens, entry.last_sender = max(entry.tokens, own), index
            path.append((node, own))
            parent = node
        if self.lru_capacity_tokens is not None:
            for node, own in reversed(path):
                held = self._lru.pop(node, 0)
                self._lru[node] = max(held, own)
                self._lru_tokens += self._lru[node] - held
            while self._lru_tokens > self.lru_capacity_tokens and self._lru:
                self._lru_tokens -= self._lru.popitem(last=False)[1]
        return DesignedReuse(
            infinite_tokens=infinite,
            lru_tokens=lru_tokens,
            shared_blocks=blocks,
            last_sender=sender,
        )


def designed_reuse(
    requests: Sequence[TraceRequest],
    scaling: TraceScaling,
    lru_capacity_tokens: int | None = None,
) -> tuple[DesignedReuse, ...]:
    """Every request's designed reuse, in window order."""
    ledger = ReuseLedger(lru_capacity_tokens)
    return tuple(
        ledger.admit(index, r.hash_ids, scaling.block_lengths(r))
        for index, r in enumerate(requests)
    )


def reachable_reuse(
    requests: Sequence[TraceRequest],
    scaling: TraceScaling,
    sent_s: Sequence[float | None],
    answered_s: Sequence[float | None],
) -> tuple[int | None, ...]:
    """The most each answered request could have reused (an infinite cache) of the other
    requests the server may have taken before it: every one sent before it was answered.
    Requests due together are sent at once and may reach the server in any order, so a
    request can reuse what the trace designed a later one to send first; a claim is an
    over-claim only beyond this too. None: not sent or not answered."""
    order = sorted((s, i) for i, s in enumerate(sent_s) if s is not None)
    queries = sorted((a, i) for i, a in enumerate(answered_s) if a is not None)
    nodes: dict[tuple[int, int], int] = {}
    # Each block node's tokens as each request sent it: a request must not reuse its own.
    held_by: list[dict[int, int]] = []
    reachable: list[int | None] = [None] * len(requests)
    admitted = 0
    for answered, index in queries:
        while admitted < len(order) and order[admitted][0] < answered:
            sender = order[admitted][1]
            request, parent = requests[sender], -1
            for hash_id, own in zip(request.hash_ids, scaling.block_lengths(request), strict=True):
                node = nodes.setdefault((parent, hash_id), len(held_by))
                if node == len(held_by):
                    held_by.append({})
                held_by[node][sender] = own
                parent = node
            admitted += 1
        request, parent, total = requests[index], -1, 0
        for hash_id, own in zip(request.hash_ids, scaling.block_lengths(request), strict=True):
            found = nodes.get((parent, hash_id))
            others = () if found is None else (t for s, t in held_by[found].items() if s != index)
            held = max(others, default=None)
            if found is None or held is None:
                break
            total += min(own, held)
            if own != held:  # past a block only when both sent all of it, as the design
                break
            parent = found
        reachable[index] = total
    return tuple(reachable)


# --- the per-request verdict ---------------------------------------------------------------------


class TraceRequestVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """A request's achieved reuse against its design. ``efficiency``: achieved / designed
    (infinite cache), None when nothing was designed or nothing measured. ``lost``: the
    server reused less than designed by more than its granularity. ``code``: the server
    claimed more than the trace designed plus its granularity (a cross-request match the
    trace did not design, or a counting defect)."""

    efficiency: float | None
    lost: bool
    code: TraceVerdictCode | None = None


def request_verdict(
    designed: DesignedReuse,
    achieved: int | None,
    granularity_tokens: int,
    reachable_tokens: int | None = None,
) -> TraceRequestVerdict:
    """``reachable_tokens``: what the requests sent before it was answered could have left
    (``reachable_reuse``); a claim above the design within it is no over-claim."""
    if achieved is None:
        return TraceRequestVerdict(efficiency=None, lost=False)
    target = designed.infinite_tokens
    efficiency = achieved / target if target else None
    ceiling = max(target, reachable_tokens or 0)
    if achieved > ceiling + granularity_tokens:
        return TraceRequestVerdict(
            efficiency=efficiency, lost=False, code="trace.reuse.over_claimed"
        )
    return TraceRequestVerdict(efficiency=efficiency, lost=achieved + granularity_tokens < target)


def total_efficiency(pairs: Iterable[tuple[int, int | None]]) -> float | None:
    """Achieved over designed tokens of the measured requests, each (designed, achieved)."""
    designed = achieved = 0
    for design, got in pairs:
        if got is not None:
            designed, achieved = designed + design, achieved + got
    return achieved / designed if designed else None


def read_mooncake(
    lines: Iterable[tuple[int, bytes]],
    window: TraceWindow,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """The window's requests of a Mooncake trace given as ``(line number, bytes)``, in file
    order. Every line is checked, also past the window: a trace is refused or replayed
    whole, whichever part a run takes of it."""
    checker = MooncakeLines(block_tokens)
    taken: list[TraceRequest] = []
    closed = False
    for number, raw in lines:
        request = checker.check(number, raw)
        if request is None or closed:
            continue
        if window.past(len(taken), request):
            closed = True
        elif window.holds(len(taken), request):
            taken.append(request)
    if not taken:
        raise refuse("trace.window.empty", None, f"no request of the trace lies in {window}")
    return taken


__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "TRACE_FILE_MAX_BYTES",
    "TRACE_LINE_MAX_BYTES",
    "DesignedReuse",
    "MooncakeLines",
    "ReuseLedger",
    "TracePrompts",
    "TraceRequest",
    "TraceRequestVerdict",
    "TraceScaling",
    "TraceWindow",
    "check_context",
    "designed_reuse",
    "distinct_ids",
    "read_mooncake",
    "request_verdict",
    "total_efficiency",
]
