"""The preset catalog: which models a run may plan, with every shape as data.

Nothing here derives a number from a key or a family name: the zoo writes a catalog in this same
format with its own shapes, so every field is read from the document. A loaded catalog carries
the SHA-256 of exactly the bytes parsed (the plan's ``catalog_sha256``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any, Final, Literal, TypeVar

import msgspec

from cache_family.errors import Refusal, Refused, json_path
from cache_family.schemas.bounded import MIB, read_bounded

CATALOG_SCHEMA_VERSION = 1
CATALOG_MAX_BYTES = 4 * MIB
# The reference plan admits at most 14 cases; a zoo catalog may list more tiny presets,
# but a catalog is a hand-written list, never a generated thousand-row table.
CATALOG_MAX_PRESETS = 256
CATALOG_MAX_USE_CASES = 128

KEY_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,128}")
# How a synthetic (zoo) catalog says it holds no model for a preset, followed by the reason.
NOT_BUILT_NOTE_PREFIX = "zoo: no tiny model: "
REVISION_PATTERN = re.compile(r"[0-9a-f]{40}")
# llama.cpp names split GGUF shards "<stem>-%05d-of-%05d.gguf".
SHARD_PATTERN = re.compile(r"(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf")

Payload = Literal["resident-kv", "kv-recurrent"]
# The production cache modes, as data (Payload must name exactly these; a test checks it).
# Anything else, such as the reference's experimental full-state, is refused wherever a
# payload is read: a catalog, or a prepared input.
PRODUCTION_PAYLOADS: Final[tuple[str, ...]] = ("resident-kv", "kv-recurrent")
LoadMode = Literal["runtime-slice", "layer-package"]
ArtifactKind = Literal["single-gguf", "split-gguf", "layer-package"]
BaselinePolicy = Literal["monolithic", "package-only"]

T = TypeVar("T")


class PackageContract(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What a layer package's admission check demands: it was cut for exactly this shape."""

    ctx: int
    prefix_tokens: int


class Preset(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One catalog case. Field order is part of the format: new fields go last with defaults."""

    key: str
    family: str
    model_id: str  # "<hub ref>:<quant>", as the reference catalog writes it
    repo: str  # "org/name" of the hub cache directory that holds the bytes
    revision: str  # 40-hex snapshot directory name
    snapshot_relative: str  # path under the hub cache root
    architecture: str  # llama.cpp general.architecture expected in the GGUF header
    payload: Payload
    layer_end: int
    activation_width: int
    ctx: int
    prefix_tokens: int
    load_mode: LoadMode
    state_layer_start: int
    state_layer_end: int
    state_stage_index: int
    kv_bytes_per_token: int | None
    n_gpu_layers: int
    cache_hit_repeats: int
    artifact_kind: ArtifactKind
    shard_names: tuple[str, ...] = ()
    baseline_policy: BaselinePolicy = "monolithic"
    skip_llama_server_reason: str | None = None
    package_contract: PackageContract | None = None
    synthetic: bool = False
    architecture_note: str = ""

    @property
    def model_ref(self) -> str:
        return self.model_id.rpartition(":")[0]

    @property
    def quant(self) -> str:
        return self.model_id.rpartition(":")[2]

    @property
    def cache_dir(self) -> str:
        """The hub cache directory name, ``models--<org>--<name>``."""
        return "models--" + self.repo.replace("/", "--")


class Catalog(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    schema_version: int
    family_order: tuple[str, ...]
    use_case_order: tuple[str, ...]
    presets: tuple[Preset, ...]
    synthetic: bool = False

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(p.key for p in self.presets)

    def preset(self, key: str) -> Preset:
        for p in self.presets:
            if p.key == key:
                return p
        raise Refused.one(
            "catalog.unknown_case",
            "$",
            f"catalog has no case {key!r}",
            "use one of: " + ", ".join(self.keys),
        )

    def family_rank(self, family: str) -> int:
        """Report position of a family; families outside ``family_order`` sort last."""
        try:
            return self.family_order.index(family)
        except ValueError:
            return len(self.family_order)

    def use_case_rank(self, use_case: str) -> int:
        try:
            return self.use_case_order.index(use_case)
        except ValueError:
            return len(self.use_case_order)


@dataclass(frozen=True, slots=True)
class LoadedCatalog:
    """A catalog with the SHA-256 of exactly the bytes it was decoded from."""

    catalog: Catalog
    sha256: str
    path: str


def decode_strict(data: bytes, kind: type[T], *, code_prefix: str, what: str) -> T:
    """Decode JSON bytes into ``kind``: UTF-8, no coercion, no unknown or repeated members.

    msgspec keeps the last of two equal member names silently, so a second pass with the
    standard parser looks for them: a repeated member would let a reviewer and the loader
    read different values from the same file.
    """
    try:
        value = msgspec.json.decode(data, type=kind, strict=True)
    except msgspec.ValidationError as exc:
        raise Refused.one(
            f"{code_prefix}.decode",
            _msgspec_path(str(exc)),
            f"{what} does not match the schema: {exc}",
            f"fix the {what} so every field has the documented type and no unknown field appears",
        ) from None
    except msgspec.DecodeError as exc:
        raise Refused.one(
            f"{code_prefix}.decode",
            "$",
            f"{what} is not valid UTF-8 JSON: {exc}",
            f"write the {what} as one UTF-8 JSON object",
        ) from None
    repeated: list[str] = []

    def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                repeated.append(name)
            seen.add(name)
        return dict(pairs)

    json.loads(data, object_pairs_hook=_pairs)
    if repeated:
        raise Refused.one(
            f"{code_prefix}.decode",
            "$",
            f"{what} repeats the member name(s) {sorted(set(repeated))!r} in one object",
            "give each member once per object",
        )
    return value


def payload_refusal(value: object, path: str, code: str) -> Refusal | None:
    """The one check that a payload names a production cache mode; None when it does.

    Only text is judged here: a payload of another JSON type is a type error for the
    document's own decoder to report.
    """
    if not isinstance(value, str) or value in PRODUCTION_PAYLOADS:
        return None
    shown = ascii(value[:80])
    return Refusal(
        code,
        path,
        f"payload {shown} is not a production cache mode: only "
        + " and ".join(PRODUCTION_PAYLOADS)
        + " are",
        "use resident-kv for attention models or kv-recurrent for recurrent and hybrid ones",
    )


def _catalog_payload_refusals(data: bytes) -> list[Refusal]:
    """Payload refusals with their reason, before the typed decode calls them a bad enum."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return []  # not JSON: decode_strict refuses it with its own reason
    presets = doc.get("presets") if isinstance(doc, dict) else None
    if not isinstance(presets, list):
        return []
    found = (
        payload_refusal(
            preset.get("payload"),
            json_path(["presets", index, "payload"]),
            "catalog.payload.not_production",
        )
        for index, preset in enumerate(presets)
        if isinstance(preset, dict)
    )
    return [refusal for refusal in found if refusal is not None]


def _msgspec_path(message: str) -> str:
    match = re.search(r"- at `(\$[^`]*)`$", message)
    return match.group(1) if match else "$"


def _parse_catalog(data: bytes, path: str) -> LoadedCatalog:
    payloads = _catalog_payload_refusals(data)
    if payloads:
        raise Refused(tuple(payloads))
    catalog = decode_strict(data, Catalog, code_prefix="catalog", what="catalog")
    refusals = check_catalog(catalog)
    if refusals:
        raise Refused(tuple(refusals))
    return LoadedCatalog(catalog=catalog, sha256=hashlib.sha256(data).hexdigest(), path=path)


def load_catalog(path: str) -> LoadedCatalog:
    """Read a catalog file (absolute, regular, at most 4 MiB) and check its integrity.

    Raises :class:`Refused` with every integrity refusal found, or with the first
    decode/file refusal (a document that does not decode cannot be checked further).
    """
    raw = read_bounded(path, CATALOG_MAX_BYTES, what="catalog")
    return _parse_catalog(raw.data, raw.path)


@functools.cache
def packaged_catalog() -> LoadedCatalog:
    """The 14 reference presets shipped in the package (decoded and checked once)."""
    resource = resources.files("cache_family.schemas").joinpath("catalog.json")
    data = resource.read_bytes()
    if len(data) > CATALOG_MAX_BYTES:
        raise Refused.one(
            "catalog.too_large",
            "$",
            "the packaged catalog exceeds 4 MiB",
            "reinstall cache-family-bench",
        )
    return _parse_catalog(data, str(resource))


def check_catalog(catalog: Catalog) -> list[Refusal]:
    """Every integrity refusal of a decoded catalog, in document order."""
    out: list[Refusal] = []

    def refuse(code: str, where: list[str | int], message: str, hint: str) -> None:
        out.append(Refusal(code, json_path(where), message, hint))

    if catalog.schema_version != CATALOG_SCHEMA_VERSION:
        refuse(
            "catalog.schema_version",
            ["schema_version"],
            f"schema_version is {catalog.schema_version}, not {CATALOG_SCHEMA_VERSION}",
            "write schema_version 1",
        )
    if not catalog.presets:
        refuse("catalog.empty", ["presets"], "the catalog lists no presets", "list at least one")
    if len(catalog.presets) > CATALOG_MAX_PRESETS:
        refuse(
            "catalog.too_many",
            ["presets"],
            f"{len(catalog.presets)} presets, more than {CATALOG_MAX_PRESETS}",
            "split the catalog",
        )

    _check_unique(
        catalog.family_order,
        ["family_order"],
        "catalog.duplicate_family_group",
        "family group",
        refuse,
        check_key=False,
    )
    families = {p.family for p in catalog.presets}
    for i, group in enumerate(catalog.family_order):
        if group not in families:
            refuse(
                "catalog.unknown_family_group",
                ["family_order", i],
                f"family group {group!r} names no preset's family",
                "list only families that presets use (spelled exactly as in the presets)",
            )
    if len(catalog.use_case_order) > CATALOG_MAX_USE_CASES:
        refuse(
            "catalog.too_many_use_cases",
            ["use_case_order"],
            f"{len(catalog.use_case_order)} use cases, more than {CATALOG_MAX_USE_CASES}",
            "keep the use-case order within the corpus bound",
        )
    _check_unique(
        catalog.use_case_order,
        ["use_case_order"],
        "catalog.duplicate_use_case",
        "use case",
        refuse,
        check_key=True,
    )

    seen: set[str] = set()
    for i, preset in enumerate(catalog.presets):
        where: list[str | int] = ["presets", i]
        if not KEY_PATTERN.fullmatch(preset.key):
            refuse(
                "catalog.bad_key",
                [*where, "key"],
                f"key {preset.key!r} is not [A-Za-z0-9_-]{{1,128}}",
                "use letters, digits, '_' and '-' only",
            )
        elif preset.key in seen:
            refuse(
                "catalog.duplicate_key",
                [*where, "key"],
                f"key {preset.key!r} appears twice",
                "give every preset its own key",
            )
        seen.add(preset.key)
        if preset.synthetic != catalog.synthetic:
            refuse(
                "catalog.synthetic_mismatch",
                [*where, "synthetic"],
                f"preset synthetic={preset.synthetic} in a catalog with "
                f"synthetic={catalog.synthetic}",
                "a catalog is either all reference presets or all synthetic (zoo) presets",
            )
        _check_preset(preset, where, refuse)
    return out


_Refuse = Callable[[str, list[str | int], str, str], None]


def _check_unique(
    items: tuple[str, ...],
    where: list[str | int],
    code: str,
    what: str,
    refuse: _Refuse,
    *,
    check_key: bool,
) -> None:
    seen: set[str] = set()
    for i, item in enumerate(items):
        if check_key and not KEY_PATTERN.fullmatch(item):
            refuse(
                "catalog.bad_key",
                [*where, i],
                f"{what} {item!r} is not [A-Za-z0-9_-]{{1,128}}",
                "use letters, digits, '_' and '-' only",
            )
        elif not item:
            refuse(code, [*where, i], f"empty {what}", f"name every {what}")
        elif item in seen:
            refuse(code, [*where, i], f"{what} {item!r} appears twice", f"list each {what} once")
        seen.add(item)


def _check_preset(p: Preset, where: list[str | int], refuse: _Refuse) -> None:
    if not p.family:
        refuse("catalog.bad_family", [*where, "family"], "family is empty", "name the family")
    ref, sep, quant = p.model_id.rpartition(":")
    if not sep or not ref or not quant or "/" not in ref:
        refuse(
            "catalog.bad_model_id",
            [*where, "model_id"],
            f"model_id {p.model_id!r} is not '<org>/<name>:<quant>'",
            "write e.g. 'Qwen/Qwen3-0.6B:Q8_0'",
        )
    org, slash, name = p.repo.partition("/")
    repo_ok = bool(slash) and bool(org) and bool(name) and "/" not in name and ".." not in p.repo
    if not repo_ok:
        refuse(
            "catalog.bad_repo",
            [*where, "repo"],
            f"repo {p.repo!r} is not 'org/name'",
            "write the hub repository as org/name",
        )
    if not p.architecture:
        refuse(
            "catalog.bad_architecture",
            [*where, "architecture"],
            "architecture is empty",
            "write the llama.cpp architecture name",
        )
    rev_ok = bool(REVISION_PATTERN.fullmatch(p.revision))
    if not rev_ok:
        refuse(
            "catalog.bad_revision",
            [*where, "revision"],
            f"revision {p.revision!r} is not 40 lowercase hex digits",
            "use the snapshot directory name",
        )
    _check_snapshot_path(p, where, refuse, check_prefix=repo_ok and rev_ok)

    for field_name in (
        "layer_end",
        "activation_width",
        "ctx",
        "prefix_tokens",
        "cache_hit_repeats",
    ):
        value = getattr(p, field_name)
        if value <= 0:
            refuse(
                "catalog.bad_number",
                [*where, field_name],
                f"{field_name} is {value}, not > 0",
                f"give a positive {field_name}",
            )
    if p.cache_hit_repeats > 1024:
        refuse(
            "catalog.bad_number",
            [*where, "cache_hit_repeats"],
            f"cache_hit_repeats {p.cache_hit_repeats} exceeds 1024",
            "use 1..=1024",
        )
    if p.n_gpu_layers < -1:
        refuse(
            "catalog.bad_number",
            [*where, "n_gpu_layers"],
            f"n_gpu_layers is {p.n_gpu_layers}",
            "use -1 (all) or a count >= 0",
        )
    if 0 < p.ctx <= p.prefix_tokens:
        refuse(
            "catalog.prefix_exceeds_ctx",
            [*where, "prefix_tokens"],
            f"prefix_tokens {p.prefix_tokens} does not fit in ctx {p.ctx}",
            "make ctx larger than the prefix",
        )
    if not (0 <= p.state_layer_start < p.state_layer_end <= p.layer_end) or p.state_stage_index < 0:
        refuse(
            "catalog.state_range",
            [*where, "state_layer_start"],
            f"state layers {p.state_layer_start}..{p.state_layer_end} "
            f"at stage {p.state_stage_index} "
            f"do not fit a {p.layer_end}-layer model",
            "use 0 <= start < end <= layer_end and a stage index >= 0",
        )
    if p.payload == "resident-kv" and (p.kv_bytes_per_token is None or p.kv_bytes_per_token <= 0):
        refuse(
            "catalog.kv_bytes",
            [*where, "kv_bytes_per_token"],
            "a resident-kv preset needs a positive kv_bytes_per_token",
            "give the KV bytes one token occupies (all layers)",
        )
    elif p.kv_bytes_per_token is not None and p.kv_bytes_per_token <= 0:
        refuse(
            "catalog.kv_bytes",
            [*where, "kv_bytes_per_token"],
            f"kv_bytes_per_token is {p.kv_bytes_per_token}",
            "give a positive count or null",
        )

    _check_artifact(p, where, refuse)


def _check_snapshot_path(
    p: Preset, where: list[str | int], refuse: _Refuse, *, check_prefix: bool
) -> None:
    rel = p.snapshot_relative
    parts = rel.split("/")
    if rel.startswith("/") or "\\" in rel or any(part in ("", ".", "..") for part in parts):
        refuse(
            "catalog.bad_snapshot_path",
            [*where, "snapshot_relative"],
            f"snapshot_relative {rel!r} is not a clean relative path",
            "write models--org--name/snapshots/REV[/file]",
        )
        return
    if not check_prefix:
        return
    prefix = [p.cache_dir, "snapshots", p.revision]
    if parts[:3] != prefix:
        refuse(
            "catalog.bad_snapshot_path",
            [*where, "snapshot_relative"],
            f"snapshot_relative {rel!r} does not start with {'/'.join(prefix)!r}",
            "keep repo, revision and the hub path in agreement",
        )
        return
    is_dir = len(parts) == 3
    if p.artifact_kind == "layer-package" and not is_dir:
        refuse(
            "catalog.bad_snapshot_path",
            [*where, "snapshot_relative"],
            "a layer package is the snapshot directory itself",
            "end snapshot_relative at the revision",
        )
    if p.artifact_kind != "layer-package" and (is_dir or not parts[-1].endswith(".gguf")):
        refuse(
            "catalog.bad_snapshot_path",
            [*where, "snapshot_relative"],
            f"a {p.artifact_kind} preset must name a .gguf file",
            "append the GGUF file name",
        )


def _check_artifact(p: Preset, where: list[str | int], refuse: _Refuse) -> None:
    is_package = p.artifact_kind == "layer-package"
    if is_package != (p.load_mode == "layer-package"):
        refuse(
            "catalog.load_mode",
            [*where, "load_mode"],
            f"load_mode {p.load_mode} does not fit artifact_kind {p.artifact_kind}",
            "layer packages load as layer-package; GGUF files as runtime-slice",
        )
    if is_package != (p.baseline_policy == "package-only"):
        refuse(
            "catalog.baseline_policy",
            [*where, "baseline_policy"],
            f"baseline_policy {p.baseline_policy} does not fit artifact_kind {p.artifact_kind}",
            "a layer package has no full GGUF, so no monolithic baseline; "
            "every GGUF preset has one",
        )
    if (p.baseline_policy == "package-only") != bool(p.skip_llama_server_reason):
        refuse(
            "catalog.skip_reason",
            [*where, "skip_llama_server_reason"],
            "skip_llama_server_reason must be given exactly for package-only presets",
            "explain why llama-server cannot run it, or remove the reason",
        )
    if is_package:
        contract = p.package_contract
        if contract is None:
            refuse(
                "catalog.package_contract",
                [*where, "package_contract"],
                "a layer package needs its admission contract (ctx, prefix_tokens)",
                "write the ctx and prefix the package was cut for",
            )
        elif (contract.ctx, contract.prefix_tokens) != (p.ctx, p.prefix_tokens):
            refuse(
                "catalog.package_contract",
                [*where, "package_contract"],
                f"package contract ctx {contract.ctx}/prefix {contract.prefix_tokens} differs from "
                f"the preset's ctx {p.ctx}/prefix {p.prefix_tokens}",
                "the package admission check fixes ctx and prefix; make them agree",
            )
    elif p.package_contract is not None:
        refuse(
            "catalog.package_contract",
            [*where, "package_contract"],
            "only a layer package has a package contract",
            "set package_contract to null",
        )

    shards = p.shard_names
    if p.artifact_kind != "split-gguf":
        if shards:
            refuse(
                "catalog.shard_count",
                [*where, "shard_names"],
                f"a {p.artifact_kind} preset lists {len(shards)} shard(s)",
                "list shards only for split-gguf",
            )
        return
    if len(shards) < 2:
        refuse(
            "catalog.shard_count",
            [*where, "shard_names"],
            f"a split-gguf preset lists {len(shards)} shard(s)",
            "list every shard, first to last (at least 2)",
        )
        return
    stems: set[str] = set()
    for i, name in enumerate(shards):
        match = SHARD_PATTERN.fullmatch(name)
        if match is None or "/" in name:
            refuse(
                "catalog.shard_name",
                [*where, "shard_names", i],
                f"shard {name!r} is not '<stem>-NNNNN-of-NNNNN.gguf'",
                "use llama.cpp split names",
            )
            continue
        stems.add(match["stem"])
        if int(match["count"]) != len(shards):
            refuse(
                "catalog.shard_count",
                [*where, "shard_names", i],
                f"shard {name!r} says {int(match['count'])} shards but {len(shards)} are listed",
                "list every shard of the split",
            )
        if int(match["index"]) != i + 1:
            refuse(
                "catalog.shard_order",
                [*where, "shard_names", i],
                f"shard {name!r} is listed at position {i + 1}",
                "list shards first to last",
            )
    if len(stems) > 1:
        refuse(
            "catalog.shard_name",
            [*where, "shard_names"],
            f"shards belong to different splits: {sorted(stems)!r}",
            "list the shards of one split",
        )
    if p.snapshot_relative.rsplit("/", 1)[-1] != shards[0]:
        refuse(
            "catalog.shard_name",
            [*where, "snapshot_relative"],
            "snapshot_relative must name the first shard",
            "point at the -00001-of- shard",
        )
