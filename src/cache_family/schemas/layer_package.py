"""The schema-1 layer package (``format: "layer-package"``) as its manifest describes it.

The manifest's pin is the SHA-256 of its raw bytes. ``decode_manifest`` ignores members it does
not know (as the reference reader does) and refuses every rule of the reference reader it
breaks, all at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal

import msgspec

from cache_family.errors import Refusal, Refused

MANIFEST_NAME: Final = "model-package.json"
PACKAGE_FORMAT: Final = "layer-package"
PACKAGE_SCHEMA_VERSION: Final = 1
#: The ABI this project's package reader and writer speak; a manifest's major must match.
PACKAGE_ABI_VERSION: Final = "1.0.0"
MANIFEST_MAX_BYTES: Final = 16 * 1024 * 1024
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SEMVER = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")

Role = Literal["metadata", "embeddings", "layer", "output"]


class Artifact(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    tensor_count: int
    tensor_bytes: int
    artifact_bytes: int
    sha256: str


class LayerArtifact(Artifact, frozen=True, kw_only=True):
    layer_index: int


class SharedArtifacts(msgspec.Struct, frozen=True, kw_only=True):
    metadata: Artifact
    embeddings: Artifact
    output: Artifact


class SourceModel(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    path: str
    sha256: str
    repo: str | None = None
    revision: str | None = None
    primary_file: str | None = None
    canonical_ref: str | None = None
    distribution_id: str | None = None


class Projector(Artifact, frozen=True, kw_only=True):
    kind: str


class LayerPackageManifest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """``model-package.json``; field order is the order the writer emits."""

    schema_version: int
    model_id: str
    source_model: SourceModel
    format: str
    layer_count: int
    activation_width: int | None = None
    shared: SharedArtifacts
    layers: tuple[LayerArtifact, ...]
    projectors: tuple[Projector, ...] = ()
    skippy_abi_version: str
    created_at_unix_secs: int


@dataclass(frozen=True, slots=True)
class StagePart:
    role: Role
    layer_index: int | None
    artifact: Artifact


def _refusal(where: str, message: str, hint: str = "rebuild the package") -> Refusal:
    return Refusal("package.manifest_invalid", where, message, hint)


def safe_relative(path: str) -> bool:
    """A plain relative POSIX path: no root, no ``.``/``..``, no backslash, no empty part."""
    if not path or path.startswith("/") or "\\" in path or "\x00" in path:
        return False
    return all(part not in ("", ".", "..") for part in path.split("/"))


def _check_artifact(artifact: Artifact, where: str) -> list[Refusal]:
    found = []
    if not safe_relative(artifact.path):
        found.append(_refusal(f"{where}.path", f"artifact path {artifact.path!r} is not safe"))
    if artifact.artifact_bytes <= 0:
        found.append(_refusal(f"{where}.artifact_bytes", "artifact_bytes must be above 0"))
    if artifact.tensor_count < 0 or artifact.tensor_bytes < 0:
        found.append(_refusal(where, "tensor_count and tensor_bytes must not be negative"))
    elif (artifact.tensor_count == 0) != (artifact.tensor_bytes == 0):
        found.append(_refusal(where, "tensor_bytes is 0 exactly when tensor_count is 0"))
    if not _SHA256.match(artifact.sha256):
        found.append(_refusal(f"{where}.sha256", "sha256 is not 64 lowercase hex"))
    return found


def check_manifest(manifest: LayerPackageManifest) -> list[Refusal]:
    """Every reference-reader rule the manifest breaks (empty when it is well formed)."""
    found: list[Refusal] = []
    if manifest.schema_version != PACKAGE_SCHEMA_VERSION:
        found.append(_refusal("$.schema_version", f"schema_version is {manifest.schema_version}"))
    if manifest.format != PACKAGE_FORMAT:
        found.append(_refusal("$.format", f"format is {manifest.format!r}, not {PACKAGE_FORMAT}"))
    abi = _SEMVER.match(manifest.skippy_abi_version)
    ours = _SEMVER.match(PACKAGE_ABI_VERSION)
    assert ours is not None
    if abi is None or abi.group(1) != ours.group(1):
        found.append(
            _refusal(
                "$.skippy_abi_version",
                f"skippy_abi_version {manifest.skippy_abi_version!r} is not compatible with "
                f"{PACKAGE_ABI_VERSION}",
            )
        )
    if not manifest.model_id:
        found.append(_refusal("$.model_id", "model_id is empty"))
    source = manifest.source_model
    if not source.path:
        found.append(_refusal("$.source_model.path", "source_model.path is empty"))
    if not _SHA256.match(source.sha256):
        found.append(_refusal("$.source_model.sha256", "source_model.sha256 is not 64 hex"))
    for name in ("repo", "revision", "primary_file", "canonical_ref", "distribution_id"):
        if getattr(source, name) == "":
            found.append(_refusal(f"$.source_model.{name}", f"source_model.{name} is empty"))
    if manifest.layer_count <= 0:
        found.append(_refusal("$.layer_count", "layer_count must be above 0"))
    for role in ("metadata", "embeddings", "output"):
        found += _check_artifact(getattr(manifest.shared, role), f"$.shared.{role}")
    seen: set[int] = set()
    for i, layer in enumerate(manifest.layers):
        where = f"$.layers[{i}]"
        found += _check_artifact(layer, where)
        if not 0 <= layer.layer_index < manifest.layer_count:
            found.append(
                _refusal(
                    f"{where}.layer_index",
                    f"layer_index {layer.layer_index} is outside 0..{manifest.layer_count}",
                )
            )
        if layer.layer_index in seen:
            found.append(_refusal(f"{where}.layer_index", f"layer {layer.layer_index} twice"))
        seen.add(layer.layer_index)
    for i, projector in enumerate(manifest.projectors):
        found += _check_artifact(projector, f"$.projectors[{i}]")
        if projector.kind != "mmproj":
            found.append(_refusal(f"$.projectors[{i}].kind", "a projector's kind is mmproj"))
    return found


def decode_manifest(data: bytes, where: str = "$") -> LayerPackageManifest:
    """Parse and check ``model-package.json`` bytes; refuses (``package.manifest_invalid``)."""
    try:
        manifest = msgspec.json.decode(data, type=LayerPackageManifest)
    except msgspec.ValidationError as error:
        message = f"model-package.json does not fit schema 1: {error}"
        raise Refused((_refusal(where, message),)) from None
    except msgspec.DecodeError as error:
        raise Refused((_refusal(where, f"model-package.json is not JSON: {error}"),)) from None
    found = check_manifest(manifest)
    if found:
        raise Refused(tuple(found))
    return manifest


def encode_manifest(manifest: LayerPackageManifest) -> bytes:
    """Pretty-printed with a trailing newline, as the reference writer emits it."""
    return msgspec.json.format(msgspec.json.encode(manifest), indent=2) + b"\n"


def stage_parts(
    manifest: LayerPackageManifest, layer_start: int, layer_end: int, where: str = "$"
) -> list[StagePart]:
    """The artifacts a stage ``[layer_start, layer_end)`` loads; refuses a range it cannot."""
    if not layer_start < layer_end <= manifest.layer_count:
        raise Refused.one(
            "package.layer_range_outside",
            where,
            f"layers {layer_start}..{layer_end} are not a range inside the package's "
            f"0..{manifest.layer_count}",
            "ask for layer_start < layer_end <= the manifest's layer_count",
        )
    by_index = {layer.layer_index: layer for layer in manifest.layers}
    missing = [i for i in range(layer_start, layer_end) if i not in by_index]
    if missing:
        raise Refused.one(
            "package.layer_missing",
            where,
            f"the manifest lists no artifact for layer(s) {', '.join(map(str, missing))}",
            "rebuild the package with every layer",
        )
    parts = [StagePart("metadata", None, manifest.shared.metadata)]
    if layer_start == 0:
        parts.append(StagePart("embeddings", None, manifest.shared.embeddings))
    parts += [StagePart("layer", i, by_index[i]) for i in range(layer_start, layer_end)]
    if layer_end == manifest.layer_count:
        parts.append(StagePart("output", None, manifest.shared.output))
    return parts
