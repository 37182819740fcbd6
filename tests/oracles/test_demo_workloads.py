"""The demo's workload run (not in ``--quick``): the workload file it writes is valid, its
steps prepare with it, run, report and replay; and, on the real parts, the run measures the
overlap and the open-loop sweep on one attention and one recurrent family (both also on the
old and new stage servers), every accepted point within its band, the report shows
both sections and old against new, and replay is identical."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import msgspec
import pytest
from real_run_harness import cli

from cache_family.actors.audit.trace_file import pin_trace
from cache_family.console import bench_sequence
from cache_family.oracles.demo import (
    DEFAULT_PLAN,
    DEMO_TRACE,
    DEMO_WORKLOADS,
    PLANS,
    REAL_TRACE,
    WORKLOAD_CASES,
    operator_input,
    runs_workloads,
    with_trace,
    workload_steps,
)
from cache_family.oracles.native_parts import Parts
from cache_family.schemas.catalog import packaged_catalog
from cache_family.schemas.workload import validate_workload_object
from cache_family.schemas.workload_records import TraceReceipt, decode_workload_receipt
from cache_family.states.chat_pieces import CHAT_ALPHABET
from cache_family.states.workloads import CHAT_CALIBRATION_MESSAGES


def test_the_demo_workload_file_is_valid_and_names_an_attention_and_a_recurrent_family() -> None:
    workloads = validate_workload_object(DEMO_WORKLOADS)
    assert workloads.prefix_overlap is not None and workloads.open_loop is not None
    assert workloads.open_loop.sweep is not None
    keys = {preset.key for preset in packaged_catalog().catalog.presets}
    assert set(WORKLOAD_CASES) <= keys and len(WORKLOAD_CASES) == 2


def test_quick_skips_the_workload_run_and_the_default_plan_runs_it() -> None:
    assert not runs_workloads(PLANS["quick"])
    assert runs_workloads(PLANS[DEFAULT_PLAN]) and runs_workloads(PLANS["full"])


def test_the_workload_steps_prepare_with_the_file_then_run_report_and_replay(
    tmp_path: Path,
) -> None:
    steps, wrote = workload_steps(str(tmp_path), "/op.json", "/w.json")
    runner = bench_sequence.default_runner()
    prepared_dir = f"{tmp_path}/workloads-input"
    assert [step.argv[len(runner) :] for step in steps] == [
        ("prepare-full", "--input", "/op.json", "--output", prepared_dir, "--workloads", "/w.json"),
        (
            "run",
            "--input",
            f"{prepared_dir}/cache-family-input.json",
            "--output",
            f"{tmp_path}/workloads",
        ),
        ("report-run", f"{tmp_path}/workloads"),
        ("replay", f"{tmp_path}/workloads"),
    ]
    assert wrote == (f"Wrote run report: {tmp_path}/workloads/report.html",)


@pytest.mark.native
def test_the_demo_workload_run_measures_both_families_and_replays(
    native_parts: Parts, oracle_tools: Path, tmp_path: Path
) -> None:
    operator = tmp_path / "operator.json"
    operator.write_text(json.dumps(operator_input(native_parts, oracle_tools, WORKLOAD_CASES)))
    workloads = tmp_path / "workloads.json"
    workloads.write_text(json.dumps(DEMO_WORKLOADS))
    steps, _ = workload_steps(str(tmp_path), str(operator), str(workloads))
    runner = bench_sequence.default_runner()
    for step in steps:
        done = cli(*step.argv[len(runner) :], cwd=tmp_path)
        assert done.returncode == 0, (step.name, done.stdout[-3000:], done.stderr[-3000:])
    run = tmp_path / "workloads"
    receipts = [decode_workload_receipt(p.read_bytes()) for p in run.glob("cell-*/*/workload.json")]
    native = [r for r in receipts if r.arm and r.arm.startswith("native-")]
    by_family = {(r.architecture, r.kind): r for r in native}
    assert set(by_family) == {
        (family, kind) for family in WORKLOAD_CASES for kind in ("prefix-overlap", "open-loop")
    }
    # The overlap sweep on the bound stage servers too: the new one (prefix reuse on) within
    # its band at every point it designs, the old one (the demo's prefix-reuse-off) reusing
    # nothing. A point whose design shares nothing the rule reuses is refused as designed
    # (never sent and accepted), on both servers.
    stage = {
        (r.architecture, r.arm): r for r in receipts if r.arm in ("old-overlap", "new-overlap")
    }
    assert set(stage) == {(f, a) for f in WORKLOAD_CASES for a in ("old-overlap", "new-overlap")}
    for family in WORKLOAD_CASES:
        new = stage[(family, "new-overlap")]
        assert [p.hit_ratio_pct for p in new.overlap] == [0, 30, 50, 70, 90]
        for point in new.overlap:
            shares = point.hit_ratio_pct == 0 or point.reusable_tokens > 0
            assert point.accepted == shares, point
            assert shares or point.refusal == "workload.overlap.nothing_shared", point
        old = stage[(family, "old-overlap")].overlap
        assert old[0].accepted and old[0].achieved_ratio_pct == 0.0
        for point in old[1:]:
            if point.reusable_tokens:
                assert point.refusal == "workload.overlap.outside_band", point
                assert point.achieved_ratio_pct == 0.0
            else:
                assert point.refusal == "workload.overlap.nothing_shared", point
                assert point.measured_requests == 0
    for family in WORKLOAD_CASES:
        overlap = by_family[(family, "prefix-overlap")]
        assert [p.hit_ratio_pct for p in overlap.overlap] == [0, 30, 50, 70, 90]
        assert all(p.accepted for p in overlap.overlap), overlap.overlap
        sweep = by_family[(family, "open-loop")].open_loop
        assert [s.stage for s in sweep[:2]] == ["synchronous", "throughput"]
    # The open-loop sweep on each stage server too: the row's prompt as a streamed chat, the
    # same closed-loop stages first as on the native host, answered through the stage server.
    stage_loops = {
        (r.architecture, r.arm): r for r in receipts if r.arm in ("old-open-loop", "new-open-loop")
    }
    assert set(stage_loops) == {
        (f, a) for f in WORKLOAD_CASES for a in ("old-open-loop", "new-open-loop")
    }
    for receipt in stage_loops.values():
        assert receipt.status == "accepted", receipt
        assert [s.stage for s in receipt.open_loop[:2]] == ["synchronous", "throughput"]
        assert all(s.completed > 0 for s in receipt.open_loop[:2]), receipt.open_loop
    # The recurrent family on llama-server: each group primed with a prompt its checkpoint
    # lands on, so the sweep shares what every point asks, as the attention family does.
    hybrid = {p.hit_ratio_pct: p for p in by_family[("qwen3next", "prefix-overlap")].overlap}
    for ratio in (30, 50, 70, 90):
        assert hybrid[ratio].reusable_tokens == 1024 * ratio // 100, hybrid[ratio]
    assert by_family[("qwen3next", "prefix-overlap")].reuse_probe is not msgspec.UNSET
    markdown = (run / "report.md").read_text()
    assert markdown.count("prefix-overlap (synthetic: plumbing evidence)") == 6
    assert "### Old against new" in markdown
    assert markdown.count("open-loop (synthetic: plumbing evidence)") == 6


def test_the_demo_replays_a_window_of_the_bundled_trace_slice_beside_its_notice() -> None:
    document = with_trace(DEMO_WORKLOADS, DEMO_TRACE)
    trace = validate_workload_object(document).trace
    assert trace is not None and trace.first == 4 and trace.tokens_per_block == 8
    slice_path = Path(trace.path)
    notice = (slice_path.parent / "NOTICE.md").read_text()
    assert hashlib.sha256(slice_path.read_bytes()).hexdigest() in notice
    assert "Apache License, Version 2.0" in notice
    real = validate_workload_object(with_trace(DEMO_WORKLOADS, REAL_TRACE)).trace
    assert real is not None and real.path == trace.path
    # The zoo's stage servers write the window in the byte alphabet: the plan keeps their
    # trace arms only while its ids and the template's calibration fit it.
    pinned, distinct = pin_trace(trace)
    assert pinned.sha256 is not None and distinct == 46
    assert distinct + CHAT_CALIBRATION_MESSAGES <= len(CHAT_ALPHABET)


@pytest.mark.native
def test_the_demo_trace_window_replays_on_native_and_stage_servers_of_both_families(
    native_parts: Parts, oracle_tools: Path, tmp_path: Path
) -> None:
    """The demo's trace window alone: every request of it, on each family's native host and
    on both stage servers, has a designed and an achieved figure; the report shows the trace
    section with old against new, and replay is identical."""
    operator = tmp_path / "operator.json"
    operator.write_text(json.dumps(operator_input(native_parts, oracle_tools, WORKLOAD_CASES)))
    workloads = tmp_path / "workloads.json"
    workloads.write_text(json.dumps(with_trace({"schema_version": 1}, DEMO_TRACE)))
    steps, _ = workload_steps(str(tmp_path), str(operator), str(workloads))
    runner = bench_sequence.default_runner()
    for step in steps:
        done = cli(*step.argv[len(runner) :], cwd=tmp_path)
        assert done.returncode == 0, (step.name, done.stdout[-3000:], done.stderr[-3000:])
    run = tmp_path / "workloads"
    receipts = [decode_workload_receipt(p.read_bytes()) for p in run.glob("cell-*/*/workload.json")]
    by_arm = {(r.architecture, r.arm): r for r in receipts}
    arms = ("native-trace", "old-trace", "new-trace")
    assert set(by_arm) == {(f, a) for f in WORKLOAD_CASES for a in arms}
    for (family, arm), receipt in by_arm.items():
        trace = receipt.trace
        assert isinstance(trace, TraceReceipt), receipt
        assert [r.index for r in trace.requests] == [0, 1, 2, 3]
        assert all(r.achieved_tokens is not None for r in trace.requests), (family, arm, trace)
        # Named with its rows: a claim above the design says which request and by how much.
        assert trace.over_claimed == () and trace.token_count_mismatches == (), (family, arm, trace)
        assert [r.designed_infinite_tokens for r in trace.requests] == [0, 8, 8, 8]
        if arm == "old-trace":  # the demo's old server: prefix reuse off
            assert trace.achieved_tokens == 0, trace
    markdown = (run / "report.md").read_text()
    assert markdown.count("each 512-token block replayed as 8 tokens") == 6
    assert markdown.count("trace replay (efficiency)") == 2
