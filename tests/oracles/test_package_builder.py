"""The package builder oracle (``skippy-package-builder``) run as a real child process.

Sources are real tiny GGUF models from the zoo builders: the DeepSeek-V3.2 shape as one file and
MiniMax-M2.7 as three split shards. Packages are written by ``write-package`` itself.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest

from cache_family.oracles.zoo import minimax, moe
from cache_family.schemas.layer_package import MANIFEST_NAME

MODEL_ID = moe.DEEPSEEK3_MODEL_ID


def tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cache_family.oracles.package_builder", *args],
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin"},
        timeout=120,
    )


def receipt(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("}\n") and result.stdout.count("\n}\n") == 1
    loaded: dict[str, Any] = json.loads(result.stdout)
    return loaded


def refused(result: subprocess.CompletedProcess[str], code: str) -> None:
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert f"error: {code} at" in result.stderr, result.stderr


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("source")
    return moe._build_monolithic(where, 0, moe.DEEPSEEK_V32, "tiny-deepseek3.gguf").files[0]


@pytest.fixture(scope="module")
def package(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("written") / "package"
    written = receipt(
        tool("write-package", str(source), "--out-dir", str(out), "--model-id", MODEL_ID)
    )
    assert written == json.loads((out / MANIFEST_NAME).read_text())
    return out


def copy_package(package: Path, into: Path) -> Path:
    target = into / "copy"
    subprocess.run(["cp", "-r", str(package), str(target)], check=True)
    return target


def admit(package: Path, start: int = 3, end: int = 4, context: int = 32) -> list[str]:
    return [
        "admit-package",
        str(package),
        "--manifest-sha256",
        sha256(package / MANIFEST_NAME),
        "--model-id",
        MODEL_ID,
        "--layer-start",
        str(start),
        "--layer-end",
        str(end),
        "--minimum-context",
        str(context),
    ]


def test_a_written_package_has_the_public_layout_and_holds_exactly_the_source_tensors(
    source: Path, package: Path
) -> None:
    manifest = json.loads((package / MANIFEST_NAME).read_text())
    assert manifest["format"] == "layer-package" and manifest["schema_version"] == 1
    assert manifest["layer_count"] == moe.DEEPSEEK_V32.n_layer
    assert manifest["activation_width"] == moe.DEEPSEEK_V32.n_embd
    assert manifest["source_model"]["sha256"] == sha256(source)
    paths = [manifest["shared"][r]["path"] for r in ("metadata", "embeddings", "output")]
    assert paths == ["shared/metadata.gguf", "shared/embeddings.gguf", "shared/output.gguf"]
    assert [layer["path"] for layer in manifest["layers"]] == [
        f"layers/layer-{i:03d}.gguf" for i in range(manifest["layer_count"])
    ]
    assert manifest["shared"]["metadata"]["tensor_count"] == 0
    original = {t.name: (t.tensor_type, bytes(t.data)) for t in gguf.GGUFReader(source).tensors}
    cut: dict[str, tuple[Any, bytes]] = {}
    for artifact in [*manifest["shared"].values(), *manifest["layers"]]:
        path = package / artifact["path"]
        assert artifact["sha256"] == sha256(path)
        assert artifact["artifact_bytes"] == path.stat().st_size
        reader = gguf.GGUFReader(path)
        assert reader.fields["deepseek2.block_count"].contents() == manifest["layer_count"]
        assert len(reader.tensors) == artifact["tensor_count"]
        for tensor in reader.tensors:
            cut[tensor.name] = (tensor.tensor_type, bytes(tensor.data))
    assert cut == original


def test_the_written_package_is_admitted_for_the_catalog_stage(package: Path) -> None:
    got = receipt(tool(*admit(package)))
    assert got["kind"] == "layer-package" and got["root"] == str(package.resolve())
    assert got["manifest_sha256"] == sha256(package / MANIFEST_NAME)
    assert got["model_id"] == MODEL_ID
    assert got["dimensions"] == {
        "architecture": "deepseek2",
        "layer_count": 6,
        "activation_width": 256,
        "native_context_tokens": moe.DEEPSEEK_V32.n_ctx_train,
    }
    assert (got["state_layer_start"], got["state_layer_end"]) == (3, 4)
    roles = [(f["role"], f["layer_index"]) for f in got["selected_files"]]
    assert roles == [("metadata", None), ("layer", 3), ("embeddings", None), ("layer", 0)]
    assert got["independent_full_source_verified"] is False
    assert got["baseline"] == "n/a-package-only"


def test_a_tampered_layer_is_refused(package: Path, tmp_path: Path) -> None:
    copy = copy_package(package, tmp_path)
    layer = copy / "layers" / "layer-003.gguf"
    data = bytearray(layer.read_bytes())
    data[-1] ^= 0xFF
    layer.write_bytes(bytes(data))
    refused(tool(*admit(copy)), "package.artifact_sha256")


def test_a_layer_outside_the_selection_is_not_read(package: Path, tmp_path: Path) -> None:
    copy = copy_package(package, tmp_path)
    (copy / "layers" / "layer-005.gguf").unlink()
    receipt(tool(*admit(copy)))
    refused(tool(*admit(copy, 4, 6)), "package.artifact_missing")


def test_a_changed_manifest_fails_its_pin(package: Path, tmp_path: Path) -> None:
    copy = copy_package(package, tmp_path)
    args = admit(copy)
    manifest = copy / MANIFEST_NAME
    manifest.write_text(
        manifest.read_text().replace('"created_at_unix_secs"', ' "created_at_unix_secs"')
    )
    refused(tool(*args), "package.manifest_pin_mismatch")


def test_a_layer_range_outside_the_package_is_refused(package: Path) -> None:
    refused(tool(*admit(package, 3, 7)), "package.layer_range_outside")
    refused(tool(*admit(package, 4, 4)), "package.layer_range_outside")


def test_a_context_below_the_minimum_is_refused(package: Path) -> None:
    refused(
        tool(*admit(package, context=moe.DEEPSEEK_V32.n_ctx_train + 1)), "source.context_too_small"
    )


def test_another_model_id_is_refused(package: Path) -> None:
    args = admit(package)
    args[args.index("--model-id") + 1] = "org/other:Q4"
    refused(tool(*args), "package.model_id_mismatch")


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return list(minimax.build_minimax_m27(tmp_path_factory.mktemp("split"), 0).files)


def pins(paths: list[Path]) -> list[str]:
    return [arg for p in paths for arg in ("--pin", f"{p.name}={sha256(p)}")]


def test_a_complete_split_source_is_admitted_in_shard_order(shards: list[Path]) -> None:
    got = receipt(tool("admit-source", str(shards[0]), *pins(shards), "--minimum-context", "32"))
    assert got["kind"] == "gguf-source" and got["primary"] == str(shards[0])
    assert [f["path"] for f in got["ordered_files"]] == [str(p) for p in shards]
    assert got["dimensions"]["architecture"] == "minimax-m2"
    assert got["dimensions"]["layer_count"] == minimax.MINIMAX_M2.n_layer


def test_a_missing_shard_is_refused(shards: list[Path], tmp_path: Path) -> None:
    for shard in shards[:2]:
        (tmp_path / shard.name).write_bytes(shard.read_bytes())
    copies = [tmp_path / s.name for s in shards[:2]]
    result = tool("admit-source", str(copies[0]), *pins(copies), "--minimum-context", "32")
    refused(result, "source.shard_missing")


def test_shards_under_each_others_names_are_refused(shards: list[Path], tmp_path: Path) -> None:
    order = [shards[0], shards[2], shards[1]]
    for name_of, bytes_of in zip(shards, order, strict=True):
        (tmp_path / name_of.name).write_bytes(bytes_of.read_bytes())
    copies = [tmp_path / s.name for s in shards]
    result = tool("admit-source", str(copies[0]), *pins(copies), "--minimum-context", "32")
    refused(result, "source.shard_order")


def test_a_later_shard_as_primary_and_a_wrong_pin_are_refused(shards: list[Path]) -> None:
    result = tool("admit-source", str(shards[1]), *pins(shards), "--minimum-context", "32")
    refused(result, "source.not_primary_shard")
    wrong = pins(shards)
    wrong[1] = f"{shards[0].name}={'0' * 64}"
    refused(
        tool("admit-source", str(shards[0]), *wrong, "--minimum-context", "32"),
        "source.pin_mismatch",
    )


@pytest.mark.parametrize("command", [[], ["admit-source"], ["admit-package"], ["write-package"]])
def test_every_command_answers_help(command: list[str]) -> None:
    result = tool(*command, "--help")
    assert result.returncode == 0 and "usage: skippy-package-builder" in result.stdout


def test_an_unknown_flag_is_a_usage_error(package: Path) -> None:
    result = tool(*admit(package), "--verify-everything")
    assert result.returncode == 2 and result.stdout == ""
