"""The tiny real-model zoo: random-weight GGUF models for every catalog family.

``build_zoo(cache_root, seed=..., progress=...)`` writes, for every packaged catalog preset,
a tiny model of the family's llama.cpp architecture into a Hugging Face hub cache tree at the
preset's ``snapshot_relative`` path, so the zoo's cache root is a drop-in ``plan.cache_root``.
Next to the ``models--*`` directories it writes two files:

``catalog.json``
    the packaged catalog's format, ``synthetic: true``, with the tiny models' true shapes
    (see ``zoo_catalog``); plan against it to get rows that match the files.
``zoo-report.json``
    ``{"schema_version": 1, "synthetic": true, "seed": N, "models": {KEY: {"status":
    "built" | "unsupported", "reason": str | null, "architecture": str | null,
    "files": [snapshot-relative path, ...], "sha256": {snapshot-relative path: hex}}}}``.
    A preset a builder cannot make load is "unsupported" with the builder's reason and no
    files: its row then observes a missing model, never a stand-in.

The same seed gives byte-identical files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TextIO

from cache_family.oracles.zoo import dense, hybrid, minimax, moe
from cache_family.oracles.zoo.base import Builder, BuiltModel, ZooUnsupported
from cache_family.oracles.zoo.hub import HubFile, SnapshotPath, publish_snapshot
from cache_family.oracles.zoo.zoo_catalog import (
    encode_catalog,
    missing_preset,
    tiny_preset,
    zoo_catalog,
)
from cache_family.schemas.catalog import Preset, packaged_catalog

CATALOG_NAME = "catalog.json"
REPORT_NAME = "zoo-report.json"
REPORT_SCHEMA_VERSION = 1


#: Catalog key -> the builder that writes its tiny model.
BUILDERS: dict[str, Builder] = {
    "qwen3_dense": dense.build_qwen3_dense,
    "llama": dense.build_llama,
    "deepseek2": moe.build_deepseek2,
    "deepseek3": moe.build_deepseek3_package,
    "glm47_flash": moe.build_glm47_flash,
    "glm4": dense.build_glm4,
    "gemma4_a4b": dense.build_gemma4_a4b,
    "gemma4_e4b": dense.build_gemma4_e4b,
    "gemma3": dense.build_gemma3,
    "gemma2": dense.build_gemma2,
    "falcon_h1": hybrid.build_falcon_h1,
    "olmo": dense.build_olmo,
    "minimax_m27": minimax.build_minimax_m27,
    "qwen3next": hybrid.build_qwen3next,
}

Status = Literal["built", "unsupported"]


@dataclass(frozen=True)
class ZooEntry:
    key: str
    status: Status
    reason: str | None
    architecture: str | None
    files: tuple[HubFile, ...] = ()
    model: BuiltModel | None = None

    def report(self) -> dict[str, object]:
        return {
            "status": self.status,
            "reason": self.reason,
            "architecture": self.architecture,
            "files": [f.snapshot_path for f in self.files],
            "sha256": {f.snapshot_path: f.sha256 for f in self.files},
        }


@dataclass(frozen=True)
class ZooResult:
    cache_root: Path
    seed: int
    catalog_path: Path
    report_path: Path
    entries: dict[str, ZooEntry] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def built(self) -> list[str]:
        return [k for k, e in self.entries.items() if e.status == "built"]

    @property
    def unsupported(self) -> dict[str, str]:
        return {k: e.reason or "" for k, e in self.entries.items() if e.status == "unsupported"}

    def summary(self) -> str:
        lines = [
            f"zoo: {len(self.built)} of {len(self.entries)} tiny models written to "
            f"{self.cache_root} (seed {self.seed}, {self.seconds:.1f} s); tiny random weights, "
            "not real models",
        ]
        for key, entry in self.entries.items():
            if entry.status == "built":
                size = sum(f.size for f in entry.files)
                lines.append(
                    f"  {key:<12} built        {entry.architecture:<11} "
                    f"{len(entry.files)} file(s), {size / 1e6:5.1f} MB"
                )
            else:
                lines.append(f"  {key:<12} unsupported  {entry.reason}")
        lines.append(f"catalog: {self.catalog_path}")
        lines.append(f"report:  {self.report_path}")
        return "\n".join(lines)


def _check_files(preset: Preset, staging: Path, built: BuiltModel) -> None:
    """A builder must write the file names the catalog promises, in shard order."""
    names = [Path(f).name for f in built.files]
    if preset.artifact_kind == "split-gguf":
        expected = list(preset.shard_names)
    elif preset.artifact_kind == "single-gguf":
        expected = [preset.snapshot_relative.rsplit("/", 1)[-1]]
    else:
        expected = names  # a layer package names its own files
    if names != expected or not names:
        raise ValueError(f"{preset.key}: builder wrote {names}, the catalog names {expected}")
    for file in built.files:
        path = file if file.is_absolute() else staging / file
        if not path.is_file() or path.is_symlink():
            raise ValueError(f"{preset.key}: builder reported {file} but wrote no regular file")


def _remove_snapshot_entry(cache_root: Path, snapshot_relative: str) -> None:
    """An unsupported preset must not keep an older zoo's model at its path."""
    target = cache_root / snapshot_relative
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.is_dir():
        shutil.rmtree(target)


def build_one(cache_root: Path, preset: Preset, builder: Builder, seed: int) -> ZooEntry:
    SnapshotPath.parse(preset.snapshot_relative)  # refuse a path the hub writer cannot place
    staging = Path(tempfile.mkdtemp(prefix=f".zoo-staging-{preset.key}-", dir=cache_root))
    try:
        try:
            built = builder(staging, seed)
        except ZooUnsupported as unsupported:
            _remove_snapshot_entry(cache_root, preset.snapshot_relative)
            return ZooEntry(preset.key, "unsupported", unsupported.reason, None)
        _check_files(preset, staging, built)
        files = publish_snapshot(cache_root, preset.snapshot_relative, staging, built.files)
        return ZooEntry(preset.key, "built", None, built.architecture, tuple(files), built)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(path)


def build_zoo(
    cache_root: Path,
    *,
    seed: int,
    progress: TextIO,
    builders: dict[str, Builder] | None = None,
) -> ZooResult:
    """Write every preset's tiny model, the zoo catalog and the report under ``cache_root``."""
    started = time.monotonic()
    cache_root.mkdir(parents=True, exist_ok=True)
    chosen = BUILDERS if builders is None else builders
    reference = packaged_catalog().catalog
    entries: dict[str, ZooEntry] = {}
    presets: dict[str, Preset] = {}
    for preset in reference.presets:
        builder = chosen.get(preset.key)
        if builder is None:
            entry = ZooEntry(preset.key, "unsupported", "no zoo builder for this preset", None)
            _remove_snapshot_entry(cache_root, preset.snapshot_relative)
        else:
            entry = build_one(cache_root, preset, builder, seed)
        entries[preset.key] = entry
        if entry.model is not None:
            presets[preset.key] = tiny_preset(preset, entry.model)
        else:
            presets[preset.key] = missing_preset(preset, entry.reason or "")
        print(f"zoo: {preset.key}: {entry.status}", file=progress, flush=True)
    catalog = zoo_catalog(reference, presets)
    catalog_path = cache_root / CATALOG_NAME
    report_path = cache_root / REPORT_NAME
    _write_atomic(catalog_path, encode_catalog(catalog))
    report = {
        "schema_version": REPORT_SCHEMA_VERSION,
        "synthetic": True,
        "seed": seed,
        "models": {key: entry.report() for key, entry in entries.items()},
    }
    _write_atomic(report_path, (json.dumps(report, indent=2, sort_keys=True) + "\n").encode())
    return ZooResult(
        cache_root=cache_root,
        seed=seed,
        catalog_path=catalog_path,
        report_path=report_path,
        entries=entries,
        seconds=time.monotonic() - started,
    )
