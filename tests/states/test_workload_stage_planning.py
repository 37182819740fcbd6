"""The stage servers' workload arms in a row's plan: only when both stage servers are bound
(paired serving planned), for each of overlap and sessions the file chooses, after the native
workload arms; skipped, saying why, when a workload needs more distinct first characters than
the chat alphabet holds; each on its own stage profile."""

from __future__ import annotations

from pathlib import Path

from run_harness import make_prepared

from cache_family.schemas.arms import (
    NATIVE_OPEN_LOOP,
    NEW_OPEN_LOOP,
    NEW_OVERLAP,
    NEW_SESSIONS,
    OLD_OPEN_LOOP,
    OLD_OVERLAP,
    OLD_PROFILE,
    OLD_SESSIONS,
    MeasurementKind,
)
from cache_family.schemas.prepared import PreparedInput, PreparedRow, load_prepared_input
from cache_family.schemas.workload import WorkloadsPin, validate_workload_object
from cache_family.states.plans import PromptChoice, cell_plan, workload_arm_plans
from cache_family.states.workloads import CHAT_ALPHABET, chat_starts_needed

PREFIX = MeasurementKind.PREFIX_OVERLAP


def _prepared(tmp_path: Path, overlap: dict[str, object] | None) -> PreparedInput:
    document: dict[str, object] = {"schema_version": 1, "multi_turn": {"users": 1, "turns": 2}}
    if overlap is not None:
        document["prefix_overlap"] = overlap
    pin = WorkloadsPin(
        path="/w.json", sha256="a" * 64, workloads=validate_workload_object(document)
    )
    prepared = load_prepared_input(str(make_prepared(tmp_path / "p")))
    return prepared.model_copy(update={"workloads": pin})


def _paired(row: PreparedRow, planned: bool) -> PreparedRow:
    tasks = row.tasks
    paired = tasks.paired_serving.model_copy(update={"planned": planned})
    return row.model_copy(update={"tasks": tasks.model_copy(update={"paired_serving": paired})})


def test_the_stage_overlap_arms_come_only_with_both_stage_servers_bound(tmp_path: Path) -> None:
    prepared = _prepared(tmp_path, {"prompt_tokens": 64, "groups": 1, "requests": 2})
    row = prepared.rows[0]
    unpaired = workload_arm_plans(prepared, _paired(row, False))
    assert [p.arm for p in unpaired] == ["native-overlap", "native-sessions"]
    paired = workload_arm_plans(prepared, _paired(row, True))
    assert [(p.arm, p.status) for p in paired] == [
        ("native-overlap", "planned"),
        ("native-sessions", "planned"),
        (OLD_OVERLAP.name, "planned"),
        (NEW_OVERLAP.name, "planned"),
        (OLD_SESSIONS.name, "planned"),
        (NEW_SESSIONS.name, "planned"),
    ]
    assert OLD_OVERLAP.profile == OLD_PROFILE and NEW_OVERLAP.profile != OLD_PROFILE
    # Only the chosen workloads: sessions alone plan no overlap arm.
    sessions_only = _prepared(tmp_path / "s", None)
    plans = workload_arm_plans(sessions_only, _paired(sessions_only.rows[0], True))
    assert [p.arm for p in plans] == ["native-sessions", OLD_SESSIONS.name, NEW_SESSIONS.name]


def test_a_sweep_beyond_the_chat_alphabet_skips_the_stage_arms_with_the_code(
    tmp_path: Path,
) -> None:
    overlap = {"prompt_tokens": 64, "groups": 4, "requests": 16}
    prepared = _prepared(tmp_path, overlap)
    spec = prepared.workloads.workloads.prefix_overlap  # type: ignore[union-attr]
    assert spec is not None and chat_starts_needed(prepared.workloads.workloads, PREFIX) > len(
        CHAT_ALPHABET
    )  # type: ignore[union-attr]
    plans = workload_arm_plans(prepared, _paired(prepared.rows[0], True))
    stage = [p for p in plans if p.arm in (OLD_OVERLAP.name, NEW_OVERLAP.name)]
    assert [p.status for p in stage] == ["skipped", "skipped"]
    # The sessions' few starts fit: their stage arms stay planned.
    assert [p.status for p in plans if p.arm in (OLD_SESSIONS.name, NEW_SESSIONS.name)] == [
        "planned",
        "planned",
    ]
    assert all((p.reason or "").startswith("workload.overlap.vocabulary") for p in stage)
    # The native arm is not limited by the alphabet.
    assert plans[0].arm == "native-overlap" and plans[0].status == "planned"


def test_the_open_loop_sweep_has_stage_arms_sized_on_the_stage_servers_lanes(
    tmp_path: Path,
) -> None:
    """The open-loop sweep runs on each stage server too (the row's prompt as a chat), on the
    lanes the paired stage servers serve with, as the native arm runs on the baseline's."""
    document = {
        "schema_version": 1,
        "open_loop": {"pattern": "constant", "rates_per_s": [2, 4], "requests": 4},
    }
    pin = WorkloadsPin(
        path="/w.json", sha256="a" * 64, workloads=validate_workload_object(document)
    )
    base = load_prepared_input(str(make_prepared(tmp_path / "p")))
    prepared = base.model_copy(update={"workloads": pin})
    row = _paired(prepared.rows[0], True)
    serving = row.tasks.paired_serving.model_copy(update={"runtime_lanes": 3})
    row = row.model_copy(update={"tasks": row.tasks.model_copy(update={"paired_serving": serving})})
    plans = workload_arm_plans(prepared, row)
    assert [p.arm for p in plans] == ["native-open-loop", OLD_OPEN_LOOP.name, NEW_OPEN_LOOP.name]
    assert all(p.status == "planned" for p in plans)
    assert OLD_OPEN_LOOP.kind == NEW_OPEN_LOOP.kind == MeasurementKind.OPEN_LOOP
    prompt = PromptChoice(
        text="x", source="use-case", corpus_path="/c.json", corpus_sha256="d" * 64, entry_key="k"
    )
    stage = cell_plan(prepared, row, NEW_OPEN_LOOP, prompt, None)
    native = cell_plan(prepared, row, NATIVE_OPEN_LOOP, prompt, None)
    assert stage.lanes == 3 and stage.ctx_size == row.ctx * 3
    assert native.lanes == row.tasks.concurrent_baseline.parallel
    assert stage.output_tokens == native.output_tokens == pin.workloads.open_loop.output_tokens  # type: ignore[union-attr]
