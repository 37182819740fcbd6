"""The zoo as files: hub cache layout, determinism, the zoo catalog and report, honesty.

These tests read the written bytes back (``gguf.GGUFReader``, ``os.readlink``, the strict
catalog loader) rather than trusting what the builders say about themselves. Whether
llama.cpp loads and serves the models is ``test_zoo_real_parts.py``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path, PurePosixPath

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_family.errors import Refused
from cache_family.oracles.native_parts import zoo_key
from cache_family.oracles.zoo import (
    BUILDERS,
    REPORT_NAME,
    ZooResult,
    build_zoo,
    carries_synthetic_tag,
    dense,
    hub,
)
from cache_family.oracles.zoo.base import (
    SYNTHETIC_TAG,
    Builder,
    BuiltModel,
    ZooUnsupported,
    model_rng,
    write_gguf,
)
from cache_family.oracles.zoo.hub import SnapshotPath, place_in_snapshot, publish_snapshot
from cache_family.oracles.zoo.layers import GATE_DOWN_UP, Tensors
from cache_family.oracles.zoo.vocab import (
    EOS_TOKEN,
    TOKEN_BYTES,
    byte_to_printable,
    rendered_bytes,
    vocabulary,
)
from cache_family.oracles.zoo.zoo_catalog import NOT_BUILT_PREFIX
from cache_family.schemas.catalog import load_catalog, packaged_catalog

DENSE_KEYS = [
    "llama",
    "qwen3_dense",
    "gemma2",
    "gemma3",
    "olmo",
    "glm4",
    "gemma4_a4b",
    "gemma4_e4b",
]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> ZooResult:
    root = tmp_path_factory.mktemp("zoo")
    return build_zoo(root, seed=0, progress=io.StringIO())


def _field(reader: gguf.GGUFReader, key: str) -> object:
    found = reader.get_field(key)
    assert found is not None, key
    return found.contents()


def test_every_catalog_preset_has_a_builder_and_an_entry(zoo: ZooResult) -> None:
    keys = packaged_catalog().catalog.keys
    assert set(BUILDERS) == set(keys)
    assert list(zoo.entries) == list(keys)
    report = json.loads(zoo.report_path.read_text())
    assert report["synthetic"] is True
    assert set(report["models"]) == set(keys)
    for key, entry in report["models"].items():
        assert entry["status"] in ("built", "unsupported"), key
        if entry["status"] == "unsupported":
            assert entry["reason"], key
            assert entry["files"] == []


def test_hub_layout_is_blobs_plus_relative_symlinks(zoo: ZooResult) -> None:
    catalog = packaged_catalog().catalog
    built = [p for p in catalog.presets if zoo.entries[p.key].status == "built"]
    assert built, "the zoo built nothing"
    for preset in built:
        repo = zoo.cache_root / preset.cache_dir
        assert (repo / "refs" / "main").read_text() == preset.revision
        entry = zoo.entries[preset.key]
        for hub_file in entry.files:
            link = zoo.cache_root / hub_file.snapshot_path
            assert link.is_symlink(), link
            target = os.readlink(link)
            assert not os.path.isabs(target), target
            depth = len(link.relative_to(repo / "snapshots" / preset.revision).parts)
            assert target == "/".join([".."] * (depth + 1)) + f"/blobs/{hub_file.sha256}"
            blob = link.resolve()
            assert blob.parent == (repo / "blobs").resolve()
            assert blob.name == _sha256(blob) == hub_file.sha256
        requested = zoo.cache_root / preset.snapshot_relative
        if preset.artifact_kind == "layer-package":
            assert requested.is_dir() and not requested.is_symlink()
        else:
            assert requested.is_symlink() and requested.resolve().is_file()


def test_split_shards_are_siblings_in_one_snapshot_directory(zoo: ZooResult) -> None:
    preset = packaged_catalog().catalog.preset("minimax_m27")
    if zoo.entries[preset.key].status != "built":
        pytest.fail(f"minimax_m27 was not built: {zoo.entries[preset.key].reason}")
    first = zoo.cache_root / preset.snapshot_relative
    assert sorted(p.name for p in first.parent.iterdir()) == list(preset.shard_names)


def test_same_seed_same_bytes_other_seed_other_bytes(zoo: ZooResult, tmp_path: Path) -> None:
    again = build_zoo(tmp_path / "again", seed=0, progress=io.StringIO())
    other = build_zoo(tmp_path / "other", seed=1, progress=io.StringIO())
    for key, entry in zoo.entries.items():
        if entry.status != "built":
            continue
        first = [f.sha256 for f in entry.files]
        assert [f.sha256 for f in again.entries[key].files] == first, key
        assert [f.sha256 for f in other.entries[key].files] != first, key
    assert again.catalog_path.read_bytes() == zoo.catalog_path.read_bytes()


def test_zoo_catalog_is_the_packaged_format_marked_synthetic(zoo: ZooResult) -> None:
    loaded = load_catalog(str(zoo.catalog_path))  # the strict loader and integrity checks
    tiny = loaded.catalog
    reference = packaged_catalog().catalog
    assert tiny.synthetic is True
    assert tiny.family_order == reference.family_order
    assert [p.key for p in tiny.presets] == [p.key for p in reference.presets]
    for small, big in zip(tiny.presets, reference.presets, strict=True):
        assert small.synthetic is True
        same = ("family", "payload", "load_mode", "snapshot_relative", "revision", "repo")
        for name in (*same, "artifact_kind", "shard_names", "baseline_policy", "prefix_tokens"):
            assert getattr(small, name) == getattr(big, name), (small.key, name)
        if small.payload == "kv-recurrent":
            assert small.kv_bytes_per_token is None


@pytest.mark.parametrize("key", DENSE_KEYS)
def test_catalog_shapes_are_read_from_the_written_gguf(zoo: ZooResult, key: str) -> None:
    """Layer count, width and KV bytes per token come from the file, not from a table."""
    entry = zoo.entries[key]
    assert entry.status == "built", entry.reason
    preset = load_catalog(str(zoo.catalog_path)).catalog.preset(key)
    reader = gguf.GGUFReader(zoo.cache_root / preset.snapshot_relative)
    arch = str(_field(reader, "general.architecture"))
    assert arch == preset.architecture
    assert _field(reader, f"{arch}.block_count") == preset.layer_end
    assert _field(reader, f"{arch}.embedding_length") == preset.activation_width
    assert preset.state_layer_start == 0 and preset.state_layer_end == preset.layer_end
    # f16 K and V rows of every layer that owns a KV cache (shared-KV layers have none).
    kv_elements = sum(
        int(t.shape[1])
        for t in reader.tensors
        if t.name.endswith((".attn_k.weight", ".attn_v.weight"))
    )
    assert preset.kv_bytes_per_token == kv_elements * 2
    assert preset.ctx <= int(str(_field(reader, f"{arch}.context_length")))


def test_the_vocabulary_is_a_real_byte_level_bpe() -> None:
    tokens, merges, types = vocabulary()
    printable = byte_to_printable()
    assert len(set(printable)) == 256
    assert tokens[: len(TOKEN_BYTES)] == tuple(printable[b] for b in TOKEN_BYTES)
    assert all(not ch.isspace() for ch in printable)
    assert len(tokens) == len(types) == len(set(tokens))
    for merge in merges:
        left, right = merge.split(" ")
        assert left in tokens and right in tokens and left + right in tokens
    assert tokens.count(EOS_TOKEN) == 1 and tokens[-1] == EOS_TOKEN
    assert 750 <= len(tokens) <= 1000


def _held_back_from(text: bytes) -> int:
    """llama-server's ``validate_utf8``: where an unfinished multi-byte character starts at
    the end of the text generated so far (the server streams nothing past it), else the
    length."""
    for back in range(1, min(4, len(text)) + 1):
        byte = text[-back]
        for lead_mask, lead, size in ((0xE0, 0xC0, 2), (0xF0, 0xE0, 3), (0xF8, 0xF0, 4)):
            if byte & lead_mask == lead and back < size:
                return len(text) - back
    return len(text)


def _visible(piece: bytes) -> bool:
    text = piece.decode("utf-8")
    return bool(text) and all(ch.isprintable() or ch in "\t\n\r" for ch in text)


def _model_vocabularies(zoo: ZooResult) -> dict[str, tuple[list[str], list[int], int]]:
    """Each built family's (tokens, token types, end-of-sequence id) as its GGUF holds them."""
    out: dict[str, tuple[list[str], list[int], int]] = {}
    for preset in packaged_catalog().catalog.presets:
        entry = zoo.entries[preset.key]
        if entry.status != "built":
            continue
        for hub_file in entry.files:
            if not hub_file.snapshot_path.endswith(".gguf"):
                continue
            reader = gguf.GGUFReader(zoo.cache_root / hub_file.snapshot_path)
            if reader.get_field("tokenizer.ggml.tokens") is None:
                continue  # a layer package's part without the tokenizer
            tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens")]  # type: ignore[attr-defined]
            types = [int(t) for t in _field(reader, "tokenizer.ggml.token_type")]  # type: ignore[attr-defined]
            eos = int(str(_field(reader, "tokenizer.ggml.eos_token_id")))
            out[f"{preset.key}:{hub_file.snapshot_path}"] = (tokens, types, eos)
    return out


def test_every_token_a_zoo_model_can_generate_renders_visible_text(zoo: ZooResult) -> None:
    """Every family's vocabulary, read from its GGUF: each ordinary token renders visible,
    whole-character text on its own; the only other token is end-of-sequence (banned by
    ``ignore_eos``, and the end of the answer otherwise). So llama-server streams every
    generated token as an event with text, and first-token times can be observed."""
    vocabularies = _model_vocabularies(zoo)
    families = {key.split(":")[0] for key in vocabularies}
    assert families == set(zoo.built), "a built family's vocabulary was not read"
    for key, (tokens, types, eos) in vocabularies.items():
        for token_id, (token, kind) in enumerate(zip(tokens, types, strict=True)):
            if token_id == eos:
                assert kind == gguf.TokenType.CONTROL and token == EOS_TOKEN, key
                continue
            assert kind == gguf.TokenType.NORMAL, (key, token_id, token)
            piece = rendered_bytes(token)
            assert _held_back_from(piece) == len(piece), (key, token_id, piece)
            assert _visible(piece), (key, token_id, piece)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(vocabulary()[0]) - 1), max_size=64))
def test_no_sequence_of_zoo_tokens_is_ever_held_back_by_the_server(ids: list[int]) -> None:
    """Whatever a zoo model generates, after each token the text so far ends on a whole
    character and grew by visible text: the server sends every token as it comes."""
    tokens, _, _ = vocabulary()
    eos = tokens.index(EOS_TOKEN)
    text = b""
    for token_id in ids:
        if token_id == eos:
            continue
        piece = rendered_bytes(tokens[token_id])
        text += piece
        assert _visible(piece)
        assert _held_back_from(text) == len(text)


def test_the_vocabulary_is_in_every_dense_model(zoo: ZooResult) -> None:
    tokens, merges, _ = vocabulary()
    preset = packaged_catalog().catalog.preset("llama")
    reader = gguf.GGUFReader(zoo.cache_root / preset.snapshot_relative)
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _field(reader, "tokenizer.ggml.pre") == "gpt-2"
    assert list(_field(reader, "tokenizer.ggml.tokens")) == list(tokens)  # type: ignore[call-overload]
    assert list(_field(reader, "tokenizer.ggml.merges")) == list(merges)  # type: ignore[call-overload]
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    assert tokens[int(str(eos))] == EOS_TOKEN


def test_layer_tensors_spell_llama_cpp_names_in_ggml_order(tmp_path: Path) -> None:
    """Builders list shapes as llama.cpp does (``ne``, innermost first); files must agree."""
    t = Tensors(model_rng(3, "layers-test"), n_embd=8)
    t.token_embedding(20)
    t.attention(0, n_q=8, n_kv=4, gated_query=True)
    t.norm("ffn_norm", 8, 0, suffix=None)
    t.experts(0, n_ff=6, n_expert=3, order=GATE_DOWN_UP)
    t.bias("exp_probs_b", 3, 0)
    path = tmp_path / "layers.gguf"
    write_gguf(gguf.GGUFWriter(path, "llama"), t)
    written = {
        tensor.name: (tuple(int(n) for n in tensor.shape), tensor.tensor_type)
        for tensor in gguf.GGUFReader(path).tensors
    }
    f16, f32 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32
    assert list(written) == [name for name, _ in t]
    assert written == {
        "token_embd.weight": ((8, 20), f16),
        "blk.0.attn_q.weight": ((8, 16), f16),  # query plus its output gate
        "blk.0.attn_k.weight": ((8, 4), f16),
        "blk.0.attn_v.weight": ((8, 4), f16),
        "blk.0.attn_output.weight": ((8, 8), f16),
        "blk.0.ffn_norm": ((8,), f32),
        "blk.0.ffn_gate_exps.weight": ((8, 6, 3), f16),
        "blk.0.ffn_down_exps.weight": ((6, 8, 3), f16),
        "blk.0.ffn_up_exps.weight": ((8, 6, 3), f16),
        "blk.0.exp_probs_b.bias": ((3,), f32),
    }


def _cannot_load(staging: Path, seed: int) -> BuiltModel:
    raise ZooUnsupported("this test's architecture has no loader in llama.cpp")


def test_an_unsupported_model_is_reported_and_left_missing(tmp_path: Path) -> None:
    builders = dict(BUILDERS)
    first = build_zoo(tmp_path, seed=0, progress=io.StringIO(), builders=builders)
    assert first.entries["olmo"].status == "built"
    builders["olmo"] = _cannot_load
    second = build_zoo(tmp_path, seed=0, progress=io.StringIO(), builders=builders)
    preset = packaged_catalog().catalog.preset("olmo")
    assert not (tmp_path / preset.snapshot_relative).exists(), "an old model must not linger"
    assert not (tmp_path / preset.snapshot_relative).is_symlink()
    report = json.loads(second.report_path.read_text())["models"]["olmo"]
    assert report == {
        "status": "unsupported",
        "reason": "this test's architecture has no loader in llama.cpp",
        "architecture": None,
        "files": [],
        "sha256": {},
    }
    tiny = load_catalog(str(second.catalog_path)).catalog.preset("olmo")
    assert tiny.synthetic is True
    assert tiny.architecture_note.startswith(NOT_BUILT_PREFIX + report["reason"])
    assert "unsupported" in second.summary() and report["reason"] in second.summary()


def _wrong_name(staging: Path, seed: int) -> BuiltModel:
    built = dense.build_llama(staging, seed)
    renamed = staging / "not-the-catalog-name.gguf"
    built.files[0].rename(renamed)
    return BuiltModel((renamed,), built.architecture, built.shape, built.kv_bytes_per_token)


def test_a_builder_that_writes_another_file_name_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="the catalog names"):
        build_zoo(tmp_path, seed=0, progress=io.StringIO(), builders={"llama": _wrong_name})


def test_rebuilding_over_an_existing_zoo_keeps_it_consistent(zoo: ZooResult) -> None:
    again = build_zoo(zoo.cache_root, seed=0, progress=io.StringIO())
    for key, entry in zoo.entries.items():
        assert [f.sha256 for f in again.entries[key].files] == [f.sha256 for f in entry.files]
    assert not list(zoo.cache_root.glob(".zoo-staging-*")), "staging directories must go"


def test_snapshot_placement_rules(tmp_path: Path) -> None:
    rev = "a" * 40
    single = SnapshotPath.parse(f"models--o--n/snapshots/{rev}/m.gguf")
    nested = SnapshotPath.parse(f"models--o--n/snapshots/{rev}/Q2/m-00001-of-00002.gguf")
    package = SnapshotPath.parse(f"models--o--n/snapshots/{rev}")
    assert package.is_directory and not single.is_directory
    assert place_in_snapshot(single, tmp_path, tmp_path / "m.gguf") == PurePosixPath("m.gguf")
    flat = tmp_path / "m-00002-of-00002.gguf"
    assert place_in_snapshot(nested, tmp_path, flat) == PurePosixPath("Q2/m-00002-of-00002.gguf")
    inside = tmp_path / "Q2" / "m-00002-of-00002.gguf"
    assert place_in_snapshot(nested, tmp_path, inside) == PurePosixPath("Q2/m-00002-of-00002.gguf")
    layer = tmp_path / "layers" / "l0.gguf"
    assert place_in_snapshot(package, tmp_path, layer) == PurePosixPath("layers/l0.gguf")
    for bad in ("models--o--n/snapshots/main/m.gguf", "elsewhere/snapshots/" + rev, "../x"):
        with pytest.raises(ValueError):
            SnapshotPath.parse(bad)


def test_a_directory_snapshot_links_every_file(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    (staging / "sub").mkdir(parents=True)
    (staging / "manifest.json").write_text("{}")
    (staging / "sub" / "layer.gguf").write_bytes(b"GGUF-bytes")
    rev = "b" * 40
    files = publish_snapshot(
        tmp_path / "hub",
        f"models--o--pkg/snapshots/{rev}",
        staging,
        (Path("manifest.json"), staging / "sub" / "layer.gguf"),
    )
    snapshot = tmp_path / "hub" / "models--o--pkg" / "snapshots" / rev
    assert os.readlink(snapshot / "manifest.json").startswith("../../blobs/")
    assert os.readlink(snapshot / "sub" / "layer.gguf").startswith("../../../blobs/")
    assert (snapshot / "sub" / "layer.gguf").read_bytes() == b"GGUF-bytes"
    assert [f.sha256 for f in files] == [
        hashlib.sha256(b"{}").hexdigest(),
        hashlib.sha256(b"GGUF-bytes").hexdigest(),
    ]


def test_zoo_key_follows_the_seed() -> None:
    assert zoo_key(0) == zoo_key(0)
    assert zoo_key(0) != zoo_key(1)


def test_an_inconsistent_zoo_catalog_is_refused() -> None:
    from cache_family.oracles.zoo.zoo_catalog import zoo_catalog

    reference = packaged_catalog().catalog
    presets = {p.key: p for p in reference.presets}  # not marked synthetic
    with pytest.raises(Refused) as refused:
        zoo_catalog(reference, presets)
    assert "catalog.synthetic_mismatch" in refused.value.codes


# --- what the zoo says about itself ------------------------------------------------------------


def test_every_zoo_gguf_with_model_metadata_carries_the_synthetic_tag(zoo: ZooResult) -> None:
    """Tooling recognises a zoo model by its bytes: ``general.tags`` in the file itself."""
    checked = 0
    for key, entry in zoo.entries.items():
        if entry.status != "built":
            continue
        for hub_file in entry.files:
            path = zoo.cache_root / hub_file.snapshot_path
            if path.suffix != ".gguf":
                continue
            reader = gguf.GGUFReader(path)
            split_no = reader.get_field("split.no")
            if split_no is not None and split_no.contents() != 0:
                # Later shards hold only split keys, as gguf-split writes them.
                assert reader.get_field("general.architecture") is None, (key, path.name)
                continue
            assert carries_synthetic_tag(path), (key, path.name)
            assert list(_field(reader, "general.tags")) == [SYNTHETIC_TAG]  # type: ignore[call-overload]
            assert "random-weight" in str(_field(reader, "general.description")), key
            checked += 1
    assert checked >= len(zoo.built), "every built model has at least one marked file"


def test_zoo_catalog_says_ctx_is_the_run_context_not_the_models(zoo: ZooResult) -> None:
    tiny = load_catalog(str(zoo.catalog_path)).catalog
    reference = packaged_catalog().catalog
    for preset in tiny.presets:
        if zoo.entries[preset.key].status != "built":
            continue
        assert preset.ctx == reference.preset(preset.key).ctx, preset.key
        first = zoo.entries[preset.key].files[0].snapshot_path
        if first.endswith(".json"):  # a layer package: its first GGUF holds the header
            first = zoo.entries[preset.key].files[1].snapshot_path
        reader = gguf.GGUFReader(zoo.cache_root / first)
        arch = str(_field(reader, "general.architecture"))
        trained = int(str(_field(reader, f"{arch}.context_length")))
        assert trained > preset.ctx, preset.key
        note = preset.architecture_note
        assert f"ctx {preset.ctx} is the benchmark's run context" in note, preset.key
        assert f"context_length {trained}" in note, preset.key


# --- the zoo writes only where it may ------------------------------------------------------


REAL_REVISION = "23749fefcc72300e3a2ad315e1317431b06b590a"
REAL_LINK = f"models--Qwen--Qwen3-0.6B-GGUF/snapshots/{REAL_REVISION}/Qwen3-0.6B-Q8_0.gguf"


def _plant_real_model(root: Path, snapshot_relative: str = REAL_LINK) -> None:
    """A model as a hub download leaves it: a blob, a relative snapshot link and refs/main."""
    target = SnapshotPath.parse(snapshot_relative)
    repo = root / target.repo_dir
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "blobs" / "realblob").write_bytes(b"GGUF real weights, not the zoo's")
    link = root / snapshot_relative
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(hub.link_target(snapshot_relative, "realblob"))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(target.revision)


def _tree(root: Path) -> dict[str, str]:
    """Every path under ``root`` with what it is: link target, file digest or directory."""
    if not root.exists() and not root.is_symlink():
        return {}
    if not root.is_dir():
        return {".": "file:" + _sha256(root)}
    seen: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if path.is_symlink():
            seen[name] = "link:" + os.readlink(path)
        elif path.is_dir():
            seen[name] = "dir"
        else:
            seen[name] = "file:" + _sha256(path)
    return seen


def _llama_only() -> dict[str, Builder]:
    return {"llama": dense.build_llama}


def test_a_real_hub_cache_is_refused_and_left_untouched(tmp_path: Path) -> None:
    _plant_real_model(tmp_path)
    before = _tree(tmp_path)
    with pytest.raises(Refused) as refused:
        build_zoo(tmp_path, seed=0, progress=io.StringIO())
    assert refused.value.codes == ["zoo.cache_root_not_ours"]
    assert "no zoo-report.json" in str(refused.value)
    assert refused.value.refusals[0].hint
    assert _tree(tmp_path) == before
    assert os.readlink(tmp_path / REAL_LINK) == "../../blobs/realblob"


def test_a_foreign_link_inside_an_earlier_zoo_is_refused_with_every_conflict(
    tmp_path: Path,
) -> None:
    build_zoo(tmp_path, seed=0, progress=io.StringIO(), builders=_llama_only())
    llama = packaged_catalog().catalog.preset("llama")
    ours = tmp_path / llama.snapshot_relative
    ours.unlink()  # someone put a real model where the zoo's llama was
    _plant_real_model(tmp_path, llama.snapshot_relative)
    _plant_real_model(tmp_path)  # and one where the zoo built nothing (qwen3_dense)
    before = _tree(tmp_path)
    with pytest.raises(Refused) as refused:
        build_zoo(tmp_path, seed=0, progress=io.StringIO(), builders=_llama_only())
    assert set(refused.value.codes) == {"zoo.cache_root_not_ours"}
    message = str(refused.value)
    assert llama.snapshot_relative in message and REAL_LINK in message
    assert "refs/main" in message  # the real download's ref in the repo the zoo never wrote
    assert _tree(tmp_path) == before, "a refused build writes nothing"


def test_unrelated_models_next_to_an_earlier_zoo_are_left_alone(tmp_path: Path) -> None:
    first = build_zoo(tmp_path, seed=0, progress=io.StringIO(), builders=_llama_only())
    other = f"models--Other--Real/snapshots/{'c' * 40}/real.gguf"
    _plant_real_model(tmp_path, other)
    planted = {k: v for k, v in _tree(tmp_path).items() if k.startswith("models--Other--Real")}
    again = build_zoo(tmp_path, seed=0, progress=io.StringIO(), builders=_llama_only())
    after = _tree(tmp_path)
    assert {k: v for k, v in after.items() if k.startswith("models--Other--Real")} == planted
    assert [f.sha256 for f in again.entries["llama"].files] == [
        f.sha256 for f in first.entries["llama"].files
    ]


def test_a_directory_at_a_zoo_snapshot_path_is_refused(tmp_path: Path) -> None:
    build_zoo(tmp_path, seed=0, progress=io.StringIO(), builders=_llama_only())
    llama = tmp_path / packaged_catalog().catalog.preset("llama").snapshot_relative
    llama.unlink()
    llama.mkdir()
    (llama / "inside").write_text("not the zoo's")
    before = _tree(tmp_path)
    with pytest.raises(Refused) as refused:
        build_zoo(tmp_path, seed=0, progress=io.StringIO(), builders=_llama_only())
    assert refused.value.codes == ["zoo.cache_root_not_ours"]
    assert _tree(tmp_path) == before


def test_a_report_that_is_not_the_zoos_gives_no_claim(tmp_path: Path) -> None:
    _plant_real_model(tmp_path)
    (tmp_path / REPORT_NAME).write_text('{"schema_version": 1, "models": {}}\n')
    before = _tree(tmp_path)
    with pytest.raises(Refused) as refused:
        build_zoo(tmp_path, seed=0, progress=io.StringIO(), builders=_llama_only())
    assert refused.value.codes == ["zoo.cache_root_not_ours"]
    assert "not this tool's zoo report" in str(refused.value)
    assert _tree(tmp_path) == before


def test_a_report_claiming_a_path_outside_the_hub_layout_is_refused(tmp_path: Path) -> None:
    report = {
        "schema_version": 1,
        "synthetic": True,
        "seed": 0,
        "models": {"x": {"files": ["../../etc/passwd"], "sha256": {"../../etc/passwd": "0" * 64}}},
    }
    (tmp_path / REPORT_NAME).write_text(json.dumps(report))
    with pytest.raises(Refused) as refused:
        build_zoo(tmp_path, seed=0, progress=io.StringIO(), builders=_llama_only())
    assert refused.value.codes == ["zoo.cache_root_not_ours"]


def test_a_cache_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "zoo"
    root.write_text("a file, not a directory")
    with pytest.raises(Refused) as refused:
        build_zoo(root, seed=0, progress=io.StringIO(), builders=_llama_only())
    assert refused.value.codes == ["zoo.cache_root_not_a_directory"]
    assert root.read_text() == "a file, not a directory"


@pytest.mark.parametrize("where", ["/proc/cache-family-zoo-test", "under-a-file/zoo"])
def test_a_cache_root_that_cannot_be_made_is_a_write_refusal(tmp_path: Path, where: str) -> None:
    (tmp_path / "under-a-file").write_text("a file")
    root = tmp_path / where  # an absolute ``where`` replaces tmp_path
    with pytest.raises(Refused) as refused:
        build_zoo(root, seed=0, progress=io.StringIO(), builders=_llama_only())
    assert refused.value.codes == ["zoo.write_failed"]
    assert refused.value.refusals[0].path == "$.cache_root"


def test_publish_refuses_a_directory_at_a_link_path_and_moves_nothing(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "m.gguf").write_bytes(b"GGUF-bytes")
    snapshot_relative = f"models--o--n/snapshots/{'d' * 40}/m.gguf"
    (tmp_path / "hub" / snapshot_relative).mkdir(parents=True)
    with pytest.raises(Refused) as refused:
        publish_snapshot(tmp_path / "hub", snapshot_relative, staging, (Path("m.gguf"),))
    assert refused.value.codes == ["zoo.cache_root_not_ours"]
    assert (staging / "m.gguf").read_bytes() == b"GGUF-bytes"
    assert not (tmp_path / "hub" / "models--o--n" / "blobs").exists()
