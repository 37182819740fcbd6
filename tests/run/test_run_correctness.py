"""The run's correctness arm, on trio's autojump clock with FAKE hosts and a FAKE tool child.

The supervisor, row, correctness and cell actors, the gate, the journal and the folds are
real; the correctness tool is ``fake_hosts/fake_correctness_tool`` run in process, scripted to
write what a real tool cannot be made to write (a foreign model id, a wrong range, ...). The
real oracle's own passing run is in ``test_run_integration``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from fake_hosts.fake_custody import FakeHostScript, fake_child_runner
from run_harness import autojump_clock, make_prepared, matrix, records, row, run

from cache_family.actors.audit.replay import replay
from cache_family.schemas.journal import (
    ChildSpawned,
    CliAdmission,
    CorrectnessTopologyRan,
    CorrectnessVerdict,
    Transition,
)
from cache_family.states.handoff import RUNTIME_SLICE_TOPOLOGIES

__all__ = ["autojump_clock"]  # the fixture, imported for this module's tests

SKIPPED = "correctness failed-or-incomplete: baselines skipped"

# One member a real tool cannot be made to get wrong, and the gate's code for it.
REJECTED: list[tuple[dict[str, Any], str]] = [
    ({"mode": "recompute"}, "handoff.mode"),
    ({"status": "fail"}, "handoff.status"),
    ({"matches": False}, "handoff.mismatch"),
    ({"cache_hit_matches": False}, "handoff.mismatch"),
    ({"model_identity": {"model_id": "someone/else"}}, "handoff.model_id"),
    ({"state_payload_kind": "kv-recurrent"}, "handoff.payload"),
    ({"layer_start": 1, "layer_end": 1}, "handoff.range"),
    ({"activation_width": 1}, "handoff.activation_width"),
    ({"requested_prefix_token_count": 1}, "handoff.prefix"),
    ({"benchmark_prompt_token_count": 2}, "handoff.prompt_tokens"),
    ({"benchmark_prompt_text": ""}, "handoff.prompt_text"),
    ({"cache_hit_repeats": 99}, "handoff.repeats"),
    ({"cache_hit_import_ms": []}, "handoff.samples"),
    ({"recompute_total_ms": -1.0}, "handoff.timing"),
    ({"cache_hit_total_ms": 9.0}, "handoff.total"),
    ({"cache_hit_decode_ms": "fast"}, "handoff.type"),
]


@pytest.mark.parametrize(("edit", "code"), REJECTED, ids=[code for _, code in REJECTED])
async def test_each_rejected_report_field_reaches_the_row_and_skips_the_baselines(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, edit: dict[str, Any], code: str
) -> None:
    script = FakeHostScript()
    out = tmp_path / "out"
    outcome = await run(
        make_prepared(tmp_path / "p"), out, script, child_runner=fake_child_runner(edit)
    )
    receipt = row(out)
    assert receipt.status == "failed" and receipt.reason == "correctness_report_refused"
    checked = receipt.correctness
    assert checked.status == "failed-or-incomplete" and checked.prompt_sha256 is None
    assert [t.topology for t in checked.topologies] == list(RUNTIME_SLICE_TOPOLOGIES)
    for topology in checked.topologies:
        assert topology.status == "refused" and code in topology.refusal_codes
        # The evidence stays: the report the gate refused, the logs, the process record.
        assert (out / str(topology.evidence_dir) / "state-handoff.json").is_file()
        assert (out / str(topology.evidence_dir) / "process.json").is_file()
    # Its baselines were skipped with the reason; no host was ever launched for the row.
    assert [(o.arm, o.status, o.reason) for o in receipt.observations] == [
        ("native-serial", "skipped", SKIPPED),
        ("native-concurrent", "skipped", SKIPPED),
    ]
    assert script.launched == [] and not (out / "cell-0000" / "native-serial").exists()
    assert receipt.lifecycle == ("correctness", "finalize")  # as published
    # Never promoted: neither the row nor the matrix is completed.
    assert matrix(out).rows[0].result.status == "failed"
    assert outcome.status != "completed" and matrix(out).status != "completed"
    assert replay(str(out)).exit_code == 0


async def test_a_tool_that_exits_non_zero_fails_the_process_and_keeps_its_evidence(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    script = FakeHostScript()
    out = tmp_path / "out"
    runner = fake_child_runner(exit_code=1)
    await run(make_prepared(tmp_path / "p"), out, script, child_runner=runner)
    receipt = row(out)
    assert receipt.status == "incomplete" and receipt.reason == "correctness_process_refused"
    assert {t.status for t in receipt.correctness.topologies} == {"failed-process"}
    assert {t.reason for t in receipt.correctness.topologies} == {"the tool exited 1"}
    assert script.launched == []
    assert [o.status for o in receipt.observations] == ["skipped", "skipped"]


async def test_topologies_that_accept_different_prompts_are_not_accepted(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    script = FakeHostScript()
    out = tmp_path / "out"

    def edit(call: int) -> dict[str, Any]:
        return {"benchmark_prompt_text": "another prompt"} if call == 2 else {}

    await run(make_prepared(tmp_path / "p"), out, script, child_runner=fake_child_runner(edit))
    receipt = row(out)
    # Every topology passed the gate on its own; the stage did not.
    assert {t.status for t in receipt.correctness.topologies} == {"pass"}
    assert receipt.correctness.status == "failed-or-incomplete"
    assert str(receipt.correctness.reason).startswith("correctness_prompt_disagrees")
    assert receipt.status == "incomplete" and script.launched == []


async def test_the_tool_gets_the_reference_command_line_per_topology(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    ran: list[tuple[str, ...]] = []
    out = tmp_path / "out"
    await run(
        make_prepared(tmp_path / "p"),
        out,
        FakeHostScript(),
        child_runner=fake_child_runner(ran=ran),
    )
    assert len(ran) == 4 and row(out).status == "completed"
    ranges = []
    for argv in ran:
        assert argv[1] == "state-handoff" and argv[2] == "--model"
        flags = list(argv)
        ranges.append(
            tuple(
                int(flags[flags.index(f) + 1])
                for f in ("--state-layer-start", "--state-layer-end", "--state-stage-index")
            )
        )
        report_out = flags[flags.index("--report-out") + 1]
        assert (
            report_out.endswith("/state-handoff.json") and "/correctness/topology-0" in report_out
        )
        assert flags[flags.index("--source-bind-addr") + 1].startswith("127.0.0.1:")
        assert "--prompt" not in flags  # a full row: the tool chooses its own prompt
    layer_end = int(ran[0][ran[0].index("--layer-end") + 1])
    first = layer_end // 3
    second = 2 * first + (2 * (layer_end % 3)) // 3
    assert ranges == [(0, layer_end, 0), (0, first, 0), (first, second, 1), (second, layer_end, 2)]
    spawned = [s for s in records(out, ChildSpawned) if s.role == "correctness"]
    assert [s.argv_sha256 for s in spawned] == [
        t.argv_sha256 for t in records(out, CorrectnessTopologyRan)
    ]
    [verdict] = records(out, CorrectnessVerdict)
    assert verdict.status == "completed" and verdict.planned_topologies == RUNTIME_SLICE_TOPOLOGIES
    steps = [
        (t.from_state, t.event, t.to_state)
        for t in records(out, Transition)
        if t.machine == "correctness"
    ]
    assert steps == [
        ("admit", "admitted", "topology"),
        *[("topology", "topology-ended", "topology")] * 3,
        ("topology", "topologies-exhausted", "gate"),
        ("gate", "accepted", "finalize"),
        ("finalize", "verdict-journaled", "done"),
    ]


async def test_a_correctness_pin_that_drifted_runs_no_tool_and_no_baseline(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    from fake_hosts.fake_custody import hasher

    ran: list[tuple[str, ...]] = []
    out = tmp_path / "out"
    script = FakeHostScript()
    await run(
        make_prepared(tmp_path / "p"),
        out,
        script,
        pins=hasher({0: "correctness"}),
        child_runner=fake_child_runner(ran=ran),
    )
    receipt = row(out)
    assert ran == [] and script.launched == []
    assert receipt.correctness.status == "not-run"
    assert str(receipt.correctness.reason).startswith("pin_mismatch: correctness")
    assert receipt.status == "incomplete"


async def test_a_missing_pair_skips_paired_serving(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """No old/new pair is bound (a one-sided pair is refused at admission): no stage
    server cell, no parity; the row completes on its native arms."""
    prepared = make_prepared(tmp_path / "p", old_server=None, new_server=None)
    document = json.loads(prepared.read_bytes())
    assert document["rows"][0]["tasks"]["paired_serving"]["skip_reason"] == (
        "paired-servers-omitted"
    )
    script = FakeHostScript()
    out = tmp_path / "out"
    await run(prepared, out, script)
    receipt = row(out)
    assert receipt.status == "completed" and receipt.parity == ()
    assert [o.arm for o in receipt.observations] == ["native-serial", "native-concurrent"]
    assert script.launched == ["native-serial", "sweep-native-concurrent"]
    assert records(out, CliAdmission) == []
    assert [e.cohort for e in receipt.observation_order] == [
        "native-serial",
        "native-concurrent",
        "native-concurrent",
    ]
