"""A declared OpenAI-compatible server's arms, planned from the prepared input alone: none
without its profile, its ladder sized and skipped as the native baseline's, its cells naming
its model and judged by its own profile's pins."""

from __future__ import annotations

from pathlib import Path

from run_harness import make_prepared

from cache_family.actors.run.resume import _row_targets
from cache_family.oracles.demo import DEMO_TRACE, with_trace
from cache_family.schemas.arms import (
    NATIVE_CONCURRENT,
    OPENAI_CONCURRENT,
    OPENAI_OPEN_LOOP,
    OPENAI_OVERLAP,
    OPENAI_SESSIONS,
    OPENAI_TRACE,
)
from cache_family.schemas.openai_host import admit_serving
from cache_family.schemas.prepared import PreparedInput, encode_document, load_prepared_input
from cache_family.schemas.workload import WorkloadsPin, validate_workload_object
from cache_family.states.chat_pieces import CHAT_ALPHABET
from cache_family.states.plans import PromptChoice, cell_plan, declared_arm_plans, host_profile

SERVING = {
    "schema_version": 1,
    "module": None,
    "args": ["--port", "{port}"],
    "dialects": ["chat"],
    "block_size": 32,
    "metrics_path": None,
    "listening_text": "listening on {port}",
}
PROMPT = PromptChoice(
    text="x", source="use-case", corpus_path="/c.json", corpus_sha256="d" * 64, entry_key="k"
)


def _declared(prepared: PreparedInput) -> PreparedInput:
    key = prepared.rows[0].key
    profiles = prepared.profiles[key]
    assert profiles.native is not None
    served = profiles.native.model_copy(
        update={"host": "openai", "model_id": "served", "openai": admit_serving(SERVING)}
    )
    declared = profiles.model_copy(update={"openai": served})
    return prepared.model_copy(update={"profiles": {**prepared.profiles, key: declared}})


def test_no_declared_server_plans_no_arm_and_encodes_as_before(tmp_path: Path) -> None:
    path = make_prepared(tmp_path / "p")
    prepared = load_prepared_input(str(path))
    assert declared_arm_plans(prepared, prepared.rows[0]) == ()
    assert encode_document(prepared) == Path(path).read_bytes()
    assert b'"openai"' not in Path(path).read_bytes()


def test_the_declared_ladder_pairs_with_the_native_baseline(tmp_path: Path) -> None:
    prepared = _declared(load_prepared_input(str(make_prepared(tmp_path / "p"))))
    row = prepared.rows[0]
    assert [p.arm for p in declared_arm_plans(prepared, row)] == [OPENAI_CONCURRENT.name]
    ladder = cell_plan(prepared, row, OPENAI_CONCURRENT, PROMPT, None)
    native = cell_plan(prepared, row, NATIVE_CONCURRENT, PROMPT, None)
    assert ladder.refusal is None and ladder.profile is not None
    assert ladder.profile.host == "openai"
    assert (ladder.rungs, ladder.lanes, ladder.ctx_size, ladder.output_tokens) == (
        native.rungs,
        native.lanes,
        native.ctx_size,
        native.output_tokens,
    )
    # Its requests name the model it serves; llama-server's need none.
    assert ladder.model_id == "served" and native.model_id == ""

    skipped = row.tasks.concurrent_baseline.model_copy(
        update={"planned": False, "skip_reason": "skipped-by-request"}
    )
    unplanned = row.model_copy(
        update={"tasks": row.tasks.model_copy(update={"concurrent_baseline": skipped})}
    )
    (plan,) = declared_arm_plans(prepared, unplanned)
    assert (plan.arm, plan.status) == (OPENAI_CONCURRENT.name, "skipped")


def test_the_overlap_arm_comes_with_an_overlap_workload_and_its_own_pins(tmp_path: Path) -> None:
    prepared = _declared(load_prepared_input(str(make_prepared(tmp_path / "p"))))
    pin = WorkloadsPin(
        path="/w.json",
        sha256="a" * 64,
        workloads=validate_workload_object(
            {
                "schema_version": 1,
                "prefix_overlap": {"prompt_tokens": 64, "groups": 1, "requests": 2},
            }
        ),
    )
    with_overlap = prepared.model_copy(update={"workloads": pin})
    row = with_overlap.rows[0]
    assert [p.arm for p in declared_arm_plans(with_overlap, row)] == [
        OPENAI_CONCURRENT.name,
        OPENAI_OVERLAP.name,
    ]
    # A profile pinning another model than the row observed is refused by name.
    profiles = with_overlap.profiles[row.key]
    assert profiles.openai is not None
    other = profiles.openai.model_copy(update={"model_sha256": "e" * 64})
    drifted = with_overlap.model_copy(
        update={
            "profiles": {
                **with_overlap.profiles,
                row.key: profiles.model_copy(update={"openai": other}),
            }
        }
    )
    _, refusal = host_profile(drifted, row, OPENAI_OVERLAP)
    assert refusal is not None and refusal.startswith("openai profile pins model " + "e" * 64)


def _with_workloads(
    prepared: PreparedInput, document: dict[str, object], ids: int
) -> PreparedInput:
    pin = WorkloadsPin(
        path="/w.json",
        sha256="a" * 64,
        workloads=validate_workload_object(document),
        trace_distinct_ids=ids,
    )
    return prepared.model_copy(update={"workloads": pin})


SESSIONS = {
    "users": 2,
    "turns": 2,
    "system_prompt_tokens": 32,
    "user_context_tokens": 16,
    "question_tokens": 8,
    "answer_tokens": 4,
}
OPEN_LOOP = {"pattern": "constant", "rates_per_s": [10.0], "duration_s": 1, "output_tokens": 4}


def test_every_workload_runs_on_the_declared_server_sized_as_its_chat_workloads(
    tmp_path: Path,
) -> None:
    prepared = _declared(load_prepared_input(str(make_prepared(tmp_path / "p"))))
    document = with_trace(
        {"schema_version": 1, "multi_turn": SESSIONS, "open_loop": OPEN_LOOP}, DEMO_TRACE
    )
    chosen = _with_workloads(prepared, document, 46)
    row = chosen.rows[0]
    plans = declared_arm_plans(chosen, row)
    assert [(p.arm, p.status) for p in plans] == [
        (OPENAI_CONCURRENT.name, "planned"),
        (OPENAI_SESSIONS.name, "planned"),
        (OPENAI_OPEN_LOOP.name, "planned"),
        (OPENAI_TRACE.name, "planned"),
    ]
    sessions = cell_plan(chosen, row, OPENAI_SESSIONS, PROMPT, None)
    # A slot per user, without the host-side prompt cache; requests name the served model.
    assert (sessions.lanes, sessions.cache_ram_mib, sessions.model_id) == (2, 0, "served")
    assert sessions.workloads is not None and sessions.workloads_sha256 == "a" * 64
    trace = cell_plan(chosen, row, OPENAI_TRACE, PROMPT, None)
    native = cell_plan(chosen, row, NATIVE_CONCURRENT, PROMPT, None)
    assert (trace.lanes, trace.output_tokens) == (native.lanes, DEMO_TRACE["output_tokens_cap"])

    # A synthetic row's trace window with more ids than the byte alphabet holds is skipped,
    # as the stage servers' is, saying why; so is every workload when the baseline is not.
    crowded = _with_workloads(prepared, document, len(CHAT_ALPHABET))
    zoo_row = crowded.rows[0].model_copy(update={"synthetic": True})
    by_arm = {p.arm: p for p in declared_arm_plans(crowded, zoo_row)}
    assert by_arm[OPENAI_TRACE.name].status == "skipped"
    # A trained model's pieces are chosen as the cell opens: only its replay can tell.
    assert by_arm[OPENAI_SESSIONS.name].status == "planned"
    assert declared_arm_plans(crowded, crowded.rows[0])[-1].status == "planned"
    assert (by_arm[OPENAI_TRACE.name].reason or "").startswith("trace.vocabulary")
    skipped = row.tasks.concurrent_baseline.model_copy(
        update={"planned": False, "skip_reason": "skipped-by-request"}
    )
    unplanned = row.model_copy(
        update={"tasks": row.tasks.model_copy(update={"concurrent_baseline": skipped})}
    )
    assert {p.status for p in declared_arm_plans(chosen, unplanned)} == {"skipped"}


def test_a_resumed_row_re_verifies_the_declared_servers_pins_too(tmp_path: Path) -> None:
    prepared = _declared(load_prepared_input(str(make_prepared(tmp_path / "p"))))
    key = prepared.rows[0].key
    profiles = prepared.profiles[key]
    declared = profiles.host("openai")
    assert declared is not None
    # A declared server of its own binary (the fixture's declares the native one's bytes).
    own = declared.model_copy(update={"binary": "/opt/vllm/bin/python", "binary_sha256": "c" * 64})
    separate = prepared.model_copy(
        update={"profiles": {key: profiles.model_copy(update={"openai": own})}}
    )
    assert list(separate.profiles[key].hosts()) == ["native-baseline", "openai"]
    targets = {(t.path, t.expected_sha256) for t in _row_targets(separate, key)}
    assert ("/opt/vllm/bin/python", "c" * 64) in targets
    native = separate.profiles[key].host("native-baseline")
    assert native is not None and (native.binary, native.binary_sha256) in targets
