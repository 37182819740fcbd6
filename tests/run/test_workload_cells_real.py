"""The workload file's measurement kinds as cells of a real run on the zoo (llama-server, the
tiny llama): prepared with ``--workloads``, each chosen workload runs as its own arm after
the row's host arms, publishes ``workload.json`` folded from the journal, and ``replay``
re-folds it byte for byte. The 0 % overlap control measures no reuse, the 90 % point about
90 %, every session turn reuses the session so far, and an open-loop rate the zoo cannot
sustain stops as over-saturated (the rate below it does not). Tiny random-weight models:
plumbing evidence, not performance claims."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
from real_run_harness import cli, operator_for

from cache_family.actors.run.workload_dialects import WorkloadHost
from cache_family.actors.run.workloads import run_overlap
from cache_family.oracles.native_parts import Parts, serve
from cache_family.schemas.arms import HOST_ARMS, WORKLOAD_ARMS
from cache_family.schemas.journal import JournalLine, Record
from cache_family.schemas.receipts import decode_row_receipt
from cache_family.schemas.workload import validate_workload_object
from cache_family.schemas.workload_records import (
    OverlapPointMeasured,
    ReuseProbed,
    decode_workload_receipt,
)
from cache_family.states.workload_fold import fold_workload
from cache_family.system.http import LoopbackHttp

pytestmark = pytest.mark.native

# The workloads this file chooses (the trace replay has its own test).
CHOSEN = tuple(arm for arm in WORKLOAD_ARMS if arm.name != "native-trace")
OVER_SATURATED = ("workload.arrivals.in_flight_growing", "workload.arrivals.sender_late")
WORKLOADS = {
    "schema_version": 1,
    "prefix_overlap": {
        "prompt_tokens": 128,
        "hit_ratios_pct": [0, 50, 90],
        "groups": 2,
        "requests": 4,
        "seed": 7,
    },
    "multi_turn": {
        "users": 2,
        "turns": 3,
        "system_prompt_tokens": 32,
        "user_context_tokens": 16,
        "question_tokens": 8,
        "answer_tokens": 4,
        "seed": 3,
    },
    "open_loop": {
        "pattern": "poisson",
        "rates_per_s": [10, 3000],
        "duration_s": 3,
        "output_tokens": 2,
        "seed": 5,
        # On a shared 2-core host the client may fall behind before the queue is seen
        # growing: either stop is an over-saturated rate.
        "over_saturation": {"window": 16, "min_in_flight": 8, "max_lateness_ms": 200},
    },
}


def test_a_run_with_a_workload_file_measures_each_workload_as_a_cell_and_replays_it(
    native_parts: Parts, oracle_tools: Path, tmp_path: Path
) -> None:
    operator = operator_for(native_parts, oracle_tools, tmp_path, ["llama"])
    workloads = tmp_path / "workloads.json"
    workloads.write_text(json.dumps(WORKLOADS))
    prepared_dir = tmp_path / "prepared"
    prepare = cli(
        "prepare-full",
        "--input",
        str(operator),
        "--output",
        str(prepared_dir),
        "--workloads",
        str(workloads),
        cwd=tmp_path,
    )
    assert prepare.returncode == 0, prepare.stderr
    out = tmp_path / "run"
    prepared = prepared_dir / "cache-family-input.json"
    ran = cli("run", "--input", str(prepared), "--output", str(out), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr

    row = decode_row_receipt((out / "cell-0000" / "row.json").read_bytes())
    # The host arms are measured as before, then each workload as a planned arm of its own.
    observed = {o.arm: (o.planned, o.status) for o in row.observations}
    assert [o.arm for o in row.observations][-3:] == [arm.name for arm in CHOSEN]
    for arm in (*HOST_ARMS[:2], *CHOSEN):
        assert observed[arm.name] == ("planned", "completed"), row.observations
    assert row.status == "completed"
    receipts = {
        arm.name: decode_workload_receipt(
            (out / "cell-0000" / arm.directory / "workload.json").read_bytes()
        )
        for arm in CHOSEN
    }

    overlap = receipts["native-overlap"]
    assert overlap.kind == "prefix-overlap" and overlap.rule == "exact-prefix"
    points = {p.hit_ratio_pct: p for p in overlap.overlap}
    assert sorted(points) == [0, 50, 90]
    assert points[0].accepted and points[0].achieved_ratio_pct == 0.0
    high = points[90]
    assert high.accepted, high
    assert high.band_pp is not None and high.achieved_ratio_pct is not None
    assert high.achieved_ratio_pct == pytest.approx(90.0, abs=high.band_pp)
    assert points[50].accepted, points[50]
    assert overlap.status == "accepted" and overlap.synthetic

    sessions = receipts["native-sessions"].sessions
    assert sessions is not None and sessions.failed_requests == 0
    assert [t.turn for t in sessions.by_turn] == [0, 1, 2]
    for turn in sessions.by_turn[1:]:
        assert turn.achieved_reused_tokens == turn.expected_reused_tokens > 0, turn
    assert sessions.eviction_turn is None

    arrivals = receipts["native-open-loop"]
    low, high_rate = arrivals.open_loop
    assert low.target_rate_per_s == 10 and low.stop_reason is None
    assert low.completed == low.scheduled > 0
    assert high_rate.stop_reason in OVER_SATURATED, high_rate
    assert high_rate.launched < high_rate.scheduled
    assert arrivals.over_saturated_at_per_s == 3000

    # The host's own counters around every point (llama-server --metrics), beside the
    # client's sums of the point's requests: they agree wherever every request reported.
    agreements = {
        arm: [
            (p.scope, p.index, p.metrics.status, p.metrics.agreement)
            for p in receipt.server_metrics
        ]  # type: ignore[union-attr]
        for arm, receipt in receipts.items()
    }
    assert agreements["native-overlap"] == [
        ("prefix-overlap", index, "read", "agrees") for index in range(3)
    ]
    assert agreements["native-sessions"] == [("sessions", 0, "read", "agrees")]
    (low_rate, *rest) = agreements["native-open-loop"]
    assert low_rate == ("open-loop", 0, "read", "agrees")
    # The over-saturated rate may stop with requests the server never answered in full.
    assert [(s, i, st) for s, i, st, _ in rest] == [("open-loop", 1, "read")]
    for receipt in receipts.values():
        for point in receipt.server_metrics:  # type: ignore[union-attr]
            assert point.metrics.server is not None
            assert point.metrics.server.server == "llama.cpp"

    # The report shows each workload (replay regenerates the report files and compares them).
    reported = cli("report-run", str(out), cwd=tmp_path)
    assert reported.returncode == 0, reported.stderr
    markdown = (out / "report.md").read_text()
    section = markdown[markdown.index("## Workloads") :]
    assert "| 90 % | 89.84 % | 89.84 % | ± 0.78 pp | accepted |" in section
    assert "eviction: none" in section
    assert "Over-saturated at 3000/s" in section
    for arm in CHOSEN:
        slug = f"cell-0000_{arm.name}"
        assert (out / "plots" / f"workload-{slug}.svg").is_file()
        assert f"plots/workload-{slug}.svg" in (out / "report.html").read_text()

    replayed = cli("replay", str(out), cwd=tmp_path)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    for arm in CHOSEN:
        assert f"cell-0000/{arm.directory}/workload.json" in replayed.stdout
    # An edited verdict is caught: replay re-folds workload.json from the journal.
    edited = out / "cell-0000" / CHOSEN[0].directory / "workload.json"
    edited.write_text(edited.read_text().replace('"accepted": true', '"accepted": false', 1))
    tampered = cli("replay", str(out), cwd=tmp_path)
    assert tampered.returncode != 0
    assert f"DIFFERS cell-0000/{CHOSEN[0].directory}/workload.json" in tampered.stdout


def test_a_server_that_reuses_nothing_is_refused_at_every_overlap_point(
    native_parts: Parts,
) -> None:
    """The overlap runner against a llama-server started with ``--no-cache-prompt`` (its
    request bodies leave prompt caching to the server): the probe as the workload opens finds
    the server following no reuse rule (it reused nothing of a prompt sent twice), journals
    what it saw, and every point is refused as designed with its code, nothing sent."""
    spec = validate_workload_object(
        {
            "schema_version": 1,
            "prefix_overlap": {
                "prompt_tokens": 96,
                "hit_ratios_pct": [0, 30, 90],
                "groups": 1,
                "requests": 3,
            },
        }
    )
    journaled: list[Record] = []

    async def journal(record: Record) -> None:
        journaled.append(record)

    with serve(
        native_parts.llama_server,
        native_parts.model_path("llama"),
        ctx_size=256,
        extra_args=["--no-cache-prompt"],
    ) as server:

        async def main() -> bool:
            host = WorkloadHost(
                cell_id="cell-0000/native-overlap",
                base_url=server.url,
                http=LoopbackHttp(),
                journal=journal,
                deadline=trio.current_time() + 120,
                request_timeout_ms=60_000,
                architecture="llama",
                workloads=spec,
                workloads_sha256="",
                prompt_text="",
                ignore_eos=True,
            )
            return await run_overlap(host)

        assert trio.run(main)
    lines = [
        JournalLine(seq=seq, mono_ns=0, wall_ns=0, prev="", record=record)
        for seq, record in enumerate(journaled, start=1)
    ]
    receipt = fold_workload(lines, "cell-0000/native-overlap")
    [probe] = [r for r in journaled if isinstance(r, ReuseProbed)]
    assert probe.header_rule == "exact-prefix" and probe.rule is None
    assert [step.cached_tokens for step in probe.steps] == [0, 0, 0, 0]
    assert [p.hit_ratio_pct for p in receipt.overlap] == [0, 30, 90]
    for point in receipt.overlap:
        assert not point.accepted and point.refusal == "workload.reuse.server_disagrees", point
        assert point.measured_requests == 0 and point.achieved_ratio_pct is None
    assert not any(isinstance(r, OverlapPointMeasured) and r.requests for r in journaled)
    assert receipt.status == "refused" and receipt.rule is None
