"""Client metrics over rosters: the reference vector, refusals and percentile properties."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_family.errors import Refused
from cache_family.schemas.measurement import RequestRow, RungSummary, ServerTimings
from cache_family.states.metrics import median, percentile, rung_summary, serial_summary


def done(
    request_id: int,
    *,
    elapsed: float = 100.0,
    ttft: float | None = 10.0,
    tpot: float | None = 1.0,
    tokens: int = 5,
    cache_n: int | None = None,
    warmup: bool = False,
) -> RequestRow:
    return RequestRow(
        request_id=request_id,
        status="completed",
        excluded_warmup=warmup,
        elapsed_ms=elapsed,
        ttft_ms=ttft,
        tpot_ms=tpot,
        tokens_predicted=tokens,
        tokens_evaluated=20,
        timings=ServerTimings(predicted_n=tokens, cache_n=cache_n),
    )


def test_reference_vector_two_requests_in_two_seconds() -> None:
    rows = [
        done(0, elapsed=900.0, ttft=50.0, tpot=5.0, tokens=4),
        done(1, elapsed=900.0, ttft=500.0, tpot=5.0, tokens=6),
    ]
    summary = rung_summary(
        rows,
        concurrency=2,
        requested_requests=2,
        makespan_seconds=2.0,
        ttft_slo_ms=100.0,
        tpot_slo_ms=10.0,
    )
    assert summary.throughput_requests_per_sec == 1.0
    assert summary.goodput_requests_per_sec == 0.5
    assert summary.output_tokens_per_sec == 5.0
    assert summary.observed_completion_tokens == 10
    assert summary.measured_requests == 2
    assert summary.complete is True
    assert summary.failed_or_unlaunched_requests == 0


def test_goodput_needs_both_objectives() -> None:
    rows = [done(0, ttft=50.0, tpot=50.0), done(1, elapsed=900.0, ttft=500.0, tpot=1.0)]
    summary = rung_summary(
        rows,
        concurrency=2,
        requested_requests=2,
        makespan_seconds=1.0,
        ttft_slo_ms=100.0,
        tpot_slo_ms=10.0,
    )
    assert summary.goodput_requests_per_sec == 0.0


def test_goodput_is_absent_without_objectives() -> None:
    summary = rung_summary([done(0)], concurrency=1, requested_requests=1, makespan_seconds=1.0)
    assert summary.goodput_requests_per_sec is None


def test_partial_roster_is_summarised_but_not_complete() -> None:
    rows = [
        done(0, elapsed=30.0),
        RequestRow(request_id=1, status="failed", error="http 500"),
        RequestRow(request_id=2, status="not-launched"),
    ]
    summary = rung_summary(rows, concurrency=2, requested_requests=3, makespan_seconds=0.5)
    assert summary.complete is False
    assert summary.measured_requests == 1
    assert summary.failed_or_unlaunched_requests == 2
    assert summary.throughput_requests_per_sec == 2.0
    assert summary.latency_p50_ms == 30.0


def test_all_failed_roster_is_not_complete_and_has_no_percentiles() -> None:
    rows = [RequestRow(request_id=0, status="incomplete")]
    summary = rung_summary(rows, concurrency=1, requested_requests=1, makespan_seconds=1.0)
    assert summary.complete is False
    assert summary.latency_p99_ms is None


@pytest.mark.parametrize("makespan", [0.0, -1.0])
def test_zero_or_negative_makespan_is_refused(makespan: float) -> None:
    with pytest.raises(Refused) as caught:
        rung_summary([done(0)], concurrency=1, requested_requests=1, makespan_seconds=makespan)
    assert caught.value.codes == ["metrics.zero_makespan"]


def test_non_finite_makespan_is_refused() -> None:
    with pytest.raises(Refused) as caught:
        rung_summary([done(0)], concurrency=1, requested_requests=1, makespan_seconds=math.inf)
    assert caught.value.codes == ["metrics.non_finite"]


def test_short_roster_is_refused() -> None:
    with pytest.raises(Refused) as caught:
        rung_summary([done(0)], concurrency=1, requested_requests=2, makespan_seconds=1.0)
    assert caught.value.codes == ["metrics.short_roster"]
    assert "missing [1]" in str(caught.value)


def test_duplicate_request_id_is_refused() -> None:
    with pytest.raises(Refused) as caught:
        rung_summary([done(0), done(0)], concurrency=1, requested_requests=2, makespan_seconds=1.0)
    assert caught.value.codes == ["metrics.short_roster"]
    assert "duplicated [0]" in str(caught.value)


def test_every_reason_is_reported_at_once() -> None:
    rows = [done(0, elapsed=-5.0, ttft=None), done(1, ttft=math.nan)]
    with pytest.raises(Refused) as caught:
        rung_summary(rows, concurrency=1, requested_requests=3, makespan_seconds=0.0)
    assert sorted(caught.value.codes) == [
        "metrics.negative_latency",
        "metrics.non_finite",
        "metrics.short_roster",
        "metrics.zero_makespan",
    ]
    paths = {r.path for r in caught.value.refusals}
    assert "$.rows[0].elapsed_ms" in paths
    assert "$.rows[1].ttft_ms" in paths


def test_first_token_after_end_is_refused() -> None:
    with pytest.raises(Refused) as caught:
        rung_summary(
            [done(0, elapsed=5.0, ttft=9.0)],
            concurrency=1,
            requested_requests=1,
            makespan_seconds=1.0,
        )
    assert caught.value.codes == ["metrics.ttft_after_latency"]


def test_overflowing_throughput_is_refused() -> None:
    with pytest.raises(Refused) as caught:
        rung_summary(
            [done(0, tokens=10**308 * 10)],
            concurrency=1,
            requested_requests=1,
            makespan_seconds=1e-300,
        )
    assert "metrics.non_finite" in caught.value.codes


def test_serial_warm_statistics_exclude_the_warmup() -> None:
    rows = [
        done(0, elapsed=900.0, ttft=None, tpot=None, cache_n=0, warmup=True),
        done(1, elapsed=10.0, ttft=None, tpot=None, cache_n=127),
        done(2, elapsed=30.0, ttft=None, tpot=None, cache_n=128),
        done(3, elapsed=20.0, ttft=None, tpot=None, cache_n=128),
        done(4, elapsed=50.0, ttft=None, tpot=None, cache_n=128),
    ]
    summary = serial_summary(rows, requested=5)
    assert summary.warm_mean_ms == 27.5
    assert summary.warm_median_ms == 25.0
    assert summary.excluded_runs == 1
    assert summary.warm_requests == 4
    assert summary.warm_cache_n == (127, 128, 128, 128)
    assert summary.warm_cache_n_min == 127
    assert summary.complete is True


def test_serial_with_only_the_warmup_has_no_statistics() -> None:
    summary = serial_summary([done(0, warmup=True)], requested=1)
    assert summary.warm_mean_ms is None
    assert summary.warm_median_ms is None
    assert summary.warm_cache_n_min is None
    assert summary.complete is True


def test_serial_cache_minimum_needs_every_warm_request() -> None:
    rows = [done(0, warmup=True), done(1, cache_n=5), done(2, cache_n=None)]
    assert serial_summary(rows, requested=3).warm_cache_n_min is None


def test_percentile_rule_is_nearest_rank_below() -> None:
    values = [float(v) for v in range(1, 11)]
    assert percentile(values, 50) == 6.0  # sorted[floor(10 * 0.5)] = sorted[5]
    assert percentile(values, 90) == 10.0
    assert percentile(values, 99) == 10.0
    assert percentile([3.0, 1.0], 50) == 3.0
    assert percentile([], 50) is None
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5


def test_summary_round_trips_through_json() -> None:
    summary = rung_summary([done(0)], concurrency=1, requested_requests=1, makespan_seconds=0.25)
    encoded = msgspec.json.encode(summary)
    assert msgspec.json.decode(encoded, type=RungSummary) == summary


finite = st.floats(min_value=0, max_value=1e9, allow_nan=False, allow_infinity=False)


@settings(deadline=None)  # wall-clock deadlines flake on a loaded machine
@given(st.lists(finite, min_size=1, max_size=200))
def test_percentiles_are_monotone_and_members(values: list[float]) -> None:
    p50, p90, p99 = (percentile(values, p) for p in (50, 90, 99))
    assert p50 is not None and p90 is not None and p99 is not None
    assert min(values) <= p50 <= p90 <= p99 <= max(values)
    assert p99 in values


@settings(deadline=None)  # wall-clock deadlines flake on a loaded machine
@given(
    st.lists(
        st.tuples(finite, st.integers(min_value=1, max_value=4096), st.booleans()),
        min_size=1,
        max_size=50,
    ),
    st.floats(min_value=1e-3, max_value=1e4),
)
def test_rung_counts_add_up(spec: list[tuple[float, int, bool]], makespan: float) -> None:
    rows = [
        done(i, elapsed=elapsed, ttft=0.0, tokens=tokens)
        if ok
        else RequestRow(request_id=i, status="failed", error="x")
        for i, (elapsed, tokens, ok) in enumerate(spec)
    ]
    summary = rung_summary(
        rows, concurrency=4, requested_requests=len(rows), makespan_seconds=makespan
    )
    succeeded = sum(1 for _, _, ok in spec if ok)
    assert summary.measured_requests + summary.failed_or_unlaunched_requests == len(rows)
    assert summary.measured_requests == succeeded
    assert summary.complete == (succeeded == len(rows))
    assert math.isclose(summary.throughput_requests_per_sec * makespan, succeeded)
    assert summary.observed_completion_tokens == sum(t for _, t, ok in spec if ok)


@settings(deadline=None)  # wall-clock deadlines flake on a loaded machine
@given(st.lists(finite, min_size=1, max_size=300))
def test_a_compact_rungs_percentiles_agree_whichever_way_it_is_sorted(values: list[float]) -> None:
    from array import array

    from cache_family.states import metrics

    as_objects = metrics._percentiles(array("d", values))
    saved = metrics.SORT_IN_PLACE_ABOVE
    metrics.SORT_IN_PLACE_ABOVE = 0  # type: ignore[misc]
    try:
        in_place = metrics._percentiles(array("d", values))
    finally:
        metrics.SORT_IN_PLACE_ABOVE = saved  # type: ignore[misc]
    assert as_objects == in_place == tuple(percentile(values, p) for p in (50, 90, 99))


def test_a_small_compact_rung_is_summarised_without_loading_numpy() -> None:
    """numpy's import costs more client CPU than a small rung's whole load (the harness's
    CPU-per-request figure counted it); only a rung past SORT_IN_PLACE_ABOVE may load it."""
    import subprocess
    import sys

    program = (
        "import sys\n"
        "from cache_family.schemas.measurement import RequestRow, ServerTimings\n"
        "from cache_family.states.metrics import RungAccumulator\n"
        "acc = RungAccumulator(1000, compact=True)\n"
        "for i in range(1000):\n"
        "    acc.add(RequestRow(request_id=i, status='completed', ttft_ms=float(i % 97),\n"
        "        tpot_ms=1.0, elapsed_ms=float(i % 89) + 100.0, tokens_predicted=4,\n"
        "        tokens_evaluated=20, timings=ServerTimings(predicted_n=4)))\n"
        "summary = acc.summary(concurrency=8, makespan_seconds=1.0)\n"
        "assert summary.ttft_p50_ms is not None, summary\n"
        "print('numpy' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False"
