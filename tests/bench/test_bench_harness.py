"""The pure parts of ``bench/harness.py`` and ``bench/_results.py``: judging targets from
figures, reading the benchmark scripts' output and receipts, and the recorded section.

No benchmark runs here and nothing is timed: every input is a figure or a file written by
the test.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import math
from pathlib import Path

import pytest
from bench_modules import BENCH, load_bench

harness = load_bench("harness")
results = load_bench("_results")


FIGURE_KEYS = [
    *("n", "errors", "cpu_ms_per_request", "requests_per_s"),
    *(f"{k}_{q}" for k in ("ttft_err", "tpot_err") for q in ("p50", "p99", "max")),
    *(f"above_{q}" for q in ("p50", "p90", "p99")),
    *(
        f"{k}_{q}"
        for k in ("server_late", "send_receipt", "sent_receipt", "write_read")
        for q in ("p50", "p99")
    ),
]


def _figures(**values: float) -> dict[str, float]:
    out = dict.fromkeys(FIGURE_KEYS, math.nan)
    out |= {"n": 10.0, "errors": 0.0}
    return out | values


def test_a_target_is_met_at_its_limit_and_missed_by_the_gap() -> None:
    at_limit = harness.Target("3", "t", "ms", 1.0, 1.0)
    over = harness.Target("3", "t", "ms", 3.5, 1.0)
    assert at_limit.met() is True and at_limit.verdict() == "met"
    assert over.met() is False
    assert over.verdict() == "**missed** by 2.50 ms"
    rate = harness.Target("6", "t", "/s", 150_000.0, 200_000.0, higher_is_better=True)
    assert rate.verdict() == "**missed** by 50,000 /s"
    assert harness.Target("6", "t", "/s", 250_000.0, 200_000.0, higher_is_better=True).met()


def test_a_target_without_figures_is_not_judged() -> None:
    assert harness.Target("3", "t", "ms", None, 1.0).verdict() == "not measured"
    assert harness.Target("3", "t", "ms", math.nan, 1.0).verdict() == "not measured"
    unjudged = harness.Target("3", "t", "ms", 2.0, None)
    assert unjudged.met() is None
    assert unjudged.verdict().startswith("recorded")
    assert harness.Target("3", "t", "ms", 2.0, 1.0, reference=4.0).ratio() == "0.50x"
    assert harness.Target("3", "t", "ms", 2.0, 1.0).ratio() == "-"


def _fidelity_part() -> object:
    table = {
        "ours": {
            1: _figures(above_p50=2.5, above_p90=3.2, above_p99=9.0, cpu_ms_per_request=3.3),
            64: _figures(ttft_err_p99=585.0),
        },
        "bare": {
            1: _figures(above_p50=2.3, above_p90=2.6, above_p99=3.0, cpu_ms_per_request=2.0),
            64: _figures(ttft_err_p99=826.0, sent_receipt_p99=800.0),
        },
        "bare-aiohttp": {1: _figures(above_p50=2.2, cpu_ms_per_request=1.9)},
        "aiperf": {1: _figures(above_p90=7.8, above_p99=12.0)},
        "guidellm": {1: _figures(above_p90=5.9, above_p99=8.0)},
    }
    part = harness.Part("fidelity", "fidelity")
    part.figures = {
        "table": table,
        "capacity": {"ours": 60.0, "bare": 64.0, "aiperf": 40.0, "guidellm": 55.0},
        "pace": {"ttft_ms": 50.0, "itl_ms": 10.0, "tokens": 16},
    }
    return part


def test_item_3_targets_use_the_best_floor_and_the_best_peer() -> None:
    targets = {t.target: t for t in harness.build_targets({"fidelity": _fidelity_part()})}
    p50 = targets["c=1 client time above server truth, p50: within 0.2 ms of the floor"]
    assert p50.reference_name == "bare-aiohttp"  # the lower of the two floors
    assert p50.limit == pytest.approx(2.4)
    assert p50.verdict() == "**missed** by 0.10 ms"
    p90 = targets["c=1 client time above server truth, p90: at most the best peer's"]
    assert (p90.reference, p90.reference_name, p90.met()) == (5.9, "guidellm", True)
    p99 = targets["c=1 client time above server truth, p99: at most the best peer's"]
    assert p99.verdict() == "**missed** by 1.00 ms"
    cpu = targets["client CPU per streamed request (c=1): at most 1.2x the floor"]
    assert cpu.limit == pytest.approx(1.2 * 1.9)
    capacity = targets["sustained capacity (unpaced server): at least the best peer's"]
    assert (capacity.reference_name, capacity.met()) == ("guidellm", True)


def test_the_c64_target_says_the_floor_misses_too_and_why() -> None:
    targets = {t.target: t for t in harness.build_targets({"fidelity": _fidelity_part()})}
    c64 = targets["c=64 TTFT error p99: at most 1 ms"]
    assert c64.verdict() == "**missed** by 584 ms"
    assert c64.ratio() == f"{585.0 / 826.0:.2f}x"
    assert "the floor misses too, by 825 ms" in c64.note
    assert "800 ms of its p99 after its send returned" in c64.note
    # 64 streams of 50 + 15 x 10 ms offer 320 requests/s; the floor sustained 64.
    assert "offers 320 req/s, the floor sustained 64.00 req/s" in c64.note


def test_every_section_contributes_its_targets() -> None:
    cells = [
        {"overhead_ms": 20.0, "marker_to_ready_ms": 4.0},
        {"overhead_ms": 40.0, "marker_to_ready_ms": 8.0},
        {"overhead_ms": 100.0, "marker_to_ready_ms": None},
    ]
    pins = {"model_gib": 100.0, "rehash_per_cell_s": 1465.0, "identity_per_cell_ms": 0.13}
    journal = {
        "appends_per_s": 32_000.0,
        "plain_appends_per_s": 375_000.0,
        "durable_per_s": 281.0,
        "plain_durable_per_s": 338.0,
        "replay_lines_per_s": 66_613.0,
    }
    million = {
        "requests": 1e6,
        "run_s": 45.2,
        "run_rss_mib": 1619.0,
        "replay_s": 50.6,
        "replay_rss_mib": 2319.0,
    }
    parts = {
        "overhead": harness.Part(
            "overhead", "o", figures=harness.overhead_summary([{"per_cell": cells}])
        ),
        "pins": harness.Part("pins", "p", figures=pins),
        "journal": harness.Part("journal", "j", figures=journal),
        "million": harness.Part("million", "m", figures=million),
    }
    verdicts = {t.target: t for t in harness.build_targets(parts)}
    overhead = verdicts["per-cell overhead, median: at most 30 ms"]
    assert overhead.ours == 40.0 and overhead.verdict() == "**missed** by 10.00 ms"
    assert verdicts["marker-to-ready, median: at most 5 ms"].ours == 6.0
    durable = verdicts["durable transitions: at least 0.8x a write+fsync loop"]
    assert durable.met() is True and durable.ratio() == f"{281 / 338:.2f}x"
    assert verdicts["non-durable appends: at least 200,000/s"].met() is False
    (cell,) = (t for t in verdicts.values() if "1,000,000-request cell" in t.target)
    assert cell.ours == 2319.0 and cell.met() is False
    (pin,) = (t for t in verdicts.values() if t.item == "5")
    assert pin.met() is True and pin.reference == 1_465_000.0
    table = harness.targets_table(list(verdicts.values()))
    assert table.count("\n") == len(verdicts) + 1  # header, rule, one line a target
    assert "| 6 | non-durable appends: at least 200,000/s | 32,000 /s |" in table


JOURNAL_OUT = """\
non-durable appends: ours 32,000/s, plain write 391,399/s (ours/plain 0.08x; target >= 200,000/s)
replay (read_journal: chain + typed decode): 66,613 lines/s (108.1 MiB; target >= 200,000/s)
durable transitions: ours 281/s, write+fsync 338/s (ours/plain 0.83x, median of 9 alternating \
rounds of 200; target >= 0.8x)
"""
PINS_OUT = """\
full hash: 0.14 GiB/s over 4.0 GiB (8 sparse shards, hash_pins threads); the 100 GiB model in \
8 shards: 733 s (extrapolated)
per cell (a pre- and a post-verify): full re-hash 1465 s, identity checks 0.13 ms (11,275,218x \
less)
"""
MILLION_OUT = """\
1,000,000 requests, after the network: rung 55.1 s (18,145 requests/s), peak RSS 94 MiB
bench-figures: {"bytes_per_further_request": 34.3, "replay_rss_mib": 106.0, "replay_s": 9.4, \
"requests": 1000000, "run_rss_mib": 94.0, "run_s": 55.1}
"""


def test_the_scripts_prose_is_read_when_they_print_no_figures_line() -> None:
    assert harness.parse_journal(JOURNAL_OUT) == {
        "appends_per_s": 32_000.0,
        "plain_appends_per_s": 391_399.0,
        "replay_lines_per_s": 66_613.0,
        "durable_per_s": 281.0,
        "plain_durable_per_s": 338.0,
    }
    assert harness.parse_pins(PINS_OUT) == {
        "hash_gib_per_s": 0.14,
        "model_gib": 100.0,
        "rehash_per_cell_s": 1465.0,
        "identity_per_cell_ms": 0.13,
    }
    assert harness.parse_journal("something else entirely") == {}


def test_the_million_cell_is_read_from_its_figures_line_only() -> None:
    million = harness.parse_million(MILLION_OUT)
    assert million == {
        "requests": 1e6,
        "run_s": 55.1,
        "run_rss_mib": 94.0,
        "replay_s": 9.4,
        "replay_rss_mib": 106.0,
        "bytes_per_further_request": 34.3,
    }
    assert harness.parse_million("1,000,000 requests, after the network: rung 55.1 s") == {}


def test_a_figures_line_wins_over_the_prose() -> None:
    stream = io.StringIO()
    results.emit_figures({"appends_per_s": 250_000, "note": "text is kept out"}, stream)
    stdout = JOURNAL_OUT + stream.getvalue()
    assert results.read_figures(stdout) == {"appends_per_s": 250_000, "note": "text is kept out"}
    assert harness.parse_journal(stdout) == {"appends_per_s": 250_000.0}
    assert results.read_figures(JOURNAL_OUT) is None


def test_calibration_figures_come_from_the_matrix_and_the_cell_receipts(tmp_path: Path) -> None:
    calibration = {"requests": 20, "overhead_p50_ms": 0.9, "near_factor": 10.0}
    run = tmp_path / "full-gguf"
    (run / "cell-0000" / "sweep-native-concurrent").mkdir(parents=True)
    (run / "cell-0000" / "native-serial").mkdir()
    (run / "cache-family-matrix.json").write_text(json.dumps({"client_calibration": calibration}))
    rungs = [
        {"near_client_overhead": True, "first_content_with_final_ids": [3, 4]},
        {"near_client_overhead": False, "first_content_with_final_ids": []},
    ]
    cell = run / "cell-0000" / "sweep-native-concurrent" / "cell.json"
    cell.write_text(json.dumps({"measurement": {"rungs": rungs}}))
    serial = run / "cell-0000" / "native-serial" / "cell.json"
    serial.write_text(json.dumps({"measurement": {"rungs": [{"near_client_overhead": None}]}}))
    other = tmp_path / "use-cases"
    other.mkdir()
    (other / "cache-family-matrix.json").write_text(json.dumps({"client_calibration": None}))
    figures = harness.calibration_figures([run, other])
    assert figures["calibrated_runs"] == 1 and figures["runs"] == 2
    assert (figures["rungs"], figures["flagged_rungs"], figures["unflagged_unknown"]) == (3, 1, 1)
    assert figures["final_event_requests"] == 2
    part = harness.Part("calibration", "c", figures=figures)
    (recorded, judged) = harness.build_targets({"calibration": part})
    assert recorded.verdict() == "**missed** by 1 runs"
    assert judged.ours == 2.0


def test_the_section_names_command_machine_and_load(tmp_path: Path) -> None:
    when = dt.datetime(2026, 12, 1, 23, 5, tzinfo=dt.UTC)
    text = results.section(
        "Issue 13 benchmarks",
        "| a | b |\n|---|---|",
        command="python bench/harness.py --only pins",
        when=when,
        machine_text="Linux x86_64, 2 CPUs",
        load_before=(1.0, 2.0, 3.0),
        load_after=(0.5, 0.25, 0.125),
        notes="All sections in 1.0 min.",
    )
    lines = text.splitlines()
    assert lines[1] == "## Issue 13 benchmarks (2026-12-01 23:05 UTC)"
    assert "```\npython bench/harness.py --only pins\n```" in text
    assert (
        "Machine: Linux x86_64, 2 CPUs; load average (1/5/15 min) 1.00/2.00/3.00 before, "
        "0.50/0.25/0.12 after." in lines
    )
    assert text.index("All sections") < text.index("| a | b |")
    target = tmp_path / "RESULTS.md"
    target.write_text("# Results\n")
    results.append(text, target)
    results.append(text, target)
    assert target.read_text() == "# Results\n" + text + text


def test_the_command_line_names_the_script_as_typed_from_the_repository() -> None:
    argv = [str(BENCH / "pins_bench.py"), "--hash-gib", "4"]
    assert results.command_line(argv) == "python bench/pins_bench.py --hash-gib 4"
    assert results.command_line(argv, "bench-pins").endswith("(`just bench-pins`)")
    assert "CPUs" in results.machine() and "Python" in results.machine()


def test_the_combined_text_marks_a_smoke_and_a_failed_section() -> None:
    failed = harness.Part("pins", "Pins", error="RuntimeError: exited 1")
    text = harness.combined([failed], [], "Load average reached 8.0", quick=True)
    assert text.startswith("**Smoke sizes")
    assert "**Failed:** RuntimeError: exited 1" in text
    assert text.index("Load average reached") > text.index("### Targets of issue 13")
    assert harness.load_warning((0.5, 0, 0), (0.7, 0, 0), 2) == ""
    assert "8.0 on 2 CPUs" in harness.load_warning((8.0, 0, 0), (1.0, 0, 0), 2)
