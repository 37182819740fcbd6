"""The stage servers' workload arms in a row's plan: only when both stage servers are bound
(paired serving planned), for each of overlap and sessions the file chooses, after the native
workload arms; skipped, saying why, when a workload needs more distinct first characters than
the chat alphabet holds; each on its own stage profile."""

from __future__ import annotations

from pathlib import Path

from run_harness import make_prepared

from cache_family.schemas.arms import (
    NATIVE_OPEN_LOOP,
    NATIVE_TRACE,
    NEW_OPEN_LOOP,
    NEW_OVERLAP,
    NEW_SESSIONS,
    NEW_TRACE,
    OLD_OPEN_LOOP,
    OLD_OVERLAP,
    OLD_PROFILE,
    OLD_SESSIONS,
    OLD_TRACE,
    MeasurementKind,
)
from cache_family.schemas.prepared import PreparedInput, PreparedRow, load_prepared_input
from cache_family.schemas.workload import WorkloadsPin, validate_workload_object
from cache_family.states.plans import PromptChoice, cell_plan, workload_arm_plans
from cache_family.states.workloads import (
    CHAT_ALPHABET,
    CHAT_CALIBRATION_MESSAGES,
    chat_starts_needed,
)

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


def _traced(
    tmp_path: Path, distinct: int | None, synthetic: bool
) -> tuple[PreparedInput, PreparedRow]:
    document = {"schema_version": 1, "trace": {"path": "/t.jsonl", "sha256": "b" * 64}}
    pin = WorkloadsPin(
        path="/w.json",
        sha256="a" * 64,
        workloads=validate_workload_object(document),
        trace_distinct_ids=distinct,
    )
    base = load_prepared_input(str(make_prepared(tmp_path)))
    prepared = base.model_copy(update={"workloads": pin})
    row = _paired(prepared.rows[0], True).model_copy(update={"synthetic": synthetic})
    return prepared, row


def test_a_trace_window_beyond_a_synthetic_models_chat_alphabet_skips_its_stage_arms(
    tmp_path: Path,
) -> None:
    """The count preparation pinned decides: the window's ids and the template's two
    calibration messages each start with a character of their own."""
    fits = len(CHAT_ALPHABET) - CHAT_CALIBRATION_MESSAGES
    prepared, row = _traced(tmp_path / "a", fits, synthetic=True)
    plans = workload_arm_plans(prepared, row)
    assert [(p.arm, p.status) for p in plans] == [
        (NATIVE_TRACE.name, "planned"),
        (OLD_TRACE.name, "planned"),
        (NEW_TRACE.name, "planned"),
    ]
    prepared, row = _traced(tmp_path / "b", fits + 1, synthetic=True)
    plans = workload_arm_plans(prepared, row)
    # The native arm sends token ids: not limited by the alphabet.
    assert plans[0].arm == NATIVE_TRACE.name and plans[0].status == "planned"
    stage = plans[1:]
    assert [(p.arm, p.status) for p in stage] == [
        (OLD_TRACE.name, "skipped"),
        (NEW_TRACE.name, "skipped"),
    ]
    for plan in stage:
        assert (plan.reason or "").startswith("trace.vocabulary: ")
        assert f"has {fits + 1} distinct hash ids" in (plan.reason or "")
        assert f"needing {len(CHAT_ALPHABET) + 1} " in (plan.reason or "")


def test_a_stage_trace_is_left_to_the_replay_where_the_plan_cannot_know_the_pieces(
    tmp_path: Path,
) -> None:
    """Another model's chat pieces are chosen from its vocabulary at run time, and a pin
    without the count says nothing: both stay planned (the replay refuses what does not fit)."""
    for name, distinct, synthetic in (("real", 400, False), ("uncounted", None, True)):
        prepared, row = _traced(tmp_path / name, distinct, synthetic=synthetic)
        plans = workload_arm_plans(prepared, row)
        assert [p.status for p in plans] == ["planned"] * 3, name
