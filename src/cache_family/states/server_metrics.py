"""A host's Prometheus counters: parsed, differenced, and read as prompt and cached tokens.

Pure: the text comes from ``actors/run/server_metrics.py``. The exposition is parsed by
``prometheus_client``'s text parser; only counter samples are kept (a gauge says nothing of
an interval). Which counters mean what is ``SERVER_COUNTERS``, one entry per server kind,
recognised by the counters its exposition names: a kind not recognised gets no totals.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from prometheus_client.parser import text_string_to_metric_families

from cache_family.errors import Refused
from cache_family.schemas.journal import ServerMetricsRead
from cache_family.schemas.measurement import RequestRow
from cache_family.schemas.refusal_codes import server_metrics_hint
from cache_family.schemas.server_metrics import (
    METRICS_NONE,
    METRICS_READ,
    METRICS_REFUSED,
    CounterDelta,
    MetricsStatus,
    ServerMetricsVerdict,
    ServerTokenTotals,
    TokenSums,
)
from cache_family.schemas.workload_records import WorkloadRequest

#: An exposition larger than this is refused, unparsed (a llama-server's is about 3 KiB).
EXPOSITION_MAX_BYTES: Final = 1024 * 1024
#: Counter samples kept of one exposition; more is refused (the journal keeps every delta).
COUNTER_SAMPLES_MAX: Final = 512

# (name, sorted labels) -> value: one exposition's counter samples.
Counters = Mapping[tuple[str, tuple[tuple[str, str], ...]], float]


def refused(code: str, message: str) -> Refused:
    return Refused.one(code, "$.metrics", message, server_metrics_hint(code))


def parse_counters(data: bytes) -> Counters:
    """Every counter sample of a Prometheus text exposition (``_created`` timestamps left
    out), refused ``server_metrics.oversized`` or ``server_metrics.malformed``."""
    if len(data) > EXPOSITION_MAX_BYTES:
        raise refused(
            "server_metrics.oversized",
            f"the exposition is {len(data)} bytes, over the cap of {EXPOSITION_MAX_BYTES}",
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise refused("server_metrics.malformed", f"the exposition is not UTF-8: {exc}") from None
    try:
        # The parser is lazy: its errors (naming the line it could not read) come as it goes.
        samples = [
            (sample.name, tuple(sorted(sample.labels.items())), float(sample.value))
            for family in text_string_to_metric_families(text)
            if family.type == "counter"
            for sample in family.samples
            if not sample.name.endswith("_created")
        ]
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise refused("server_metrics.malformed", f"the exposition does not parse: {exc}") from None
    if len(samples) > COUNTER_SAMPLES_MAX:
        raise refused(
            "server_metrics.oversized",
            f"the exposition holds {len(samples)} counter samples, over {COUNTER_SAMPLES_MAX}",
        )
    counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for name, labels, value in samples:
        key = (name, labels)
        if key in counters:
            raise refused("server_metrics.malformed", f"counter {_show(key)} is given twice")
        if not math.isfinite(value) or value < 0:
            raise refused("server_metrics.malformed", f"counter {_show(key)} is {value!r}")
        counters[key] = value
    return counters


def counter_deltas(before: Counters, after: Counters) -> tuple[CounterDelta, ...]:
    """Each counter's growth from ``before`` to ``after``, sorted by name and labels; a
    sample first seen after grew from 0. Refused ``server_metrics.counter_reset`` when one
    went down or vanished (the host restarted or reset its metrics)."""
    for key, value in before.items():
        if key not in after:
            raise refused("server_metrics.counter_reset", f"counter {_show(key)} vanished")
        if after[key] < value:
            raise refused(
                "server_metrics.counter_reset",
                f"counter {_show(key)} went down from {value:g} to {after[key]:g}",
            )
    return tuple(
        CounterDelta(
            name=name, labels=labels, delta=after[(name, labels)] - before.get((name, labels), 0.0)
        )
        for name, labels in sorted(after)
    )


def _show(key: tuple[str, tuple[tuple[str, str], ...]]) -> str:
    name, labels = key
    inner = ",".join(f'{k}="{v}"' for k, v in labels)
    return f"{name}{{{inner}}}" if inner else name


# --- what the counters mean -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServerCounters:
    """Which counters of one server kind hold its token figures (summed over their labels).

    ``prompt``: every counter whose sum is the prompt tokens the server counted, cached ones
    included (llama.cpp counts the ones it processed and the cached ones apart). A figure
    whose counters are not all in the exposition is None: nothing is guessed."""

    server: str
    # Counters only this server kind exposes: how its exposition is recognised.
    recognised_by: str
    prompt: tuple[str, ...]
    cached: tuple[str, ...]
    predicted: tuple[str, ...]
    # The label that splits the cached tokens by where they came from, if any.
    cached_source_label: str | None = None


#: The counters of each server kind. llama.cpp: read from the project's own ``llama-server
#: --metrics`` (``docs/server-metrics.md``); vLLM and SGLang: their documented names.
SERVER_COUNTERS: Final[tuple[ServerCounters, ...]] = (
    ServerCounters(
        server="llama.cpp",
        recognised_by="llamacpp:prompt_tokens_total",
        prompt=("llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total"),
        cached=("llamacpp:prompt_tokens_cached_total",),
        predicted=("llamacpp:tokens_predicted_total",),
    ),
    ServerCounters(
        server="vllm",
        recognised_by="vllm:prefix_cache_queries_total",
        prompt=("vllm:prefix_cache_queries_total",),
        cached=("vllm:prefix_cache_hits_total",),
        predicted=("vllm:generation_tokens_total",),
    ),
    ServerCounters(
        server="sglang",
        recognised_by="sglang:prompt_tokens_total",
        prompt=("sglang:prompt_tokens_total",),
        cached=("sglang:cached_tokens_total",),
        predicted=("sglang:generation_tokens_total",),
        cached_source_label="cache_source",
    ),
)


def server_kind(deltas: Iterable[CounterDelta]) -> ServerCounters | None:
    """The server kind whose counters the deltas hold; None when none is recognised."""
    names = {delta.name for delta in deltas}
    for kind in SERVER_COUNTERS:
        if kind.recognised_by in names:
            return kind
    return None


def token_totals(deltas: tuple[CounterDelta, ...]) -> ServerTokenTotals | None:
    """The server's own token figures over the interval; None when no server kind is
    recognised by its counters."""
    kind = server_kind(deltas)
    if kind is None:
        return None
    sums: dict[str, float] = {}
    for delta in deltas:
        sums[delta.name] = sums.get(delta.name, 0.0) + delta.delta

    def total(names: tuple[str, ...]) -> int | None:
        if not all(name in sums for name in names):
            return None
        return round(math.fsum(sums[name] for name in names))

    by_source: dict[str, float] = {}
    if kind.cached_source_label is not None:
        for delta in deltas:
            if delta.name in kind.cached:
                source = dict(delta.labels).get(kind.cached_source_label, "")
                by_source[source] = by_source.get(source, 0.0) + delta.delta
    used = (*kind.prompt, *kind.cached, *kind.predicted)
    return ServerTokenTotals(
        server=kind.server,
        prompt_tokens=total(kind.prompt),
        cached_tokens=total(kind.cached),
        predicted_tokens=total(kind.predicted),
        cached_by_source=tuple(sorted((k, round(v)) for k, v in by_source.items())),
        counters=tuple(name for name in dict.fromkeys(used) if name in sums),
    )


# --- the client's side ------------------------------------------------------------------------


class TokenSummer:
    """The client's sum of the server's per-request figures, one request at a time."""

    def __init__(self) -> None:
        self.accounted = self.unaccounted = self.prompt = self.cached = 0
        self.predicted: int | None = 0

    def add(
        self,
        *,
        reached_server: bool,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        predicted_tokens: int | None,
    ) -> None:
        if not reached_server:
            return
        if prompt_tokens is None:
            self.unaccounted += 1
            return
        self.accounted += 1
        self.prompt += prompt_tokens
        self.cached += cached_tokens or 0
        if predicted_tokens is None or self.predicted is None:
            self.predicted = None
        else:
            self.predicted += predicted_tokens

    def add_row(self, row: RequestRow) -> None:
        self.add(
            reached_server=row.status != "not-launched",
            prompt_tokens=row.prompt_tokens,
            cached_tokens=row.cached_tokens,
            predicted_tokens=row.tokens_predicted,
        )

    def add_requests(self, requests: Iterable[WorkloadRequest]) -> None:
        """A workload point's requests (their generated tokens are not kept: not summed)."""
        for request in requests:
            self.add(
                reached_server=True,
                prompt_tokens=request.prompt_tokens,
                cached_tokens=request.cached_tokens,
                predicted_tokens=None,
            )

    def sums(self) -> TokenSums:
        return TokenSums(
            accounted=self.accounted,
            unaccounted=self.unaccounted,
            prompt_tokens=self.prompt,
            cached_tokens=self.cached,
            predicted_tokens=self.predicted if self.accounted else None,
        )


# --- the verdict ------------------------------------------------------------------------------


def metrics_verdict(
    status: str,
    *,
    reason: str | None,
    refusal_code: str | None,
    counters: tuple[CounterDelta, ...],
    client: TokenSums | None,
) -> ServerMetricsVerdict:
    """A receipt's server metrics from one ``server_metrics`` record: the server's totals
    beside the client's sums, and whether they agree. ``incomparable`` when either side
    lacks the figures, or requests reached the server without reporting their accounting."""
    if status != METRICS_READ:
        known: MetricsStatus = METRICS_NONE if status == METRICS_NONE else METRICS_REFUSED
        return ServerMetricsVerdict(
            status=known, reason=reason, refusal_code=refusal_code, client=client
        )
    server = token_totals(counters)
    if server is None:
        return ServerMetricsVerdict(
            status=METRICS_READ,
            reason="no known server's token counters in the exposition",
            client=client,
            agreement="incomparable",
        )
    if client is None or client.unaccounted:
        return ServerMetricsVerdict(
            status=METRICS_READ, server=server, client=client, agreement="incomparable"
        )
    pairs = (
        ("prompt_tokens", server.prompt_tokens, client.prompt_tokens),
        ("cached_tokens", server.cached_tokens, client.cached_tokens),
        ("predicted_tokens", server.predicted_tokens, client.predicted_tokens),
    )
    compared = [(name, ours, theirs) for name, ours, theirs in pairs if None not in (ours, theirs)]
    disagreeing = tuple(name for name, ours, theirs in compared if ours != theirs)
    return ServerMetricsVerdict(
        status=METRICS_READ,
        server=server,
        client=client,
        agreement="disagrees" if disagreeing else "agrees" if compared else "incomparable",
        disagreeing=disagreeing,
    )


def verdict_of(record: ServerMetricsRead) -> ServerMetricsVerdict:
    """The receipt's server metrics of one journaled read."""
    return metrics_verdict(
        record.status,
        reason=record.reason,
        refusal_code=record.refusal_code,
        counters=record.counters,
        client=record.client,
    )
