"""Client metrics: pure arithmetic over a roster of request rows.

A roster is accepted only when it names every planned request id exactly once with finite, non-
negative timings; anything else is refused with every reason at once, never silently summarised.
Percentiles are nearest-rank-below, ``sorted[min(floor(n * p / 100), n - 1)]``, with no
interpolation.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator, MutableSequence, Sequence
from typing import Final

from msgspec import UNSET, UnsetType

from cache_family.errors import Refusal, Refused, json_path
from cache_family.schemas.measurement import RequestRow, RungSummary, SerialSummary
from cache_family.states.first_token import server_times


def percentile(values: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile (0..100) by nearest rank below; None for no values."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} is outside 0..100")
    if not values:
        return None
    ordered = sorted(values)
    n = len(ordered)
    return ordered[min(math.floor(n * p / 100), n - 1)]


def mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def median(values: Sequence[float]) -> float | None:
    """Middle value; for an even count, the mean of the two middle values."""
    if not values:
        return None
    ordered = sorted(values)
    half = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[half]
    return (ordered[half - 1] + ordered[half]) / 2


def is_successful(row: RequestRow) -> bool:
    """Counted in the metrics: completed and not an excluded warmup."""
    return row.status == "completed" and not row.excluded_warmup


def roster_refusals(rows: Sequence[RequestRow], requested: int, path: str = "$") -> list[Refusal]:
    """Every reason the roster cannot be summarised (empty list: it can)."""
    refusals: list[Refusal] = []
    ids = [row.request_id for row in rows]
    if sorted(ids) != list(range(requested)):
        duplicates = sorted(i for i, count in Counter(ids).items() if count > 1)
        missing = sorted(set(range(requested)) - set(ids))
        extra = sorted({i for i in ids if not 0 <= i < requested})
        refusals.append(
            Refusal(
                "metrics.short_roster",
                json_path([*_parts(path), "rows"]),
                f"roster of {len(rows)} rows is not exactly request ids 0..{requested - 1}"
                f" (missing {missing[:8]}, duplicated {duplicates[:8]}, unplanned {extra[:8]})",
                "record a row for every planned request, including not-launched ones",
            )
        )
    for index, row in enumerate(rows):
        refusals += _row_refusals(row, [*_parts(path), "rows", index])
    return refusals


def _row_refusals(row: RequestRow, where: list[str | int]) -> list[Refusal]:
    """Every reason one row's numbers cannot be summarised."""
    refusals: list[Refusal] = []
    for field, value in _row_numbers(row):
        name = ".".join(field)
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            refusals.append(
                Refusal(
                    "metrics.non_finite",
                    json_path([*where, *field]),
                    f"request {row.request_id} has a non-finite {name} ({value})",
                    "a finite measurement is required; check the clock and the server",
                )
            )
        elif value < 0:
            refusals.append(
                Refusal(
                    "metrics.negative_latency"
                    if name.endswith("_ms")
                    else "metrics.negative_count",
                    json_path([*where, *field]),
                    f"request {row.request_id} has a negative {name} ({value})",
                    "times and counts cannot be negative; check the clock source",
                )
            )
    if (
        row.ttft_ms is not None
        and row.elapsed_ms is not None
        and math.isfinite(row.ttft_ms)
        and math.isfinite(row.elapsed_ms)
        and row.ttft_ms > row.elapsed_ms
    ):
        refusals.append(
            Refusal(
                "metrics.ttft_after_latency",
                json_path([*where, "ttft_ms"]),
                f"request {row.request_id} reports its first token ({row.ttft_ms} ms)"
                f" after its end ({row.elapsed_ms} ms)",
                "both times must come from the same monotonic clock",
            )
        )
    if row.status == "completed" and row.elapsed_ms is None:
        refusals.append(
            Refusal(
                "metrics.missing_latency",
                json_path([*where, "elapsed_ms"]),
                f"completed request {row.request_id} has no elapsed time",
                "a completed request must record its latency",
            )
        )
    return refusals


def rung_summary(
    rows: Sequence[RequestRow],
    *,
    concurrency: int,
    requested_requests: int,
    makespan_seconds: float,
    ttft_slo_ms: float | None = None,
    tpot_slo_ms: float | None = None,
    path: str = "$",
) -> RungSummary:
    """Summarise one concurrency rung; raises ``Refused`` with every reason it cannot."""
    rung = RungAccumulator(
        requested_requests, ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms, path=path
    )
    for row in rows:
        rung.add(row)
    return rung.summary(concurrency=concurrency, makespan_seconds=makespan_seconds)


class RungAccumulator:
    """``rung_summary`` of rows given one at a time (the one definition of a rung summary).

    It never holds the rows: one byte per planned request id (the roster check), the measured
    times of the successful requests, and counters. ``compact`` keeps those times as 8-byte
    floats (``array``), so a rung of a million requests streamed from its rows file is
    summarised in a few tens of MiB; the percentiles are the same nearest-rank values.
    """

    def __init__(
        self,
        requested_requests: int,
        *,
        ttft_slo_ms: float | None = None,
        tpot_slo_ms: float | None = None,
        path: str = "$",
        compact: bool = False,
    ) -> None:
        self.requested = requested_requests
        self._slos = (ttft_slo_ms, tpot_slo_ms)
        self._path = path
        self._seen = bytearray(max(requested_requests, 0))
        self._unplanned: Counter[int] = Counter()
        self._rows = 0
        self._refusals: list[Refusal] = []
        # Client TTFT, TPOT and latency; then the server's own TTFT and TPOT.
        self._times: tuple[MutableSequence[float], ...] = tuple(
            array("d") if compact else [] for _ in range(5)
        )
        self._good = self._tokens = self._meeting = self._not_completed = 0
        self._unobserved = 0

    def add(self, row: RequestRow, index: int | None = None) -> None:
        """Count one row; ``index`` is its place in the roster (refusal paths), by default
        the order rows were added in."""
        where = [*_parts(self._path), "rows", self._rows if index is None else index]
        self._rows += 1
        request_id = row.request_id
        if 0 <= request_id < self.requested:
            if self._seen[request_id] < 255:
                self._seen[request_id] += 1
        else:
            self._unplanned[request_id] += 1
        self._refusals += _row_refusals(row, where)
        if row.status != "completed":
            self._not_completed += 1
        if not is_successful(row):
            return
        self._good += 1
        self._tokens += row.tokens_predicted or 0
        self._unobserved += row.ttft_unobserved is not UNSET
        if (self._slos[0] is not None or self._slos[1] is not None) and _meets(row, *self._slos):
            self._meeting += 1
        ttfts, tpots, latencies, server_ttfts, server_tpots = self._times
        if row.ttft_ms is not None:
            ttfts.append(row.ttft_ms)
        if row.tpot_ms is not None:
            tpots.append(row.tpot_ms)
        if row.elapsed_ms is not None:
            latencies.append(row.elapsed_ms)
        server = server_times(row)
        if server is not None and server.ttft_ms is not None:
            server_ttfts.append(server.ttft_ms)
        if server is not None and server.tpot_ms is not None:
            server_tpots.append(server.tpot_ms)

    def _roster_refusal(self) -> Refusal | None:
        seen = self._seen
        if self._rows == self.requested and not self._unplanned and seen.count(1) == len(seen):
            return None
        missing = list(_indices(seen, 0, 8))
        duplicates = sorted(
            [*_indices_above(seen, 1, 8), *(i for i, n in self._unplanned.items() if n > 1)]
        )
        extra = sorted(self._unplanned)
        return Refusal(
            "metrics.short_roster",
            json_path([*_parts(self._path), "rows"]),
            f"roster of {self._rows} rows is not exactly request ids 0..{self.requested - 1}"
            f" (missing {missing[:8]}, duplicated {duplicates[:8]}, unplanned {extra[:8]})",
            "record a row for every planned request, including not-launched ones",
        )

    def refusals(self) -> list[Refusal]:
        """Why the roster cannot be summarised: its ids, then its rows' numbers."""
        roster = self._roster_refusal()
        return ([roster] if roster is not None else []) + self._refusals

    def summary(self, *, concurrency: int, makespan_seconds: float) -> RungSummary:
        """The rung's summary; raises ``Refused`` with every reason it cannot."""
        path = self._path
        refusals = self.refusals()
        if not math.isfinite(makespan_seconds):
            refusals.append(
                Refusal(
                    "metrics.non_finite",
                    json_path([*_parts(path), "makespan_seconds"]),
                    f"makespan {makespan_seconds} is not finite",
                    "measure the makespan with a monotonic clock",
                )
            )
        elif makespan_seconds <= 0:
            refusals.append(
                Refusal(
                    "metrics.zero_makespan",
                    json_path([*_parts(path), "makespan_seconds"]),
                    f"makespan {makespan_seconds} s is not positive",
                    "a rung that launched requests must take measurable time",
                )
            )
        if refusals:
            raise Refused(tuple(refusals))
        goodput: float | None = None
        # A request without an observable TTFT can be judged by neither objective: no
        # goodput then, rather than one that counts it as missing them.
        if (self._slos[0] is not None or self._slos[1] is not None) and not self._unobserved:
            goodput = _rate(self._meeting, makespan_seconds)
        ttft, tpot, latency, server_ttft, server_tpot = (
            _percentiles(values) for values in self._times
        )
        summary = RungSummary(
            concurrency=concurrency,
            requested_requests=self.requested,
            measured_requests=self._good,
            makespan_seconds=makespan_seconds,
            throughput_requests_per_sec=_rate(self._good, makespan_seconds),
            output_tokens_per_sec=_rate(self._tokens, makespan_seconds),
            goodput_requests_per_sec=goodput,
            observed_completion_tokens=self._tokens,
            ttft_p50_ms=ttft[0],
            ttft_p90_ms=ttft[1],
            ttft_p99_ms=ttft[2],
            tpot_p50_ms=tpot[0],
            tpot_p90_ms=tpot[1],
            tpot_p99_ms=tpot[2],
            latency_p50_ms=latency[0],
            latency_p90_ms=latency[1],
            latency_p99_ms=latency[2],
            failed_or_unlaunched_requests=self._not_completed,
            complete=self._good > 0 and self._not_completed == 0,
            ttft_unobserved_requests=self._unobserved or UNSET,
            server_ttft_p50_ms=_or_unset(server_ttft[0]),
            server_ttft_p90_ms=_or_unset(server_ttft[1]),
            server_ttft_p99_ms=_or_unset(server_ttft[2]),
            server_tpot_p50_ms=_or_unset(server_tpot[0]),
            server_tpot_p90_ms=_or_unset(server_tpot[1]),
            server_tpot_p99_ms=_or_unset(server_tpot[2]),
        )
        _refuse_non_finite_summary(
            [
                ("throughput_requests_per_sec", summary.throughput_requests_per_sec),
                ("output_tokens_per_sec", summary.output_tokens_per_sec),
                ("goodput_requests_per_sec", summary.goodput_requests_per_sec),
            ],
            path,
        )
        return summary


def _or_unset(value: float | None) -> float | UnsetType:
    """A figure of the server's own, unset (not written) when no request had it."""
    return UNSET if value is None else value


# Above this many values a compact rung's times are sorted in place (numpy) rather than as a
# list of float objects (about 32 bytes a value): memory stays at 8 bytes a value.
SORT_IN_PLACE_ABOVE: Final = 100_000


def _percentiles(values: MutableSequence[float]) -> tuple[float | None, ...]:
    """p50, p90 and p99 as ``percentile`` gives them, one metric at a time. A large compact
    ``array`` is sorted in place by numpy (8 bytes a value, no float objects)."""
    if not values:
        return (None, None, None)
    n = len(values)
    ranks = [min(math.floor(n * p / 100), n - 1) for p in (50, 90, 99)]
    if isinstance(values, array) and n > SORT_IN_PLACE_ABOVE:
        # Imported only here: a process whose rungs are all small never loads numpy (its import
        # costs more CPU than a whole small rung's client work).
        import numpy

        in_place = numpy.frombuffer(values, dtype=numpy.float64)
        in_place.sort()
        return tuple(float(in_place[rank]) for rank in ranks)
    ordered = sorted(values)
    return tuple(ordered[rank] for rank in ranks)


def _indices(seen: bytearray, value: int, limit: int) -> Iterator[int]:
    """The first ``limit`` ids whose count is ``value``."""
    start = seen.find(value)
    while start != -1 and limit:
        yield start
        limit -= 1
        start = seen.find(value, start + 1)


def _indices_above(seen: bytearray, value: int, limit: int) -> list[int]:
    found: list[int] = []
    for index, count in enumerate(seen):
        if count > value:
            found.append(index)
            if len(found) == limit:
                break
    return found


def serial_summary(rows: Sequence[RequestRow], *, requested: int, path: str = "$") -> SerialSummary:
    """Warm statistics of a serial baseline; the excluded warmup row never counts."""
    serial = SerialAccumulator(requested, path=path)
    for row in rows:
        serial.add(row)
    return serial.summary()


class SerialAccumulator:
    """``serial_summary`` of rows given one at a time, in any order (the one definition):
    the roster check of ``RungAccumulator``, the warm latencies as 8-byte floats and the warm
    requests' reported ``cache_n`` by request id."""

    def __init__(self, requested: int, *, path: str = "$") -> None:
        self._roster = RungAccumulator(requested, path=path, compact=True)
        self._latencies = array("d")
        self._cache_n: list[tuple[int, int]] = []
        self._warm = self._excluded = 0
        self._all_completed = True

    def add(self, row: RequestRow) -> None:
        self._roster.add(row)
        self._excluded += row.excluded_warmup
        self._all_completed &= row.status == "completed"
        if not is_successful(row):
            return
        self._warm += 1
        if row.elapsed_ms is not None:
            self._latencies.append(row.elapsed_ms)
        if row.timings is not None and row.timings.cache_n is not None:
            self._cache_n.append((row.request_id, row.timings.cache_n))

    def summary(self) -> SerialSummary:
        """The summary; raises ``Refused`` with every reason the roster cannot give one."""
        refusals = self._roster.refusals()
        if refusals:
            raise Refused(tuple(refusals))
        cache_hits = tuple(cache_n for _, cache_n in sorted(self._cache_n))
        return SerialSummary(
            warm_mean_ms=mean(self._latencies),
            warm_median_ms=median(self._latencies),
            excluded_runs=self._excluded,
            warm_requests=self._warm,
            warm_cache_n=cache_hits,
            # Only a claim about every warm request: one without a reported cache_n voids it.
            warm_cache_n_min=(
                min(cache_hits) if cache_hits and len(cache_hits) == self._warm else None
            ),
            complete=self._all_completed,
        )


def _rate(count: int, seconds: float) -> float:
    """count per second; an overflow becomes infinity so the caller refuses it as non-finite."""
    try:
        return count / seconds
    except OverflowError:
        return math.inf


def _meets(row: RequestRow, ttft_slo_ms: float | None, tpot_slo_ms: float | None) -> bool:
    if ttft_slo_ms is not None and (row.ttft_ms is None or row.ttft_ms > ttft_slo_ms):
        return False
    return not (tpot_slo_ms is not None and (row.tpot_ms is None or row.tpot_ms > tpot_slo_ms))


def _row_numbers(row: RequestRow) -> Iterable[tuple[tuple[str, ...], float | None]]:
    yield ("elapsed_ms",), row.elapsed_ms
    yield ("ttft_ms",), row.ttft_ms
    yield ("tpot_ms",), row.tpot_ms
    yield ("tokens_predicted",), row.tokens_predicted
    yield ("tokens_evaluated",), row.tokens_evaluated
    if not isinstance(row.first_token_late_ms, UnsetType):
        yield ("first_token_late_ms",), row.first_token_late_ms
    if row.timings is not None:
        yield ("timings", "prompt_ms"), row.timings.prompt_ms
        yield ("timings", "predicted_ms"), row.timings.predicted_ms
        yield ("timings", "prompt_n"), row.timings.prompt_n
        yield ("timings", "predicted_n"), row.timings.predicted_n
        yield ("timings", "cache_n"), row.timings.cache_n


def _refuse_non_finite_summary(values: list[tuple[str, float | None]], path: str) -> None:
    bad = [
        Refusal(
            "metrics.non_finite",
            json_path([*_parts(path), name]),
            f"{name} overflowed to {value}",
            "the roster holds values too large to summarise; check the server's counts",
        )
        for name, value in values
        if value is not None and not math.isfinite(value)
    ]
    if bad:
        raise Refused(tuple(bad))


def _parts(path: str) -> list[str | int]:
    """Split a rendered ``$.a.b`` path back into parts so sub-paths render consistently."""
    if path in ("", "$"):
        return []
    return [part for part in path.removeprefix("$").split(".") if part]
