"""The packaged catalog holds the 14 reference presets, and corrupted copies are refused."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from cache_family.errors import Refused
from cache_family.schemas.catalog import (
    Catalog,
    LoadedCatalog,
    load_catalog,
    packaged_catalog,
)

REFERENCE_KEYS = (
    "qwen3_dense", "llama", "deepseek2", "deepseek3", "glm47_flash", "glm4", "gemma4_a4b",
    "gemma4_e4b", "gemma3", "gemma2", "falcon_h1", "olmo", "minimax_m27", "qwen3next",
)  # fmt: skip
REFERENCE_FAMILY_ORDER = (
    "Qwen3Next", "Falcon-H1", "Llama", "Qwen3 dense", "DeepSeek2", "GLM-4.7 Flash", "GLM4",
    "Gemma4 A4B", "Gemma4 E4B", "Gemma3", "Gemma2", "OLMo", "MiniMax M2.7",
)  # fmt: skip
REFERENCE_USE_CASES = (
    "tool_calling", "text_to_sql", "coding_agent_loop", "issue_fixing", "code_refinement",
    "few_shot_reasoning", "open_chat", "summarization_rag",
)  # fmt: skip


def packaged_bytes() -> bytes:
    return resources.files("cache_family.schemas").joinpath("catalog.json").read_bytes()


def packaged_document() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(packaged_bytes())
    return doc


def preset_doc(doc: dict[str, Any], key: str) -> dict[str, Any]:
    found: dict[str, Any] = next(p for p in doc["presets"] if p["key"] == key)
    return found


def write_json(tmp_path: Path, doc: Any, name: str = "catalog.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc, indent=1))
    return str(path)


def refused_codes(path: str) -> list[str]:
    with pytest.raises(Refused) as info:
        load_catalog(path)
    return info.value.codes


@pytest.fixture
def catalog() -> Catalog:
    return packaged_catalog().catalog


def test_packaged_catalog_has_the_fourteen_reference_presets_in_order(catalog: Catalog) -> None:
    assert catalog.keys == REFERENCE_KEYS
    assert len(set(catalog.keys)) == 14
    assert catalog.schema_version == 1
    assert catalog.synthetic is False
    assert all(p.synthetic is False for p in catalog.presets)


def test_family_order_has_thirteen_groups_and_covers_every_family_but_deepseek3(
    catalog: Catalog,
) -> None:
    assert catalog.family_order == REFERENCE_FAMILY_ORDER
    ungrouped = {p.family for p in catalog.presets} - set(catalog.family_order)
    assert ungrouped == {"DeepSeek3"}
    assert catalog.family_rank("DeepSeek3") == 13
    assert catalog.family_rank("Qwen3Next") == 0
    assert catalog.family_rank("MiniMax M2.7") == 12
    assert catalog.family_rank("not a family") == len(catalog.family_order)
    ranked = sorted(catalog.presets, key=lambda p: catalog.family_rank(p.family))
    assert ranked[0].key == "qwen3next"
    assert ranked[-1].key == "deepseek3"


def test_use_case_order_is_the_reference_order(catalog: Catalog) -> None:
    assert catalog.use_case_order == REFERENCE_USE_CASES
    assert catalog.use_case_rank("open_chat") == 6
    assert catalog.use_case_rank("unknown") == 8


def test_minimax_lists_its_three_shards_in_order(catalog: Catalog) -> None:
    minimax = catalog.preset("minimax_m27")
    assert minimax.artifact_kind == "split-gguf"
    assert minimax.shard_names == tuple(
        f"MiniMax-M2.7-UD-Q2_K_XL-0000{i}-of-00003.gguf" for i in (1, 2, 3)
    )
    assert minimax.snapshot_relative.endswith("/UD-Q2_K_XL/" + minimax.shard_names[0])
    others = [p for p in catalog.presets if p.key != "minimax_m27"]
    assert all(p.shard_names == () for p in others)


def test_deepseek3_is_package_only_with_its_admission_contract(catalog: Catalog) -> None:
    ds3 = catalog.preset("deepseek3")
    assert ds3.load_mode == "layer-package"
    assert ds3.artifact_kind == "layer-package"
    assert ds3.baseline_policy == "package-only"
    assert ds3.skip_llama_server_reason == "layer-package evidence only, no full GGUF"
    assert ds3.package_contract is not None
    assert (ds3.package_contract.ctx, ds3.package_contract.prefix_tokens) == (32, 4)
    assert (ds3.ctx, ds3.prefix_tokens) == (32, 4)
    assert (ds3.state_layer_start, ds3.state_layer_end, ds3.state_stage_index) == (3, 4, 1)
    assert ds3.repo == "meshllm/DeepSeek-V3.2-UD-Q4_K_XL-layers"
    assert ds3.snapshot_relative.endswith(ds3.revision)
    for p in catalog.presets:
        if p.key != "deepseek3":
            assert p.load_mode == "runtime-slice"
            assert p.baseline_policy == "monolithic"
            assert p.skip_llama_server_reason is None
            assert p.package_contract is None
            assert (p.state_layer_start, p.state_layer_end, p.state_stage_index) == (
                0,
                p.layer_end,
                0,
            )


def test_revisions_are_forty_hex_and_name_the_snapshot_dir(catalog: Catalog) -> None:
    for p in catalog.presets:
        assert re.fullmatch(r"[0-9a-f]{40}", p.revision), p.key
        assert f"/snapshots/{p.revision}" in p.snapshot_relative, p.key
        assert p.snapshot_relative.startswith(p.cache_dir + "/snapshots/"), p.key
        assert p.model_ref and p.quant, p.key
        assert p.n_gpu_layers == 0
        assert p.cache_hit_repeats == 3


def test_recurrent_presets_have_no_kv_bytes_and_resident_ones_do(catalog: Catalog) -> None:
    recurrent = {p.key for p in catalog.presets if p.payload == "kv-recurrent"}
    assert recurrent == {"falcon_h1", "qwen3next"}
    for p in catalog.presets:
        assert (p.kv_bytes_per_token is None) == (p.key in recurrent), p.key
    assert catalog.preset("qwen3_dense").kv_bytes_per_token == 114688


def test_architectures_are_llama_cpp_names(catalog: Catalog) -> None:
    arch = {p.key: p.architecture for p in catalog.presets}
    assert arch["glm47_flash"] == "deepseek2"
    assert arch["olmo"] == "olmo"
    assert arch["gemma4_a4b"] == arch["gemma4_e4b"] == "gemma4"
    assert arch["minimax_m27"] == "minimax-m2"
    assert arch["falcon_h1"] == "falcon-h1"


def test_sha256_is_of_the_packaged_bytes() -> None:
    loaded = packaged_catalog()
    assert isinstance(loaded, LoadedCatalog)
    assert loaded.sha256 == hashlib.sha256(packaged_bytes()).hexdigest()
    assert packaged_catalog() is loaded


def test_a_copy_on_disk_loads_with_the_sha_of_its_own_bytes(tmp_path: Path) -> None:
    path = tmp_path / "catalog.json"
    data = packaged_bytes() + b"\n  \n"  # same document, different bytes, different pin
    path.write_bytes(data)
    loaded = load_catalog(str(path))
    assert loaded.catalog == packaged_catalog().catalog
    assert loaded.sha256 == hashlib.sha256(data).hexdigest()
    assert loaded.sha256 != packaged_catalog().sha256
    assert loaded.path == str(path)


def test_unknown_case_is_refused(catalog: Catalog) -> None:
    with pytest.raises(Refused) as info:
        catalog.preset("gpt5")
    assert info.value.codes == ["catalog.unknown_case"]


def test_a_synthetic_zoo_catalog_with_tiny_shapes_loads(tmp_path: Path) -> None:
    doc = packaged_document()
    doc["synthetic"] = True
    tiny = preset_doc(doc, "llama")
    tiny.update(
        key="zoo_llama", synthetic=True, layer_end=2, activation_width=64, ctx=256,
        prefix_tokens=32, state_layer_end=2, kv_bytes_per_token=512,
    )  # fmt: skip
    doc["presets"] = [tiny]
    doc["family_order"] = ["Llama"]
    loaded = load_catalog(write_json(tmp_path, doc))
    assert loaded.catalog.synthetic is True
    assert loaded.catalog.preset("zoo_llama").activation_width == 64


def test_optional_fields_default_when_absent(tmp_path: Path) -> None:
    defaults: dict[str, Any] = {
        "shard_names": [], "skip_llama_server_reason": None, "package_contract": None,
        "synthetic": False, "architecture_note": "", "baseline_policy": "monolithic",
    }  # fmt: skip
    doc = packaged_document()
    dropped = 0
    for p in doc["presets"]:
        for name, default in defaults.items():
            if p[name] == default:
                del p[name]
                dropped += 1
    del doc["synthetic"]
    assert dropped > 13 * 4
    assert load_catalog(write_json(tmp_path, doc)).catalog == packaged_catalog().catalog


Mutation = Callable[[dict[str, Any]], None]


def _set(preset_key: str, /, **fields: Any) -> Mutation:
    def mutate(doc: dict[str, Any]) -> None:
        preset_doc(doc, preset_key).update(fields)

    return mutate


def _top(**fields: Any) -> Mutation:
    def mutate(doc: dict[str, Any]) -> None:
        doc.update(fields)

    return mutate


def _duplicate_preset(doc: dict[str, Any]) -> None:
    doc["presets"].append(copy.deepcopy(doc["presets"][0]))


def _drop_minimax_shard(doc: dict[str, Any]) -> None:
    shards = preset_doc(doc, "minimax_m27")["shard_names"]
    del shards[2]


def _swap_minimax_shards(doc: dict[str, Any]) -> None:
    shards = preset_doc(doc, "minimax_m27")["shard_names"]
    shards[1], shards[2] = shards[2], shards[1]


def _unknown_preset_field(doc: dict[str, Any]) -> None:
    preset_doc(doc, "llama")["flash_attention"] = True


CORRUPTIONS: dict[str, tuple[Mutation, str]] = {
    "unknown field": (_unknown_preset_field, "catalog.decode"),
    "wrong type": (_set("llama", ctx="512"), "catalog.decode"),
    "unknown payload": (_set("llama", payload="full-state"), "catalog.payload.not_production"),
    "schema version": (_top(schema_version=2), "catalog.schema_version"),
    "no presets": (_top(presets=[], family_order=[]), "catalog.empty"),
    "duplicate key": (_duplicate_preset, "catalog.duplicate_key"),
    "bad key": (_set("llama", key="llama/../x"), "catalog.bad_key"),
    "unknown family group": (_set("llama", family="Llama3"), "catalog.unknown_family_group"),
    "duplicate family group": (
        _top(family_order=[*REFERENCE_FAMILY_ORDER, "Llama"]),
        "catalog.duplicate_family_group",
    ),
    "duplicate use case": (
        _top(use_case_order=[*REFERENCE_USE_CASES, "open_chat"]),
        "catalog.duplicate_use_case",
    ),
    "bad use case key": (_top(use_case_order=["open chat"]), "catalog.bad_key"),
    "model id without quant": (_set("llama", model_id="meta/llama"), "catalog.bad_model_id"),
    "bad repo": (_set("llama", repo="just-a-name"), "catalog.bad_repo"),
    "short revision": (_set("llama", revision="7d1f70022fcab"), "catalog.bad_revision"),
    "revision not in path": (
        _set("llama", revision="0" * 40),
        "catalog.bad_snapshot_path",
    ),
    "escaping path": (
        _set("gemma3", snapshot_relative="../etc/passwd"),
        "catalog.bad_snapshot_path",
    ),
    "package names a file": (
        _set(
            "deepseek3",
            snapshot_relative="models--meshllm--DeepSeek-V3.2-UD-Q4_K_XL-layers/snapshots/"
            "c7d74031a7201334b4550da6537d0b8734b81fe2/x.gguf",
        ),
        "catalog.bad_snapshot_path",
    ),
    "zero width": (_set("olmo", activation_width=0), "catalog.bad_number"),
    "too many repeats": (_set("olmo", cache_hit_repeats=5000), "catalog.bad_number"),
    "prefix beyond ctx": (_set("gemma2", prefix_tokens=512), "catalog.prefix_exceeds_ctx"),
    "state past the model": (_set("gemma2", state_layer_end=27), "catalog.state_range"),
    "resident kv without bytes": (_set("glm4", kv_bytes_per_token=None), "catalog.kv_bytes"),
    "package as runtime slice": (_set("deepseek3", load_mode="runtime-slice"), "catalog.load_mode"),
    "package with a baseline": (
        _set("deepseek3", baseline_policy="monolithic", skip_llama_server_reason=None),
        "catalog.baseline_policy",
    ),
    "package-only without reason": (
        _set("deepseek3", skip_llama_server_reason=None),
        "catalog.skip_reason",
    ),
    "package without contract": (
        _set("deepseek3", package_contract=None),
        "catalog.package_contract",
    ),
    "contract disagrees": (
        _set("deepseek3", package_contract={"ctx": 256, "prefix_tokens": 128}),
        "catalog.package_contract",
    ),
    "gguf with contract": (
        _set("llama", package_contract={"ctx": 512, "prefix_tokens": 128}),
        "catalog.package_contract",
    ),
    "missing shard": (_drop_minimax_shard, "catalog.shard_count"),
    "single gguf with shards": (
        _set("llama", shard_names=["a-00001-of-00002.gguf", "a-00002-of-00002.gguf"]),
        "catalog.shard_count",
    ),
    "shards out of order": (_swap_minimax_shards, "catalog.shard_order"),
    "synthetic preset in reference catalog": (
        _set("gemma3", synthetic=True),
        "catalog.synthetic_mismatch",
    ),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_a_corrupted_copy_is_refused(tmp_path: Path, name: str) -> None:
    mutate, code = CORRUPTIONS[name]
    doc = packaged_document()
    mutate(doc)
    assert code in refused_codes(write_json(tmp_path, doc))


def test_every_integrity_refusal_is_reported_at_once(tmp_path: Path) -> None:
    doc = packaged_document()
    _duplicate_preset(doc)
    _drop_minimax_shard(doc)
    preset_doc(doc, "olmo")["revision"] = "X" * 40
    preset_doc(doc, "deepseek3")["package_contract"] = None
    with pytest.raises(Refused) as info:
        load_catalog(write_json(tmp_path, doc))
    codes = info.value.codes
    for code in ("catalog.duplicate_key", "catalog.shard_count", "catalog.bad_revision",
                 "catalog.package_contract"):  # fmt: skip
        assert code in codes
    paths = {r.path for r in info.value.refusals}
    assert "$.presets[11].revision" in paths


def test_not_json_and_repeated_members_are_decode_refusals(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"schema_version": 1,')
    assert refused_codes(str(bad)) == ["catalog.decode"]
    latin = tmp_path / "latin.json"
    latin.write_bytes(packaged_bytes().replace(b"Llama", b"Ll\xe1ma"))
    assert refused_codes(str(latin)) == ["catalog.decode"]
    repeated = tmp_path / "repeated.json"
    repeated.write_bytes(
        packaged_bytes().replace(
            b'"synthetic": false,', b'"synthetic": false, "synthetic": true,', 1
        )
    )
    assert refused_codes(str(repeated)) == ["catalog.decode"]


def test_wrong_type_refusal_points_at_the_field(tmp_path: Path) -> None:
    doc = packaged_document()
    doc["presets"][2]["ctx"] = "512"
    with pytest.raises(Refused) as info:
        load_catalog(write_json(tmp_path, doc))
    assert info.value.refusals[0].path == "$.presets[2].ctx"


def test_symlinked_relative_and_oversized_catalogs_are_refused(tmp_path: Path) -> None:
    real = tmp_path / "real.json"
    real.write_bytes(packaged_bytes())
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert refused_codes(str(link)) == ["file.symlink"]
    assert refused_codes("catalog.json") == ["file.not_absolute"]
    big = tmp_path / "big.json"
    big.write_bytes(packaged_bytes() + b" " * (4 * 1024 * 1024))
    assert refused_codes(str(big)) == ["file.too_large"]
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    assert refused_codes(str(fifo)) == ["file.not_regular"]
