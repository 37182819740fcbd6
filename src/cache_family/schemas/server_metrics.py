"""A host's own Prometheus counters read around a measured interval, and what they mean.

The journal keeps the counters' deltas as read (``server_metrics`` records); which counters
mean prompt and cached tokens for which server is ``states/server_metrics.py``'s, so a
receipt's server totals are re-derived from the journal alone.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

#: A read's outcome: ``read`` (both expositions parsed, deltas kept), ``none`` (the host
#: serves no metrics: nothing is guessed) or ``refused`` (its exposition could not be used).
MetricsStatus = Literal["read", "none", "refused"]
METRICS_READ: Final = "read"
METRICS_NONE: Final = "none"
METRICS_REFUSED: Final = "refused"

#: Whether the server's totals agree with the sum of its per-request figures.
Agreement = Literal["agrees", "disagrees", "incomparable"]


class CounterDelta(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One counter sample's growth over the interval (its value after less its value before;
    a sample first seen after counts from 0)."""

    name: str
    # The sample's labels, sorted by name.
    labels: tuple[tuple[str, str], ...] = ()
    delta: float


class TokenSums(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The client's sum of the server's per-request figures over the same interval."""

    # Requests that reached the server and reported its prompt accounting.
    accounted: int = 0
    # Requests that reached the server without reporting it (failed, cut short): the server
    # may have counted tokens for them that no per-request figure shows.
    unaccounted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # Generated tokens, where every accounted request reported them (None otherwise).
    predicted_tokens: int | None = 0


class ServerTokenTotals(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the server's own counters say of the interval, as the server kind's counters mean
    it (``states/server_metrics.SERVER_COUNTERS``); None: that server counts no such figure."""

    server: str  # llama.cpp | vllm | sglang
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    predicted_tokens: int | None = None
    # SGLang's cached tokens by ``cache_source`` (device, host, storage tiers), sorted.
    cached_by_source: tuple[tuple[str, int], ...] = ()
    # The counters the figures were read from.
    counters: tuple[str, ...] = ()


class ServerMetricsVerdict(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A receipt's server metrics of one rung or workload point: the server's own totals
    (labelled as the server's) beside the client's sum of the per-request figures."""

    status: MetricsStatus
    # Why there are no totals (``none``: the host serves no metrics; ``refused``: the code).
    reason: str | None = None
    refusal_code: str | None = None
    server: ServerTokenTotals | None = None
    client: TokenSums | None = None
    agreement: Agreement | None = None
    # The figures whose server total differs from the client's sum, e.g. "cached_tokens".
    disagreeing: tuple[str, ...] = ()


class ServerMetricsPoint(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A workload receipt's server metrics of one point (``scope``: the workload kind)."""

    scope: str
    index: int
    metrics: ServerMetricsVerdict
