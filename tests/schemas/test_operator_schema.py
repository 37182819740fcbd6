"""Operator input schema: one mutation per refusal code, plus the rules that span a document."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from cache_family.errors import Refused
from cache_family.schemas.catalog import packaged_catalog
from cache_family.schemas.examples import (
    EXAMPLE_COMMIT,
    EXAMPLE_SHA256_COMMIT,
    example_operator,
    example_plan,
)
from cache_family.schemas.operator import (
    OperatorInput,
    PlanInput,
    validate_operator_document,
    validate_operator_object,
    validate_plan_object,
)
from cache_family.schemas.refusal_codes import OPERATOR_REFUSAL_CODES

C40 = EXAMPLE_COMMIT
C64 = EXAMPLE_SHA256_COMMIT
SHA = "ab" * 32
KEYS = packaged_catalog().catalog.keys


def valid_document() -> dict[str, Any]:
    """The reference example (§1), with real hex where it shows placeholders."""
    return example_operator(
        example_plan(
            "/data/hf/hub",
            old_server={"path": "/opt/old/skippy", "sha256": None},
            new_server={"path": "/t/cargo/debug/skippy", "sha256": None},
        )
    )


def refusals_of(doc: dict[str, Any] | bytes) -> list[tuple[str, str]]:
    data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    with pytest.raises(Refused) as caught:
        validate_operator_document(data)
    return [(r.code, r.path) for r in caught.value.refusals]


# --------------------------------------------------------------------------------------
# Valid documents


def test_reference_example_is_valid_and_keeps_every_value() -> None:
    model = validate_operator_document(json.dumps(valid_document()).encode())
    assert model.plan.concurrency == [1, 2, 4, 8]
    assert model.environment == {"OMP_NUM_THREADS": "8", "LLAMA_STAGE_BACKEND": "cpu"}
    assert model.plan.old_server is not None
    assert model.plan.old_server.sha256 is None
    assert model.native_source_commit == C64
    assert model.plan.catalog is None


def test_defaults_fill_the_optional_members() -> None:
    doc = valid_document()
    for name in ("borrow_resident_hits", "cache_decoded_result_hits"):
        doc.pop(name, None)
    del doc["environment"], doc["toolkit_directories"]
    model = validate_operator_object(doc)
    assert model.borrow_resident_hits is False
    assert model.cache_decoded_result_hits is False
    assert model.environment == {}
    assert model.toolkit_directories == {}
    dumped = model.model_dump(mode="json")
    assert dumped["environment"] == {} and dumped["plan"]["catalog"] is None


def test_dump_round_trips_and_field_order_follows_the_reference() -> None:
    doc = valid_document()
    doc["plan"]["catalog"] = {"path": "/zoo/catalog.json", "sha256": SHA}
    model = validate_operator_object(doc)
    dumped = model.model_dump(mode="json")
    assert validate_operator_object(dumped) == model
    assert validate_operator_document(json.dumps(dumped).encode()) == model
    assert list(dumped) == [
        "schema_version", "plan", "correctness", "stage_server", "native_server",
        "artifact_tool", "native_build", "old_source_commit", "new_source_commit",
        "native_source_commit", "borrow_resident_hits", "cache_decoded_result_hits",
        "environment", "toolkit_directories", "execution_seconds", "cell_seconds",
        "request_timeout_ms", "preparation_seconds",
    ]  # fmt: skip
    assert list(dumped["plan"])[-2:] == ["model_sha256", "catalog"]


def test_a_full_selection_is_valid() -> None:
    doc = valid_document()
    plan = doc["plan"]
    plan["cases"] = list(reversed(KEYS))
    plan["use_cases"] = ["all"]
    plan["corpus"] = {"path": "/corpus/use-cases.json", "sha256": SHA}
    plan["prefix_sweep"] = [64, 16, 128]
    plan["n_gpu_layers"] = -1
    plan["old_server"] = {"path": "/opt/old/skippy", "sha256": SHA}
    plan["model_sha256"] = {key: SHA for key in KEYS}
    doc["native_server"] = None
    doc["artifact_tool"] = None
    doc["environment"] = {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "LLAMA_STAGE_BACKEND": "cuda",
        "SKIPPY_LLAMA_BACKEND": "cuda",
        "SKIPPY_CUDA_ARCHITECTURES": "86,89-real,90a,100f-virtual",
        "LLAMA_STAGE_AMDGPU_TARGETS": "gfx90a,gfx1100",
        "SKIPPY_GGML_NATIVE": "OFF",
        "LLAMA_STAGE_LINK_MODE": "shared",
        "GGML_CUDA_FORCE_MMQ": "1",
    }
    doc["toolkit_directories"] = {"CUDA_PATH": {"path": "/usr/local/cuda", "sha256": SHA}}
    model = validate_operator_object(doc)
    assert model.plan.cases == list(reversed(KEYS))
    assert model.toolkit_directories["CUDA_PATH"].path == "/usr/local/cuda"


def test_the_model_is_frozen() -> None:
    model = validate_operator_object(valid_document())
    with pytest.raises(ValidationError):
        model.cell_seconds = 30  # type: ignore[misc]


# --------------------------------------------------------------------------------------
# One mutation per refusal code

Mutation = Callable[[dict[str, Any]], dict[str, Any] | bytes]


def _set(path: str, value: Any) -> Mutation:
    """Set a dotted path (``plan.concurrency``) in a copy of the valid document."""

    def mutate(doc: dict[str, Any]) -> dict[str, Any]:
        *parents, last = path.split(".")
        node = doc
        for part in parents:
            node = node[part]
        node[last] = value
        return doc

    return mutate


def _drop(path: str) -> Mutation:
    def mutate(doc: dict[str, Any]) -> dict[str, Any]:
        *parents, last = path.split(".")
        node = doc
        for part in parents:
            node = node[part]
        del node[last]
        return doc

    return mutate


def _env(entries: dict[str, Any]) -> Mutation:
    return _set("environment", entries)


def _raw(text: str | bytes) -> Mutation:
    return lambda _doc: text if isinstance(text, bytes) else text.encode()


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


def _duplicate_member(doc: dict[str, Any]) -> bytes:
    text = json.dumps(doc)
    return text.replace('"cell_seconds": 900', '"cell_seconds": 900, "cell_seconds": 901').encode()


def _use_cases(keys: list[str]) -> Mutation:
    def mutate(doc: dict[str, Any]) -> dict[str, Any]:
        doc["plan"]["use_cases"] = keys
        doc["plan"]["corpus"] = {"path": "/corpus/c.json", "sha256": SHA}
        return doc

    return mutate


def _toolkits(names: list[str]) -> Mutation:
    return _set(
        "toolkit_directories", {n: {"path": f"/opt/{n.lower()}", "sha256": SHA} for n in names}
    )


# (id, mutation, expected code, expected path, the only refusal?)
CASES: list[tuple[str, Mutation, str, str, bool]] = [
    ("too-large", _raw(b" " * (1024 * 1024 + 1)), "operator.json.too_large", "$", True),
    ("truncated", _raw('{"schema_version": 1'), "operator.json.decode", "$", True),
    ("nan", _raw('{"schema_version": NaN}'), "operator.json.decode", "$", True),
    ("not-utf8", _raw(b'{"a": "\xff"}'), "operator.json.decode", "$", True),
    ("bom", _raw(b"\xef\xbb\xbf{}"), "operator.json.decode", "$", True),
    ("deep", _raw("[" * 100_000), "operator.json.too_deep", "$", True),
    ("deep-member", _set("plan.cases", _nested(900)), "operator.json.too_deep",
     "$.plan.cases" + "[0]" * 30, True),
    ("long-array", _set("plan.prefix_sweep", list(range(1, 2000))),
     "operator.json.too_many_entries", "$.plan.prefix_sweep", False),
    ("huge-int", _raw('{"cell_seconds": ' + "9" * 5000 + "}"), "operator.json.decode", "$", True),
    ("many-values", _set("environment", {f"E{i}": list(range(100)) for i in range(50)}),
     "operator.json.too_many_values", "$", True),
    ("many-unknown", _set("plan.old_server", {"path": "/x", "sha256": None,
                                              **{f"u{i}": 0 for i in range(10)}}),
     "operator.more_refusals", "$.plan", False),
    ("dup-member", _duplicate_member, "operator.json.duplicate_key", "$.cell_seconds", True),
    ("top-array", _raw("[]"), "operator.type", "$", True),
    ("top-null", _raw("null"), "operator.type", "$", True),
    ("str-for-int", _set("cell_seconds", "900"), "operator.type", "$.cell_seconds", True),
    ("bool-for-int", _set("cell_seconds", True), "operator.type", "$.cell_seconds", True),
    ("float-for-int", _set("cell_seconds", 900.0), "operator.type", "$.cell_seconds", True),
    ("int-for-bool", _set("borrow_resident_hits", 1), "operator.type", "$.borrow_resident_hits",
     True),
    ("null-tool", _set("correctness", None), "operator.type", "$.correctness", True),
    ("rung-str", _set("plan.concurrency", [1, "2"]), "operator.type", "$.plan.concurrency[1]",
     True),
    ("env-int", _env({"OMP_NUM_THREADS": 8}), "operator.type", "$.environment.OMP_NUM_THREADS",
     True),
    ("plan-list", _set("plan", []), "operator.type", "$.plan", True),
    ("server-str", _set("plan.old_server", "/x"), "operator.type", "$.plan.old_server", True),
    ("unknown-top", _set("HF_TOKEN", "x"), "operator.unknown_field", "$.HF_TOKEN", True),
    ("unknown-plan", _set("plan.prefix", 1), "operator.unknown_field", "$.plan.prefix", True),
    ("unknown-server", _set("plan.new_server.args", []), "operator.unknown_field",
     "$.plan.new_server.args", True),
    ("missing-top", _drop("correctness"), "operator.missing_field", "$.correctness", True),
    ("missing-stage-server", _drop("stage_server"), "operator.missing_field", "$.stage_server",
     True),
    ("missing-plan", _drop("plan.concurrency"), "operator.missing_field", "$.plan.concurrency",
     True),
    ("missing-sha", _drop("plan.old_server.sha256"), "operator.missing_field",
     "$.plan.old_server.sha256", True),
    ("version-2", _set("schema_version", 2), "operator.schema_version", "$.schema_version", True),
    ("relative", _set("correctness", "bin/skippy"), "operator.path.not_absolute",
     "$.correctness", True),
    ("empty-path", _set("native_build", ""), "operator.path.not_absolute", "$.native_build",
     True),
    ("dot", _set("stage_server", "/t/./skippy"), "operator.path.not_normalized",
     "$.stage_server", True),
    ("dotdot", _set("plan.cache_root", "/data/../hub"), "operator.path.not_normalized",
     "$.plan.cache_root", True),
    ("trailing", _set("native_build", "/t/native/"), "operator.path.not_normalized",
     "$.native_build", True),
    ("double", _set("native_build", "//t/native"), "operator.path.not_normalized",
     "$.native_build", True),
    ("surrogate-name", _env({"GGML_\udc80": "1"}), "operator.text.surrogate",
     "$.environment[\"GGML_\ufffd\"]", False),
    ("rlo", _set("correctness", "/t/\u202egnp.exe"), "operator.path.format_char",
     "$.correctness", True),
    ("zero-width", _set("plan.cache_root", "/data/hf\u200b/hub"), "operator.path.format_char",
     "$.plan.cache_root", True),
    ("nul", _set("native_server", "/t/llama\x00-server"), "operator.path.bad_char",
     "$.native_server", True),
    ("newline", _set("artifact_tool", "/t/a\nb"), "operator.path.bad_char", "$.artifact_tool",
     True),
    ("long", _set("correctness", "/" + "a" * 4096), "operator.path.too_long", "$.correctness",
     True),
    ("commit-upper", _set("old_source_commit", C40.upper()), "operator.commit.bad_hex",
     "$.old_source_commit", True),
    ("commit-short", _set("new_source_commit", C40[:39]), "operator.commit.bad_hex",
     "$.new_source_commit", True),
    ("sha-short", _set("plan.old_server.sha256", SHA[:63]), "operator.sha256.bad_hex",
     "$.plan.old_server.sha256", True),
    ("sha-model", _set("plan.model_sha256", {"llama": "G" * 64}), "operator.sha256.bad_hex",
     "$.plan.model_sha256.llama", True),
    ("env-65", _env({f"GGML_X{i}": "1" for i in range(65)}), "operator.environment.too_many",
     "$.environment", True),
    ("hf-token", _env({"HF_TOKEN": "hf_abc"}), "operator.environment.secret_name",
     "$.environment.HF_TOKEN", True),
    ("ggml-path", _env({"GGML_BACKEND_DL_PATH": "/x"}), "operator.environment.secret_name",
     "$.environment.GGML_BACKEND_DL_PATH", True),
    ("build-dir", _env({"LLAMA_STAGE_BUILD_DIR": "/x"}), "operator.environment.secret_name",
     "$.environment.LLAMA_STAGE_BUILD_DIR", True),
    ("lower-secret", _env({"my_api_key": "x"}), "operator.environment.secret_name",
     '$.environment.my_api_key', True),
    ("home", _env({"HOME": "/root"}), "operator.environment.not_allowed", "$.environment.HOME",
     True),
    ("not-allowed", _env({"LD_PRELOAD": "x.so"}), "operator.environment.not_allowed",
     "$.environment.LD_PRELOAD", True),
    ("bare-ggml", _env({"GGML_": "1"}), "operator.environment.not_allowed", "$.environment.GGML_",
     True),
    ("lower-ggml", _env({"ggml_debug": "1"}), "operator.environment.not_allowed",
     "$.environment.ggml_debug", True),
    ("empty-value", _env({"GGML_SCHED_MAX_COPIES": ""}), "operator.environment.bad_value",
     "$.environment.GGML_SCHED_MAX_COPIES", True),
    ("long-value", _env({"GGML_X": "é" * 129}), "operator.environment.bad_value",
     "$.environment.GGML_X", True),
    ("ctl-value", _env({"GGML_X": "a\tb"}), "operator.environment.bad_value",
     "$.environment.GGML_X", True),
    ("alias", _env({"LLAMA_STAGE_BACKEND": "cpu", "SKIPPY_LLAMA_BACKEND": "cuda"}),
     "operator.environment.alias_conflict", "$.environment.SKIPPY_LLAMA_BACKEND", True),
    ("rlo-value", _env({"GGML_X": "a\u202eb"}), "operator.environment.bad_value",
     "$.environment.GGML_X", True),
    ("devices-newline", _env({"CUDA_VISIBLE_DEVICES": "0\n1"}), "operator.environment.bad_value",
     "$.environment.CUDA_VISIBLE_DEVICES", True),
    ("toolkit-6", _toolkits([*("CUDA_PATH", "HIP_PATH", "ROCM_PATH", "LLVMInstallDir"),
                             "VULKAN_SDK", "CUDA_HOME"]),
     "operator.toolkit.too_many", "$.toolkit_directories", False),
    ("toolkit-name", _toolkits(["CUDA_HOME"]), "operator.toolkit.bad_name",
     "$.toolkit_directories.CUDA_HOME", True),
    ("exec-low", _set("execution_seconds", 29), "operator.budget.out_of_range",
     "$.execution_seconds", True),
    ("exec-high", _set("execution_seconds", 86401), "operator.budget.out_of_range",
     "$.execution_seconds", True),
    ("cell-low", _set("cell_seconds", 14), "operator.budget.out_of_range", "$.cell_seconds", True),
    ("cell-high", _set("cell_seconds", 3601), "operator.budget.out_of_range", "$.cell_seconds",
     True),
    ("timeout-0", _set("request_timeout_ms", 0), "operator.budget.out_of_range",
     "$.request_timeout_ms", True),
    ("timeout-high", _set("request_timeout_ms", 600001), "operator.budget.out_of_range",
     "$.request_timeout_ms", True),
    ("prep-low", _set("preparation_seconds", 29), "operator.budget.out_of_range",
     "$.preparation_seconds", True),
    ("prep-high", _set("preparation_seconds", 3601), "operator.budget.out_of_range",
     "$.preparation_seconds", True),
    ("plan-version", _set("plan.schema_version", 0), "plan.schema_version",
     "$.plan.schema_version", True),
    ("rung-0", _set("plan.concurrency", [0, 1]), "plan.out_of_range", "$.plan.concurrency[0]",
     True),
    ("rung-1025", _set("plan.concurrency", [1, 1025]), "plan.out_of_range",
     "$.plan.concurrency[1]", True),
    ("prefix-0", _set("plan.prefix_tokens", 0), "plan.out_of_range", "$.plan.prefix_tokens", True),
    ("sweep-0", _set("plan.prefix_sweep", [0]), "plan.out_of_range", "$.plan.prefix_sweep[0]",
     True),
    ("ngl", _set("plan.n_gpu_layers", -2), "plan.out_of_range", "$.plan.n_gpu_layers", True),
    ("lanes", _set("plan.runtime_lane_count", 1025), "plan.out_of_range",
     "$.plan.runtime_lane_count", True),
    ("hits", _set("plan.cache_hit_repeats", 0), "plan.out_of_range", "$.plan.cache_hit_repeats",
     True),
    ("ctx", _set("plan.serving_ctx_size", 2**32), "plan.out_of_range", "$.plan.serving_ctx_size",
     True),
    ("requests", _set("plan.concurrent_requests", 65537), "plan.out_of_range",
     "$.plan.concurrent_requests", True),
    ("out-tokens", _set("plan.concurrent_output_tokens", 0), "plan.out_of_range",
     "$.plan.concurrent_output_tokens", True),
    ("parallel", _set("plan.llama_parallel", 1025), "plan.out_of_range", "$.plan.llama_parallel",
     True),
    ("repeats", _set("plan.llama_repeats", 0), "plan.out_of_range", "$.plan.llama_repeats", True),
    ("ttft", _set("plan.ttft_slo_ms", 0), "plan.out_of_range", "$.plan.ttft_slo_ms", True),
    ("tpot", _set("plan.tpot_slo_ms", -5), "plan.out_of_range", "$.plan.tpot_slo_ms", True),
    ("case", _set("plan.cases", ["llama", "mistral"]), "plan.case.unknown", "$.plan.cases[1]",
     True),
    ("pin-key", _set("plan.model_sha256", {"mistral": SHA}), "plan.case.unknown",
     "$.plan.model_sha256.mistral", True),
    ("case-dup", _set("plan.cases", ["llama", "olmo", "llama"]), "plan.case.duplicate",
     "$.plan.cases", True),
    ("case-15", _set("plan.cases", [*KEYS, "llama"]), "plan.case.too_many", "$.plan.cases",
     False),
    ("use-case-key", _use_cases(["tool calling"]), "plan.use_case.bad_key",
     "$.plan.use_cases[0]", True),
    ("use-case-empty", _use_cases([""]), "plan.use_case.bad_key", "$.plan.use_cases[0]", True),
    ("use-case-dup", _use_cases(["open_chat", "open_chat"]), "plan.use_case.duplicate",
     "$.plan.use_cases", True),
    ("use-case-129", _use_cases([f"u{i}" for i in range(129)]), "plan.use_case.too_many",
     "$.plan.use_cases", True),
    ("all-plus", _use_cases(["all", "open_chat"]), "plan.use_case.all_not_alone",
     "$.plan.use_cases", True),
    ("corpus-null", _set("plan.use_cases", ["open_chat"]), "plan.corpus.required",
     "$.plan.corpus", True),
    ("corpus-extra", _set("plan.corpus", {"path": "/c.json", "sha256": SHA}),
     "plan.corpus.unexpected", "$.plan.corpus", True),
    ("sweep-dup", _set("plan.prefix_sweep", [16, 32, 16]), "plan.prefix_sweep.duplicate",
     "$.plan.prefix_sweep", True),
    ("sweep-33", _set("plan.prefix_sweep", list(range(1, 34))), "plan.prefix_sweep.too_many",
     "$.plan.prefix_sweep", True),
    ("ladder-empty", _set("plan.concurrency", []), "plan.concurrency.empty", "$.plan.concurrency",
     True),
    ("ladder-33", _set("plan.concurrency", list(range(1, 34))), "plan.concurrency.too_many",
     "$.plan.concurrency", True),
    ("ladder-dup", _set("plan.concurrency", [1, 2, 2, 4]), "plan.concurrency.duplicate",
     "$.plan.concurrency", True),
    ("ladder-order", _set("plan.concurrency", [1, 4, 2, 8]), "plan.concurrency.not_ascending",
     "$.plan.concurrency", True),
    ("one-sided", _set("plan.new_server", None), "plan.servers.one_sided", "$.plan.new_server",
     True),
]  # fmt: skip


@pytest.mark.parametrize(
    ("mutation", "code", "path", "alone"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_each_mutation_is_refused_with_its_code_and_path(
    mutation: Mutation, code: str, path: str, alone: bool
) -> None:
    found = refusals_of(mutation(copy.deepcopy(valid_document())))
    assert (code, path) in found
    if alone:
        assert found == [(code, path)]


def test_every_registered_code_has_a_mutation() -> None:
    assert {case[2] for case in CASES} == set(OPERATOR_REFUSAL_CODES)


# --------------------------------------------------------------------------------------
# Rules across one document


def test_every_refusal_of_a_document_is_reported_at_once() -> None:
    doc = valid_document()
    doc["cell_seconds"] = "900"  # pass 1: type
    doc["correctness"] = "skippy-correctness"  # pass 1: path
    del doc["native_build"]  # pass 1: missing
    doc["extra"] = True  # pass 1: unknown
    doc["environment"] = {"HF_TOKEN": "x", "OMP_NUM_THREADS": 8}  # pass 2 and pass 1
    doc["plan"]["concurrency"] = [8, 4, "2"]  # pass 1 element type and pass 2 order
    doc["plan"]["cases"] = ["nope"]  # pass 2
    found = refusals_of(doc)
    assert found == [
        ("plan.case.unknown", "$.plan.cases[0]"),
        ("operator.type", "$.plan.concurrency[2]"),
        ("plan.concurrency.not_ascending", "$.plan.concurrency"),
        ("operator.path.not_absolute", "$.correctness"),
        ("operator.missing_field", "$.native_build"),
        ("operator.type", "$.environment.OMP_NUM_THREADS"),
        ("operator.environment.secret_name", "$.environment.HF_TOKEN"),
        ("operator.type", "$.cell_seconds"),
        ("operator.unknown_field", "$.extra"),
    ]


def test_a_non_ascending_ladder_hint_shows_the_sorted_unique_ladder() -> None:
    doc = valid_document()
    doc["plan"]["concurrency"] = [8, 4, 4, 1]
    with pytest.raises(Refused) as caught:
        validate_operator_object(doc)
    by_code = {r.code: r for r in caught.value.refusals}
    assert by_code["plan.concurrency.not_ascending"].hint == "use [1, 4, 8]"
    assert by_code["plan.concurrency.duplicate"].hint == "use [1, 4, 8]"


def test_refused_environment_values_are_never_echoed() -> None:
    secret = "s3cr3t-Value-9f8e"
    doc = valid_document()
    doc["environment"] = {
        "HF_TOKEN": secret,
        "HOME": secret,
        "OMP_NUM_THREADS": secret + "\u202e",
        "LLAMA_STAGE_BACKEND": secret + "\x00",
        "GGML_X": secret + "\n",
        "GGML_Y": secret * 20,
        "LLAMA_STAGE_LINK_MODE": "static",
        "SKIPPY_LLAMA_LINK_MODE": "shared",
    }
    doc["plan"]["model_sha256"] = {"llama": secret}
    with pytest.raises(Refused) as caught:
        validate_operator_document(json.dumps(doc).encode())
    refused = caught.value
    assert len(refused.refusals) == 8
    for refusal in refused.refusals:
        if refusal.path.startswith("$.environment"):
            assert secret not in json.dumps(refusal.as_dict())
    assert "HF_TOKEN" in str(refused)
    del doc["plan"]["model_sha256"]["llama"]  # pins are not secret and are shown; drop it
    with pytest.raises(ValidationError) as direct:
        OperatorInput.model_validate(doc)
    assert "operator.environment" in str(direct.value)
    assert secret not in str(direct.value)


def test_equal_alias_values_are_accepted() -> None:
    doc = valid_document()
    doc["environment"] = {"LLAMA_STAGE_GGML_NATIVE": "ON", "SKIPPY_GGML_NATIVE": "ON"}
    assert validate_operator_object(doc).environment["SKIPPY_GGML_NATIVE"] == "ON"


def test_models_built_directly_apply_the_cross_entry_rules_too() -> None:
    doc = valid_document()
    doc["environment"] = {"HF_TOKEN": "x"}
    with pytest.raises(ValidationError, match=re.escape("operator.environment.secret_name")):
        OperatorInput.model_validate(doc)
    plan = valid_document()["plan"]
    plan["concurrency"] = [2, 1]
    with pytest.raises(ValidationError, match=re.escape("plan.concurrency.not_ascending")):
        PlanInput.model_validate(plan)


def test_a_plan_validates_on_its_own_with_plan_paths() -> None:
    plan = valid_document()["plan"]
    assert validate_plan_object(plan).llama_repeats == 3
    plan["llama_repeats"] = 0
    plan["concurrency"] = [4, 1]
    with pytest.raises(Refused) as caught:
        validate_plan_object(plan)
    assert [(r.code, r.path) for r in caught.value.refusals] == [
        ("plan.concurrency.not_ascending", "$.plan.concurrency"),
        ("plan.out_of_range", "$.plan.llama_repeats"),
    ]
    with pytest.raises(Refused) as not_object:
        validate_plan_object([])
    assert not_object.value.codes == ["operator.type"]


@pytest.mark.parametrize(
    "obj", [None, 1, "x", [], [{}], {1: 2}, {"plan": {3: 4}}, {"environment": {5: "x"}}]
)
def test_odd_python_objects_are_refused_without_a_traceback(obj: object) -> None:
    with pytest.raises(Refused) as caught:
        validate_operator_object(obj)
    for refusal in caught.value.refusals:
        assert refusal.code in OPERATOR_REFUSAL_CODES
        assert refusal.path.startswith("$")


def test_native_server_and_artifact_tool_are_optional_and_default_to_null() -> None:
    doc = valid_document()
    del doc["native_server"]
    del doc["artifact_tool"]
    operator = validate_operator_object(doc)
    assert operator.native_server is None
    assert operator.artifact_tool is None


def test_a_plan_with_its_own_catalog_may_name_that_catalogs_keys() -> None:
    """Keys of an operator's own catalog are not the packaged ones; preparation checks them
    against that catalog once it has pinned its bytes, so the edge lets them through."""
    doc = valid_document()
    doc["plan"]["catalog"] = {"path": "/data/my-catalog.json", "sha256": SHA}
    doc["plan"]["cases"] = ["gemma3_270m"]
    doc["plan"]["model_sha256"] = {"gemma3_270m": SHA}
    model = validate_operator_object(doc)
    assert model.plan.cases == ["gemma3_270m"]
    del doc["plan"]["catalog"]
    assert ("plan.case.unknown", "$.plan.cases[0]") in refusals_of(doc)
