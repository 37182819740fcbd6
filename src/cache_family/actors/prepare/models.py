"""Preparation's view of models and pinned files: layout, identity from the bytes, pins.

A model's files are found and compared with the catalog preset from a GGUF header or a package
manifest alone; ``hash_models`` then pins the bytes and refuses bytes that changed since their
identity was read. Every refusal is gathered (``Gathered``) so one preparation reports them all.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from cache_family.errors import Refusal, Refused, json_path
from cache_family.schemas.bounded import MIB, read_bounded
from cache_family.schemas.catalog import NOT_BUILT_NOTE_PREFIX, Preset
from cache_family.schemas.gguf_header import (
    ZOO_SYNTHETIC_TAG,
    FileIdentity,
    file_identity,
    read_gguf_header,
)
from cache_family.schemas.layer_package import MANIFEST_NAME, decode_manifest
from cache_family.schemas.prepared import ModelObservation, PreparedRow, ShardPin
from cache_family.system.hashing_progress import ProgressSink
from cache_family.system.pins import (
    Budget,
    FilePin,
    HashJob,
    canonical_regular_file,
    hash_files,
)
from cache_family.system.publish import path_inside

PACKAGE_MANIFEST_MAX_BYTES: Final = 4 * MIB
ADMISSION_STDOUT_MAX_BYTES: Final = MIB
ADMISSION_STDERR_KEEP_BYTES: Final = 4096
ADMISSION_POLL_SECONDS: Final = 0.2


class Gathered:
    """Refusals of every check so far, so one run reports them all; cancellation or the
    deadline (a ``budget.*`` refusal) ends the run at once, with what was gathered."""

    def __init__(self) -> None:
        self.refusals: list[Refusal] = []

    def add(self, refused: Refused) -> None:
        budget = [r for r in refused.refusals if r.code.startswith("budget.")]
        if budget:
            raise Refused((*self.refusals, budget[0]))
        self.refusals.extend(refused.refusals)

    def raise_any(self) -> None:
        if self.refusals:
            raise Refused(tuple(self.refusals))


def pin_files(
    named: Sequence[tuple[str, str, str]],
    budget: Budget,
    progress: ProgressSink,
    gathered: Gathered,
) -> dict[str, FilePin]:
    """Pin (name, path, json_path) triples: canonical regular files, hashed in parallel.

    A file that is missing, not regular or unreadable is refused into ``gathered``; the
    others are still pinned.
    """
    jobs: list[tuple[str, HashJob]] = []
    for name, path, where in named:
        try:
            jobs.append(
                (name, HashJob(canonical_regular_file(path, what=name, json_path=where), where))
            )
        except Refused as exc:
            gathered.add(exc)
    try:
        pins = hash_files([job for _, job in jobs], budget, progress=progress)
    except Refused as exc:
        gathered.add(exc)
        return {}
    return {name: pin for (name, _), pin in zip(jobs, pins, strict=True)}


def _case_where(key: str) -> str:
    return json_path(["plan", "cases", key])


def _identity_where(key: str) -> str:
    return json_path(["plan", "model_sha256", key])


@dataclass(frozen=True, slots=True)
class _Identity:
    """What a model's bytes claim to be, and the bytes the claim was read from."""

    source: Literal["gguf-header", "package-manifest"]
    architecture: str
    block_count: int
    context_length: int | None
    synthetic_marker: str | None
    file_identity: FileIdentity | None = None  # a GGUF header's file, as it was read
    manifest_sha256: str | None = None  # the manifest bytes that were parsed


@dataclass(slots=True)
class ModelLook:
    preset: Preset
    requested: str
    kind: Literal["single-gguf", "split-gguf-first-shard", "layer-package-tree"] | None = None
    canonical: str | None = None
    entrypoint: str | None = None
    pinned: str | None = None
    root: str = "/"  # the canonical cache root every file must stay inside
    shards: list[tuple[str, str, str]] = field(default_factory=list)  # name, logical, canonical
    identity: _Identity | None = None
    artifact_tool: str | None = None  # runs admit-package on a layer package

    @property
    def present(self) -> bool:
        return self.kind is not None

    @property
    def files(self) -> list[tuple[str, str]]:
        """(pin name, canonical path) of every file whose bytes are pinned."""
        key = self.preset.key
        if self.kind == "split-gguf-first-shard":
            return [(f"{key}/{name}", canonical) for name, _, canonical in self.shards]
        return [(key, self.pinned)] if self.pinned is not None else []


def _look_at_model(preset: Preset, root: str) -> ModelLook:
    """Find a model's files without reading their bytes; refusals for a broken layout."""
    requested = os.path.join(root, preset.snapshot_relative)
    look = ModelLook(preset=preset, requested=requested, root=root)
    where = _case_where(preset.key)
    if not os.path.lexists(requested):
        return look

    def inside(path: str, what: str) -> str:
        canonical = os.path.realpath(path)
        if not path_inside(canonical, root):
            raise Refused.one(
                "preparation.model_outside_cache_root",
                where,
                f"{what} {path} resolves to {canonical}, outside the cache root {root}",
                "keep every snapshot link pointing into the cache's own blobs",
            )
        if not os.path.exists(canonical):
            raise Refused.one(
                "preparation.model_unreadable",
                where,
                f"{what} {path} is a dangling link",
                "repair or re-download the model",
            )
        return canonical

    if preset.artifact_kind == "layer-package":
        canonical = inside(requested, "layer package")
        if not Path(canonical).is_dir():
            raise Refused.one(
                "preparation.package_not_directory",
                where,
                f"layer package {requested} is not a directory",
                f"a layer package is the snapshot directory holding {MANIFEST_NAME}",
            )
        manifest = os.path.join(canonical, MANIFEST_NAME)
        if not os.path.lexists(manifest):
            raise Refused.one(
                "preparation.package_manifest_missing",
                where,
                f"layer package {canonical} has no {MANIFEST_NAME}",
                "repair the package (a schema-1 layer package keeps its manifest there)",
            )
        look.kind, look.canonical, look.entrypoint = "layer-package-tree", canonical, canonical
        look.pinned = inside(manifest, "package manifest")
        return look
    if preset.artifact_kind == "split-gguf":
        directory = inside(os.path.dirname(requested), "snapshot directory")
        look.kind = "split-gguf-first-shard"
        look.entrypoint = os.path.join(directory, os.path.basename(requested))
        missing = []
        for name in preset.shard_names:
            logical = os.path.join(directory, name)
            if not os.path.lexists(logical):
                missing.append(name)
                continue
            look.shards.append((name, logical, inside(logical, "shard")))
        if missing:
            raise Refused.one(
                "preparation.split_shard_missing",
                where,
                f"{preset.key} needs all {len(preset.shard_names)} shards; missing "
                + ", ".join(missing),
                "download every shard of the split model into the same snapshot",
            )
        look.canonical = look.pinned = look.shards[0][2]
        return look
    look.kind = "single-gguf"
    look.canonical = look.entrypoint = look.pinned = inside(requested, "model")
    return look


def _not_the_preset(preset: Preset, path: str, differences: Sequence[str]) -> Refusal:
    return Refusal(
        "preparation.model_identity_mismatch",
        _identity_where(preset.key),
        f"{preset.key} ({preset.model_id}) at {path}: " + "; ".join(differences),
        "put the model the catalog names at its snapshot path, or plan against a catalog "
        "that describes these bytes (a zoo's own catalog.json for zoo models)",
    )


def _synthetic_refusal(preset: Preset, path: str) -> Refusal:
    return Refusal(
        "preparation.synthetic_model_in_real_catalog",
        _identity_where(preset.key),
        f"{preset.key} at {path} is a synthetic random-weight zoo model "
        f"({ZOO_SYNTHETIC_TAG}), but its catalog preset is not marked synthetic",
        "plan zoo models against the zoo's catalog.json, never as a real family",
    )


def _gguf_identity(look: ModelLook) -> tuple[_Identity | None, list[Refusal]]:
    """Compare the entrypoint's (split: first shard's) header with the preset."""
    preset = look.preset
    assert look.pinned is not None
    header = read_gguf_header(look.pinned, json_path=_identity_where(preset.key))
    differences = []
    architecture, block_count = header.architecture, header.block_count
    if architecture is None:
        differences.append("the GGUF header has no general.architecture")
    elif architecture != preset.architecture:
        differences.append(
            f"general.architecture is {architecture!r}, the catalog says {preset.architecture!r}"
        )
    if architecture is not None and block_count is None:
        differences.append(f"the GGUF header has no {architecture}.block_count")
    elif block_count is not None and preset.layer_end not in {
        block_count,
        # Converters count next-token-prediction layers in block_count (GLM-4.7-Flash:
        # 47 trunk layers + 1); the catalog's layer_end counts the trunk.
        block_count - header.nextn_predict_layers,
    }:
        extra = header.nextn_predict_layers
        trunk = f" ({block_count - extra} without its {extra} prediction layer(s))" if extra else ""
        differences.append(
            f"{architecture}.block_count is {block_count}{trunk}, the catalog's layer_end is "
            f"{preset.layer_end}"
        )
    if look.kind == "split-gguf-first-shard" and header.split_count != len(preset.shard_names):
        differences.append(
            f"split.count is {header.split_count}, the catalog names "
            f"{len(preset.shard_names)} shards"
        )
    synthetic = ZOO_SYNTHETIC_TAG in header.tags
    refusals = [_not_the_preset(preset, look.pinned, differences)] if differences else []
    if synthetic and not preset.synthetic:
        refusals.append(_synthetic_refusal(preset, look.pinned))
    if refusals or architecture is None or block_count is None:
        return None, refusals
    return (
        _Identity(
            source="gguf-header",
            architecture=architecture,
            block_count=block_count,
            context_length=header.context_length,
            synthetic_marker=ZOO_SYNTHETIC_TAG if synthetic else None,
            file_identity=header.identity,
        ),
        [],
    )


def _package_identity(look: ModelLook) -> tuple[_Identity | None, list[Refusal]]:
    """What a schema-1 layer package claims: its manifest's model and layer count, and the
    architecture, context and tags of its metadata artifact's GGUF header."""
    preset = look.preset
    assert look.pinned is not None and look.canonical is not None
    where = _identity_where(preset.key)
    raw = read_bounded(
        look.pinned, PACKAGE_MANIFEST_MAX_BYTES, what="layer package manifest", json_path=where
    )
    try:
        manifest = decode_manifest(raw.data, where)
    except Refused as refused:
        return None, [
            Refusal(
                "preparation.package_manifest_invalid",
                where,
                f"layer package manifest {look.pinned}: {refused.refusals[0].message}",
                "rebuild the package with a schema-1 layer-package writer",
            )
        ]
    metadata = os.path.realpath(os.path.join(look.canonical, manifest.shared.metadata.path))
    if not path_inside(metadata, look.root):
        raise Refused.one(
            "preparation.model_outside_cache_root",
            where,
            f"layer package file {manifest.shared.metadata.path} resolves to {metadata}, "
            "outside the cache",
            "keep every package link pointing into the cache's own blobs",
        )
    header = read_gguf_header(metadata, json_path=where)
    architecture = header.architecture
    differences = []
    if manifest.model_id != preset.model_id:
        differences.append(
            f"the manifest's model_id is {manifest.model_id!r}, the catalog says "
            f"{preset.model_id!r}"
        )
    if architecture is None:
        differences.append("the package's metadata GGUF has no general.architecture")
    elif architecture != preset.architecture:
        differences.append(
            f"the package's general.architecture is {architecture!r}, the catalog says "
            f"{preset.architecture!r}"
        )
    if manifest.layer_count != preset.layer_end:
        differences.append(
            f"the manifest's layer_count is {manifest.layer_count}, the catalog's layer_end is "
            f"{preset.layer_end}"
        )
    synthetic = ZOO_SYNTHETIC_TAG in header.tags
    refusals = [_not_the_preset(preset, look.pinned, differences)] if differences else []
    if synthetic and not preset.synthetic:
        refusals.append(_synthetic_refusal(preset, look.pinned))
    if refusals or architecture is None:
        return None, refusals
    return (
        _Identity(
            source="package-manifest",
            architecture=architecture,
            block_count=manifest.layer_count,
            context_length=header.context_length,
            synthetic_marker=ZOO_SYNTHETIC_TAG if synthetic else None,
            manifest_sha256=raw.sha256,
        ),
        [],
    )


_ADMISSION_CODES: Final = {
    "admit-package": "preparation.package_admission_refused",
    "admit-source": "preparation.source_admission_refused",
}


def _admission_refusal(look: ModelLook, message: str, verb: str = "admit-package") -> Refusal:
    what = "layer package" if verb == "admit-package" else "split model's shards"
    return Refusal(
        _ADMISSION_CODES[verb],
        _case_where(look.preset.key),
        f"{look.preset.key}: {verb} {message}",
        f"repair the {what} (or give the artifact tool that admits it) and prepare again",
    )


def admission_argv(look: ModelLook, manifest_sha256: str) -> list[str]:
    """The reference's exact ``admit-package`` call for the preset's correctness stage."""
    preset = look.preset
    assert look.artifact_tool is not None and look.canonical is not None
    return [
        look.artifact_tool,
        "admit-package",
        look.canonical,
        "--manifest-sha256",
        manifest_sha256,
        "--model-id",
        preset.model_id,
        "--layer-start",
        str(preset.state_layer_start),
        "--layer-end",
        str(preset.state_layer_end),
        "--minimum-context",
        str(preset.ctx),
    ]


def source_admission_argv(look: ModelLook, shards: Sequence[ShardPin]) -> list[str]:
    """The reference's ``admit-source <primary> --minimum-context C --pin name=sha ...``."""
    assert look.artifact_tool is not None and look.entrypoint is not None
    argv = [
        look.artifact_tool,
        "admit-source",
        look.entrypoint,
        "--minimum-context",
        str(look.preset.ctx),
    ]
    for shard in shards:
        argv += ["--pin", f"{shard.name}={shard.sha256}"]
    return argv


def _run_admission(argv: list[str], budget: Budget, where: str) -> tuple[int, bytes, bytes]:
    """Run the tool with no inherited environment, bounded by the budget; output to files so a
    chatty tool cannot fill memory."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
            start_new_session=True,
        )
        try:
            while True:
                try:
                    code = process.wait(timeout=ADMISSION_POLL_SECONDS)
                    break
                except subprocess.TimeoutExpired:
                    budget.check(where)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        out.seek(0)
        stdout = out.read(ADMISSION_STDOUT_MAX_BYTES + 1)
        err.seek(0)
        stderr = err.read(ADMISSION_STDERR_KEEP_BYTES)
    return code, stdout, stderr


def _admission_receipt(
    look: ModelLook, argv: list[str], budget: Budget, verb: str
) -> tuple[dict[str, Any], dict[str, Any]] | Refusal:
    """The artifact tool's JSON receipt and its ``dimensions``, or why there is none."""
    where = _case_where(look.preset.key)
    if look.artifact_tool is None:
        return _admission_refusal(look, "cannot run: artifact_tool is null", verb)
    try:
        code, stdout, stderr = _run_admission(argv, budget, where)
    except OSError as error:
        return _admission_refusal(look, f"could not start: {error.strerror}", verb)
    if code != 0:
        tail = stderr.decode("utf-8", errors="replace").strip().splitlines()[-1:] or [""]
        return _admission_refusal(look, f"exited {code}: {tail[0]}", verb)
    if len(stdout) > ADMISSION_STDOUT_MAX_BYTES:
        return _admission_refusal(look, "printed more than 1 MiB", verb)
    try:
        receipt = json.loads(stdout)
    except ValueError:
        return _admission_refusal(look, "printed no JSON receipt", verb)
    dimensions = receipt.get("dimensions") if isinstance(receipt, dict) else None
    if not isinstance(receipt, dict) or not isinstance(dimensions, dict):
        return _admission_refusal(look, "printed a receipt without dimensions", verb)
    return receipt, dimensions


def _dimension_problems(preset: Preset, dimensions: Mapping[str, Any]) -> list[str]:
    wrong = []
    for name, value in (
        ("layer_count", preset.layer_end),
        ("activation_width", preset.activation_width),
    ):
        if dimensions.get(name) != value:
            wrong.append(f"dimensions.{name} is {dimensions.get(name)!r}, not {value}")
    context = dimensions.get("native_context_tokens")
    if not isinstance(context, int) or context < preset.ctx:
        wrong.append(f"dimensions.native_context_tokens {context!r} is below {preset.ctx}")
    return wrong


def admit_package(look: ModelLook, manifest_sha256: str, budget: Budget) -> list[Refusal]:
    """Run the artifact tool's ``admit-package`` and check its receipt against the preset."""
    preset = look.preset
    answered = _admission_receipt(
        look, admission_argv(look, manifest_sha256), budget, "admit-package"
    )
    if isinstance(answered, Refusal):
        return [answered]
    receipt, dimensions = answered
    expected = {
        "schema_version": 1,
        "kind": "layer-package",
        "root": look.canonical,
        "manifest_sha256": manifest_sha256,
        "model_id": preset.model_id,
        "state_layer_start": preset.state_layer_start,
        "state_layer_end": preset.state_layer_end,
        "independent_full_source_verified": False,
        "baseline": "n/a-package-only",
    }
    wrong = [
        f"{k} is {receipt.get(k)!r}, not {v!r}" for k, v in expected.items() if receipt.get(k) != v
    ]
    wrong += _dimension_problems(preset, dimensions)
    if not receipt.get("selected_files"):
        wrong.append("selected_files is empty")
    return [_admission_refusal(look, "receipt: " + "; ".join(wrong))] if wrong else []


def admit_source(look: ModelLook, shards: Sequence[ShardPin], budget: Budget) -> list[Refusal]:
    """Run the artifact tool's ``admit-source`` on a split model's first shard with every
    shard's pin, and check that its receipt lists exactly those files, in order, with the
    preset's dimensions and at least the preset's context."""
    verb = "admit-source"
    answered = _admission_receipt(look, source_admission_argv(look, shards), budget, verb)
    if isinstance(answered, Refusal):
        return [answered]
    receipt, dimensions = answered
    wrong = [
        f"{k} is {receipt.get(k)!r}, not {v!r}"
        for k, v in (("schema_version", 1), ("kind", "gguf-source"))
        if receipt.get(k) != v
    ]
    files = receipt.get("ordered_files")
    listed = (
        [(f.get("logical_path"), f.get("sha256")) for f in files if isinstance(f, dict)]
        if isinstance(files, list)
        else None
    )
    pinned = [(shard.logical_path, shard.sha256) for shard in shards]
    if listed != pinned:
        wrong.append(f"ordered_files {listed!r} are not the pinned shards {pinned!r}")
    wrong += _dimension_problems(look.preset, dimensions)
    return [_admission_refusal(look, "receipt: " + "; ".join(wrong), verb)] if wrong else []


def context_refusals(rows: Sequence[PreparedRow]) -> list[Refusal]:
    """Planned rows whose model's GGUF ``context_length`` is below the row's context (or is
    not stated): the host would be launched with more context than the model was built for."""
    refusals: list[Refusal] = []
    seen: set[tuple[str, int]] = set()
    for row in rows:
        observation = row.model_observation
        stated = observation.context_length
        if not observation.present or (stated is not None and stated >= row.ctx):
            continue
        if (row.key, row.ctx) in seen:
            continue
        seen.add((row.key, row.ctx))
        says = "states no context_length" if stated is None else f"states {stated} tokens"
        refusals.append(
            Refusal(
                "preparation.model_context_too_small",
                _case_where(row.key),
                f"{row.key} (row {row.index}) runs with ctx {row.ctx}, but its GGUF {says}",
                "use a shorter prefix (a row's ctx is max(catalog ctx, prefix + 128)) or a "
                "model built for a longer context",
            )
        )
    return refusals


def examine_models(
    presets: Sequence[Preset], cache_root: str, artifact_tool: str | None, gathered: Gathered
) -> list[ModelLook]:
    """Layout, file kind and identity of every selected model, all refusals gathered; no
    model byte beyond a GGUF header or a package manifest is read."""
    looks: list[ModelLook] = []
    for preset in presets:
        try:
            look = _look_at_model(preset, cache_root)
        except Refused as exc:
            gathered.add(exc)
            continue
        look.artifact_tool = artifact_tool
        looks.append(look)
        if not look.present:
            continue
        where = _case_where(preset.key)
        regular = True
        for name, path in look.files:
            try:
                canonical_regular_file(path, what=name, json_path=where)
            except Refused as exc:
                gathered.add(exc)
                regular = False
        if not regular:
            continue
        try:
            if look.kind == "layer-package-tree":
                look.identity, refusals = _package_identity(look)
            else:
                look.identity, refusals = _gguf_identity(look)
        except Refused as exc:
            gathered.add(exc)
            continue
        gathered.refusals.extend(refusals)
    needing_tool = [
        look.preset.key
        for look in looks
        if look.present and look.preset.artifact_kind != "single-gguf"
    ]
    if needing_tool and artifact_tool is None:
        gathered.refusals.append(
            Refusal(
                "preparation.artifact_tool_missing",
                "$.artifact_tool",
                f"{', '.join(needing_tool)} need the artifact tool (split or layer package "
                "models) but artifact_tool is null",
                "give the shard/package admission tool (skippy-package-builder)",
            )
        )
    return looks


def missing_observation(look: ModelLook, declared: Mapping[str, str]) -> ModelObservation:
    note = look.preset.architecture_note
    reason = None
    if look.preset.synthetic and NOT_BUILT_NOTE_PREFIX in note:
        reason = note[note.index(NOT_BUILT_NOTE_PREFIX) + len(NOT_BUILT_NOTE_PREFIX) :].strip()
    return ModelObservation(
        status="missing-model",
        requested=look.requested,
        declared_revision=look.preset.revision,
        declared_byte_sha256=declared.get(look.preset.key),
        missing_reason=reason,
    )


def _changed_since_read(look: ModelLook, pin: FilePin) -> bool:
    """Whether the bytes hashed can differ from those whose identity was read."""
    identity = look.identity
    assert identity is not None
    if identity.manifest_sha256 is not None:
        return identity.manifest_sha256 != pin.sha256
    try:
        now = file_identity(os.stat(pin.path))
    except OSError:
        return True
    return now != identity.file_identity or pin.size != now[2]


def hash_models(
    looks: Sequence[ModelLook],
    declared: Mapping[str, str],
    budget: Budget,
    progress: ProgressSink,
    gathered: Gathered,
) -> dict[str, ModelObservation]:
    """Pin every present model's bytes and record what it is; declared pins must match."""
    named = [
        (name, path, _case_where(look.preset.key)) for look in looks for name, path in look.files
    ]
    pins = pin_files(named, budget, progress, gathered)
    observations: dict[str, ModelObservation] = {}
    for look in looks:
        key = look.preset.key
        if not look.present:
            observations[key] = missing_observation(look, declared)
            continue
        if not all(name in pins for name, _ in look.files) or look.identity is None:
            continue
        shards = [
            ShardPin(
                name=name,
                logical_path=logical,
                canonical=canonical,
                sha256=pins[f"{key}/{name}"].sha256,
                size=pins[f"{key}/{name}"].size,
            )
            for name, logical, canonical in look.shards
        ]
        first = pins[look.files[0][0]]
        identity = look.identity
        if _changed_since_read(look, first):
            gathered.refusals.append(
                Refusal(
                    "preparation.model_changed",
                    _case_where(key),
                    f"{first.path} changed between reading what it is and hashing it",
                    "leave the model files alone during preparation and run it again",
                )
            )
            continue
        if look.kind == "layer-package-tree":
            refusals = admit_package(look, first.sha256, budget)
            if refusals:
                gathered.refusals.extend(refusals)
                continue
        if look.kind == "split-gguf-first-shard":
            refusals = admit_source(look, shards, budget)
            if refusals:
                gathered.refusals.extend(refusals)
                continue
        expected = declared.get(key)
        if expected is not None and expected != first.sha256:
            gathered.refusals.append(
                Refusal(
                    "preparation.model_pin_mismatch",
                    _identity_where(key),
                    f"{key} at {first.path} has SHA-256 {first.sha256}, "
                    f"not the declared {expected}",
                    "restore the model bytes or update plan.model_sha256",
                )
            )
        assert look.kind is not None
        observations[key] = ModelObservation(
            status="present",
            kind=look.kind,
            canonical=look.canonical,
            runtime_entrypoint=look.entrypoint,
            pinned_file=first.path,
            sha256=first.sha256,
            size=first.size,
            shard_pins=shards,
            requested=look.requested,
            declared_revision=look.preset.revision,
            declared_byte_sha256=expected,
            identity_source=identity.source,
            architecture=identity.architecture,
            block_count=identity.block_count,
            context_length=identity.context_length,
            synthetic_marker=identity.synthetic_marker,
        )
    return observations
