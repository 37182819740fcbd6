"""The pure planner: row order, prefix precedence, skip reasons, rungs and profiles."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from cache_family.errors import Refused
from cache_family.schemas.catalog import Catalog, Preset, packaged_catalog
from cache_family.schemas.corpus import Corpus, UseCase
from cache_family.schemas.operator import (
    OperatorInput,
    PlanInput,
    validate_operator_object,
    validate_plan_object,
)
from cache_family.schemas.prepared import (
    FilePinRecord,
    ModelObservation,
    PreparedRow,
    ShardPin,
    ToolPins,
    TreePinRecord,
)
from cache_family.states.planning import (
    ProfileInputs,
    build_profiles,
    check_selection,
    plan_rows,
)

ROOT = "/hub"
SHA = {name: (str(i) * 64)[:64] for i, name in enumerate("abcdefghij")}
SHA_OF = {key: f"{i:064x}" for i, key in enumerate(packaged_catalog().catalog.keys, start=1)}


def catalog() -> Catalog:
    return packaged_catalog().catalog


def preset(key: str) -> Preset:
    return catalog().preset(key)


def plan(**overrides: object) -> PlanInput:
    from hub_fixture import plan_document

    return validate_plan_object(plan_document(Path(ROOT), **overrides))


def corpus(*keys_and_prefixes: tuple[str, int]) -> Corpus:
    return Corpus(
        version=1,
        use_cases=tuple(
            UseCase(key=k, label=k.title(), prompt=f"prompt of {k}", prefix_tokens=p)
            for k, p in keys_and_prefixes
        ),
    )


def missing(key: str) -> ModelObservation:
    p = preset(key)
    return ModelObservation(
        status="missing-model",
        requested=f"{ROOT}/{p.snapshot_relative}",
        declared_revision=p.revision,
        declared_byte_sha256=None,
    )


def present(key: str) -> ModelObservation:
    p = preset(key)
    requested = f"{ROOT}/{p.snapshot_relative}"
    blob = f"{ROOT}/{p.cache_dir}/blobs/{SHA_OF[key]}"
    if p.artifact_kind == "layer-package":
        return ModelObservation(
            status="present",
            requested=requested,
            declared_revision=p.revision,
            declared_byte_sha256=None,
            kind="layer-package-tree",
            canonical=requested,
            runtime_entrypoint=requested,
            pinned_file=blob,
            sha256=SHA_OF[key],
            size=10,
        )
    shards: list[ShardPin] = []
    kind = "single-gguf"
    if p.artifact_kind == "split-gguf":
        kind = "split-gguf-first-shard"
        directory = requested.rsplit("/", 1)[0]
        shards = [
            ShardPin(
                name=name,
                logical_path=f"{directory}/{name}",
                canonical=f"{ROOT}/{p.cache_dir}/blobs/{i}",
                sha256=SHA["abc"[i]],
                size=5,
            )
            for i, name in enumerate(p.shard_names)
        ]
    return ModelObservation(
        status="present",
        requested=requested,
        declared_revision=p.revision,
        declared_byte_sha256=None,
        kind=kind,
        canonical=blob,  # type: ignore[arg-type]
        runtime_entrypoint=requested if shards else blob,
        pinned_file=blob,
        sha256=SHA_OF[key],
        size=10,
        shard_pins=shards,
    )


def all_missing() -> dict[str, ModelObservation]:
    return {key: missing(key) for key in catalog().keys}


def test_an_empty_cache_plans_fourteen_missing_rows_in_catalog_order() -> None:
    rows = plan_rows(plan(), catalog(), None, all_missing())
    assert [r.key for r in rows] == list(catalog().keys)
    assert [r.index for r in rows] == list(range(14))
    for row in rows:
        tasks = row.tasks
        assert not row.model_observation.present
        assert not any(
            t.planned
            for t in (
                tasks.correctness,
                tasks.serial_baseline,
                tasks.concurrent_baseline,
                tasks.paired_serving,
            )
        )
        assert {
            tasks.correctness.skip_reason,
            tasks.serial_baseline.skip_reason,
            tasks.concurrent_baseline.skip_reason,
            tasks.paired_serving.skip_reason,
        } == {"missing-model"}
        assert row.prefix_source in ("catalog", "package-contract")
        assert row.output_relative == f"{row.key}-p{row.prefix_tokens}"


def test_order_is_prefix_then_use_case_then_catalog_order() -> None:
    rows = plan_rows(
        plan(
            cases=["qwen3_dense", "llama"][::-1],
            prefix_sweep=[256, 64],
            use_cases=["b", "a"],
            corpus={"path": "/c.json", "sha256": "f" * 64},
        ),
        catalog(),
        corpus(("a", 128), ("b", 128)),
        {"llama": missing("llama"), "qwen3_dense": missing("qwen3_dense")},
    )
    assert [r.output_relative for r in rows] == [
        "b/qwen3_dense-p256",
        "b/llama-p256",
        "a/qwen3_dense-p256",
        "a/llama-p256",
        "b/qwen3_dense-p64",
        "b/llama-p64",
        "a/qwen3_dense-p64",
        "a/llama-p64",
    ]
    assert {r.prefix_source for r in rows} == {"sweep"}
    assert rows[0].use_case_label == "B"


def test_all_use_cases_follow_the_corpus_order() -> None:
    rows = plan_rows(
        plan(cases=["llama"], use_cases=["all"], corpus={"path": "/c.json", "sha256": "f" * 64}),
        catalog(),
        corpus(("zeta", 100), ("alpha", 8)),
        {"llama": missing("llama")},
    )
    assert [r.output_relative for r in rows] == ["zeta/llama-p100", "alpha/llama-p8"]
    assert [r.prefix_source for r in rows] == ["use-case", "use-case"]
    # ctx rises to prefix + 128 only when that exceeds the catalog's ctx
    assert [r.ctx for r in rows] == [512, 512]


def test_prefix_precedence_and_ctx_headroom() -> None:
    uc = {"use_cases": ["a"], "corpus": {"path": "/c.json", "sha256": "f" * 64}}
    cases = {"cases": ["llama"]}
    obs = {"llama": missing("llama")}
    explicit = plan_rows(
        plan(prefix_tokens=1000, **uc, **cases), catalog(), corpus(("a", 600)), obs
    )[0]
    assert (explicit.prefix_tokens, explicit.prefix_source, explicit.ctx) == (
        1000,
        "override",
        1128,
    )
    from_use_case = plan_rows(plan(**uc, **cases), catalog(), corpus(("a", 600)), obs)[0]
    assert (from_use_case.prefix_tokens, from_use_case.prefix_source, from_use_case.ctx) == (
        600,
        "use-case",
        728,
    )
    from_catalog = plan_rows(plan(**cases), catalog(), None, obs)[0]
    assert (from_catalog.prefix_tokens, from_catalog.prefix_source, from_catalog.ctx) == (
        128,
        "catalog",
        512,
    )
    assert from_catalog.prefix_note is None


def test_a_package_contract_keeps_its_prefix_and_context_and_says_why() -> None:
    rows = plan_rows(
        plan(cases=["deepseek3", "llama"], prefix_sweep=[64, 128]),
        catalog(),
        None,
        {"deepseek3": missing("deepseek3"), "llama": missing("llama")},
    )
    assert [r.output_relative for r in rows] == ["llama-p64", "deepseek3-p4", "llama-p128"]
    package = rows[1]
    assert (package.prefix_tokens, package.ctx, package.prefix_source) == (
        4,
        32,
        "package-contract",
    )
    assert package.prefix_note is not None
    assert "fixes ctx 32 and prefix 4" in package.prefix_note
    assert "64, 128" in package.prefix_note
    alone = plan_rows(
        plan(cases=["deepseek3"]), catalog(), None, {"deepseek3": missing("deepseek3")}
    )[0]
    assert alone.prefix_note is None and alone.prefix_source == "package-contract"


def test_overrides_of_gpu_layers_and_repeats_apply_to_every_row() -> None:
    rows = plan_rows(
        plan(cases=["llama", "gemma3"], n_gpu_layers=-1, cache_hit_repeats=7),
        catalog(),
        None,
        {"llama": missing("llama"), "gemma3": missing("gemma3")},
    )
    assert {(r.n_gpu_layers, r.cache_hit_repeats) for r in rows} == {(-1, 7)}
    default = plan_rows(plan(cases=["llama"]), catalog(), None, {"llama": missing("llama")})[0]
    assert (default.n_gpu_layers, default.cache_hit_repeats) == (0, 3)


def test_tasks_of_present_rows_and_their_skip_reasons() -> None:
    servers = {
        "old_server": {"path": "/o", "sha256": None},
        "new_server": {"path": "/n", "sha256": None},
    }
    obs = {k: present(k) for k in ("llama", "deepseek3", "minimax_m27")}
    rows = {
        r.key: r
        for r in plan_rows(
            plan(cases=list(obs), concurrency=[1, 2, 8], concurrent_requests=4, **servers),
            catalog(),
            None,
            obs,
        )
    }
    llama = rows["llama"].tasks
    assert llama.correctness.planned and llama.correctness.admission == "source"
    assert llama.correctness.topologies == [
        "one-stage",
        "split-stage0",
        "split-middle",
        "split-final",
    ]
    assert llama.serial_baseline.planned and llama.serial_baseline.runs == 3
    assert (llama.serial_baseline.warmup_excluded, llama.serial_baseline.output_tokens) == (1, 1)
    assert [(r.concurrency, r.requests) for r in llama.concurrent_baseline.rungs] == [
        (1, 4),
        (2, 4),
        (8, 8),
    ]
    assert llama.concurrent_baseline.output_tokens == 128
    assert llama.paired_serving.planned
    assert llama.paired_serving.runtime_lanes == 8  # highest rung when the plan says null
    assert llama.paired_serving.shared_ctx_size == 512 * 8
    assert llama.paired_serving.output_tokens == 32

    package = rows["deepseek3"].tasks
    assert package.correctness.planned and package.correctness.admission == "package"
    assert package.correctness.topologies == ["package-stage1"]
    assert (
        package.correctness.state_layer_start,
        package.correctness.state_layer_end,
        package.correctness.state_stage_index,
    ) == (3, 4, 1)
    for task in (package.serial_baseline, package.concurrent_baseline, package.paired_serving):
        assert not task.planned and task.skip_reason == "layer-package-not-full-GGUF"
    assert rows["minimax_m27"].tasks.paired_serving.planned


def test_skip_flag_and_missing_pair_are_skip_reasons() -> None:
    rows = plan_rows(
        plan(cases=["llama"], skip_llama_server=True, runtime_lane_count=2, serving_ctx_size=999),
        catalog(),
        None,
        {"llama": present("llama")},
    )
    tasks = rows[0].tasks
    assert tasks.serial_baseline.skip_reason == "skipped-by-request"
    assert tasks.concurrent_baseline.skip_reason == "skipped-by-request"
    assert tasks.paired_serving.skip_reason == "paired-servers-omitted"
    assert (tasks.paired_serving.runtime_lanes, tasks.paired_serving.shared_ctx_size) == (2, 999)
    assert tasks.correctness.planned


def test_selection_refusals_are_collected() -> None:
    zoo = msgspec.structs.replace(catalog(), presets=catalog().presets[:3])
    with pytest.raises(Refused) as caught:
        check_selection(
            plan(
                cases=["llama", "olmo"],
                model_sha256={"gemma2": "a" * 64},
                use_cases=["nope"],
                corpus={"path": "/c", "sha256": "f" * 64},
            ),
            zoo,
            corpus(("a", 1)),
        )
    assert sorted(caught.value.codes) == [
        "planning.unknown_case",
        "planning.unknown_case",
        "planning.unknown_use_case",
    ]
    assert {r.path for r in caught.value.refusals} == {
        "$.plan.cases[1]",
        "$.plan.model_sha256.gemma2",
        "$.plan.use_cases[0]",
    }


def test_too_many_rows_is_refused_before_planning() -> None:
    big = corpus(*((f"u{i}", 8) for i in range(128)))
    with pytest.raises(Refused) as caught:
        check_selection(
            plan(
                use_cases=["all"],
                corpus={"path": "/c", "sha256": "f" * 64},
                prefix_sweep=[1, 2, 3, 4, 5],
            ),
            catalog(),
            big,
        )
    assert caught.value.codes == ["planning.too_many_rows"]


U32_MAX = 2**32 - 1


def bounds_codes(**overrides: object) -> dict[str, str]:
    with pytest.raises(Refused) as caught:
        check_selection(plan(**overrides), catalog(), None)
    return {r.code: r.path for r in caught.value.refusals}


def test_a_prefix_whose_headroom_overflows_uint32_is_refused() -> None:
    # 4294967295 + 128 would be the ctx: refused once, not once per row
    with pytest.raises(Refused) as caught:
        check_selection(plan(prefix_tokens=U32_MAX), catalog(), None)
    assert caught.value.codes == ["planning.prefix_too_large"]
    refusal = caught.value.refusals[0]
    assert refusal.path == "$.plan.prefix_tokens"
    # 13 rows: the layer package keeps its contract's prefix and is not refused
    assert "4294967423" in refusal.message and "(and 12 more rows)" in refusal.message
    assert bounds_codes(prefix_sweep=[64, U32_MAX - 127]) == {
        "planning.prefix_too_large": "$.plan.prefix_sweep"
    }
    with pytest.raises(Refused) as caught:
        check_selection(
            plan(use_cases=["all"], corpus={"path": "/c", "sha256": "f" * 64}),
            catalog(),
            corpus(("fine", 64), ("huge", U32_MAX)),
        )
    assert [(r.code, r.path) for r in caught.value.refusals] == [
        ("planning.prefix_too_large", "$.plan.corpus.use_cases.huge.prefix_tokens")
    ]


def test_ctx_times_lanes_or_parallel_must_fit_uint32() -> None:
    biggest = U32_MAX - 128  # ctx exactly 2**32 - 1
    check_selection(
        plan(prefix_tokens=biggest, runtime_lane_count=1, llama_parallel=1, concurrency=[1]),
        catalog(),
        None,
    )
    assert bounds_codes(prefix_tokens=biggest, runtime_lane_count=2, concurrency=[1]) == {
        "planning.serving_ctx_too_large": "$.plan.runtime_lane_count"
    }
    assert bounds_codes(prefix_tokens=biggest // 4 + 1, concurrency=[1, 4]) == {
        "planning.serving_ctx_too_large": "$.plan.concurrency"
    }
    # an explicit shared serving ctx replaces ctx × lanes, the native host still multiplies
    assert bounds_codes(
        prefix_tokens=biggest // 2, serving_ctx_size=4096, llama_parallel=3, concurrency=[1]
    ) == {"planning.host_ctx_too_large": "$.plan.llama_parallel"}


def test_a_prefix_must_leave_room_for_the_generated_token() -> None:
    tight = msgspec.structs.replace(
        catalog(),
        presets=tuple(
            msgspec.structs.replace(p, ctx=p.prefix_tokens) if p.key == "llama" else p
            for p in catalog().presets
        ),
    )
    with pytest.raises(Refused) as caught:
        check_selection(plan(cases=["llama"]), tight, None)
    assert caught.value.codes == ["planning.prefix_exceeds_ctx"]
    # an explicit prefix raises the ctx instead
    check_selection(plan(cases=["llama"], prefix_tokens=512), tight, None)


def test_every_selected_case_needs_an_observation() -> None:
    with pytest.raises(Refused) as caught:
        plan_rows(plan(cases=["llama", "olmo"]), catalog(), None, {"llama": missing("llama")})
    assert caught.value.codes == ["planning.unobserved_case"]


# --- profiles ----------------------------------------------------------------------------------


def operator(**plan_overrides: object) -> OperatorInput:
    from hub_fixture import plan_document

    return validate_operator_object(
        {
            "schema_version": 1,
            "plan": plan_document(Path(ROOT), **plan_overrides),
            "correctness": "/t/skippy-correctness",
            "stage_server": "/t/skippy",
            "native_server": "/t/native/bin/llama-server",
            "artifact_tool": "/t/pkg",
            "native_build": "/t/native",
            "old_source_commit": "1" * 40,
            "new_source_commit": "2" * 40,
            "native_source_commit": "3" * 40,
            "environment": {"OMP_NUM_THREADS": "4"},
            "toolkit_directories": {},
            "execution_seconds": 600,
            "cell_seconds": 20,
            "request_timeout_ms": 1000,
            "preparation_seconds": 30,
        }
    )


def pin(path: str, sha: str) -> FilePinRecord:
    return FilePinRecord(path=path, sha256=sha, size=1)


def inputs(op: OperatorInput, *, artifact_tool: bool = True, servers: bool = True) -> ProfileInputs:
    return ProfileInputs(
        operator=op,
        tools=ToolPins(
            correctness=pin("/t/skippy-correctness", SHA["a"]),
            stage_server=pin("/t/skippy", SHA["b"]),
            native_server=pin("/t/native/bin/llama-server", SHA["c"]),
            artifact_tool=pin("/t/pkg", SHA["d"]) if artifact_tool else None,
        ),
        native_build=TreePinRecord(path="/t/native", sha256=SHA["e"], files=2, size=3),
        toolkit_directories={
            "CUDA_PATH": TreePinRecord(path="/cuda", sha256=SHA["f"], files=1, size=1)
        },
        old_server=pin("/t/old", SHA["g"]) if servers else None,
        new_server=pin("/t/new", SHA["h"]) if servers else None,
    )


def rows_for(
    op: OperatorInput, keys: list[str], *, absent: tuple[str, ...] = ()
) -> list[PreparedRow]:
    obs = {k: (missing(k) if k in absent else present(k)) for k in keys}
    return plan_rows(op.plan, catalog(), None, obs)


def test_profiles_cover_present_keys_only_with_the_reference_fields() -> None:
    op = operator(cases=["llama", "olmo"], prefix_sweep=[64, 256])
    rows = rows_for(op, ["llama", "olmo"], absent=("olmo",))
    profiles = build_profiles(rows, inputs(op))
    assert set(profiles) == {"llama"}
    correctness = profiles["llama"].correctness
    assert (correctness.case_key, correctness.model_id) == ("llama", preset("llama").model_id)
    assert (correctness.correctness, correctness.correctness_sha256) == (
        "/t/skippy-correctness",
        SHA["a"],
    )
    assert (correctness.stage_server_sha256, correctness.native_build_sha256) == (
        SHA["b"],
        SHA["e"],
    )
    assert correctness.model == rows[0].model_observation.runtime_entrypoint
    assert correctness.model_sha256 == SHA_OF["llama"]
    assert correctness.artifact is None
    assert (correctness.ctx_size, correctness.prefix_tokens) == (512, 64)  # first row of the key
    assert (correctness.source_port, correctness.restore_port, correctness.prompt) == (1, 2, None)
    assert correctness.runtime_lane_count == 1
    assert (correctness.execution_seconds, correctness.cell_seconds) == (20, 11)
    assert correctness.settings == {"OMP_NUM_THREADS": "4"}
    assert correctness.toolkit_directories["CUDA_PATH"].sha256 == SHA["f"]

    native = profiles["llama"].native
    assert native is not None
    assert (native.host, native.binary, native.binary_sha256) == (
        "native-baseline",
        "/t/native/bin/llama-server",
        SHA["c"],
    )
    assert native.source_commit == "3" * 40
    assert (native.lane_count, native.port, native.worker) == (1, 1, {})
    assert (native.startup_timeout_secs, native.execution_timeout_secs) == (6, 20)
    old, new = profiles["llama"].old, profiles["llama"].new
    assert old is not None and new is not None
    assert (old.host, old.binary_sha256, old.source_commit) == ("skippy-old", SHA["g"], "1" * 40)
    assert (new.host, new.binary_sha256, new.source_commit) == ("skippy-new", SHA["h"], "2" * 40)


def test_split_and_package_profiles_carry_their_artifact() -> None:
    op = operator(cases=["minimax_m27", "deepseek3"])
    rows = rows_for(op, ["minimax_m27", "deepseek3"])
    profiles = build_profiles(rows, inputs(op))
    split = profiles["minimax_m27"].correctness.artifact
    assert split is not None and split.kind == "complete-shards"
    assert [s.name for s in split.shard_pins] == list(preset("minimax_m27").shard_names)
    assert (split.tool, split.tool_sha256) == ("/t/pkg", SHA["d"])
    assert profiles["minimax_m27"].native is not None
    package = profiles["deepseek3"]
    assert package.correctness.artifact is not None
    assert package.correctness.artifact.kind == "layer-package"
    assert package.correctness.artifact.shard_pins == []
    assert package.correctness.topologies == ["package-stage1"]
    assert (package.native, package.old, package.new) == (None, None, None)


def test_a_present_split_or_package_model_needs_the_artifact_tool() -> None:
    op = operator(cases=["deepseek3"])
    with pytest.raises(Refused) as caught:
        build_profiles(rows_for(op, ["deepseek3"]), inputs(op, artifact_tool=False))
    assert caught.value.codes == ["preparation.artifact_tool_missing"]
    # a missing one needs nothing
    assert (
        build_profiles(
            rows_for(op, ["deepseek3"], absent=("deepseek3",)), inputs(op, artifact_tool=False)
        )
        == {}
    )


def test_startup_timeout_is_clamped() -> None:
    op = operator(cases=["llama"]).model_copy(update={"cell_seconds": 3600})
    profiles = build_profiles(rows_for(op, ["llama"]), inputs(op, servers=False))
    native = profiles["llama"].native
    assert native is not None and native.startup_timeout_secs == 900
    assert profiles["llama"].old is None and profiles["llama"].new is None
