"""The overlap sweep and multi-turn sessions on the paired stage servers (old
``skippy-prefix-reuse-off``, new ``skippy``: the oracle with prefix reuse off and on), in their
OpenAI chat dialect, through a real run on the zoo's llama and qwen3next: text messages, reuse
from the server's own ``usage.prompt_tokens_details.cached_tokens``, the chat template's tokens
measured by the cell's calibration and left out of the judged figures. The new server's 0 %
control reuses nothing beyond the template, its 90 % point about 90 %; the old one reuses
nothing and is refused at every non-zero point; qwen3next (hybrid) reuses the whole prompt's
checkpoint; sessions run as chat conversations whose every later turn reuses the one before on
the new server and nothing on the old; replay re-folds every receipt; the report sets old
against new. Tiny random-weight models: plumbing evidence, not performance claims."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from real_run_harness import cli, paired_operator, prepare_and_run

from cache_family.oracles.native_parts import Parts
from cache_family.schemas.arms import (
    NEW_OVERLAP,
    NEW_SESSIONS,
    OLD_OVERLAP,
    OLD_SESSIONS,
    STAGE_WORKLOAD_ARMS,
    MeasurementKind,
)
from cache_family.schemas.journal import read_journal
from cache_family.schemas.receipts import decode_row_receipt
from cache_family.schemas.workload_records import OverlapPointMeasured, decode_workload_receipt

pytestmark = pytest.mark.native

WORKLOADS = {
    "schema_version": 1,
    "prefix_overlap": {
        "prompt_tokens": 1024,
        "hit_ratios_pct": [0, 50, 90],
        "groups": 2,
        "requests": 4,
        "seed": 11,
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
}


# The stage arms this workload file chooses (it has no open-loop sweep).
CHOSEN_STAGE_ARMS = tuple(
    arm
    for arm in STAGE_WORKLOAD_ARMS
    if arm.kind in (MeasurementKind.PREFIX_OVERLAP, MeasurementKind.SESSIONS)
)


def test_the_overlap_sweep_runs_on_old_and_new_stage_servers_and_replays(
    native_parts: Parts, oracle_tools: Path, tmp_path: Path
) -> None:
    operator = paired_operator(native_parts, oracle_tools, tmp_path, ["llama", "qwen3next"])
    workloads = tmp_path / "workloads.json"
    workloads.write_text(json.dumps(WORKLOADS))
    out, code, stderr = prepare_and_run(
        operator, tmp_path, "prepare-full", "--workloads", str(workloads)
    )
    assert code == 0, stderr
    row = decode_row_receipt((out / "cell-0000" / "row.json").read_bytes())
    observed = {o.arm: (o.planned, o.status) for o in row.observations}
    assert [o.arm for o in row.observations][-4:] == [a.name for a in CHOSEN_STAGE_ARMS]
    for arm in CHOSEN_STAGE_ARMS:
        assert observed[arm.name] == ("planned", "completed"), row.observations
    receipts = {
        arm.name: decode_workload_receipt(
            (out / "cell-0000" / arm.directory / "workload.json").read_bytes()
        )
        for arm in CHOSEN_STAGE_ARMS
    }

    new = receipts[NEW_OVERLAP.name]
    assert new.kind == "prefix-overlap" and new.rule == "exact-prefix" and new.synthetic
    points = {p.hit_ratio_pct: p for p in new.overlap}
    assert points[0].accepted and points[0].achieved_ratio_pct == 0.0, points[0]
    high = points[90]
    assert high.accepted, high
    assert high.band_pp is not None and high.achieved_ratio_pct is not None
    assert high.achieved_ratio_pct == pytest.approx(90.0, abs=high.band_pp)
    assert points[50].accepted, points[50]
    assert new.status == "accepted"
    # Each stage point lists its requests' prompt times (the report's interval).
    assert len(high.prompt_ms) == 4  # type: ignore[arg-type]

    old = receipts[OLD_OVERLAP.name]
    old_points = {p.hit_ratio_pct: p for p in old.overlap}
    assert old_points[0].accepted
    for ratio in (50, 90):
        assert old_points[ratio].refusal == "workload.overlap.outside_band", old_points[ratio]
        assert old_points[ratio].achieved_ratio_pct == 0.0
    assert old.status == "refused"

    # The chat template's tokens, as the calibration measured them, are journaled per point;
    # the server counted each prompt the designed length, template included.
    journal = read_journal((out / "journal.jsonl").read_bytes())
    stage_points = [
        line.record
        for line in journal.lines
        if isinstance(line.record, OverlapPointMeasured)
        and line.record.cell_id.endswith(NEW_OVERLAP.name)
    ]
    assert stage_points and all(p.template_tokens > 0 for p in stage_points)
    for point in stage_points:
        assert point.prompt_tokens + point.template_tokens == 1024
        assert {r.prompt_tokens for r in point.requests if not r.priming} == {1024}
        # A checkpoint family's priming message is cut to put the checkpoint on the prefix.
        priming = (point.priming_prompt_tokens or point.prompt_tokens) + point.template_tokens
        assert {r.prompt_tokens for r in point.requests if r.priming} == {priming}
    # The recurrent row's points that share are primed and reuse their design.
    recurrent = decode_workload_receipt(
        (out / "cell-0001" / NEW_OVERLAP.directory / "workload.json").read_bytes()
    )
    assert recurrent.rule == "checkpoint"
    assert any(p.priming_prompt_tokens for p in stage_points if p.cell_id.startswith("cell-0001"))
    for point in recurrent.overlap:
        assert point.accepted, point

    # Sessions as chat conversations: on the new server every later turn reuses the turn
    # before it (its prompt and answer as the server counted them); the old reuses nothing.
    for row_dir in ("cell-0000", "cell-0001"):
        chats = {
            arm.name: decode_workload_receipt(
                (out / row_dir / arm.directory / "workload.json").read_bytes()
            ).sessions
            for arm in (OLD_SESSIONS, NEW_SESSIONS)
        }
        new_sessions, old_sessions = chats[NEW_SESSIONS.name], chats[OLD_SESSIONS.name]
        assert new_sessions is not None and old_sessions is not None
        assert new_sessions.failed_requests == 0 and new_sessions.eviction_turn is None
        assert [t.turn for t in new_sessions.by_turn] == [0, 1, 2]
        assert new_sessions.by_turn[0].achieved_reused_tokens == 0
        for turn in new_sessions.by_turn[1:]:
            assert turn.achieved_reused_tokens == turn.expected_reused_tokens > 0, turn
        # Every user on a slot of its own with room to spare: nothing could be evicted, so
        # the old server's lost reuse is a shortfall against the rule, refused, not an eviction.
        assert old_sessions.eviction_turn is None and old_sessions.shortfall_turn == 1
        assert old_sessions.refusal == "workload.sessions.reuse_short"
        assert all(t.achieved_reused_tokens == 0 for t in old_sessions.by_turn)

    # qwen3next (hybrid recurrent): what its checkpoint rule allows, on the new server only.
    hybrid = {
        arm.name: decode_workload_receipt(
            (out / "cell-0001" / arm.directory / "workload.json").read_bytes()
        )
        for arm in CHOSEN_STAGE_ARMS
    }
    checkpointed = hybrid[NEW_OVERLAP.name]
    assert checkpointed.rule == "checkpoint" and checkpointed.status == "accepted"
    for point in checkpointed.overlap:
        assert point.accepted and point.achieved_ratio_pct == point.designed_ratio_pct, point
    assert checkpointed.overlap[-1].reusable_tokens == 1024 - 4 - 512
    assert hybrid[OLD_OVERLAP.name].status == "refused"

    reported = cli("report-run", str(out), cwd=tmp_path)
    assert reported.returncode == 0, reported.stderr
    markdown = (out / "report.md").read_text()
    section = markdown[markdown.index("### Old against new") :]
    assert "| cell-0000 | overlap 90 % | 0.00 % |" in section
    assert "| cell-0000 | sessions turn 2 | 0.00 % |" in section

    replayed = cli("replay", str(out), cwd=tmp_path)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    for arm in CHOSEN_STAGE_ARMS:
        assert f"cell-0000/{arm.directory}/workload.json" in replayed.stdout
    # An edited stage verdict is caught: replay re-folds it from the journal.
    edited = out / "cell-0000" / NEW_OVERLAP.directory / "workload.json"
    edited.write_text(edited.read_text().replace('"accepted": true', '"accepted": false', 1))
    tampered = cli("replay", str(out), cwd=tmp_path)
    assert tampered.returncode != 0
    assert f"DIFFERS cell-0000/{NEW_OVERLAP.directory}/workload.json" in tampered.stdout
