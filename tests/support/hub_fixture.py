"""A real Hugging Face hub cache tree with tiny real GGUF files, built in well under a second.

Layout, as the hub client writes it::

    ROOT/models--ORG--NAME/refs/main                      (the revision)
    ROOT/models--ORG--NAME/blobs/<sha256 of the bytes>    (the bytes)
    ROOT/models--ORG--NAME/snapshots/REV/<file>           (relative symlink into ../blobs)

Every catalog kind is written for real with the ``gguf`` library: a single GGUF, a split GGUF
whose shards carry ``split.no``/``split.count`` (all three snapshot names are symlinks into
``blobs/``, so llama.cpp's sibling discovery by name works in the snapshot directory), and a
schema-1 layer package cut by the package builder oracle (a snapshot *directory* whose
``model-package.json``, ``shared/*.gguf`` and ``layers/layer-NNN.gguf`` are symlinks into
``blobs/``). The weights are tiny zero tensors: these files exercise layout and
pins, not inference (the model zoo writes loadable models).

Headers say what the preset says (``general.architecture``, ``<arch>.block_count`` =
``layer_end``; a package's metadata header and its manifest's ``layer_count``) unless a test
asks for other claims through :class:`Claims`, e.g. a 4-layer model under a 28-layer preset or
the zoo's synthetic tag.

``huge_sparse_bytes`` extends one model's blob with a sparse hole so hashing it takes minutes
while the disk holds only the GGUF header: tests use it to catch a worker in the middle of
hashing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from cache_family.oracles.package_builder import write_package
from cache_family.schemas.catalog import Catalog, Preset, packaged_catalog
from cache_family.schemas.examples import example_operator, example_plan
from cache_family.schemas.gguf_header import ZOO_SYNTHETIC_TAG
from cache_family.schemas.layer_package import MANIFEST_NAME


@dataclass(frozen=True)
class Claims:
    """What a model's bytes say about themselves, when a test wants them to lie."""

    architecture: str | None = None  # None: the preset's
    block_count: int | None = None  # None: the preset's layer_end
    nextn_predict_layers: int | None = None  # None: the key is not written
    synthetic: bool = False  # the zoo's tag in general.tags (a package: in every artifact)
    omit_architecture: bool = False


@dataclass
class HubModel:
    key: str
    snapshot_path: Path  # what the plan's cache_root/snapshot_relative names
    blob_paths: list[Path]  # canonical bytes, in shard order (package: model-package.json first)
    sha256: str  # of the first blob (package: of model-package.json)


@dataclass
class HubFixture:
    root: Path
    models: dict[str, HubModel] = field(default_factory=dict)

    def model(self, key: str) -> HubModel:
        return self.models[key]


def _write_gguf(
    path: Path,
    preset: Preset,
    *,
    split: tuple[int, int] | None = None,
    tag: str = "",
    claims: Claims = Claims(),
) -> None:
    architecture = claims.architecture or preset.architecture
    writer = gguf.GGUFWriter(str(path), architecture)
    if claims.omit_architecture:
        writer.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE)
    if split is None or split[0] == 0:  # later shards of a split hold no model metadata
        writer.add_name(f"fixture {preset.key} {tag}".strip())
        if claims.synthetic:
            writer.add_tags([ZOO_SYNTHETIC_TAG])
        block_count = preset.layer_end if claims.block_count is None else claims.block_count
        writer.add_uint32(f"{architecture}.block_count", block_count)
        if claims.nextn_predict_layers is not None:
            writer.add_uint32(f"{architecture}.nextn_predict_layers", claims.nextn_predict_layers)
        writer.add_uint32(f"{architecture}.context_length", max(preset.ctx, 32))
        writer.add_uint32(f"{architecture}.embedding_length", preset.activation_width)
    if split is not None:
        index, count = split
        writer.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_NO, index)
        writer.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, count)
        writer.add_int32(gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, count)
    writer.add_tensor(
        f"blk.{split[0] if split else 0}.fixture.weight", np.zeros((4, 8), dtype=np.float32)
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_package(staging: Path, preset: Preset, claims: Claims) -> Path:
    """A schema-1 layer package cut by the package builder oracle from a fixture GGUF.

    ``omit_architecture`` cannot be cut (the writer needs the architecture), so its package is
    cut whole and then given a metadata artifact that lacks it, re-pinned in the manifest.
    """
    source = staging / "package-source.gguf"
    _write_gguf(source, preset, claims=dataclasses.replace(claims, omit_architecture=False))
    package = staging / "package"
    write_package(source, package, preset.model_id, created_at_unix_secs=0)
    source.unlink()
    if claims.omit_architecture:
        metadata = package / "shared" / "metadata.gguf"
        metadata.unlink()
        _write_gguf(metadata, preset, claims=claims)
        manifest = json.loads((package / MANIFEST_NAME).read_text())
        manifest["shared"]["metadata"].update(
            tensor_count=1,
            tensor_bytes=128,
            artifact_bytes=metadata.stat().st_size,
            sha256=hashlib.sha256(metadata.read_bytes()).hexdigest(),
        )
        (package / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return package


def _into_blobs(repo_dir: Path, staged: Path) -> tuple[Path, str]:
    digest = hashlib.sha256(staged.read_bytes()).hexdigest()
    blobs = repo_dir / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    blob = blobs / digest
    if blob.exists():
        staged.unlink()
    else:
        staged.rename(blob)
    return blob, digest


def _link(snapshot_file: Path, blob: Path) -> None:
    snapshot_file.parent.mkdir(parents=True, exist_ok=True)
    snapshot_file.symlink_to(os.path.relpath(blob, snapshot_file.parent))


def _repo_dir(root: Path, preset: Preset) -> Path:
    repo_dir = root / preset.cache_dir
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(preset.revision)
    return repo_dir


def add_model(
    root: Path, preset: Preset, *, huge_sparse_bytes: int = 0, claims: Claims = Claims()
) -> HubModel:
    repo_dir = _repo_dir(root, preset)
    snapshot = root / preset.snapshot_relative
    staging = repo_dir / ".staging"
    staging.mkdir(exist_ok=True)
    blobs: list[Path] = []
    if preset.artifact_kind == "single-gguf":
        staged = staging / "model.gguf"
        _write_gguf(staged, preset, claims=claims)
        blob, _ = _into_blobs(repo_dir, staged)
        _link(snapshot, blob)
        blobs.append(blob)
    elif preset.artifact_kind == "split-gguf":
        count = len(preset.shard_names)
        for index, name in enumerate(preset.shard_names):
            staged = staging / name
            _write_gguf(staged, preset, split=(index, count), tag=name, claims=claims)
            blob, _ = _into_blobs(repo_dir, staged)
            _link(snapshot.parent / name, blob)
            blobs.append(blob)
    else:
        package = _write_package(staging, preset, claims)
        files = sorted(p for p in package.rglob("*") if p.is_file())
        files.sort(key=lambda p: p.name != MANIFEST_NAME)  # the manifest's blob first
        for staged in files:
            relative = staged.relative_to(package)
            blob, _ = _into_blobs(repo_dir, staged)
            _link(snapshot / relative, blob)
            blobs.append(blob)
        for directory in sorted(package.rglob("*"), reverse=True):
            directory.rmdir()
        package.rmdir()
    staging.rmdir()
    if huge_sparse_bytes:
        # Blobs are named by digest; this one no longer matches its name, which no pin reads.
        with blobs[0].open("r+b") as handle:
            handle.truncate(huge_sparse_bytes)
    return HubModel(
        key=preset.key,
        snapshot_path=snapshot,
        blob_paths=blobs,
        sha256=hashlib.sha256(blobs[0].read_bytes()).hexdigest() if not huge_sparse_bytes else "",
    )


def replace_model(hub: HubFixture, preset: Preset, claims: Claims) -> HubModel:
    """Put other bytes (with other claims) behind a model's snapshot links."""
    snapshot = hub.root / preset.snapshot_relative
    if preset.artifact_kind == "split-gguf":
        for name in preset.shard_names:
            (snapshot.parent / name).unlink()
    elif preset.artifact_kind == "layer-package":
        for link in sorted(snapshot.rglob("*"), reverse=True):
            link.unlink() if link.is_symlink() else link.rmdir()
    else:
        snapshot.unlink()
    hub.models[preset.key] = add_model(hub.root, preset, claims=claims)
    return hub.models[preset.key]


def build_hub(
    root: Path,
    keys: Iterable[str] | None = None,
    *,
    catalog: Catalog | None = None,
    huge_sparse: dict[str, int] | None = None,
) -> HubFixture:
    """Write the named presets (default: every preset) as a hub cache under ``root``."""
    chosen = catalog or packaged_catalog().catalog
    wanted = set(chosen.keys if keys is None else keys)
    root.mkdir(parents=True, exist_ok=True)
    fixture = HubFixture(root=root)
    for preset in chosen.presets:
        if preset.key in wanted:
            fixture.models[preset.key] = add_model(
                root, preset, huge_sparse_bytes=(huge_sparse or {}).get(preset.key, 0)
            )
    return fixture


def write_tool(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    """A stand-in executable whose only role in preparation is to have pinnable bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def write_native_build(root: Path) -> Path:
    """A small native build tree: bin/llama-server, lib/ with a versioned .so and its link."""
    write_tool(root / "bin" / "llama-server", "#!/bin/sh\necho fixture llama-server\n")
    lib = root / "lib"
    lib.mkdir(parents=True, exist_ok=True)
    (lib / "libllama.so.0.0.1").write_bytes(b"\x7fELF fixture library bytes")
    (lib / "libllama.so").symlink_to("libllama.so.0.0.1")
    return root


ZERO_COMMIT = "0" * 40


def plan_document(root: Path, **overrides: object) -> dict[str, object]:
    """A valid plan input (reference §2) for the hub cache at ``root``, every member given."""
    plan = example_plan(
        str(root), runtime_lane_count=None, concurrency=[1, 2, 4], concurrent_requests=3
    )
    plan.update(overrides)
    return plan


@dataclass
class Toolbox:
    """Operator tools, a native build and a hub cache laid out side by side under one root."""

    root: Path
    correctness: Path
    stage_server: Path
    old_server: Path
    artifact_tool: Path
    native_build: Path
    hub: HubFixture

    @property
    def native_server(self) -> Path:
        return self.native_build / "bin" / "llama-server"


def build_toolbox(
    root: Path, keys: Iterable[str] | None = None, *, huge_sparse: dict[str, int] | None = None
) -> Toolbox:
    tools = root / "tools"
    return Toolbox(
        root=root,
        correctness=write_tool(tools / "skippy-correctness", "#!/bin/sh\necho correctness\n"),
        stage_server=write_tool(tools / "skippy", "#!/bin/sh\necho stage server\n"),
        old_server=write_tool(tools / "old" / "skippy", "#!/bin/sh\necho old server\n"),
        artifact_tool=write_tool(
            tools / "skippy-package-builder",
            f'#!/bin/sh\nexec {sys.executable} -I -m cache_family.oracles.package_builder "$@"\n',
        ),
        native_build=write_native_build(root / "native"),
        hub=build_hub(root / "hub", keys, huge_sparse=huge_sparse),
    )


def operator_document(box: Toolbox, **plan_overrides: object) -> dict[str, object]:
    """A valid operator input (schema_version 1) naming the toolbox's files."""
    return example_operator(
        plan_document(box.hub.root, **plan_overrides),
        correctness=str(box.correctness),
        stage_server=str(box.stage_server),
        native_server=str(box.native_server),
        artifact_tool=str(box.artifact_tool),
        native_build=str(box.native_build),
        old_source_commit="1" * 40,
        new_source_commit="2" * 40,
        native_source_commit="3" * 40,
        environment={"OMP_NUM_THREADS": "2", "LLAMA_STAGE_BACKEND": "cpu"},
        preparation_seconds=60,
    )
