"""Pure planning and statistics of the open-loop workload: arrival schedules drawn lazily
from a seed, their goodness of fit, the sender's lateness and the over-saturation watch.

Schedules are constant, Poisson or gamma (burstiness is the gamma shape; 1 is Poisson); fit is
the Kolmogorov-Smirnov statistic of inter-arrival times against the drawn distribution.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from itertools import count, islice, pairwise, takewhile
from typing import Final, Literal

import msgspec

from cache_family.schemas.workload import REQUESTS_MAX, OverSaturation
from cache_family.states.metrics import percentile
from cache_family.states.workloads import seeded_random

ArrivalPattern = Literal["constant", "poisson", "gamma"]
SaturationCode = Literal["workload.arrivals.in_flight_growing", "workload.arrivals.sender_late"]
#: The most sends one open-loop rate's schedule holds: the bound preparation checks explicit
#: rates against (a rate x its duration), and the cap of a sweep's measured rates.
SENDS_MAX: Final = REQUESTS_MAX


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
    rng = seeded_random(seed)
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
