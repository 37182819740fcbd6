"""Old-versus-new effect sizes: the difference of medians with a bootstrap confidence interval.

Percentile bootstrap over two independent samples, seeded with ``BOOTSTRAP_SEED`` for every
comparison and drawing only through ``random.Random.random`` (its sequence for an integer seed
is stable across Python versions), so the same samples always give the same interval, byte for
byte.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

BOOTSTRAP_RESAMPLES: Final = 2000
BOOTSTRAP_SEED: Final = 20261201
CONFIDENCE: Final = 0.95
#: Below this many measured requests in either arm no interval is computed.
MIN_SAMPLES: Final = 2


def median(values: Sequence[float]) -> float:
    """The middle value; the mean of the middle two for an even count."""
    if not values:
        raise ValueError("median of no values")
    # Total order as the reference sorts: -0.0 before 0.0.
    ordered = sorted(values, key=lambda v: (v, math.copysign(1.0, v)))
    middle = len(ordered) // 2
    if len(ordered) % 2 == 1:
        return ordered[middle]
    return ordered[middle - 1] / 2.0 + ordered[middle] / 2.0


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (NumPy's default ``linear`` method)."""
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _resample(rng: random.Random, values: Sequence[float]) -> list[float]:
    n = len(values)
    return [values[min(int(rng.random() * n), n - 1)] for _ in range(n)]


@dataclass(frozen=True, slots=True)
class MedianDifference:
    """median(new) - median(old) in the samples' unit, with its bootstrap interval."""

    n_old: int
    n_new: int
    median_old: float
    median_new: float
    difference: float
    low: float
    high: float

    @property
    def relative(self) -> float | None:
        """The difference as a fraction of the old median (None when that median is 0)."""
        return None if self.median_old == 0 else self.difference / self.median_old

    @property
    def verdict(self) -> str:
        """Whether the interval excludes 0: lower means the new arm is faster."""
        if self.low > 0:
            return "new slower"
        if self.high < 0:
            return "new faster"
        return "no clear difference"


def bootstrap_median_difference(
    old: Sequence[float],
    new: Sequence[float],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> MedianDifference | None:
    """The effect and its ``CONFIDENCE`` interval, or None with fewer than ``MIN_SAMPLES``
    values in either arm."""
    if len(old) < MIN_SAMPLES or len(new) < MIN_SAMPLES:
        return None
    rng = random.Random(seed)  # noqa: S311 -- a reproducible resampler, not a secret
    diffs = sorted(
        median(_resample(rng, new)) - median(_resample(rng, old)) for _ in range(resamples)
    )
    tail = (1.0 - CONFIDENCE) / 2.0
    median_old, median_new = median(old), median(new)
    return MedianDifference(
        n_old=len(old),
        n_new=len(new),
        median_old=median_old,
        median_new=median_new,
        difference=median_new - median_old,
        low=_percentile(diffs, tail),
        high=_percentile(diffs, 1.0 - tail),
    )
