"""The open-loop bench's side-by-side figures (issue 20): lateness from the server's arrival
stamps against the client's schedule, the achieved rate, CPU between two moments, the target
verdicts, and the peers' commands and exports. Pure functions on made-up stamps: nothing is
timed."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from bench_modules import load_bench

bench = load_bench("open_loop_bench")
peers = load_bench("bench_peers")

MS = 1_000_000  # ns


def test_arrivals_on_the_schedule_deviate_by_nothing_whatever_their_order() -> None:
    arrivals = [5_000 * MS + i * 20 * MS for i in range(10)]  # 50/s exactly
    deviation = bench.schedule_deviation_ms(
        list(reversed(arrivals)), bench.constant_schedule(10, 50.0)
    )
    assert deviation == pytest.approx([0.0] * 10, abs=1e-9)


def test_a_late_send_is_late_by_its_delay_against_the_first_arrival() -> None:
    arrivals = [i * 5 * MS for i in range(8)]  # 200/s
    arrivals[5] += 3 * MS
    deviation = bench.schedule_deviation_ms(arrivals, bench.constant_schedule(8, 200.0))
    assert deviation[5] == pytest.approx(3.0)
    assert [d for i, d in enumerate(deviation) if i != 5] == pytest.approx([0.0] * 7, abs=1e-9)


def test_a_late_first_send_makes_the_rest_early_until_anchored_at_the_earliest() -> None:
    arrivals = [i * 2 * MS for i in range(6)]  # 500/s
    arrivals[0] += 1_500_000  # the first arrived 1.5 ms late (its connection opened then)
    deviation = bench.schedule_deviation_ms(arrivals, bench.constant_schedule(6, 500.0))
    assert deviation[0] == 0.0
    assert deviation[1:] == pytest.approx([-1.5] * 5)
    anchored = bench.earliest_anchored(deviation)
    assert anchored == pytest.approx([1.5, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert min(anchored) == 0.0


def test_a_slow_sender_drifts_later_send_by_send() -> None:
    # Every gap 1 % too long: the k-th arrival is k * 0.2 ms behind a 50/s schedule.
    arrivals = [round(i * 20.2 * MS) for i in range(5)]
    deviation = bench.schedule_deviation_ms(arrivals, bench.constant_schedule(5, 50.0))
    assert deviation == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8])
    assert bench.arrival_rate(arrivals) == pytest.approx(1000 / 20.2)


def test_no_arrivals_give_no_figures() -> None:
    assert bench.schedule_deviation_ms([], [0.0, 0.02]) == []
    assert bench.schedule_deviation_ms([1, 2], []) == []
    assert bench.earliest_anchored([]) == []
    assert bench.arrival_rate([]) is None
    assert bench.arrival_rate([7 * MS]) is None


def test_the_achieved_rate_counts_gaps_not_arrivals() -> None:
    # 11 arrivals 0.1 s apart span 1 s: 10 per second, not 11.
    assert bench.arrival_rate([i * 100 * MS for i in range(11)]) == pytest.approx(10.0)


def test_cpu_between_samples_is_linear_and_clamped_outside_them() -> None:
    samples = [(1_000, 2.0), (2_000, 3.0), (4_000, 3.0)]
    assert bench.cpu_at(samples, 1_500) == pytest.approx(2.5)
    assert bench.cpu_at(samples, 3_000) == pytest.approx(3.0)
    assert bench.cpu_at(samples, 0) == 2.0
    assert bench.cpu_at(samples, 9_000) == 3.0
    assert bench.cpu_at([], 1_000) is None


def test_the_tree_cpu_of_this_process_is_at_least_its_own() -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    own = time.process_time()
    # /proc counts whole ticks per field (user, system): up to two ticks below process_time.
    assert bench.tree_cpu_s(os.getpid(), ticks) >= own - 2 / ticks - 1e-9
    assert bench.tree_cpu_s(2**22 + 12345, ticks) == 0.0  # no such process: nothing counted


def _row(client: str, rate: float, p99: float | None, achieved: float) -> dict[str, object]:
    return {
        "client": client,
        "pattern": "constant",
        "target_rate_per_s": rate,
        "earliest_p99_ms": p99,
        "achieved_rate_per_s": achieved,
    }


def test_verdicts_say_met_and_not_met_against_1_ms_the_best_peer_and_the_rate() -> None:
    rows = [
        _row("ours", 50.0, 0.8, 50.2),
        _row("guidellm", 50.0, 9.0, 50.0),
        _row("aiperf", 50.0, 0.5, 50.0),
        _row("ours", 500.0, 1.2, 480.0),
        _row("aiperf", 500.0, None, 0.0),  # a peer that failed is no comparison
    ]
    found = bench.verdicts(rows)
    assert found[("constant", 50.0)] == [
        "p99 <= 1 ms: met (0.800 ms)",
        "p99 <= best peer's 0.500 ms: NOT met",
        "rate within 1 %: met (+0.40 %)",
    ]
    assert found[("constant", 500.0)] == [
        "p99 <= 1 ms: NOT met (1.200 ms)",
        "p99 <= best peer's: no peer measured",
        "rate within 1 %: NOT met (-4.00 %)",
    ]


def test_poisson_rows_are_judged_on_lateness_but_not_on_the_rate() -> None:
    rows = [
        _row("ours", 50.0, 0.1, 47.0) | {"pattern": "poisson"},
        _row("guidellm", 50.0, 3.0, 52.0) | {"pattern": "poisson"},
    ]
    assert bench.verdicts(rows) == {
        ("poisson", 50.0): ["p99 <= 1 ms: met (0.100 ms)", "p99 <= best peer's 3.000 ms: met"]
    }


def test_arrivals_against_an_uneven_schedule_and_one_that_arrived_short() -> None:
    schedule = [10.0, 10.05, 10.06, 10.3]  # GuideLLM's targeted starts: epoch seconds
    arrivals = [0, 50 * MS, 61 * MS]  # the third 1 ms late; the fourth never arrived
    assert bench.schedule_deviation_ms(arrivals, schedule) == pytest.approx([0.0, 0.0, 1.0])


def test_each_client_schedule_is_what_it_meant_to_keep() -> None:
    def schedule(client: str, pattern: str, targeted: list[float] | None) -> object:
        return bench.client_schedule(
            client, pattern, 100.0, 3, seed=1, duration_s=0.5, targeted_s=targeted
        )

    assert schedule("aiperf", "constant", None) == pytest.approx([0.0, 0.01, 0.02])
    ours = schedule("ours", "poisson", None)
    assert ours == list(bench.arrival_schedule("poisson", 100.0, seed=1, duration_s=0.5))
    assert schedule("guidellm", "poisson", [3.0, 1.0, 2.0]) == [1.0, 2.0, 3.0]
    assert schedule("guidellm", "poisson", []) is None
    assert schedule("aiperf", "poisson", None) is None


def test_the_peers_commands_carry_the_rate_the_pattern_and_the_count(tmp_path: Path) -> None:
    aiperf = peers.aiperf_rate_command(
        Path("/v"), "http://h", 200.0, "poisson", 2000, 4, tmp_path, Path("/t"), 7
    )
    text = " ".join(aiperf)
    assert "--request-rate 200 --arrival-pattern poisson --request-count 2000" in text
    assert "--random-seed 7" in text
    assert "--concurrency" not in aiperf
    guidellm = peers.guidellm_rate_command(
        Path("/v"), "http://h", 50.0, "constant", 500, 4, tmp_path, Path("/t"), 7
    )
    assert guidellm[guidellm.index("--profile") + 1] == "kind=constant,rate=50"
    assert guidellm[guidellm.index("--constraint") + 1] == "kind=max_requests,count=500"
    assert guidellm[guidellm.index("--seed") + 1] == "kind=static,value=7"


def test_the_peers_exports_give_their_own_send_stamps(tmp_path: Path) -> None:
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    records = [
        {"metadata": {"credit_issued_ns": 100, "request_start_ns": 150}, "metrics": {}},
        {"metadata": {"credit_issued_ns": 200, "request_start_ns": 260}, "error": {"x": 1}},
    ]
    (artifacts / "profile_export.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    assert peers.aiperf_send_rows(tmp_path) == [
        {"issued_ns": 100, "start_ns": 150, "error": False},
        {"issued_ns": 200, "start_ns": 260, "error": True},
    ]

    def request(targeted: float, start: float) -> dict[str, object]:
        return {"info": {"timings": {"targeted_start": targeted, "request_start": start}}}

    report = {
        "benchmarks": [
            {
                "requests": {
                    "successful": [request(1.0, 1.002)],
                    "errored": [request(2.0, 2.5)],
                    "incomplete": [],
                }
            }
        ]
    }
    (tmp_path / "benchmarks.json").write_text(json.dumps(report))
    assert peers.guidellm_send_rows(tmp_path) == [
        {"targeted_s": 1.0, "start_s": 1.002, "error": False},
        {"targeted_s": 2.0, "start_s": 2.5, "error": True},
    ]
