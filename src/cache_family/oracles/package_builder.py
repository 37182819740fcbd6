"""Reference oracle of ``skippy-package-builder``: source and package admission, package writing.

Like the program it stands in for, a refusal exits 1 (``ExitCode.PACKAGE_REFUSED``; usage errors
2) and a receipt is one pretty JSON document on stdout. ``write-package`` keeps every tensor's
name, type and bytes, and every artifact carries the source's whole metadata, so each is
readable alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import gguf

from cache_family.errors import Refusal, Refused
from cache_family.exit_codes import ExitCode
from cache_family.schemas.bounded import read_bounded
from cache_family.schemas.gguf_header import GgufHeader, read_gguf_header
from cache_family.schemas.layer_package import (
    MANIFEST_MAX_BYTES,
    MANIFEST_NAME,
    PACKAGE_ABI_VERSION,
    PACKAGE_FORMAT,
    PACKAGE_SCHEMA_VERSION,
    Artifact,
    LayerArtifact,
    LayerPackageManifest,
    SharedArtifacts,
    SourceModel,
    StagePart,
    decode_manifest,
    encode_manifest,
    stage_parts,
)
from cache_family.system.hashing import sha256_file

PROGRAM: Final = "skippy-package-builder"
MAX_PINS: Final = 128
SOURCE_SCOPE: Final = (
    "reference-oracle gguf source admission: shard order, byte pins and header dimensions; "
    "tensor payloads are not validated"
)
PACKAGE_SCOPE: Final = (
    "reference-oracle layer-package admission: manifest pin and the selected artifacts' bytes; "
    "the full source model is not verified"
)
_SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<total>\d{5})\.gguf$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.")
_EMBEDDING_TENSORS = ("token_embd.", "token_embd_norm.", "token_types.", "position_embd.")
_OUTPUT_TENSORS = ("output.", "output_norm.")
# Keys a writer derives itself, or that describe the source's split rather than the model.
_NOT_COPIED = ("GGUF.", "general.architecture", "general.alignment", "split.")


def _refused(code: str, message: str, hint: str, where: str = "$") -> Refused:
    return Refused.one(code, where, message, hint)


# --- shared checks ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dimensions:
    architecture: str
    layer_count: int
    activation_width: int
    native_context_tokens: int

    def receipt(self) -> dict[str, Any]:
        return {
            "architecture": self.architecture,
            "layer_count": self.layer_count,
            "activation_width": self.activation_width,
            "native_context_tokens": self.native_context_tokens,
        }


def header_dimensions(header: GgufHeader, minimum_context: int) -> Dimensions:
    """Architecture, block count, width and native context; all present, context >= minimum."""
    arch = header.architecture
    if arch is None:
        raise _refused(
            "source.architecture_missing",
            f"{header.path} has no general.architecture",
            "admit a GGUF model written by a converter",
        )
    values = {
        key: header.whole_number(f"{arch}.{key}")
        for key in ("block_count", "embedding_length", "context_length")
    }
    absent = [f"{arch}.{key}" for key, value in values.items() if value is None or value <= 0]
    if absent:
        raise _refused(
            "source.dimension_missing",
            f"{header.path} has no positive {', '.join(absent)}",
            "admit a GGUF model whose header states its dimensions",
        )
    context = values["context_length"]
    assert context is not None and values["block_count"] and values["embedding_length"]
    if context < minimum_context:
        raise _refused(
            "source.context_too_small",
            f"{header.path} states a native context of {context} tokens, below the minimum "
            f"{minimum_context}",
            "lower the minimum context or admit a model trained for a longer context",
        )
    return Dimensions(arch, values["block_count"], values["embedding_length"], context)


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not above 0")
    return value


def _whole(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def _absolute(path: str, what: str) -> Path:
    if not os.path.isabs(path):
        raise _refused(f"{what}.not_absolute", f"{path} is not absolute", "give an absolute path")
    return Path(path)


# --- admit-source -------------------------------------------------------------------------------


def _pins(raw: Sequence[str]) -> dict[str, str]:
    if not 1 <= len(raw) <= MAX_PINS:
        raise _refused(
            "source.pin_count", f"{len(raw)} pins given", f"give 1 to {MAX_PINS} --pin NAME=SHA"
        )
    pins: dict[str, str] = {}
    for item in raw:
        name, _, digest = item.partition("=")
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise _refused("source.pin_name", f"pin name {name!r} is not a bare file name", "")
        if not _SHA256.match(digest):
            raise _refused("source.pin_sha256", f"pin {name} is not 64 lowercase hex", "")
        if name in pins:
            raise _refused("source.pin_duplicate", f"{name} is pinned twice", "pin it once")
        pins[name] = digest
    return pins


def _shard_paths(model: Path) -> list[Path]:
    """Every shard of ``model`` in order (a single file: itself); missing siblings refused."""
    match = _SHARD_NAME.match(model.name)
    if match is None:
        return [model]
    total = int(match["total"])
    if int(match["no"]) != 1:
        raise _refused(
            "source.not_primary_shard",
            f"{model.name} is shard {int(match['no'])} of {total}, not the first",
            "admit a split model by its first shard",
        )
    names = [f"{match['prefix']}-{i:05d}-of-{total:05d}.gguf" for i in range(1, total + 1)]
    paths = [model.parent / name for name in names]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise _refused(
            "source.shard_missing",
            f"{model.name} needs {total} shards; missing {', '.join(missing)}",
            "download every shard of the split model into the same directory",
        )
    return paths


def _tensor_names(path: Path) -> list[str]:
    try:
        return [tensor.name for tensor in gguf.GGUFReader(path).tensors]
    except (ValueError, OSError) as error:
        raise _refused("source.unreadable", f"{path} cannot be read as GGUF: {error}", "") from None


def admit_source(model_arg: str, pin_args: Sequence[str], minimum_context: int) -> dict[str, Any]:
    model = _absolute(model_arg, "source")
    pins = _pins(pin_args)
    try:
        parent = Path(os.path.realpath(model.parent, strict=True))
    except OSError:
        raise _refused("source.missing", f"{model.parent} does not exist", "") from None
    logical = parent / model.name
    if not Path(os.path.realpath(logical)).is_file():
        raise _refused("source.not_a_file", f"{model} is not a regular file", "")
    shards = _shard_paths(logical)
    names = {p.name for p in shards}
    if names != set(pins):
        raise _refused(
            "source.pin_set",
            f"the shards are {sorted(names)}, the pins name {sorted(pins)}",
            "pin exactly the model's shard files",
        )
    ordered: list[dict[str, Any]] = []
    headers: list[GgufHeader] = []
    tensor_names: list[str] = []
    for index, shard in enumerate(shards):
        canonical = Path(os.path.realpath(shard))
        if not canonical.is_file():
            raise _refused("source.not_a_file", f"{shard} is not a regular file", "")
        digest = sha256_file(canonical)
        if digest != pins[shard.name]:
            raise _refused(
                "source.pin_mismatch",
                f"{shard.name} has SHA-256 {digest}, the pin says {pins[shard.name]}",
                "restore the shard's bytes or correct the pin",
            )
        header = read_gguf_header(str(canonical))
        split_count = header.whole_number("split.count")
        split_no = header.whole_number("split.no")
        is_split = len(shards) > 1 or split_count is not None
        if is_split and (split_count != len(shards) or split_no != index):
            raise _refused(
                "source.shard_order",
                f"{shard.name} says split.no {split_no} of split.count {split_count}; "
                f"by its name it is shard {index} of {len(shards)}",
                "restore the shards under their own names",
            )
        headers.append(header)
        tensor_names += _tensor_names(canonical)
        ordered.append(
            {
                "logical_path": str(shard),
                "path": str(canonical),
                "sha256": digest,
                "byte_size": canonical.stat().st_size,
            }
        )
    first = headers[0]
    for header in headers[1:]:
        for key, value in header.metadata.items():
            if key != "split.no" and key in first.metadata and first.metadata[key] != value:
                raise _refused(
                    "source.metadata_conflict",
                    f"{key} is {first.metadata[key]!r} in the first shard, {value!r} in "
                    f"{header.path}",
                    "the shards come from different models",
                )
    declared_total = first.whole_number("split.tensors.count")
    if declared_total is not None and declared_total != len(tensor_names):
        raise _refused(
            "source.tensor_count",
            f"split.tensors.count is {declared_total}; the shards hold {len(tensor_names)}",
            "the split set is incomplete or mixed",
        )
    if len(set(tensor_names)) != len(tensor_names):
        raise _refused("source.duplicate_tensor", "a tensor name appears twice", "")
    dimensions = header_dimensions(first, minimum_context)
    return {
        "schema_version": 1,
        "kind": "gguf-source",
        "primary": ordered[0]["path"],
        "ordered_files": ordered,
        "dimensions": dimensions.receipt(),
        "scope": SOURCE_SCOPE,
    }


# --- admit-package ------------------------------------------------------------------------------


def _verified(root: Path, part: StagePart) -> dict[str, Any]:
    artifact = part.artifact
    logical = root / artifact.path
    canonical = Path(os.path.realpath(logical))
    if not canonical.is_file():
        raise _refused(
            "package.artifact_missing",
            f"{artifact.path} ({part.role}) is missing or not a regular file",
            "restore the package's files",
        )
    size = canonical.stat().st_size
    if size != artifact.artifact_bytes:
        raise _refused(
            "package.artifact_size",
            f"{artifact.path} has {size} bytes, the manifest says {artifact.artifact_bytes}",
            "restore the package's files",
        )
    digest = sha256_file(canonical)
    if digest != artifact.sha256:
        raise _refused(
            "package.artifact_sha256",
            f"{artifact.path} has SHA-256 {digest}, the manifest says {artifact.sha256}",
            "restore the package's files",
        )
    return {
        "logical_path": str(logical),
        "path": str(canonical),
        "role": part.role,
        "layer_index": part.layer_index,
        "sha256": digest,
        "byte_size": size,
    }


def read_package_manifest(root: Path) -> tuple[LayerPackageManifest, str]:
    # A hub snapshot links every file into blobs/: follow the link, then read bounded.
    manifest = os.path.realpath(root / MANIFEST_NAME)
    raw = read_bounded(manifest, MANIFEST_MAX_BYTES, what="package manifest")
    return decode_manifest(raw.data), raw.sha256


def admit_package(
    package_arg: str,
    manifest_sha256: str,
    model_id: str,
    layer_start: int,
    layer_end: int,
    minimum_context: int,
) -> dict[str, Any]:
    package = _absolute(package_arg, "package")
    root = Path(os.path.realpath(package))
    if not root.is_dir():
        raise _refused("package.not_directory", f"{package} is not a directory", "")
    if not _SHA256.match(manifest_sha256):
        raise _refused("package.pin_format", "--manifest-sha256 is not 64 lowercase hex", "")
    manifest, observed = read_package_manifest(root)
    if observed != manifest_sha256:
        raise _refused(
            "package.manifest_pin_mismatch",
            f"{MANIFEST_NAME} has SHA-256 {observed}, the pin says {manifest_sha256}",
            "restore the manifest or re-pin the package",
        )
    if manifest.model_id != model_id:
        raise _refused(
            "package.model_id_mismatch",
            f"the package is {manifest.model_id!r}, not {model_id!r}",
            "admit the package the catalog names",
        )
    requested = stage_parts(manifest, layer_start, layer_end)
    tokenizer = stage_parts(manifest, 0, 1)
    selected: dict[str, dict[str, Any]] = {}
    records: dict[str, Artifact] = {}
    for part in [*requested, *tokenizer]:
        earlier = records.get(part.artifact.path)
        if earlier is not None:
            same = (earlier.sha256, earlier.artifact_bytes) == (
                part.artifact.sha256,
                part.artifact.artifact_bytes,
            )
            if not same:
                raise _refused(
                    "package.duplicate_part",
                    f"{part.artifact.path} is listed twice with different bytes",
                    "rebuild the package",
                )
            continue
        records[part.artifact.path] = part.artifact
        selected[part.artifact.path] = _verified(root, part)
    metadata_path = selected[manifest.shared.metadata.path]["path"]
    dimensions = header_dimensions(read_gguf_header(metadata_path), minimum_context)
    if dimensions.layer_count != manifest.layer_count:
        raise _refused(
            "package.layer_count_mismatch",
            f"the metadata says {dimensions.layer_count} blocks, the manifest "
            f"{manifest.layer_count}",
            "rebuild the package",
        )
    width = manifest.activation_width
    if width is not None and width != dimensions.activation_width:
        raise _refused(
            "package.width_mismatch",
            f"the metadata's embedding length is {dimensions.activation_width}, the manifest's "
            f"activation_width {width}",
            "rebuild the package",
        )
    return {
        "schema_version": 1,
        "kind": PACKAGE_FORMAT,
        "root": str(root),
        "manifest_sha256": observed,
        "model_id": manifest.model_id,
        "dimensions": dimensions.receipt(),
        "state_layer_start": layer_start,
        "state_layer_end": layer_end,
        "selected_files": list(selected.values()),
        "source_model_sha256_declared": manifest.source_model.sha256,
        "independent_full_source_verified": False,
        "baseline": "n/a-package-only",
        "scope": PACKAGE_SCOPE,
    }


# --- write-package ------------------------------------------------------------------------------


def tensor_roles(names: Sequence[str]) -> dict[str, tuple[str, int | None]]:
    """Each tensor's (role, layer): ``layer`` for ``blk.N.*``, ``embeddings``, ``output``, or
    ``global`` for tensors no stage owns alone (they go into every artifact)."""
    roles: dict[str, tuple[str, int | None]] = {}
    for name in names:
        layer = _LAYER_TENSOR.match(name)
        if layer:
            roles[name] = ("layer", int(layer.group(1)))
        elif name.startswith(_EMBEDDING_TENSORS):
            roles[name] = ("embeddings", None)
        elif name.startswith(_OUTPUT_TENSORS):
            roles[name] = ("output", None)
        else:
            roles[name] = ("global", None)
    return roles


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for field in reader.fields.values():
        if field.name.startswith(_NOT_COPIED):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        if kind == gguf.GGUFValueType.ARRAY and len(field.types) > 2:
            raise _refused("package.nested_array", f"{field.name} nests arrays", "")
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    alignment = reader.fields.get("general.alignment")
    if alignment is not None:
        writer.add_custom_alignment(int(alignment.contents()))


def _write_artifact(
    reader: gguf.GGUFReader, arch: str, tensors: Sequence[gguf.ReaderTensor], path: Path
) -> tuple[int, int]:
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, arch)
    _copy_metadata(reader, writer)
    for tensor in tensors:
        writer.add_tensor(
            tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return len(tensors), sum(int(t.n_bytes) for t in tensors)


def _artifact(root: Path, relative: str, counts: tuple[int, int]) -> dict[str, Any]:
    path = root / relative
    return {
        "path": relative,
        "tensor_count": counts[0],
        "tensor_bytes": counts[1],
        "artifact_bytes": path.stat().st_size,
        "sha256": sha256_file(path),
    }


def layer_file(index: int) -> str:
    return f"layers/layer-{index:03d}.gguf"


def write_package(
    source: Path,
    out_dir: Path,
    model_id: str,
    *,
    source_repo: str | None = None,
    source_revision: str | None = None,
    source_file: str | None = None,
    created_at_unix_secs: int | None = None,
) -> LayerPackageManifest:
    """Cut the single-file GGUF ``source`` into a layer package at the new ``out_dir``."""
    if not model_id:
        raise _refused("package.model_id_missing", "--model-id is empty", "name the model")
    if _SHARD_NAME.match(source.name):
        raise _refused(
            "package.split_source",
            f"{source.name} is one shard of a split model",
            "merge the shards first (llama-gguf-split --merge); this writer takes one file",
        )
    if out_dir.exists() or out_dir.is_symlink():
        raise _refused("package.out_dir_exists", f"{out_dir} already exists", "give a new path")
    canonical = Path(os.path.realpath(source))
    if not canonical.is_file():
        raise _refused(
            "source.not_a_file",
            f"{source} is not a regular file",
            "give a local GGUF path; hub coordinates (org/repo:QUANT) need a download, which "
            "this oracle never makes",
        )
    header = read_gguf_header(str(canonical))
    dimensions = header_dimensions(header, 1)
    reader = gguf.GGUFReader(canonical)
    roles = tensor_roles([t.name for t in reader.tensors])
    by_role: dict[tuple[str, int | None], list[gguf.ReaderTensor]] = {}
    for tensor in reader.tensors:
        by_role.setdefault(roles[tensor.name], []).append(tensor)
    beyond = sorted({i for role, i in roles.values() if role == "layer" and i is not None})
    if beyond and beyond[-1] >= dimensions.layer_count:
        raise _refused(
            "package.layer_beyond_block_count",
            f"a tensor of layer {beyond[-1]} lies beyond block_count {dimensions.layer_count}",
            "the source model is inconsistent",
        )
    shared = by_role.get(("global", None), [])
    output = by_role.get(("output", None), [])
    if not any(t.name.startswith("output.") for t in output):
        # A tied head reads the token embedding: the terminal stage needs it too.
        output = output + by_role.get(("embeddings", None), [])
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.writing-", dir=out_dir.parent))
    try:
        arch = dimensions.architecture
        written = {
            "metadata": ("shared/metadata.gguf", shared),
            "embeddings": (
                "shared/embeddings.gguf",
                shared + by_role.get(("embeddings", None), []),
            ),
            "output": ("shared/output.gguf", shared + output),
        }
        artifacts = {
            role: _artifact(
                staging, relative, _write_artifact(reader, arch, tensors, staging / relative)
            )
            for role, (relative, tensors) in written.items()
        }
        layers = []
        for index in range(dimensions.layer_count):
            relative = layer_file(index)
            counts = _write_artifact(
                reader, arch, shared + by_role.get(("layer", index), []), staging / relative
            )
            layers.append(LayerArtifact(layer_index=index, **_artifact(staging, relative, counts)))
        manifest = LayerPackageManifest(
            schema_version=PACKAGE_SCHEMA_VERSION,
            model_id=model_id,
            source_model=SourceModel(
                path=source_file or source.name,
                sha256=sha256_file(canonical),
                repo=source_repo,
                revision=source_revision,
                primary_file=source_file,
            ),
            format=PACKAGE_FORMAT,
            layer_count=dimensions.layer_count,
            activation_width=dimensions.activation_width,
            shared=SharedArtifacts(**{role: Artifact(**a) for role, a in artifacts.items()}),
            layers=tuple(layers),
            skippy_abi_version=PACKAGE_ABI_VERSION,
            created_at_unix_secs=(
                int(time.time()) if created_at_unix_secs is None else created_at_unix_secs
            ),
        )
        (staging / MANIFEST_NAME).write_bytes(encode_manifest(manifest))
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def assemble_package(
    root: Path, out: Path, layer_start: int = 0, layer_end: int | None = None
) -> Path:
    """One GGUF from a package's stage ``[layer_start, layer_end)`` (default: every layer).

    The metadata artifact gives the keys; the stage's artifacts give the tensors, each once, in
    stage order. A whole range rebuilds a loadable model; the manifest is verified first.
    """
    manifest, _ = read_package_manifest(root)
    parts = stage_parts(
        manifest, layer_start, manifest.layer_count if layer_end is None else layer_end
    )
    for part in parts:
        _verified(root, part)
    metadata = gguf.GGUFReader(root / manifest.shared.metadata.path)
    arch = read_gguf_header(os.path.realpath(root / manifest.shared.metadata.path)).architecture
    writer = gguf.GGUFWriter(out, arch or "")
    _copy_metadata(metadata, writer)
    seen: set[str] = set()
    for part in parts:
        for tensor in gguf.GGUFReader(root / part.artifact.path).tensors:
            if tensor.name not in seen:
                seen.add(tensor.name)
                writer.add_tensor(
                    tensor.name,
                    tensor.data,
                    raw_shape=tensor.data.shape,
                    raw_dtype=tensor.tensor_type,
                )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# --- command line -------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog=PROGRAM,
        description="Reference oracle of the Skippy package builder (cache-family-bench): "
        "GGUF source and layer-package admission receipts, and a schema-1 layer-package writer.",
    )
    commands = top.add_subparsers(dest="command", required=True)
    source = commands.add_parser("admit-source", help="admit a GGUF model and its shards")
    source.add_argument("model", help="absolute path of the model (the first shard if split)")
    source.add_argument(
        "--pin", action="append", default=[], metavar="NAME=SHA256", help="one per shard file"
    )
    source.add_argument("--minimum-context", type=_positive, required=True)
    package = commands.add_parser("admit-package", help="admit a layer package for a stage")
    package.add_argument("package", help="absolute path of the package directory")
    package.add_argument("--manifest-sha256", required=True)
    package.add_argument("--model-id", required=True)
    package.add_argument("--layer-start", type=_whole, required=True)
    package.add_argument("--layer-end", type=_whole, required=True)
    package.add_argument("--minimum-context", type=_positive, required=True)
    write = commands.add_parser("write-package", help="write a layer package from a local GGUF")
    write.add_argument("model", help="a local single-file GGUF (hub coordinates need a network)")
    write.add_argument("--out-dir", required=True)
    write.add_argument("--model-id", required=True, help="the model coordinate, org/repo:QUANT")
    write.add_argument("--source-repo")
    write.add_argument("--source-revision")
    write.add_argument("--source-file")
    write.add_argument(
        "--created-at-unix-secs",
        type=_whole,
        help="the manifest's creation time (default: now); fix it for reproducible bytes",
    )
    return top


def _emit(document: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(document, indent=2) + "\n")
    sys.stdout.flush()


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.command == "admit-source":
        return admit_source(args.model, args.pin, args.minimum_context)
    if args.command == "admit-package":
        return admit_package(
            args.package,
            args.manifest_sha256,
            args.model_id,
            args.layer_start,
            args.layer_end,
            args.minimum_context,
        )
    manifest = write_package(
        Path(args.model).absolute(),
        Path(args.out_dir).absolute(),
        args.model_id,
        source_repo=args.source_repo,
        source_revision=args.source_revision,
        source_file=args.source_file,
        created_at_unix_secs=args.created_at_unix_secs,
    )
    loaded: dict[str, Any] = json.loads(encode_manifest(manifest))
    return loaded


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        _emit(run(args))
    except Refused as refused:
        for refusal in refused.refusals:
            print(f"{PROGRAM}: error: {refusal.line()}", file=sys.stderr)
        return ExitCode.PACKAGE_REFUSED
    except OSError as error:
        failure = Refusal("package.io", "$", str(error), "check the paths and the disk")
        print(f"{PROGRAM}: error: {failure.line()}", file=sys.stderr)
        return ExitCode.PACKAGE_REFUSED
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())
