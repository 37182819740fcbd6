"""The tiny real-model zoo: random-weight GGUF models for every catalog family.

The same seed gives byte-identical files, every GGUF carries ``base.SYNTHETIC_TAG``, and a
preset no builder can make load is "unsupported" in ``zoo-report.json`` with no files (its row
observes a missing model, never a stand-in). The zoo writes only into an empty root or over a
zoo it wrote, replacing only what that zoo's report lists; conflicts are refused before anything
is written (``zoo.cache_root_not_ours``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Literal, TextIO

import gguf

from cache_family.errors import Refusal, Refused
from cache_family.oracles.zoo import dense, hybrid, minimax, moe
from cache_family.oracles.zoo.base import SYNTHETIC_TAG, Builder, BuiltModel, ZooUnsupported
from cache_family.oracles.zoo.hub import (
    CACHE_ROOT_JSON_PATH,
    Claim,
    HubFile,
    SnapshotPath,
    check_snapshot,
    not_ours,
    publish_snapshot,
    remove_snapshot,
    write_failed,
)
from cache_family.oracles.zoo.zoo_catalog import (
    encode_catalog,
    missing_preset,
    tiny_preset,
    zoo_catalog,
)
from cache_family.schemas.bounded import MIB, read_bounded
from cache_family.schemas.catalog import Preset, packaged_catalog
from cache_family.system.publish import replace_atomically

CATALOG_NAME = "catalog.json"
REPORT_NAME = "zoo-report.json"
REPORT_SCHEMA_VERSION = 1
_REPORT_LIMIT = 16 * MIB
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


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


def carries_synthetic_tag(path: Path) -> bool:
    """True when a GGUF file's ``general.tags`` holds the zoo's synthetic-model tag."""
    tags = gguf.GGUFReader(path).get_field(gguf.Keys.General.TAGS)
    return tags is not None and SYNTHETIC_TAG in list(tags.contents())


def _check_marked(preset: Preset, staging: Path, built: BuiltModel) -> None:
    """Every GGUF holding a model's metadata must say it is synthetic (later shards hold none)."""
    for file in built.files:
        path = file if file.is_absolute() else staging / file
        if path.suffix != ".gguf":
            continue
        split_no = gguf.GGUFReader(path).get_field(gguf.Keys.Split.LLM_KV_SPLIT_NO)
        if split_no is not None and split_no.contents() != 0:
            continue
        if not carries_synthetic_tag(path):
            raise ValueError(f"{preset.key}: {path.name} lacks the {SYNTHETIC_TAG!r} tag")


def snapshot_files(preset: Preset) -> list[PurePosixPath] | None:
    """The files a preset's model occupies in its snapshot; None for a whole snapshot dir."""
    target = SnapshotPath.parse(preset.snapshot_relative)
    if target.is_directory:
        return None
    if preset.artifact_kind == "split-gguf":
        return [target.inner.parent / name for name in preset.shard_names]
    return [target.inner]


def _claim_from_report(data: bytes) -> Claim:
    """The files an earlier zoo's report says it wrote; ValueError if it is not our report."""
    doc = json.loads(data)
    if (
        not isinstance(doc, dict)
        or doc.get("schema_version") != REPORT_SCHEMA_VERSION
        or doc.get("synthetic") is not True
        or not isinstance(doc.get("models"), dict)
    ):
        raise ValueError(f"not a synthetic zoo report of schema_version {REPORT_SCHEMA_VERSION}")
    claim = Claim()
    for key, entry in doc["models"].items():
        files = entry.get("files") if isinstance(entry, dict) else None
        digests = entry.get("sha256") if isinstance(entry, dict) else None
        listed = files if isinstance(files, list) and isinstance(digests, dict) else None
        if listed is None or digests is None:
            raise ValueError(f"model {key!r} has no files list and sha256 map")
        for path in listed:
            digest = digests.get(path) if isinstance(path, str) else None
            if not (isinstance(digest, str) and _SHA256.match(digest)):
                raise ValueError(f"model {key!r} lists {path!r} without a sha256")
            claim.record(path, digest)
    return claim


def claim_cache_root(cache_root: Path) -> Claim:
    """What under ``cache_root`` the zoo may replace; refuses a root that is not the zoo's.

    An absent or empty directory holds nothing of anyone's; a directory with an earlier zoo's
    ``zoo-report.json`` holds exactly the files that report lists; anything else is refused.
    """
    try:
        if not cache_root.exists():
            if cache_root.is_symlink():
                raise Refused((not_ours(cache_root, "is a dangling symlink"),))
            return Claim()
        if not cache_root.is_dir():
            raise Refused.one(
                "zoo.cache_root_not_a_directory",
                CACHE_ROOT_JSON_PATH,
                f"{cache_root} exists and is not a directory",
                "give a new path or an empty directory as --cache-root",
            )
        names = sorted(os.listdir(cache_root))
    except OSError as error:
        raise Refused.one(
            "zoo.cache_root_unreadable",
            CACHE_ROOT_JSON_PATH,
            f"{cache_root} cannot be inspected: {error.strerror or type(error).__name__}",
            "give a readable directory (or a new path) as --cache-root",
        ) from None
    if not names:
        return Claim()
    report = cache_root / REPORT_NAME
    if REPORT_NAME not in names:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise Refused(
            (
                not_ours(
                    cache_root,
                    f"holds {shown} and no {REPORT_NAME}, so it is not a zoo (a zoo build "
                    "interrupted before writing its report leaves one like this: remove only "
                    "such a directory yourself)",
                ),
            )
        )
    try:
        return _claim_from_report(read_bounded(str(report), _REPORT_LIMIT, what="zoo report").data)
    except Refused as refused:
        reason = refused.refusals[0].message
    except ValueError as error:
        reason = str(error)
    raise Refused((not_ours(report, f"is not this tool's zoo report: {reason}"),))


def _preflight(cache_root: Path, presets: list[Preset], claim: Claim) -> None:
    """Refuse, writing nothing, if any path the build may replace is not the zoo's."""
    refusals: list[Refusal] = []
    try:
        catalog = cache_root / CATALOG_NAME
        # The root is empty or an earlier zoo's by now, so a regular catalog.json is ours.
        if catalog.is_symlink() or (catalog.exists() and not catalog.is_file()):
            refusals.append(not_ours(catalog, "exists and the zoo did not write it"))
        for preset in presets:
            files = snapshot_files(preset)
            refusals += check_snapshot(cache_root, preset.snapshot_relative, files, claim)
    except OSError as error:
        raise write_failed(error, "the cache root") from None
    if refusals:
        raise Refused(tuple(refusals))


def build_one(
    cache_root: Path, preset: Preset, builder: Builder, seed: int, claim: Claim | None = None
) -> ZooEntry:
    claim = Claim() if claim is None else claim
    SnapshotPath.parse(preset.snapshot_relative)  # refuse a path the hub writer cannot place
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".zoo-staging-{preset.key}-", dir=cache_root))
    except OSError as error:
        raise write_failed(error, "a staging directory") from None
    try:
        try:
            built = builder(staging, seed)
        except ZooUnsupported as unsupported:
            remove_snapshot(cache_root, preset.snapshot_relative, snapshot_files(preset), claim)
            return ZooEntry(preset.key, "unsupported", unsupported.reason, None)
        except OSError as error:
            raise write_failed(error, f"the {preset.key} model") from None
        _check_files(preset, staging, built)
        _check_marked(preset, staging, built)
        files = publish_snapshot(cache_root, preset.snapshot_relative, staging, built.files, claim)
        return ZooEntry(preset.key, "built", None, built.architecture, tuple(files), built)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_or_refuse(path: Path, data: bytes) -> None:
    try:
        replace_atomically(path, data)
    except OSError as error:
        raise write_failed(error, path.name) from None


def build_zoo(
    cache_root: Path,
    *,
    seed: int,
    progress: TextIO,
    builders: dict[str, Builder] | None = None,
) -> ZooResult:
    """Write every preset's tiny model, the zoo catalog and the report under ``cache_root``.

    Refuses (``Refused``), writing nothing, a cache root the zoo may not write into; see the
    module docstring.
    """
    started = time.monotonic()
    cache_root = cache_root.absolute()
    chosen = BUILDERS if builders is None else builders
    reference = packaged_catalog().catalog
    claim = claim_cache_root(cache_root)
    _preflight(cache_root, list(reference.presets), claim)
    try:
        cache_root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise write_failed(error, "the cache root") from None
    entries: dict[str, ZooEntry] = {}
    presets: dict[str, Preset] = {}
    for preset in reference.presets:
        builder = chosen.get(preset.key)
        if builder is None:
            entry = ZooEntry(preset.key, "unsupported", "no zoo builder for this preset", None)
            remove_snapshot(cache_root, preset.snapshot_relative, snapshot_files(preset), claim)
        else:
            entry = build_one(cache_root, preset, builder, seed, claim)
        entries[preset.key] = entry
        if entry.model is not None:
            presets[preset.key] = tiny_preset(preset, entry.model)
        else:
            presets[preset.key] = missing_preset(preset, entry.reason or "")
        print(f"zoo: {preset.key}: {entry.status}", file=progress, flush=True)
    catalog = zoo_catalog(reference, presets)
    catalog_path = cache_root / CATALOG_NAME
    report_path = cache_root / REPORT_NAME
    _write_or_refuse(catalog_path, encode_catalog(catalog))
    report = {
        "schema_version": REPORT_SCHEMA_VERSION,
        "synthetic": True,
        "seed": seed,
        "models": {key: entry.report() for key, entry in entries.items()},
    }
    _write_or_refuse(report_path, (json.dumps(report, indent=2, sort_keys=True) + "\n").encode())
    return ZooResult(
        cache_root=cache_root,
        seed=seed,
        catalog_path=catalog_path,
        report_path=report_path,
        entries=entries,
        seconds=time.monotonic() - started,
    )
