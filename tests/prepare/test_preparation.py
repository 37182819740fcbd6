"""Native preparation end to end: admission, the supervised worker, observation, publication.

Most tests run the real parent code in-process (``run_prepare``) with the real worker
subprocess. Signal and deadline tests run the parent itself as a subprocess and deliver the
signal to it; they hold the worker in hashing with a model blob extended by a 1 TiB sparse
hole. The deadline and late-refusal tests reach the parent through ``DRIVER`` below, which
uses ``run_prepare``'s test-only parameters (a budget under the schema's 30 s minimum, a hook
right after the fresh write); neither is reachable from the command line or the operator
input.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio
from hub_fixture import (
    Claims,
    Toolbox,
    add_model,
    build_toolbox,
    replace_model,
    write_tool,
)
from preparation_harness import PRESENT, base_environ, box, prepare, write_operator  # noqa: F401

from cache_family.actors.prepare.admission import admit, parse_overrides
from cache_family.actors.prepare.models import (
    ModelLook,
    context_refusals,
    source_admission_argv,
)
from cache_family.actors.prepare.parent import (
    INPUT_NAME,
    OBSERVATIONS_NAME,
    REQUEST_NAME,
    STDERR_LOG,
    STDOUT_LOG,
    ParentReport,
    _publish,
    _read_observations,
    preparation_latch,
    revoke_if_late,
)
from cache_family.actors.prepare.supervisor import (
    EventSink,
    WorkerOutcome,
    supervise_worker,
)
from cache_family.actors.prepare.worker import WorkerRecord, observe
from cache_family.cli import build_parser, main, normalize_argv
from cache_family.console.preparation import WorkerEvents
from cache_family.errors import Refused
from cache_family.schemas.catalog import NOT_BUILT_NOTE_PREFIX, Preset, packaged_catalog
from cache_family.schemas.layer_package import MANIFEST_NAME
from cache_family.schemas.prepared import (
    PreparationRequest,
    PreparedInput,
    PreparedRow,
    encode_document,
    load_prepared_input,
)
from cache_family.system.pins import Budget
from cache_family.system.publish import publish_fresh

TIB = 1024**4


# --- helpers -----------------------------------------------------------------------------------


def tree_listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def request_for(
    box: Toolbox,
    tmp_path: Path,
    command: str = "prepare-full",
    top: dict[str, object] | None = None,
    **plan: object,
) -> PreparationRequest:
    op = write_operator(box, tmp_path / "op-for-request.json", top, **plan)
    admission = admit(command, str(op), str(tmp_path / "unused-out"), [], environ=base_environ())
    return PreparationRequest(
        schema_version=1,
        mode=admission.mode,
        operator=admission.operator,
        corpus_source=admission.corpus_source,
        worker_budget_ms=60_000,
    )


class SilentEvents:
    def emit(self, **event: object) -> None:
        del event

    def phase(self, text: str) -> None:
        del text

    clock = staticmethod(lambda: 0.0)


def observe_codes(request: PreparationRequest, budget: Budget | None = None) -> list[str]:
    with pytest.raises(Refused) as caught:
        observe(request, budget or Budget.seconds(60), SilentEvents())  # type: ignore[arg-type]
    return caught.value.codes


# --- overrides ---------------------------------------------------------------------------------


def test_overrides_are_pairs_each_once_and_known() -> None:
    parsed = parse_overrides(
        ["--prefix-tokens", "64", "--llama-repeats=5", "--use-case-corpus", "/c.json"]
    )
    assert parsed.plan_fields == {"prefix_tokens": 64, "llama_repeats": 5}
    assert parsed.corpus == "/c.json"
    assert parse_overrides(["--", "--cache-hit-repeats", "2"]).plan_fields == {
        "cache_hit_repeats": 2
    }
    cases = {
        ("--prefix-tokens", "1", "--prefix-tokens", "2"): "preparation.override.duplicate",
        ("--frobnicate", "1"): "preparation.override.unknown",
        ("--llama-parallel",): "preparation.override.missing_value",
        ("--llama-parallel", "0"): "preparation.override.bad_value",
        ("--llama-parallel", "-3"): "preparation.override.bad_value",
        ("--llama-parallel", "4294967296"): "preparation.override.bad_value",
        ("--llama-parallel", "٣"): "preparation.override.bad_value",
        ("--use-case-corpus", "relative.json"): "preparation.override.not_absolute",
        # --workloads reaches admission by other callers than the command line too.
        ("--workloads", "/w/\x1b[2J.json"): "preparation.override.bad_path",
        ("--workloads", "/w/workloads.json/"): "preparation.override.not_normalized",
        ("--workloads", "/w/../etc/workloads.json"): "preparation.override.not_normalized",
        ("--use-case-corpus", "/c/./corpus.json"): "preparation.override.not_normalized",
    }
    for arguments, code in cases.items():
        with pytest.raises(Refused) as caught:
            parse_overrides(list(arguments))
        assert caught.value.codes == [code], arguments
        assert "\x1b" not in str(caught.value), arguments  # shown escaped, never raw


def test_overrides_are_applied_before_validation(box: Toolbox, tmp_path: Path) -> None:
    before = tree_listing(tmp_path)
    code, _, err = prepare(box, tmp_path / "out", "--llama-parallel", "2000")
    assert code == 2
    assert "plan.out_of_range at $.plan.llama_parallel" in err
    assert tree_listing(tmp_path) == before | {"box/operator.json"}


# --- admission: refusals create nothing --------------------------------------------------------


def refused_admission(
    box: Toolbox,
    tmp_path: Path,
    out: Path,
    *overrides: str,
    operator: Path | None = None,
    **plan: object,
) -> str:
    op = operator or write_operator(box, tmp_path / "operator.json", **plan)
    before = tree_listing(tmp_path)
    code, stdout, err = prepare(box, out, *overrides, operator=op)
    assert code == 2, err
    assert stdout == ""
    assert tree_listing(tmp_path) == before, "an admission refusal must create nothing"
    return err


def test_bad_operator_files_are_refused(box: Toolbox, tmp_path: Path) -> None:
    fifo = tmp_path / "operator.fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (1024 * 1024 + 1))
    not_json = tmp_path / "bad.json"
    not_json.write_text("{")
    repeated = tmp_path / "repeated.json"
    repeated.write_text('{"schema_version": 1, "schema_version": 1}')
    cases = {
        fifo: "file.not_regular",
        big: "file.too_large",
        not_json: "operator.json.decode",
        repeated: "operator.json.decode",
    }
    for path, code in cases.items():
        err = refused_admission(box, tmp_path, tmp_path / "out", operator=path)
        assert code in err, err


def test_outputs_that_exist_or_have_no_parent_are_refused(box: Toolbox, tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    assert "preparation.output_exists" in refused_admission(box, tmp_path, tmp_path / "taken")
    assert "preparation.output_parent_missing" in refused_admission(
        box, tmp_path, tmp_path / "no" / "out"
    )
    assert "preparation.output_not_absolute" in refused_admission(box, tmp_path, Path("rel/out"))


def test_output_inside_build_cache_or_toolkit_is_refused(box: Toolbox, tmp_path: Path) -> None:
    toolkit = tmp_path / "cuda"
    write_tool(toolkit / "bin" / "nvcc")
    toolkit_doc = {"CUDA_PATH": {"path": str(toolkit), "sha256": "0" * 64}}
    op = write_operator(box, tmp_path / "operator.json", {"toolkit_directories": toolkit_doc})
    link = tmp_path / "link-to-hub"
    link.symlink_to(box.hub.root)
    cases = {
        box.native_build / "prepared": "$.native_build",
        box.hub.root / "prepared": "$.plan.cache_root",
        link / "prepared": "$.plan.cache_root",  # the canonical path decides
        toolkit / "prepared": "$.toolkit_directories.CUDA_PATH",
    }
    for out, where in cases.items():
        err = refused_admission(box, tmp_path, out, operator=op)
        assert f"preparation.output_not_disjoint at {where}" in err, err


def test_output_containing_a_guarded_tree_is_refused(box: Toolbox, tmp_path: Path) -> None:
    out = tmp_path / "campaign"
    err = refused_admission(box, tmp_path, out, cache_root=str(out / "hub"))
    assert "preparation.output_not_disjoint at $.plan.cache_root" in err


def test_unknown_override_and_catalog_pin_mismatch_are_refused(
    box: Toolbox, tmp_path: Path
) -> None:
    err = refused_admission(box, tmp_path, tmp_path / "out", "--fast", "yes")
    assert "preparation.override.unknown" in err
    catalog = tmp_path / "catalog.json"
    catalog.write_bytes(Path(packaged_catalog().path).read_bytes())
    err = refused_admission(
        box, tmp_path, tmp_path / "out", catalog={"path": str(catalog), "sha256": "0" * 64}
    )
    assert "preparation.catalog_pin_mismatch at $.plan.catalog.sha256" in err


# --- the worker's observation (in-process) -----------------------------------------------------


def test_tools_must_be_regular_files(box: Toolbox, tmp_path: Path) -> None:
    fifo = tmp_path / "skippy-correctness.fifo"
    os.mkfifo(fifo)
    assert observe_codes(request_for(box, tmp_path, top={"correctness": str(fifo)})) == [
        "pin.not_regular"
    ]
    assert observe_codes(request_for(box, tmp_path, top={"stage_server": str(tmp_path)})) == [
        "pin.not_regular"
    ]
    assert observe_codes(
        request_for(
            box,
            tmp_path,
            top={
                "artifact_tool": str(tmp_path / "absent"),
                "native_server": str(tmp_path / "gone"),
            },
        )
    ) == ["pin.missing", "pin.missing"]


def test_a_changed_toolkit_pin_refuses_and_a_matching_one_is_recorded(
    box: Toolbox, tmp_path: Path
) -> None:
    from cache_family.system.pins import pin_tree

    toolkit = tmp_path / "vulkan"
    write_tool(toolkit / "bin" / "glslc")
    good = pin_tree(str(toolkit), Budget.seconds(60)).sha256
    request = request_for(
        box,
        tmp_path,
        top={"toolkit_directories": {"VULKAN_SDK": {"path": str(toolkit), "sha256": good}}},
    )
    prepared = observe(request, Budget.seconds(60), SilentEvents())  # type: ignore[arg-type]
    assert prepared.toolkit_directories["VULKAN_SDK"].sha256 == good
    profile = prepared.profiles["llama"]
    assert profile.correctness.toolkit_directories["VULKAN_SDK"].sha256 == good
    (toolkit / "bin" / "glslc").write_text("changed")
    assert observe_codes(request) == ["preparation.toolkit_pin_mismatch"]


class PhaseEvents(SilentEvents):
    def __init__(self) -> None:
        self.phases: list[str] = []

    def phase(self, text: str) -> None:
        self.phases.append(text)


OBSERVATION_STEPS = [
    "pinning tools and servers",
    "pinning the native build tree",
    "pinning toolkit directories",
    "loading the catalog and corpus",
    "examining models",
    "hashing model bytes",
    "planning rows and profiles",
    "checking the prepared input's size",
]


def test_observation_runs_its_steps_in_order(box: Toolbox, tmp_path: Path) -> None:
    from cache_family.system.pins import pin_tree

    toolkit = tmp_path / "vulkan"
    write_tool(toolkit / "bin" / "glslc")
    good = pin_tree(str(toolkit), Budget.seconds(60)).sha256
    top = {"toolkit_directories": {"VULKAN_SDK": {"path": str(toolkit), "sha256": good}}}
    events, record = PhaseEvents(), WorkerRecord()
    observe(request_for(box, tmp_path, top=top), Budget.seconds(60), events, record)  # type: ignore[arg-type]
    assert events.phases == OBSERVATION_STEPS
    assert record.phase == OBSERVATION_STEPS[-1] and record.models_hashed


def test_a_refused_model_stops_observation_before_hashing(box: Toolbox, tmp_path: Path) -> None:
    """What a refused worker publishes says how far it got: here, examining models."""
    preset = packaged_catalog().catalog.preset("llama")
    put_model(box, preset, Claims(block_count=4))
    events, record = PhaseEvents(), WorkerRecord()
    with pytest.raises(Refused):
        observe(request_for(box, tmp_path, **only("llama")), Budget.seconds(60), events, record)  # type: ignore[arg-type]
    assert events.phases == [s for s in OBSERVATION_STEPS[:5] if "toolkit" not in s]
    assert record.phase == "examining models" and not record.models_hashed
    assert record.tools and record.native_build is not None and record.catalog is not None


class ProgressEvents(SilentEvents):
    """Keeps the progress events of each phase, as the parent's display would see them."""

    def __init__(self) -> None:
        self.current = ""
        self.progress: dict[str, list[dict[str, object]]] = {}

    def emit(self, **event: object) -> None:
        if event.get("event") == "progress":
            self.progress.setdefault(self.current, []).append(event)

    def phase(self, text: str) -> None:
        self.current = text


def test_a_library_and_its_link_in_the_native_build_are_hashed_once(
    box: Toolbox, tmp_path: Path
) -> None:
    events = ProgressEvents()
    prepared = observe(request_for(box, tmp_path), Budget.seconds(60), events)  # type: ignore[arg-type]
    library = box.native_build / "lib" / "libllama.so.0.0.1"
    server = box.native_build / "bin" / "llama-server"
    unique_bytes = library.stat().st_size + server.stat().st_size
    begun, *_, ended = events.progress["pinning the native build tree"]
    assert (begun["files"], begun["total"]) == (2, unique_bytes)
    assert ended["done"] == unique_bytes
    # the pin still counts the link with its target's bytes under its own name
    assert prepared.native_build.files == 3
    assert prepared.native_build.size == unique_bytes + library.stat().st_size


def test_declared_server_pins_must_match(box: Toolbox, tmp_path: Path) -> None:
    servers = {
        "old_server": {"path": str(box.old_server), "sha256": "0" * 64},
        "new_server": {"path": str(box.stage_server), "sha256": None},
    }
    assert observe_codes(request_for(box, tmp_path, **servers)) == [
        "preparation.server_pin_mismatch"
    ]


def test_declared_model_pins_must_match(box: Toolbox, tmp_path: Path) -> None:
    request = request_for(box, tmp_path, model_sha256={"llama": "0" * 64})
    assert observe_codes(request) == ["preparation.model_pin_mismatch"]
    good = request_for(box, tmp_path, model_sha256={"llama": box.hub.model("llama").sha256})
    prepared = observe(good, Budget.seconds(60), SilentEvents())  # type: ignore[arg-type]
    row = next(r for r in prepared.rows if r.key == "llama")
    assert row.model_observation.declared_byte_sha256 == box.hub.model("llama").sha256


def test_a_split_model_needs_every_sibling(box: Toolbox, tmp_path: Path) -> None:
    shards = box.hub.model("minimax_m27").snapshot_path.parent
    (shards / "MiniMax-M2.7-UD-Q2_K_XL-00002-of-00003.gguf").unlink()
    assert observe_codes(request_for(box, tmp_path)) == ["preparation.split_shard_missing"]


def test_snapshot_links_must_stay_inside_the_cache_root(box: Toolbox, tmp_path: Path) -> None:
    snapshot = box.hub.model("llama").snapshot_path
    outside = tmp_path / "elsewhere.gguf"
    outside.write_bytes(snapshot.read_bytes())
    snapshot.unlink()
    snapshot.symlink_to(outside)
    assert observe_codes(request_for(box, tmp_path)) == ["preparation.model_outside_cache_root"]


def test_a_layer_package_needs_its_manifest(box: Toolbox, tmp_path: Path) -> None:
    (box.hub.model("deepseek3").snapshot_path / MANIFEST_NAME).unlink()
    assert observe_codes(request_for(box, tmp_path)) == ["preparation.package_manifest_missing"]


# --- model identity from the bytes ------------------------------------------------------------


def refusals_of(request: PreparationRequest) -> list[tuple[str, str]]:
    with pytest.raises(Refused) as caught:
        observe(request, Budget.seconds(60), SilentEvents())  # type: ignore[arg-type]
    return [(r.code, r.path) for r in caught.value.refusals]


def put_model(box: Toolbox, preset: Preset, claims: Claims) -> None:
    """Give a preset other bytes, whether or not the fixture hub held it already."""
    if preset.key in box.hub.models:
        replace_model(box.hub, preset, claims)
    else:
        box.hub.models[preset.key] = add_model(box.hub.root, preset, claims=claims)


def only(*keys: str) -> dict[str, object]:
    return {"cases": list(keys)}


@pytest.mark.parametrize(
    ("key", "claims", "says"),
    [
        ("llama", Claims(block_count=4), "llama.block_count is 4, the catalog's layer_end is 16"),
        (
            "glm47_flash",
            Claims(block_count=49, nextn_predict_layers=1),
            "block_count is 49 (48 without its 1 prediction layer(s)), the catalog's layer_end",
        ),
        ("llama", Claims(architecture="qwen3"), "general.architecture is 'qwen3'"),
        ("llama", Claims(omit_architecture=True), "no general.architecture"),
        ("minimax_m27", Claims(block_count=4), "block_count is 4, the catalog's layer_end is 62"),
        ("deepseek3", Claims(block_count=6), "layer_count is 6, the catalog's layer_end is 61"),
        ("deepseek3", Claims(architecture="llama"), "architecture is 'llama'"),
    ],
)
def test_a_model_that_is_not_its_preset_is_refused(
    box: Toolbox, tmp_path: Path, key: str, claims: Claims, says: str
) -> None:
    preset = packaged_catalog().catalog.preset(key)
    put_model(box, preset, claims)
    with pytest.raises(Refused) as caught:
        observe(request_for(box, tmp_path, **only(key)), Budget.seconds(60), SilentEvents())  # type: ignore[arg-type]
    (refusal,) = caught.value.refusals
    assert (refusal.code, refusal.path) == (
        "preparation.model_identity_mismatch",
        f"$.plan.model_sha256.{key}",
    )
    assert says in refusal.message and "catalog" in refusal.hint


def test_prediction_layers_counted_in_block_count_are_not_trunk_layers(
    box: Toolbox, tmp_path: Path
) -> None:
    # Real GLM-4.7-Flash GGUFs declare block_count 48 = 47 trunk layers + 1 MTP layer.
    preset = packaged_catalog().catalog.preset("glm47_flash")
    put_model(box, preset, Claims(block_count=preset.layer_end + 1, nextn_predict_layers=1))
    prepared = observe(
        request_for(box, tmp_path, **only("glm47_flash")),
        Budget.seconds(60),
        SilentEvents(),  # type: ignore[arg-type]
    )
    (row,) = prepared.rows
    assert row.model_observation.status == "present"
    assert row.model_observation.block_count == preset.layer_end + 1


def test_a_package_whose_metadata_has_no_architecture_is_refused(
    box: Toolbox, tmp_path: Path
) -> None:
    replace_model(
        box.hub, packaged_catalog().catalog.preset("deepseek3"), Claims(omit_architecture=True)
    )
    assert refusals_of(request_for(box, tmp_path, **only("deepseek3"))) == [
        ("preparation.model_identity_mismatch", "$.plan.model_sha256.deepseek3")
    ]


def test_a_manifest_that_is_not_schema_1_is_refused(box: Toolbox, tmp_path: Path) -> None:
    manifest = box.hub.model("deepseek3").blob_paths[0]
    document = json.loads(manifest.read_text())
    document["format"] = "gguf"
    manifest.write_text(json.dumps(document))
    assert refusals_of(request_for(box, tmp_path, **only("deepseek3"))) == [
        ("preparation.package_manifest_invalid", "$.plan.model_sha256.deepseek3")
    ]


def test_a_package_is_admitted_by_the_artifact_tool_and_a_tampered_layer_refused(
    box: Toolbox, tmp_path: Path
) -> None:
    prepared = observe(
        request_for(box, tmp_path, **only("deepseek3")),
        Budget.seconds(120),
        SilentEvents(),  # type: ignore[arg-type]
    )
    assert [r.model_observation.status for r in prepared.rows] == ["present"]
    preset = packaged_catalog().catalog.preset("deepseek3")
    layer = (
        box.hub.model("deepseek3").snapshot_path
        / "layers"
        / (f"layer-{preset.state_layer_start:03d}.gguf")
    )
    blob = layer.resolve()
    blob.write_bytes(blob.read_bytes() + b"\0")
    refusals = refusals_of(request_for(box, tmp_path, **only("deepseek3")))
    assert refusals == [("preparation.package_admission_refused", "$.plan.cases.deepseek3")]


def test_a_receipt_that_does_not_answer_the_stage_is_refused(box: Toolbox, tmp_path: Path) -> None:
    # Fault injection: an artifact tool that exits 0 with another package's receipt.
    box.artifact_tool.write_text(
        '#!/bin/sh\necho \'{"schema_version": 1, "kind": "layer-package", "dimensions": {}}\'\n'
    )
    (refusal,) = refusals_of(request_for(box, tmp_path, **only("deepseek3")))
    assert refusal == ("preparation.package_admission_refused", "$.plan.cases.deepseek3")


def test_a_file_that_is_not_gguf_is_refused_typed(box: Toolbox, tmp_path: Path) -> None:
    blob = box.hub.model("llama").blob_paths[0]
    blob.write_bytes(b"<html>rate limited</html>\n")
    assert refusals_of(request_for(box, tmp_path, **only("llama"))) == [
        ("gguf.not_gguf", "$.plan.model_sha256.llama")
    ]


def test_the_observation_records_what_the_bytes_say(box: Toolbox, tmp_path: Path) -> None:
    prepared = observe(request_for(box, tmp_path), Budget.seconds(60), SilentEvents())  # type: ignore[arg-type]
    observed = {r.key: r.model_observation for r in prepared.rows}
    assert (
        observed["llama"].identity_source,
        observed["llama"].architecture,
        observed["llama"].block_count,
        observed["llama"].context_length,
        observed["llama"].synthetic_marker,
    ) == ("gguf-header", "llama", 16, 512, None)
    assert (observed["minimax_m27"].architecture, observed["minimax_m27"].block_count) == (
        "minimax-m2",
        62,
    )
    assert (
        observed["deepseek3"].identity_source,
        observed["deepseek3"].architecture,
        observed["deepseek3"].block_count,
        observed["deepseek3"].context_length,
    ) == ("package-manifest", "deepseek2", 61, 32)
    assert observed["olmo"].identity_source is None and observed["olmo"].architecture is None


def synthetic_catalog(tmp_path: Path) -> dict[str, str]:
    document = json.loads(Path(packaged_catalog().path).read_text())
    document["synthetic"] = True
    for preset in document["presets"]:
        preset["synthetic"] = True
    catalog = tmp_path / "synthetic-catalog.json"
    catalog.write_text(json.dumps(document))
    return {"path": str(catalog), "sha256": sha256_of(catalog)}


def test_a_preset_the_zoo_could_not_build_is_a_missing_model_with_the_zoo_reason(
    box: Toolbox, tmp_path: Path
) -> None:
    catalog = synthetic_catalog(tmp_path)
    document = json.loads(Path(catalog["path"]).read_text())
    (gemma2,) = [p for p in document["presets"] if p["key"] == "gemma2"]
    gemma2["architecture_note"] = NOT_BUILT_NOTE_PREFIX + "llama.cpp refused the tiny shape"
    Path(catalog["path"]).write_text(json.dumps(document))
    catalog["sha256"] = sha256_of(Path(catalog["path"]))
    prepared = observe(
        request_for(box, tmp_path, cases=["gemma2", "llama"], catalog=catalog),
        Budget.seconds(60),
        SilentEvents(),  # type: ignore[arg-type]
    )
    by_key = {row.key: row.model_observation for row in prepared.rows}
    assert by_key["gemma2"].status == "missing-model"
    assert by_key["gemma2"].missing_reason == "llama.cpp refused the tiny shape"
    assert by_key["llama"].status == "present"
    assert by_key["llama"].missing_reason is None
    assert "gemma2" not in prepared.profiles


@pytest.mark.parametrize("key", ["llama", "minimax_m27", "deepseek3"])
def test_zoo_bytes_are_never_a_real_family(box: Toolbox, tmp_path: Path, key: str) -> None:
    preset = packaged_catalog().catalog.preset(key)
    replace_model(box.hub, preset, Claims(synthetic=True))
    # the shapes match the real preset: only the zoo's own tag tells the bytes apart
    assert refusals_of(request_for(box, tmp_path, **only(key))) == [
        ("preparation.synthetic_model_in_real_catalog", f"$.plan.model_sha256.{key}")
    ]
    prepared = observe(
        request_for(box, tmp_path, **only(key), catalog=synthetic_catalog(tmp_path)),
        Budget.seconds(60),
        SilentEvents(),  # type: ignore[arg-type]
    )
    (row,) = prepared.rows
    assert row.synthetic
    assert (
        row.model_observation.synthetic_marker == "cache-family-bench-zoo:synthetic-random-weights"
    )


def test_bytes_changed_after_their_header_was_read_are_refused(
    box: Toolbox, tmp_path: Path
) -> None:
    from cache_family.actors.prepare.models import Gathered, examine_models, hash_models
    from cache_family.console.progress import NullProgress

    preset = packaged_catalog().catalog.preset("llama")
    gathered = Gathered()
    looks = examine_models([preset], str(box.hub.root), None, gathered)
    assert gathered.refusals == [] and looks[0].identity is not None
    with box.hub.model("llama").blob_paths[0].open("ab") as blob:
        blob.write(b"appended after the header was read")
    hash_models(looks, {}, Budget.seconds(60), NullProgress(), gathered)
    assert [r.code for r in gathered.refusals] == ["preparation.model_changed"]


# --- every refusal at once ---------------------------------------------------------------------


def test_layout_file_and_identity_refusals_come_together(box: Toolbox, tmp_path: Path) -> None:
    catalog = packaged_catalog().catalog
    # llama: a dangling link; minimax: a missing shard; deepseek3: no manifest;
    # qwen3_dense: a FIFO behind its link; gemma2: a 4-layer model; a tool that is a FIFO
    box.hub.model("llama").blob_paths[0].unlink()
    shards = box.hub.model("minimax_m27").snapshot_path.parent
    (shards / "MiniMax-M2.7-UD-Q2_K_XL-00003-of-00003.gguf").unlink()
    (box.hub.model("deepseek3").snapshot_path / MANIFEST_NAME).unlink()

    qwen = add_model(box.hub.root, catalog.preset("qwen3_dense"))
    qwen.blob_paths[0].unlink()
    os.mkfifo(qwen.blob_paths[0])
    add_model(box.hub.root, catalog.preset("gemma2"), claims=Claims(block_count=4))
    fifo = tmp_path / "stage.fifo"
    os.mkfifo(fifo)
    found = refusals_of(request_for(box, tmp_path, top={"stage_server": str(fifo)}))
    assert sorted(found) == sorted(
        [
            ("pin.not_regular", "$.stage_server"),
            ("preparation.model_unreadable", "$.plan.cases.llama"),
            ("preparation.split_shard_missing", "$.plan.cases.minimax_m27"),
            ("preparation.package_manifest_missing", "$.plan.cases.deepseek3"),
            ("pin.not_regular", "$.plan.cases.qwen3_dense"),
            ("preparation.model_identity_mismatch", "$.plan.model_sha256.gemma2"),
        ]
    )


def test_a_declared_pin_mismatch_comes_with_the_other_hashing_results(
    box: Toolbox, tmp_path: Path
) -> None:
    request = request_for(box, tmp_path, model_sha256={"llama": "0" * 64, "minimax_m27": "1" * 64})
    assert sorted(refusals_of(request)) == [
        ("preparation.model_pin_mismatch", "$.plan.model_sha256.llama"),
        ("preparation.model_pin_mismatch", "$.plan.model_sha256.minimax_m27"),
    ]


# --- bounds and sizes --------------------------------------------------------------------------


def test_a_prefix_overflowing_uint32_is_refused_before_any_write(
    box: Toolbox, tmp_path: Path
) -> None:
    err = refused_admission(box, tmp_path, tmp_path / "out", "--prefix-tokens", "4294967295")
    assert "planning.prefix_too_large at $.plan.prefix_tokens" in err
    assert "4294967423" in err


def test_an_input_over_the_runs_cap_is_refused(
    box: Toolbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cache_family.actors.prepare import parent, worker

    monkeypatch.setattr(parent, "PREPARED_INPUT_MAX_BYTES", 4096)
    monkeypatch.setattr(worker, "PREPARED_INPUT_MAX_BYTES", 4096)
    # the worker refuses before it publishes observations...
    assert observe_codes(request_for(box, tmp_path)) == ["preparation.input_too_large"]
    # ...and the parent before it publishes the input (its worker, a fresh process, had the
    # real cap and answered)
    out = tmp_path / "out"
    code, stdout, err = prepare(box, out)
    assert code == 3 and stdout == ""
    assert "preparation.input_too_large at $" in err and "4096-byte limit" in err
    assert not (out / INPUT_NAME).exists()
    assert json.loads((out / OBSERVATIONS_NAME).read_text())["complete"] is True


def test_rows_share_one_model_observation_per_key(box: Toolbox, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.json"
    corpus.write_text(
        json.dumps(
            {
                "version": 1,
                "use_cases": [
                    {"key": f"u{i}", "label": f"U{i}", "prompt": f"prompt {i}"} for i in range(4)
                ],
            }
        )
    )
    out = tmp_path / "out"
    code, _, err = prepare(box, out, "--use-case-corpus", str(corpus), command="prepare-use-cases")
    assert code == 0, err
    document = json.loads((out / INPUT_NAME).read_text())
    assert len(document["rows"]) == 4 * 14
    assert not any("model_observation" in row for row in document["rows"])
    assert sorted(document["models"]) == sorted(packaged_catalog().catalog.keys)
    prepared = load_prepared_input(str(out / INPUT_NAME))
    llama = [r.model_observation for r in prepared.rows if r.key == "llama"]
    assert len(llama) == 4 and all(o == llama[0] for o in llama)
    assert llama[0].sha256 == sha256_of(box.hub.model("llama").blob_paths[0])
    # a hand edit that gives a row its own observation is refused
    document["rows"][0]["model_observation"] = document["models"]["qwen3_dense"]
    (tmp_path / "edited.json").write_text(json.dumps(document))
    with pytest.raises(Refused) as caught:
        load_prepared_input(str(tmp_path / "edited.json"))
    assert caught.value.codes == ["prepared.invalid"]


def test_an_incomplete_native_build_is_refused(box: Toolbox, tmp_path: Path) -> None:
    os.mkfifo(box.native_build / "lib" / "socket-like")
    assert observe_codes(request_for(box, tmp_path)) == ["tree.special_file"]


def test_present_split_or_package_models_need_the_artifact_tool(
    box: Toolbox, tmp_path: Path
) -> None:
    no_tool = {"artifact_tool": None}
    assert observe_codes(request_for(box, tmp_path, top=no_tool)) == [
        "preparation.artifact_tool_missing"
    ]
    only_llama = request_for(box, tmp_path, top=no_tool, cases=["llama", "olmo"])
    prepared = observe(only_llama, Budget.seconds(60), SilentEvents())  # type: ignore[arg-type]
    assert prepared.tools.artifact_tool is None
    assert [r.model_observation.status for r in prepared.rows] == ["present", "missing-model"]


def test_a_cancelled_budget_refuses_observation(box: Toolbox, tmp_path: Path) -> None:
    budget = Budget.seconds(60)
    budget.cancel()
    assert observe_codes(request_for(box, tmp_path), budget) == ["budget.cancelled"]


# --- end to end with the real worker -----------------------------------------------------------


def test_prepare_full_observes_bytes_and_plans_every_row(box: Toolbox, tmp_path: Path) -> None:
    old_link = tmp_path / "old-skippy-link"
    old_link.symlink_to(box.old_server)
    out = tmp_path / "out"
    code, stdout, err = prepare(
        box,
        out,
        "--llama-repeats",
        "5",
        old_server={"path": str(old_link), "sha256": None},
        new_server={"path": str(box.stage_server), "sha256": sha256_of(box.stage_server)},
    )
    assert code == 0, err
    assert stdout == f"Wrote {out / INPUT_NAME}\n"
    assert sorted(os.listdir(out)) == sorted(
        [INPUT_NAME, OBSERVATIONS_NAME, REQUEST_NAME, STDOUT_LOG, STDERR_LOG]
    )
    prepared = load_prepared_input(str(out / INPUT_NAME))
    assert prepared.mode == "full" and prepared.plan.use_cases == [] and prepared.corpus is None
    assert [r.key for r in prepared.rows] == list(packaged_catalog().catalog.keys)
    assert {r.key for r in prepared.rows if r.model_observation.present} == set(PRESENT)
    assert set(prepared.profiles) == set(PRESENT)
    assert all(r.tasks.serial_baseline.runs == 5 for r in prepared.rows)

    # old server: canonical path, pin filled from the bytes
    assert prepared.plan.old_server is not None
    assert prepared.plan.old_server.path == str(box.old_server)
    assert prepared.plan.old_server.sha256 == sha256_of(box.old_server)
    # every tool is pinned by its bytes
    assert prepared.tools.correctness.sha256 == sha256_of(box.correctness)
    assert prepared.tools.native_server is not None
    assert prepared.tools.native_server.sha256 == sha256_of(box.native_server)

    llama = box.hub.model("llama")
    row = next(r for r in prepared.rows if r.key == "llama")
    assert row.model_observation.sha256 == sha256_of(llama.blob_paths[0])
    assert row.model_observation.runtime_entrypoint == str(llama.blob_paths[0])
    assert prepared.plan.model_sha256["llama"] == row.model_observation.sha256

    minimax = box.hub.model("minimax_m27")
    split = next(r for r in prepared.rows if r.key == "minimax_m27").model_observation
    assert split.runtime_entrypoint == str(minimax.snapshot_path)  # sibling discovery by name
    assert [s.sha256 for s in split.shard_pins] == [sha256_of(b) for b in minimax.blob_paths]
    assert [s.canonical for s in split.shard_pins] == [str(b) for b in minimax.blob_paths]
    assert [Path(s.logical_path).parent for s in split.shard_pins] == [
        minimax.snapshot_path.parent
    ] * 3
    artifact = prepared.profiles["minimax_m27"].correctness.artifact
    assert artifact is not None and artifact.kind == "complete-shards"
    assert artifact.tool_sha256 == sha256_of(box.artifact_tool)

    package = next(r for r in prepared.rows if r.key == "deepseek3")
    manifest = box.hub.model("deepseek3").snapshot_path / MANIFEST_NAME
    assert package.model_observation.sha256 == sha256_of(manifest)
    assert package.model_observation.runtime_entrypoint == str(
        box.hub.model("deepseek3").snapshot_path
    )
    assert prepared.profiles["deepseek3"].native is None

    missing = next(r for r in prepared.rows if r.key == "olmo")
    assert missing.model_observation.status == "missing-model"
    assert "olmo" not in prepared.profiles

    request_bytes = (out / REQUEST_NAME).read_bytes()
    observations = json.loads((out / OBSERVATIONS_NAME).read_text())
    assert observations["request_sha256"] == hashlib.sha256(request_bytes).hexdigest()
    assert "preparation: hashing model bytes" in err


@pytest.mark.parametrize("source", ["override", "environment", "operator-plan", "checked-in"])
def test_prepare_use_cases_binds_the_selected_corpus(
    box: Toolbox, tmp_path: Path, source: str
) -> None:
    corpus = tmp_path / "corpus.json"
    corpus.write_text(
        json.dumps(
            {
                "version": 1,
                "use_cases": [
                    {
                        "key": "alpha",
                        "label": "Alpha",
                        "prompt": "first prompt",
                        "prefix_tokens": 32,
                    },
                    {"key": "beta", "label": "Beta", "prompt": "second prompt"},
                ],
            }
        )
    )
    overrides: list[str] = []
    environ = base_environ()
    plan: dict[str, object] = {}
    if source == "override":
        overrides = ["--use-case-corpus", str(corpus)]
        environ["SKIPPY_CACHE_USECASE_CORPUS"] = "/nonexistent/ignored.json"
    elif source == "environment":
        environ["SKIPPY_CACHE_USECASE_CORPUS"] = str(corpus)
    elif source == "operator-plan":
        plan = {
            "use_cases": ["alpha"],
            "corpus": {"path": str(corpus), "sha256": sha256_of(corpus)},
        }
    out = tmp_path / "out"
    code, _, err = prepare(
        box,
        out,
        *overrides,
        command="prepare-use-cases",
        environ=environ,
        cases=["llama", "olmo"],
        **plan,
    )
    assert code == 0, err
    prepared = load_prepared_input(str(out / INPUT_NAME))
    assert prepared.plan.use_cases == ["all"]
    assert prepared.corpus is not None and prepared.corpus.source == source
    if source == "checked-in":
        assert len(prepared.rows) == 2 * 8
        return
    assert prepared.corpus.path == str(corpus)
    assert prepared.corpus.sha256 == sha256_of(corpus)
    assert [r.output_relative for r in prepared.rows] == [
        "alpha/llama-p32",
        "alpha/olmo-p32",
        "beta/llama-p128",
        "beta/olmo-p128",
    ]
    assert [(u.key, u.prompt) for u in prepared.use_cases] == [
        ("alpha", "first prompt"),
        ("beta", "second prompt"),
    ]


def test_prepare_full_drops_the_plans_corpus_and_records_the_flag_as_unused(
    box: Toolbox, tmp_path: Path
) -> None:
    corpus = tmp_path / "corpus.json"
    corpus.write_text(
        json.dumps({"version": 1, "use_cases": [{"key": "alpha", "label": "Alpha", "prompt": "p"}]})
    )
    plan: dict[str, object] = {
        "cases": ["llama"],
        "use_cases": ["alpha"],
        "corpus": {"path": str(corpus), "sha256": sha256_of(corpus)},
    }
    # an operator file shared with prepare-use-cases keeps its corpus; prepare-full plans none
    out = tmp_path / "out"
    code, _, err = prepare(box, out, **plan)
    assert code == 0, err
    prepared = load_prepared_input(str(out / INPUT_NAME))
    assert (prepared.plan.use_cases, prepared.plan.corpus, prepared.corpus) == ([], None, None)
    assert prepared.use_cases == []
    assert [r.use_case for r in prepared.rows] == [None]
    assert prepared.unused_corpus is None
    # The reference wrapper passes --use-case-corpus to both modes: prepare-full accepts it,
    # never reads it (a path that does not exist is fine) and records that rows ignore it.
    absent = tmp_path / "absent-corpus.json"
    out = tmp_path / "out-with-flag"
    code, _, err = prepare(box, out, "--use-case-corpus", str(absent), **plan)
    assert code == 0, err
    prepared = load_prepared_input(str(out / INPUT_NAME))
    assert prepared.unused_corpus is not None
    assert prepared.unused_corpus.path == str(absent)
    assert "not read" in prepared.unused_corpus.reason
    assert (prepared.plan.corpus, prepared.corpus, prepared.use_cases) == (None, None, [])
    assert json.loads((out / INPUT_NAME).read_bytes())["unused_corpus"]["path"] == str(absent)


def test_a_named_synthetic_catalog_is_pinned_and_recorded(box: Toolbox, tmp_path: Path) -> None:
    catalog = synthetic_catalog(tmp_path)
    out = tmp_path / "out"
    code, _, err = prepare(box, out, cases=["llama"], catalog=catalog)
    assert code == 0, err
    prepared = load_prepared_input(str(out / INPUT_NAME))
    assert prepared.catalog.model_dump() == {
        "path": catalog["path"],
        "sha256": sha256_of(Path(catalog["path"])),
        "synthetic": True,
        "packaged": False,
    }
    assert [r.synthetic for r in prepared.rows] == [True]


def refused_observations(out: Path) -> dict[str, Any]:
    """The worker's ``observations.json`` after it refused: bound to this request, no input."""
    document: dict[str, Any] = json.loads((out / OBSERVATIONS_NAME).read_text())
    assert document["complete"] is False and document["input"] is None
    assert document["request_sha256"] == sha256_of(out / REQUEST_NAME)
    return document


def test_a_worker_refusal_keeps_observations_and_publishes_nothing(
    box: Toolbox, tmp_path: Path
) -> None:
    fifo = tmp_path / "tool.fifo"
    os.mkfifo(fifo)
    op = write_operator(box, tmp_path / "operator.json", {"correctness": str(fifo)})
    out = tmp_path / "out"
    code, stdout, err = prepare(box, out, operator=op)
    assert code == 3
    assert stdout == ""
    assert sorted(os.listdir(out)) == sorted(
        [REQUEST_NAME, OBSERVATIONS_NAME, STDOUT_LOG, STDERR_LOG]
    )
    assert "pin.not_regular at $.correctness" in (out / STDERR_LOG).read_text()
    # the operator sees the worker's own refusal, then the summary
    refused = [line for line in err.splitlines() if line.startswith("refused: ")]
    assert refused[0].startswith("refused: pin.not_regular at $.correctness: ")
    assert refused[-1].startswith("refused: preparation.worker_refused at $: ")
    assert len(refused) == 2
    observed = refused_observations(out)
    assert [r["code"] for r in observed["refusals"]] == ["pin.not_regular"]
    # what was observed before the refusal is kept: the other tools, the build, the models
    so_far = observed["observed"]
    assert so_far["tools"]["stage_server"]["sha256"] == sha256_of(box.stage_server)
    assert "correctness" not in so_far["tools"]
    assert so_far["native_build"]["path"] == str(box.native_build)
    assert so_far["models"]["olmo"]["status"] == "missing-model"
    assert so_far["models_hashed"] is False  # a plan already refused hashes no model bytes
    assert so_far["phase"] == "examining models"
    # read as the worker's answer, these observations relay the same refusals and summary
    with pytest.raises(Refused) as caught:
        _read_observations(str(out), sha256_of(out / REQUEST_NAME), "full")
    assert caught.value.codes == ["pin.not_regular", "preparation.worker_refused"]


def test_relayed_refusals_never_carry_environment_values(box: Toolbox, tmp_path: Path) -> None:
    secret = "s3cr3t-value-never-printed"
    fifo = tmp_path / "tool.fifo"
    os.mkfifo(fifo)
    op = write_operator(
        box,
        tmp_path / "operator.json",
        {"correctness": str(fifo), "environment": {"GGML_SCHED_NOTE": secret}},
    )
    out = tmp_path / "out"
    code, stdout, err = prepare(box, out, operator=op)
    assert code == 3
    assert secret not in err and secret not in stdout
    assert secret not in (out / STDERR_LOG).read_text()
    assert secret not in (out / STDOUT_LOG).read_text()


def test_observations_must_answer_this_request(tmp_path: Path) -> None:
    (tmp_path / OBSERVATIONS_NAME).write_text(json.dumps({"schema_version": 1}))
    with pytest.raises(Refused) as caught:
        _read_observations(str(tmp_path), "a" * 64, "full")
    assert caught.value.codes[0] == "prepared.invalid"


@pytest.fixture
def prepared_once(box: Toolbox, tmp_path: Path) -> tuple[Path, PreparedInput]:
    out = tmp_path / "first"
    code, _, err = prepare(box, out)
    assert code == 0, err
    return out, load_prepared_input(str(out / INPUT_NAME))


def test_request_sha_mismatch_is_refused(prepared_once: tuple[Path, PreparedInput]) -> None:
    out, _ = prepared_once
    with pytest.raises(Refused) as caught:
        _read_observations(str(out), "b" * 64, "full")
    assert caught.value.codes == ["preparation.request_mismatch"]
    with pytest.raises(Refused) as caught:
        _read_observations(str(out), sha256_of(out / REQUEST_NAME), "use-cases")
    assert caught.value.codes == ["preparation.request_mismatch"]


# --- publication -------------------------------------------------------------------------------


async def test_a_foreign_input_file_is_never_replaced(
    prepared_once: tuple[Path, PreparedInput], tmp_path: Path
) -> None:
    _, prepared = prepared_once
    out = tmp_path / "fresh"
    out.mkdir()
    foreign = out / INPUT_NAME
    foreign.write_text("someone else's file")
    budget = Budget.seconds(60)
    report = await _publish(
        str(out), prepared, budget, preparation_latch(budget), ParentReport(exit_code=0), None
    )
    assert report.exit_code == 3 and [r.code for r in report.refusals] == ["publish.exists"]
    assert foreign.read_text() == "someone else's file"


def test_a_late_refusal_revokes_only_the_file_we_wrote(
    prepared_once: tuple[Path, PreparedInput], tmp_path: Path
) -> None:
    _, prepared = prepared_once
    budget = Budget.seconds(60)
    latch = preparation_latch(budget)
    ours = tmp_path / "ours"
    ours.mkdir()
    report = ParentReport(
        exit_code=0,
        published=publish_fresh(str(ours / INPUT_NAME), encode_document(prepared)),
    )
    budget.deadline = float("-inf")
    report = revoke_if_late(report, budget, latch)
    assert (report.exit_code, report.revoked) == (3, True)
    assert not (ours / INPUT_NAME).exists()

    replaced = tmp_path / "replaced"
    replaced.mkdir()
    report = ParentReport(
        exit_code=0,
        published=publish_fresh(str(replaced / INPUT_NAME), encode_document(prepared)),
    )
    inode = (replaced / INPUT_NAME).stat().st_ino
    (replaced / INPUT_NAME).unlink()
    (replaced / INPUT_NAME).write_text("foreign")
    # ext4 hands the freed inode number straight back: (device, inode) alone cannot tell
    reused = (replaced / INPUT_NAME).stat().st_ino == inode
    latch.fire(signal.SIGTERM)
    report = revoke_if_late(report, budget, latch)
    assert (report.exit_code, report.revoked) == (130, False)
    assert (replaced / INPUT_NAME).read_text() == "foreign", f"inode reused: {reused}"


# --- signals and deadlines delivered to a real parent process ----------------------------------

DRIVER = r"""
import os, signal, sys
from cache_family.actors.prepare.parent import INPUT_NAME
from cache_family.console.preparation import run_prepare

mode, operator, output = sys.argv[1:4]

def replace_then_expire(budget):
    path = os.path.join(output, INPUT_NAME)
    os.unlink(path)
    with open(path, "w") as handle:
        handle.write("foreign")
    budget.deadline = float("-inf")

if mode == "deadline":
    # The worker's deadline is absolute and 1.5 s out, the parent's 60 s: however late the
    # worker starts on a loaded machine, its own budget ends first, never the parent's.
    import cache_family.actors.prepare.parent as parent
    parent._worker_budget_ms = lambda remaining: 1500

hooks = {
    "deadline": {"budget_seconds": 60.0},
    "late-sigterm": {"after_publish": lambda b: os.kill(os.getpid(), signal.SIGTERM)},
    "late-deadline": {"after_publish": lambda b: setattr(b, "deadline", float("-inf"))},
    "late-foreign": {"after_publish": replace_then_expire},
}
sys.exit(run_prepare("prepare-full", operator, output, [], **hooks[mode]))
"""


def child_environ() -> dict[str, str]:
    env = base_environ()
    env["PYTHONSAFEPATH"] = "1"
    return env


async def read_until(stream: trio.abc.ReceiveStream, marker: bytes, seen: bytearray) -> None:
    with trio.fail_after(60):
        while marker not in seen:
            chunk = await stream.receive_some(4096)
            if not chunk:
                raise AssertionError(f"stream ended before {marker!r}: {bytes(seen)!r}")
            seen.extend(chunk)


@pytest.fixture
def slow_box(tmp_path: Path) -> Toolbox:
    """The llama blob carries a 1 TiB sparse hole: hashing it outlasts every test here."""
    return build_toolbox(tmp_path / "box", PRESENT, huge_sparse={"llama": TIB})


def worker_pid(stderr: bytes) -> int:
    line = next(text for text in stderr.decode().splitlines() if "worker pid" in text)
    return int(line.split("worker pid ")[1].split()[0])


def assert_gone(pid: int) -> None:
    try:
        process = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    assert "prepare-worker" not in " ".join(process.cmdline()), "the worker survived"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
async def test_a_signal_to_the_parent_stops_the_hashing_worker(
    slow_box: Toolbox, tmp_path: Path, signum: signal.Signals
) -> None:
    op = write_operator(slow_box, tmp_path / "operator.json")
    out = tmp_path / "out"
    parent = await trio.lowlevel.open_process(
        [
            sys.executable,
            "-m",
            "cache_family.cli",
            "prepare-full",
            "--input",
            str(op),
            "--output",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=child_environ(),
    )
    assert parent.stderr is not None
    seen = bytearray()
    try:
        await read_until(parent.stderr, b"preparation: hashing model bytes", seen)
        parent.send_signal(signum)
        with trio.fail_after(60):
            await parent.wait()
            while chunk := await parent.stderr.receive_some(4096):
                seen.extend(chunk)
    finally:
        with trio.CancelScope(shield=True):
            if parent.returncode is None:
                parent.kill()
                await parent.wait()
    assert parent.returncode == 130, bytes(seen)
    assert b"preparation.interrupted" in seen
    assert b"refused: budget.cancelled" in seen  # the worker's own refusal, relayed
    assert_gone(worker_pid(bytes(seen)))
    assert sorted(os.listdir(out)) == sorted(
        [REQUEST_NAME, OBSERVATIONS_NAME, STDOUT_LOG, STDERR_LOG]
    )
    observed = refused_observations(out)
    assert [r["code"] for r in observed["refusals"]] == ["budget.cancelled"]
    # Where the deadline lands depends on how fast the worker started on a loaded machine; what
    # is guaranteed is that it never got past hashing the 1 TiB blob.
    assert observed["observed"]["phase"] in PHASES_UP_TO_HASHING
    assert observed["observed"]["native_build"] is not None


def run_driver(mode: str, box: Toolbox, tmp_path: Path) -> tuple[int, str, Path]:
    op = write_operator(box, tmp_path / "operator.json")
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, mode, str(op), str(out)],
        capture_output=True,
        text=True,
        env=child_environ(),
        timeout=120,
        check=False,
    )
    return done.returncode, done.stderr, out


PHASES_UP_TO_HASHING = (
    "pinning tools and servers",
    "pinning the native build tree",
    "pinning toolkit directories",
    "loading the catalog and corpus",
    "examining models",
    "hashing model bytes",
)


def test_an_expired_deadline_stops_the_worker(slow_box: Toolbox, tmp_path: Path) -> None:
    code, err, out = run_driver("deadline", slow_box, tmp_path)
    assert code == 3, err
    assert "preparation.deadline_expired" in err
    assert_gone(worker_pid(err.encode()))
    assert not (out / INPUT_NAME).exists()
    # the worker's budget ends first: it says where it was, and keeps what it observed
    assert "refused: budget.deadline_expired" in err
    observed = refused_observations(out)
    assert [r["code"] for r in observed["refusals"]] == ["budget.deadline_expired"]
    # Where the deadline lands depends on how fast the worker started on a loaded machine; what
    # is guaranteed is that it never got past hashing the 1 TiB blob.
    assert observed["observed"]["phase"] in PHASES_UP_TO_HASHING


@pytest.mark.parametrize(("mode", "exit_code"), [("late-sigterm", 130), ("late-deadline", 3)])
def test_a_late_refusal_revokes_the_published_input(
    box: Toolbox, tmp_path: Path, mode: str, exit_code: int
) -> None:
    code, err, out = run_driver(mode, box, tmp_path)
    assert code == exit_code, err
    assert f"preparation: revoked {out / INPUT_NAME}" in err
    assert not (out / INPUT_NAME).exists()
    assert (out / OBSERVATIONS_NAME).exists(), "observations are kept"


def test_a_late_refusal_leaves_a_foreign_file_alone(box: Toolbox, tmp_path: Path) -> None:
    code, err, out = run_driver("late-foreign", box, tmp_path)
    assert code == 3, err
    assert "preparation.deadline_expired" in err
    assert (out / INPUT_NAME).read_text() == "foreign"
    assert "revoked" not in err


# --- the supervisor with trio's clock ----------------------------------------------------------

IGNORES_SIGTERM = (
    "import signal, sys\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "while True:\n"
    "    signal.pause()\n"
)


async def supervise_python(
    tmp_path: Path,
    code: str,
    *,
    deadline: float,
    cancel: trio.Event | None = None,
    grace_seconds: float = 12.0,
    events: EventSink | None = None,
) -> WorkerOutcome:
    """Supervise ``python -c code`` as the worker, logging to out.log and err.log."""
    return await supervise_worker(
        [sys.executable, "-c", code],
        env=base_environ(),
        cwd=str(tmp_path),
        stdout_log=str(tmp_path / "out.log"),
        stderr_log=str(tmp_path / "err.log"),
        deadline=deadline,
        cancel=trio.Event() if cancel is None else cancel,
        grace_seconds=grace_seconds,
        events=events,
    )


class CancelWhenReady:
    def __init__(self, cancel: trio.Event) -> None:
        self.cancel = cancel
        self.lines: list[bytes] = []

    def handle(self, line: bytes) -> None:
        self.lines.append(line)
        if line == b"ready":
            self.cancel.set()

    def close(self) -> None:
        pass


async def test_a_worker_ignoring_sigterm_is_killed_after_the_grace(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    # Jump only after two real seconds of idleness: the grace flies by, while the kernel
    # still gets real time to deliver SIGKILL and report the exit on a loaded machine.
    mock_clock.autojump_threshold = 2.0
    cancel = trio.Event()
    start = trio.current_time()
    outcome = await supervise_python(
        tmp_path,
        IGNORES_SIGTERM,
        deadline=float("inf"),
        cancel=cancel,
        grace_seconds=12.0,
        events=CancelWhenReady(cancel),
    )
    assert outcome.cancelled and outcome.terminated and outcome.forced
    assert outcome.exit_code == -signal.SIGKILL
    assert not outcome.clean
    assert trio.current_time() - start >= 12.0  # the grace was honoured (on the fake clock)
    assert (tmp_path / "out.log").read_bytes() == b"ready\n"


async def test_the_deadline_terminates_the_worker(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    # As above: the worker's exit on SIGTERM must be seen before the grace is jumped over.
    mock_clock.autojump_threshold = 2.0
    outcome = await supervise_python(
        tmp_path, "import signal\nwhile True: signal.pause()", deadline=trio.current_time() + 30
    )
    assert outcome.deadline_expired and outcome.terminated and not outcome.forced
    assert outcome.exit_code == -signal.SIGTERM and not outcome.clean


async def test_a_clean_worker_and_its_logs(tmp_path: Path) -> None:
    code = 'import sys\nprint(\'{"event":"phase","text":"x"}\')\nsys.stderr.write(\'note\')\n'
    sink = CancelWhenReady(trio.Event())
    outcome = await supervise_python(
        tmp_path, code, deadline=trio.current_time() + 120, events=sink
    )
    assert outcome.clean and outcome.exit_code == 0 and not outcome.terminated
    assert sink.lines == [b'{"event":"phase","text":"x"}']
    assert (tmp_path / "err.log").read_text() == "note"


async def test_an_oversized_stdout_makes_the_worker_unclean(tmp_path: Path) -> None:
    code = "import sys\nsys.stdout.buffer.write(b'x' * (17 * 1024 * 1024))\n"
    outcome = await supervise_python(tmp_path, code, deadline=trio.current_time() + 120)
    assert outcome.exit_code == 0 and outcome.stdout_truncated and not outcome.clean
    assert (tmp_path / "out.log").stat().st_size == 16 * 1024 * 1024


# --- display and command line ------------------------------------------------------------------


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_phase_lines_otherwise() -> None:
    plain = io.StringIO()
    events = WorkerEvents(plain)
    events.handle(b'{"event":"phase","text":"hashing model bytes"}')
    events.handle(b'{"event":"progress","files":2,"done":5,"total":10}')
    events.handle(b"not json")
    events.close()
    assert plain.getvalue() == "preparation: hashing model bytes\n"
    terminal = FakeTerminal()
    events = WorkerEvents(terminal)
    events.handle(b'{"event":"progress","files":2,"done":5,"total":10}')
    events.close()
    assert terminal.getvalue()


def test_the_commands_are_listed() -> None:
    text = build_parser().format_help()
    assert "prepare-full" in text and "prepare-use-cases" in text
    assert normalize_argv(
        ["automation", "cache-family-run", "prepare-full", "--input", "/a", "--output", "/b"]
    ) == ["prepare-full", "--input", "/a", "--output", "/b"]


def guide_spelling(op: Path, out: Path, *overrides: str) -> list[str]:
    return [
        "automation",
        "cache-family-run",
        "prepare-full",
        "--input",
        str(op),
        "--output",
        str(out),
        *overrides,
    ]


def test_the_operator_guide_spelling_runs_preparation(
    box: Toolbox, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    op = write_operator(box, tmp_path / "operator.json", cases=["llama"])
    out = tmp_path / "out"
    assert main(guide_spelling(op, out)) == 0, capsys.readouterr().err
    assert capsys.readouterr().out == f"Wrote {out / INPUT_NAME}\n"
    assert [r.prefix_tokens for r in load_prepared_input(str(out / INPUT_NAME)).rows] == [128]


def test_overrides_on_the_command_line(
    box: Toolbox, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    op = write_operator(box, tmp_path / "operator.json", cases=["llama"])
    out = tmp_path / "out"
    code = main(guide_spelling(op, out, "--prefix-tokens", "64", "--llama-repeats", "2"))
    assert code == 0, capsys.readouterr().err
    rows = load_prepared_input(str(out / INPUT_NAME)).rows
    assert [(r.prefix_tokens, r.tasks.serial_baseline.runs) for r in rows] == [(64, 2)]


def test_the_native_ladder_can_ask_for_the_stage_arms_output_length(
    box: Toolbox, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--native-output-tokens is a preparation override, not a plan field (the operator
    input stays the reference's): recorded in the prepared input, applied to every row's
    native ladder; without it the prepared input has no such member and the reference's 128."""
    op = write_operator(box, tmp_path / "operator.json", cases=["llama"])
    plain, same = tmp_path / "plain", tmp_path / "same"
    assert main(guide_spelling(op, plain)) == 0, capsys.readouterr().err
    assert main(guide_spelling(op, same, "--native-output-tokens", "16")) == 0
    capsys.readouterr()
    reference = load_prepared_input(str(plain / INPUT_NAME))
    assert reference.native_output_tokens is None
    assert "native_output_tokens" not in json.loads((plain / INPUT_NAME).read_text())
    assert [r.tasks.concurrent_baseline.output_tokens for r in reference.rows] == [128]
    chosen = load_prepared_input(str(same / INPUT_NAME))
    assert chosen.native_output_tokens == 16
    assert [r.tasks.concurrent_baseline.output_tokens for r in chosen.rows] == [16]
    assert [r.tasks.paired_serving.output_tokens for r in chosen.rows] == [
        chosen.plan.concurrent_output_tokens
    ]
    assert parse_overrides(["--native-output-tokens", "16"]).native_output_tokens == 16
    with pytest.raises(Refused) as caught:
        parse_overrides(["--native-output-tokens", "0"])
    assert caught.value.codes == ["preparation.override.bad_value"]


def test_the_worker_command_is_hidden() -> None:
    assert "prepare-worker" not in build_parser().format_help()


def test_admission_reports_every_refusal_at_once(box: Toolbox, tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    op = write_operator(box, tmp_path / "operator.json", cases=["llama"])
    before = tree_listing(tmp_path)
    code, _, err = prepare(
        box,
        tmp_path / "taken",
        "--use-case-corpus",
        str(tmp_path / "no-corpus.json"),
        command="prepare-use-cases",
        operator=op,
    )
    assert code == 2
    assert "file.missing" in err and "preparation.output_exists" in err
    assert tree_listing(tmp_path) == before


# --- context and split-source admission (issue 10, item 8) -------------------------------------


def test_a_model_whose_gguf_context_is_below_the_rows_is_refused_before_any_launch(
    box: Toolbox, tmp_path: Path
) -> None:
    # The fixture's llama states context_length 512, the catalog's ctx; a 1000-token prefix
    # makes the row's ctx 1128, more than the model was built for.
    found = refusals_of(request_for(box, tmp_path, **only("llama"), prefix_tokens=1000))
    assert found == [("preparation.model_context_too_small", "$.plan.cases.llama")]
    with pytest.raises(Refused) as caught:
        observe(
            request_for(box, tmp_path, **only("llama"), prefix_tokens=1000),
            Budget.seconds(60),
            SilentEvents(),  # type: ignore[arg-type]
        )
    assert "runs with ctx 1128, but its GGUF states 512 tokens" in str(caught.value)
    # The catalog's own prefix fits: the same model is planned.
    prepared = observe(
        request_for(box, tmp_path, **only("llama")),
        Budget.seconds(60),
        SilentEvents(),  # type: ignore[arg-type]
    )
    assert [r.ctx for r in prepared.rows] == [512]


def test_context_refusals_judge_each_planned_row_once_per_context(
    box: Toolbox, tmp_path: Path
) -> None:
    prepared = observe(
        request_for(box, tmp_path, **only("llama")),
        Budget.seconds(60),
        SilentEvents(),  # type: ignore[arg-type]
    )
    base = prepared.rows[0]

    def planned(index: int, ctx: int, stated: int | None) -> PreparedRow:
        observation = base.model_observation.model_copy(update={"context_length": stated})
        return base.model_copy(
            update={"index": index, "ctx": ctx, "model_observation": observation}
        )

    rows = [
        planned(0, 512, 512),
        planned(1, 1128, 512),
        planned(2, 1128, 512),
        planned(3, 64, None),
    ]
    found = [(r.code, r.message.split(" runs")[0]) for r in context_refusals(rows)]
    assert found == [
        ("preparation.model_context_too_small", "llama (row 1)"),
        ("preparation.model_context_too_small", "llama (row 3)"),
    ]


def test_a_split_model_is_admitted_through_admit_source_with_every_shard_pin(
    box: Toolbox, tmp_path: Path
) -> None:
    prepared = observe(
        request_for(box, tmp_path, **only("minimax_m27")),
        Budget.seconds(120),
        SilentEvents(),  # type: ignore[arg-type]
    )
    split = prepared.rows[0].model_observation
    minimax = box.hub.model("minimax_m27")
    look = ModelLook(
        preset=packaged_catalog().catalog.preset("minimax_m27"),
        requested=str(minimax.snapshot_path),
        entrypoint=str(minimax.snapshot_path),
        artifact_tool=str(box.artifact_tool),
    )
    argv = source_admission_argv(look, split.shard_pins)
    assert argv[1:5] == ["admit-source", str(minimax.snapshot_path), "--minimum-context", "512"]
    assert argv[5:] == [
        item for shard in split.shard_pins for item in ("--pin", f"{shard.name}={shard.sha256}")
    ]


def test_a_wrong_shard_is_refused_by_the_artifact_tool(box: Toolbox, tmp_path: Path) -> None:
    # Shards 2 and 3 swapped behind their names: each name's pin matches its bytes, the
    # headers of the first shard are right, but the shard named 00002 says it is split.no 2.
    shards = box.hub.model("minimax_m27").snapshot_path.parent
    second = shards / "MiniMax-M2.7-UD-Q2_K_XL-00002-of-00003.gguf"
    third = shards / "MiniMax-M2.7-UD-Q2_K_XL-00003-of-00003.gguf"
    second_target, third_target = os.readlink(second), os.readlink(third)
    second.unlink()
    third.unlink()
    second.symlink_to(third_target)
    third.symlink_to(second_target)
    found = refusals_of(request_for(box, tmp_path, **only("minimax_m27")))
    assert found == [("preparation.source_admission_refused", "$.plan.cases.minimax_m27")]
    with pytest.raises(Refused) as caught:
        observe(
            request_for(box, tmp_path, **only("minimax_m27")),
            Budget.seconds(60),
            SilentEvents(),  # type: ignore[arg-type]
        )
    assert "source.shard_order" in str(caught.value)
