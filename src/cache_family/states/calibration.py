"""How close a measurement came to the client's own overhead, and when TTFT is not a first token.

A rung whose latencies are within ``NEAR_OVERHEAD_FACTOR`` times the client's own overhead
measures the client about as much as the host, and its receipt says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

from cache_family.schemas.measurement import (
    FIRST_TOKEN_WITH_FINAL,
    ClientCalibration,
    RequestRow,
    RungSummary,
    SerialSummary,
)
from cache_family.states.metrics import median, percentile

NEAR_OVERHEAD_FACTOR: Final = 10.0


def calibration(
    client_ms: Sequence[float],
    truth_ms: Sequence[float],
    ttft_error_ms: Sequence[float],
    *,
    pace: tuple[float, float, int],
) -> ClientCalibration:
    """The client's overhead from paired requests: its latency minus the server's truth."""
    if len(client_ms) != len(truth_ms) or not client_ms:
        raise ValueError("calibration needs one server truth per client latency, at least one")
    above = [client - truth for client, truth in zip(client_ms, truth_ms, strict=True)]
    ttft_ms, itl_ms, tokens = pace
    return ClientCalibration(
        requests=len(above),
        overhead_p50_ms=median(above) or 0.0,
        overhead_p90_ms=percentile(above, 90) or 0.0,
        overhead_max_ms=max(above),
        ttft_error_p50_ms=median(ttft_error_ms),
        server_ttft_ms=ttft_ms,
        server_itl_ms=itl_ms,
        server_tokens=tokens,
        near_factor=NEAR_OVERHEAD_FACTOR,
    )


def client_lag_ms(calibration: ClientCalibration | None) -> float | None:
    """The client's measured lag on this host: its median overhead in the run's
    self-calibration, the figure every rung receipt shows as ``client_overhead_ms`` (None: not
    measured). A first token read later than the server's own per-event timings allow, by more
    than this, was read by a stalled client. The median, not a tail: under load the few
    calibration requests' tail swings by ten times from run to run."""
    return None if calibration is None else calibration.overhead_p50_ms


def near_client_overhead(
    latencies_ms: Iterable[float | None], overhead_ms: float | None, factor: float
) -> bool | None:
    """True when any latency is within ``factor`` times the overhead; None when the overhead
    was not measured or no latency was."""
    known = [value for value in latencies_ms if value is not None]
    if overhead_ms is None or not known:
        return None
    return any(value <= factor * max(overhead_ms, 0.0) for value in known)


def rung_latencies(
    rung: RungSummary | None, serial: SerialSummary | None
) -> tuple[float | None, ...]:
    """The figures a rung reports that the client's overhead could swamp: the medians."""
    if rung is not None:
        return (rung.ttft_p50_ms, rung.latency_p50_ms)
    if serial is not None:
        return (serial.warm_median_ms,)
    return ()


def first_content_with_final(rows: Sequence[RequestRow]) -> tuple[int, ...]:
    """Completed streamed requests whose first token arrived with (or as) the final event:
    the row says so (``ttft_unobserved``), or, in a run recorded before rows said so, its
    TTFT is its latency."""
    return tuple(
        row.request_id
        for row in rows
        if row.status == "completed"
        and (
            row.ttft_unobserved == FIRST_TOKEN_WITH_FINAL
            or (
                row.ttft_ms is not None
                and row.elapsed_ms is not None
                and row.ttft_ms >= row.elapsed_ms
            )
        )
    )
