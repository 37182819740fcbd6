"""Operator input (schema_version 1) and its plan: strict models, every refusal at once.

Validation is two passes over the same document so that one run names every problem:

1. pydantic checks structure and each value on its own: JSON types without coercion,
   unknown and missing members, paths, hex pins and numeric bounds;
2. plain functions check the rules that relate entries to each other (environment names,
   values and aliases, toolkit names, the ladder order, corpus-iff-use-cases, catalog keys),
   reading the raw document and skipping whatever pass 1 refuses for its type.

Both passes report :class:`Refusal` values; pydantic's errors are translated in one place
(:func:`_translate`). The models run pass 2 themselves after their own validation, so a model
built directly is never weaker than one returned by :func:`validate_operator_object`.

Environment values are never echoed in a refusal: only the name is shown.
"""

from __future__ import annotations

import itertools
import json
import posixpath
import re
from collections import Counter
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final, Self, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from cache_family.errors import Refusal, RefusalCap, Refused, json_path
from cache_family.schemas.json_shape import containers
from cache_family.schemas.refusal_codes import default_hint
from cache_family.schemas.text import unsafe_character

Loc = tuple[str | int, ...]
_M = TypeVar("_M", bound=BaseModel)

SCHEMA_VERSION: Final = 1
DOCUMENT_MAX_BYTES: Final = 1024 * 1024
# The schema nests 4 levels and its longest list holds 128 entries; these leave room for
# any honest mistake while keeping every document's validation work bounded.
JSON_MAX_DEPTH: Final = 32
JSON_MAX_ENTRIES: Final = 1024
# A valid document holds a few hundred values; past this many, checking each one (a refusal
# per bad value, 130,000 from one 1 MiB input) is work the verdict does not need.
JSON_MAX_VALUES: Final = 4096
PATH_MAX_BYTES: Final = 4096
U32_MAX: Final = 2**32 - 1
I32_MAX: Final = 2**31 - 1

ENV_MAX_ENTRIES: Final = 64
ENV_VALUE_MAX_BYTES: Final = 256
ENV_SECRET_MARKERS: Final = (
    "AUTH",
    "TOKEN",
    "SECRET",
    "PASSWORD",
    "CREDENTIAL",
    "PATH",
    "DIR",
    "ROOT",
    "KEY",
)
# Abbreviations and words that mark a secret only as a whole segment of a name (split at
# `_`, `-`, `.`, digits and case changes): `GGML_DB_PWD` and `GGML_HF_TOK` are secrets,
# while `TOK` inside `STOKES` or `PASS` inside `BYPASS` or `PASSES` are not.
ENV_SECRET_WORDS: Final = (
    "TOK",
    "TOKS",
    "PWD",
    "PASSWD",
    "PASS",
    "PW",
    "PASSPHRASE",
    "CRED",
    "CREDS",
    "COOKIE",
    "COOKIES",
    "SESSION",
    "SESS",
    "SID",
    "PRIVATE",
    "PRIV",
    "CERT",
    "CERTS",
    "CERTIFICATE",
    "PEM",
    "PFX",
    "P12",
    "JWT",
    "BEARER",
    "OAUTH",
    "SSH",
    "GPG",
    "PGP",
    "PAT",
    "OTP",
    "TOTP",
    "HMAC",
    "SALT",
    "SIGNING",
    "APIKEY",
    "PASSKEY",
)
ENV_DEVICE_NAMES: Final = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
ENV_PLAIN_NAMES: Final = (*ENV_DEVICE_NAMES, "OMP_NUM_THREADS")
# (stage-server spelling, skippy spelling): the same setting under two names.
ENV_ALIAS_PAIRS: Final = (
    ("LLAMA_STAGE_BACKEND", "SKIPPY_LLAMA_BACKEND"),
    ("LLAMA_STAGE_LINK_MODE", "SKIPPY_LLAMA_LINK_MODE"),
    ("LLAMA_STAGE_CUDA_ARCHITECTURES", "SKIPPY_CUDA_ARCHITECTURES"),
    ("LLAMA_STAGE_AMDGPU_TARGETS", "SKIPPY_AMDGPU_TARGETS"),
    ("LLAMA_STAGE_GGML_NATIVE", "SKIPPY_GGML_NATIVE"),
)
ENV_GGML_PREFIX: Final = "GGML_"

TOOLKIT_NAMES: Final = ("CUDA_PATH", "HIP_PATH", "ROCM_PATH", "LLVMInstallDir", "VULKAN_SDK")
TOOLKIT_MAX_ENTRIES: Final = 5

CASES_MAX: Final = 14
USE_CASES_MAX: Final = 128
USE_CASES_ALL: Final = "all"
PREFIX_SWEEP_MAX: Final = 32
CONCURRENCY_MAX_RUNGS: Final = 32
MAX_RUNG: Final = 1024

KEY_PATTERN: Final = re.compile(r"[A-Za-z0-9_-]{1,128}")
_GGML_NAME = re.compile(r"GGML_[A-Z0-9_]+")
_HEX = re.compile(r"[0-9a-f]+")


def _catalog_keys() -> tuple[str, ...]:
    """Keys of the packaged catalog, in catalog order.

    A plan that names its own catalog is still checked against these: every catalog (the
    packaged one and the tiny-model zoo's) carries the same 14 keys.
    """
    from cache_family.schemas.catalog import packaged_catalog

    return packaged_catalog().catalog.keys


# --------------------------------------------------------------------------------------
# Rules that stand on their own: pydantic runs them per value, docs.py reads their `rule`.


def _fail(code: str, message: str, hint: str | None = None) -> PydanticCustomError:
    # The message travels in ctx, not in the template: pydantic substitutes `{name}` in
    # templates, and a path may contain braces.
    return PydanticCustomError(
        code, "{message}", {"message": message, "hint": hint or default_hint(code)}
    )


def _show(value: str, limit: int = 120) -> str:
    """A path as it may appear in a message: quoted, escaped, cut to a readable length."""
    shown = value if len(value) <= limit else value[:limit] + "..."
    return ascii(shown) if not shown.isprintable() else repr(shown)


@dataclass(frozen=True, slots=True)
class Rule:
    """Documentation of a rule checked across entries (pass 2); docs.py renders it."""

    text: str


@dataclass(frozen=True, slots=True)
class AbsolutePath:
    rule: str = (
        "absolute, normal form (no `.`/`..`, `//` or trailing `/`), "
        f"≤ {PATH_MAX_BYTES} bytes, no control or invisible format characters"
    )

    def __call__(self, value: str) -> str:
        unsafe = unsafe_character(value)
        if unsafe in ("not-utf8", "control"):
            raise _fail("operator.path.bad_char", f"path {_show(value)} has a control character")
        if unsafe == "format":
            raise _fail(
                "operator.path.format_char",
                f"path {_show(value)} has an invisible format character",
            )
        if not posixpath.isabs(value):
            raise _fail("operator.path.not_absolute", f"path {_show(value)} is not absolute")
        if len(value.encode("utf-8")) > PATH_MAX_BYTES:
            raise _fail(
                "operator.path.too_long",
                f"path {_show(value)} is longer than {PATH_MAX_BYTES} bytes",
            )
        # normpath keeps a leading "//" (POSIX leaves its meaning to the system): refuse it too.
        normal = "/" + posixpath.normpath(value).lstrip("/")
        if value != normal:
            raise _fail(
                "operator.path.not_normalized",
                f"path {_show(value)} is not in normal form",
                f"write it as {_show(normal)}",
            )
        return value


@dataclass(frozen=True, slots=True)
class LowerHex:
    lengths: tuple[int, ...]
    code: str
    what: str
    # For a code outside the operator registry (a prepared document's): its own hint.
    hint: str | None = None

    @property
    def rule(self) -> str:
        sizes = " or ".join(str(n) for n in self.lengths)
        return f"{sizes} lowercase hex characters"

    def __call__(self, value: str) -> str:
        if len(value) not in self.lengths or not _HEX.fullmatch(value):
            raise _fail(self.code, f"{self.what} {_show(value, 80)} is not {self.rule}", self.hint)
        return value


@dataclass(frozen=True, slots=True)
class IntRange:
    low: int
    high: int
    code: str

    @property
    def rule(self) -> str:
        return f"{self.low}..={self.high}"

    def __call__(self, value: int) -> int:
        if not self.low <= value <= self.high:
            shown = str(value) if abs(value) < 10**30 else "a number that large"
            raise _fail(
                self.code,
                f"{shown} is outside {self.rule}",
                f"use a whole number from {self.low} to {self.high}",
            )
        return value


@dataclass(frozen=True, slots=True)
class SchemaVersion:
    code: str

    @property
    def rule(self) -> str:
        return f"must be {SCHEMA_VERSION}"

    def __call__(self, value: int) -> int:
        if value != SCHEMA_VERSION:
            shown = str(value) if abs(value) < 10**30 else "a number that large"
            raise _fail(self.code, f"schema_version {shown} is not {SCHEMA_VERSION}")
        return value


AbsPath = Annotated[str, AfterValidator(AbsolutePath())]
Sha256Hex = Annotated[str, AfterValidator(LowerHex((64,), "operator.sha256.bad_hex", "SHA-256"))]
CommitHex = Annotated[str, AfterValidator(LowerHex((40, 64), "operator.commit.bad_hex", "commit"))]

_BUDGET = "operator.budget.out_of_range"
_PLAN_RANGE = "plan.out_of_range"
PositiveU32 = Annotated[int, AfterValidator(IntRange(1, U32_MAX, _PLAN_RANGE))]
Count1024 = Annotated[int, AfterValidator(IntRange(1, 1024, _PLAN_RANGE))]
Count65536 = Annotated[int, AfterValidator(IntRange(1, 65536, _PLAN_RANGE))]
Rung = Annotated[int, AfterValidator(IntRange(1, MAX_RUNG, _PLAN_RANGE))]
GpuLayers = Annotated[int, AfterValidator(IntRange(-1, I32_MAX, _PLAN_RANGE))]

_STRICT = ConfigDict(
    extra="forbid",
    strict=True,
    frozen=True,
    # Keeps refused values (possibly secrets) out of str(ValidationError).
    hide_input_in_errors=True,
)

# Passed as validation context by the public functions, which run pass 2 over the raw
# document themselves (to report it together with pass 1).
_PASS_TWO_DONE: Final = {"cache_family.cross_entry_checked": True}


def _pass_two_done(info: ValidationInfo) -> bool:
    return isinstance(info.context, dict) and bool(
        info.context.get("cache_family.cross_entry_checked")
    )


def _as_validation_failure(found: list[tuple[Loc, Refusal]]) -> PydanticCustomError:
    first = found[0][1]
    return PydanticCustomError(
        first.code,
        "{message}",
        {"message": first.message, "hint": first.hint, "refusals": tuple(r for _, r in found)},
    )


# --------------------------------------------------------------------------------------
# Models. Field names and order follow reference-contracts §1/§2; do not reorder.


class PinnedFile(BaseModel):
    """A file named by absolute path and pinned by the SHA-256 of its bytes."""

    model_config = _STRICT

    path: AbsPath
    sha256: Sha256Hex


class ServerBinary(BaseModel):
    """A stage-server binary; a null sha256 is filled in by preparation from the bytes."""

    model_config = _STRICT

    path: AbsPath
    sha256: Sha256Hex | None


class ToolkitDirectory(BaseModel):
    """An external toolkit tree, pinned by its tree digest and exported as NAME=path."""

    model_config = _STRICT

    path: AbsPath
    sha256: Sha256Hex


class PlanInput(BaseModel):
    """What to plan: cases, use cases, prefixes, ladders and the optional old/new pair."""

    model_config = _STRICT

    schema_version: Annotated[int, AfterValidator(SchemaVersion("plan.schema_version"))]
    cache_root: Annotated[AbsPath, Field(description="Hugging Face hub cache root directory")]
    cases: Annotated[
        list[str],
        Rule(f"≤ {CASES_MAX} unique catalog keys; [] plans every preset"),
        Field(description="catalog cases to plan, run in catalog order"),
    ]
    use_cases: Annotated[
        list[str],
        Rule(
            f'[] (none), ["{USE_CASES_ALL}"] alone, or ≤ {USE_CASES_MAX} unique keys '
            f"`{KEY_PATTERN.pattern}`"
        ),
        Field(description="use cases of the corpus to plan"),
    ]
    corpus: Annotated[
        PinnedFile | None,
        Rule("set exactly when use_cases is non-empty"),
        Field(description="use-case corpus file"),
    ]
    prefix_sweep: Annotated[
        list[PositiveU32],
        Rule(f"≤ {PREFIX_SWEEP_MAX} unique"),
        Field(description="prefix lengths (tokens) to sweep when prefix_tokens is null"),
    ]
    prefix_tokens: Annotated[
        PositiveU32 | None, Field(description="one prefix length overriding the catalog's")
    ]
    n_gpu_layers: Annotated[
        GpuLayers | None, Field(description="layers to offload (-1 = all); null = catalog")
    ]
    cache_hit_repeats: Annotated[
        Count1024 | None, Field(description="cache-hit repeats; null = catalog")
    ]
    runtime_lane_count: Annotated[
        Count1024 | None, Field(description="serving lanes; null = highest rung")
    ]
    serving_ctx_size: Annotated[
        PositiveU32 | None, Field(description="shared serving context; null = ctx × lanes")
    ]
    concurrency: Annotated[
        list[Rung],
        Rule(f"1..={CONCURRENCY_MAX_RUNGS} rungs, strictly ascending"),
        Field(description="concurrency ladder climbed by one retained host"),
    ]
    concurrent_requests: Annotated[
        Count65536, Field(description="requests per rung (at least the rung)")
    ]
    concurrent_output_tokens: Annotated[
        Count65536, Field(description="generated tokens per paired-serving request")
    ]
    llama_parallel: Annotated[Count1024, Field(description="llama-server --parallel")]
    llama_repeats: Annotated[
        Count1024, Field(description="serial baseline runs, the first excluded as warmup")
    ]
    ttft_slo_ms: Annotated[PositiveU32, Field(description="time-to-first-token objective")]
    tpot_slo_ms: Annotated[PositiveU32, Field(description="time-per-output-token objective")]
    skip_llama_server: Annotated[bool, Field(description="plan no monolithic baseline")]
    old_server: Annotated[
        ServerBinary | None,
        Rule("null exactly when new_server is null"),
        Field(description="old stage server of the paired comparison"),
    ]
    new_server: Annotated[
        ServerBinary | None,
        Rule("null exactly when old_server is null"),
        Field(description="new stage server of the paired comparison"),
    ]
    model_sha256: Annotated[
        dict[str, Sha256Hex],
        Rule(f"keys are catalog keys (≤ {CASES_MAX})"),
        Field(description="declared model pins; preparation refuses a mismatch"),
    ]
    catalog: Annotated[
        PinnedFile | None,
        Field(description="catalog file; null = the packaged catalog (same 14 keys)"),
    ] = None

    @model_validator(mode="after")
    def _cross_entry_rules(self, info: ValidationInfo) -> Self:
        if not _pass_two_done(info):
            found = _plan_cross_entry(self.model_dump(mode="json"), ("plan",))
            if found:
                raise _as_validation_failure(found)
        return self


class OperatorInput(BaseModel):
    """Tools, provenance, shared environment, budgets and the plan of one campaign."""

    model_config = _STRICT

    schema_version: Annotated[int, AfterValidator(SchemaVersion("operator.schema_version"))]
    plan: Annotated[PlanInput, Field(description="plan input (rows below)")]
    correctness: Annotated[AbsPath, Field(description="skippy-correctness executable; pinned")]
    stage_server: Annotated[
        AbsPath, Field(description="stage server the correctness tool drives; pinned")
    ]
    native_server: Annotated[
        AbsPath | None, Field(description="llama-server; null = no native baseline")
    ] = None
    artifact_tool: Annotated[
        AbsPath | None,
        Field(description="shard/package admission tool; needed for MiniMax or DeepSeek3"),
    ] = None
    native_build: Annotated[AbsPath, Field(description="native build directory; tree-pinned")]
    old_source_commit: Annotated[CommitHex, Field(description="declared provenance only")]
    new_source_commit: Annotated[CommitHex, Field(description="declared provenance only")]
    native_source_commit: Annotated[CommitHex, Field(description="declared provenance only")]
    borrow_resident_hits: Annotated[
        bool, Field(description="forwarded as --borrow-resident-hits")
    ] = False
    cache_decoded_result_hits: Annotated[
        bool, Field(description="forwarded as --cache-decoded-result-hits")
    ] = False
    environment: Annotated[
        dict[str, str],
        Rule(
            f"≤ {ENV_MAX_ENTRIES} entries; allowlisted names, never one containing "
            + "/".join(ENV_SECRET_MARKERS)
            + " or with a segment such as "
            + "/".join(ENV_SECRET_WORDS[:6])
            + f"; values free-form, 1..={ENV_VALUE_MAX_BYTES} bytes, "
            "no control or invisible format characters; "
            "the two names of an alias pair must agree (see Environment names)"
        ),
        Field(description="nonsecret settings shared by correctness and every host"),
    ] = Field(default_factory=dict)
    toolkit_directories: Annotated[
        dict[str, ToolkitDirectory],
        Rule(f"≤ {TOOLKIT_MAX_ENTRIES}; names {', '.join(TOOLKIT_NAMES)}"),
        Field(description="external toolkit trees, exported as NAME=path"),
    ] = Field(default_factory=dict)
    execution_seconds: Annotated[
        int,
        AfterValidator(IntRange(30, 86400, _BUDGET)),
        Field(description="budget of the whole run"),
    ]
    cell_seconds: Annotated[
        int,
        AfterValidator(IntRange(15, 3600, _BUDGET)),
        Field(description="budget of one cell (host session)"),
    ]
    request_timeout_ms: Annotated[
        int,
        AfterValidator(IntRange(1, 600000, _BUDGET)),
        Field(description="timeout of one HTTP request"),
    ]
    preparation_seconds: Annotated[
        int,
        AfterValidator(IntRange(30, 3600, _BUDGET)),
        Field(description="budget of preparation"),
    ]

    @model_validator(mode="after")
    def _cross_entry_rules(self, info: ValidationInfo) -> Self:
        if not _pass_two_done(info):
            found = _operator_cross_entry(self.model_dump(mode="json"), include_plan=False)
            if found:
                raise _as_validation_failure(found)
        return self


# --------------------------------------------------------------------------------------
# Pass 2: rules across entries, over raw JSON-like data. Anything of the wrong type is
# skipped here because pass 1 refuses it.


def _refusal(code: str, loc: Loc, message: str, hint: str | None = None) -> tuple[Loc, Refusal]:
    return loc, Refusal(code, json_path(loc), message, hint or default_hint(code))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_ALIAS_NAMES: Final = frozenset(name for pair in ENV_ALIAS_PAIRS for name in pair)


_NAME_SEGMENT = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")


def secret_name_marker(name: str) -> str | None:
    """What makes an environment name look like a secret or a path, or None.

    The reference's markers count anywhere in the name (`HF_TOKEN`, `MY_API_KEY`,
    `GGML_BACKEND_DL_PATH`); the abbreviations in ENV_SECRET_WORDS count as a whole segment.
    """
    upper = name.upper()
    marker = next((m for m in ENV_SECRET_MARKERS if m in upper), None)
    if marker is not None:
        return marker
    segments = {segment.upper() for segment in _NAME_SEGMENT.findall(name)}
    return next((word for word in ENV_SECRET_WORDS if word in segments), None)


def _env_name_refusal(name: str, loc: Loc) -> tuple[Loc, Refusal] | None:
    # Secret-looking names first: GGML_BACKEND_DL_PATH matches the GGML_ prefix but is a path.
    marker = secret_name_marker(name)
    if marker is not None:
        return _refusal(
            "operator.environment.secret_name",
            loc,
            f"environment name {_show(name, 80)} looks like a secret or a path ({marker}); "
            "its value is not shown",
        )
    if name in ENV_PLAIN_NAMES or name in _ALIAS_NAMES or _GGML_NAME.fullmatch(name):
        return None
    return _refusal(
        "operator.environment.not_allowed",
        loc,
        f"environment name {_show(name, 80)} is not allowed",
    )


def _env_value_refusal(name: str, value: str, loc: Loc) -> tuple[Loc, Refusal] | None:
    size = len(value.encode("utf-8", "surrogatepass"))
    if not 1 <= size <= ENV_VALUE_MAX_BYTES:
        return _refusal(
            "operator.environment.bad_value",
            loc,
            f"value of {name} has {size} bytes, outside 1..={ENV_VALUE_MAX_BYTES}",
        )
    # Values are not enumerated (the reference allowlists names only): device UUIDs
    # (GPU-..., MIG-...), `-1`, CMake lists (`86;89`) and target features (`gfx90a:xnack-`)
    # are all real settings. Only what would corrupt a log line or hide text is refused.
    unsafe = unsafe_character(value)
    if unsafe is None:
        return None
    what = "an invisible format character" if unsafe == "format" else "a control character"
    return _refusal("operator.environment.bad_value", loc, f"value of {name} contains {what}")


def _environment_cross_entry(env: Mapping[Any, object]) -> list[tuple[Loc, Refusal]]:
    out: list[tuple[Loc, Refusal]] = []
    if len(env) > ENV_MAX_ENTRIES:
        out.append(
            _refusal(
                "operator.environment.too_many",
                ("environment",),
                f"environment has {len(env)} entries, more than {ENV_MAX_ENTRIES}",
            )
        )
    accepted: dict[str, str] = {}
    for name, value in env.items():
        if not isinstance(name, str):
            continue
        loc: Loc = ("environment", name)
        refused = _env_name_refusal(name, loc)
        if refused is None and isinstance(value, str):
            refused = _env_value_refusal(name, value, loc)
            if refused is None:
                accepted[name] = value
        if refused is not None:
            out.append(refused)
    for first, second in ENV_ALIAS_PAIRS:
        if first in accepted and second in accepted and accepted[first] != accepted[second]:
            out.append(
                _refusal(
                    "operator.environment.alias_conflict",
                    ("environment", second),
                    f"{first} and {second} name the same setting with different values",
                )
            )
    return out


def environment_refusals(env: Mapping[Any, object]) -> list[Refusal]:
    """The operator's environment rules applied to any environment map (names, values,
    aliases), such as the ones a prepared input hands to each host."""
    return [refusal for _, refusal in _environment_cross_entry(env)]


def _toolkit_cross_entry(toolkits: Mapping[Any, object]) -> list[tuple[Loc, Refusal]]:
    out: list[tuple[Loc, Refusal]] = []
    if len(toolkits) > TOOLKIT_MAX_ENTRIES:
        out.append(
            _refusal(
                "operator.toolkit.too_many",
                ("toolkit_directories",),
                f"{len(toolkits)} toolkit directories, more than {TOOLKIT_MAX_ENTRIES}",
            )
        )
    for name in toolkits:
        if isinstance(name, str) and name not in TOOLKIT_NAMES:
            out.append(
                _refusal(
                    "operator.toolkit.bad_name",
                    ("toolkit_directories", name),
                    f"toolkit directory name {_show(name, 80)} is not allowed",
                )
            )
    return out


def _repeated(items: Iterable[Hashable]) -> list[Hashable]:
    """Items seen more than once, in order of their second sighting.

    Hash-based on purpose: a 1 MiB document can hold a list of 100k entries, and a
    list scan per entry made validation quadratic (minutes for one document).
    """
    seen: set[Hashable] = set()
    repeated: dict[Hashable, None] = {}
    for item in items:
        if item in seen:
            repeated[item] = None
        else:
            seen.add(item)
    return list(repeated)


def _strings(value: object) -> list[tuple[int, str]]:
    return (
        [(i, v) for i, v in enumerate(value) if isinstance(v, str)]
        if isinstance(value, list)
        else []
    )


def _ints(value: object) -> list[int]:
    return [v for v in value if _is_int(v)] if isinstance(value, list) else []


def _plan_cross_entry(plan: Mapping[Any, object], base: Loc) -> list[tuple[Loc, Refusal]]:
    out: list[tuple[Loc, Refusal]] = []
    catalog: tuple[str, ...] | None = None

    def catalog_keys() -> tuple[str, ...]:
        nonlocal catalog
        if catalog is None:
            catalog = _catalog_keys()
        return catalog

    cases = plan.get("cases")
    if isinstance(cases, list):
        if len(cases) > CASES_MAX:
            out.append(
                _refusal(
                    "plan.case.too_many",
                    (*base, "cases"),
                    f"cases has {len(cases)} entries, more than {CASES_MAX}",
                )
            )
        for index, case in _strings(cases):
            if case not in catalog_keys():
                out.append(
                    _refusal(
                        "plan.case.unknown",
                        (*base, "cases", index),
                        f"case {_show(case, 80)} is not in the catalog",
                        "use one of " + ", ".join(catalog_keys()),
                    )
                )
        repeated = _repeated(case for _, case in _strings(cases))
        if repeated:
            out.append(
                _refusal(
                    "plan.case.duplicate",
                    (*base, "cases"),
                    "cases repeats " + ", ".join(_show(str(c), 80) for c in repeated),
                )
            )

    use_cases = plan.get("use_cases")
    if isinstance(use_cases, list):
        if len(use_cases) > USE_CASES_MAX:
            out.append(
                _refusal(
                    "plan.use_case.too_many",
                    (*base, "use_cases"),
                    f"use_cases has {len(use_cases)} entries, more than {USE_CASES_MAX}",
                )
            )
        named = _strings(use_cases)
        for index, key in named:
            if not KEY_PATTERN.fullmatch(key):
                out.append(
                    _refusal(
                        "plan.use_case.bad_key",
                        (*base, "use_cases", index),
                        f"use case {_show(key, 80)} is not a key `{KEY_PATTERN.pattern}`",
                    )
                )
        if len(use_cases) > 1 and any(key == USE_CASES_ALL for _, key in named):
            out.append(
                _refusal(
                    "plan.use_case.all_not_alone",
                    (*base, "use_cases"),
                    f'"{USE_CASES_ALL}" must be the only use case when given',
                )
            )
        repeated = _repeated(key for _, key in named)
        if repeated:
            out.append(
                _refusal(
                    "plan.use_case.duplicate",
                    (*base, "use_cases"),
                    "use_cases repeats " + ", ".join(_show(str(k), 80) for k in repeated),
                )
            )
        if "corpus" in plan:
            corpus = plan["corpus"]
            if use_cases and corpus is None:
                out.append(
                    _refusal(
                        "plan.corpus.required",
                        (*base, "corpus"),
                        "use cases are selected but corpus is null",
                    )
                )
            elif not use_cases and corpus is not None:
                out.append(
                    _refusal(
                        "plan.corpus.unexpected",
                        (*base, "corpus"),
                        "corpus is set but use_cases is empty",
                    )
                )

    sweep = plan.get("prefix_sweep")
    if isinstance(sweep, list):
        if len(sweep) > PREFIX_SWEEP_MAX:
            out.append(
                _refusal(
                    "plan.prefix_sweep.too_many",
                    (*base, "prefix_sweep"),
                    f"prefix_sweep has {len(sweep)} entries, more than {PREFIX_SWEEP_MAX}",
                )
            )
        repeated = _repeated(_ints(sweep))
        if repeated:
            out.append(
                _refusal(
                    "plan.prefix_sweep.duplicate",
                    (*base, "prefix_sweep"),
                    "prefix_sweep repeats " + ", ".join(str(p) for p in repeated),
                )
            )

    ladder = plan.get("concurrency")
    if isinstance(ladder, list):
        out.extend(_ladder_refusals(ladder, (*base, "concurrency")))

    if "old_server" in plan and "new_server" in plan:
        old, new = plan["old_server"], plan["new_server"]
        if (old is None) != (new is None):
            missing = "old_server" if old is None else "new_server"
            present = "new_server" if old is None else "old_server"
            out.append(
                _refusal(
                    "plan.servers.one_sided",
                    (*base, missing),
                    f"{present} is set but {missing} is null",
                )
            )

    pins = plan.get("model_sha256")
    if isinstance(pins, dict):
        for key in pins:
            if isinstance(key, str) and key not in catalog_keys():
                out.append(
                    _refusal(
                        "plan.case.unknown",
                        (*base, "model_sha256", key),
                        f"model_sha256 names {_show(key, 80)}, which is not in the catalog",
                        "use one of " + ", ".join(catalog_keys()),
                    )
                )
    return out


def _ladder_refusals(ladder: list[object], loc: Loc) -> list[tuple[Loc, Refusal]]:
    if not ladder:
        return [_refusal("plan.concurrency.empty", loc, "the concurrency ladder is empty")]
    out: list[tuple[Loc, Refusal]] = []
    if len(ladder) > CONCURRENCY_MAX_RUNGS:
        out.append(
            _refusal(
                "plan.concurrency.too_many",
                loc,
                f"{len(ladder)} rungs, more than {CONCURRENCY_MAX_RUNGS}",
            )
        )
    rungs = _ints(ladder)
    sorted_unique = "[" + ", ".join(str(r) for r in sorted(set(rungs))) + "]"
    repeated = _repeated(rungs)
    if repeated:
        out.append(
            _refusal(
                "plan.concurrency.duplicate",
                loc,
                "the ladder repeats " + ", ".join(str(r) for r in repeated),
                f"use {sorted_unique}",
            )
        )
    if any(a > b for a, b in itertools.pairwise(rungs)):
        out.append(
            _refusal(
                "plan.concurrency.not_ascending",
                loc,
                "rungs must be strictly ascending",
                f"use {sorted_unique}",
            )
        )
    return out


def _operator_cross_entry(
    doc: Mapping[Any, object], *, include_plan: bool = True
) -> list[tuple[Loc, Refusal]]:
    out: list[tuple[Loc, Refusal]] = []
    env = doc.get("environment")
    if isinstance(env, dict):
        out.extend(_environment_cross_entry(env))
    toolkits = doc.get("toolkit_directories")
    if isinstance(toolkits, dict):
        out.extend(_toolkit_cross_entry(toolkits))
    plan = doc.get("plan")
    if include_plan and isinstance(plan, dict):
        out.extend(_plan_cross_entry(plan, ("plan",)))
    return out


# --------------------------------------------------------------------------------------
# Pass 1 translation: the one place pydantic's errors become refusals.

_EXPECTED: Final[Mapping[str, str]] = {
    "int_type": "an integer",
    "string_type": "a string",
    "bool_type": "true or false",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "none_required": "null",
    "invalid_key": "a string member name",
}


def _json_kind(value: object) -> str:
    match value:
        case None:
            return "null"
        case bool():
            return "a boolean"
        case int():
            return "an integer"
        case float():
            return "a number with a fraction or exponent"
        case str():
            return "a string"
        case list():
            return "an array"
        case dict():
            return "an object"
    return f"a Python {type(value).__name__}"


def _loc(parts: Iterable[object]) -> Loc:
    return tuple(p if isinstance(p, str | int) else str(p) for p in parts if p != "[key]")


def _translate(error: ErrorDetails, base: Loc) -> list[tuple[Loc, Refusal]]:
    kind = error["type"]
    loc = (*base, *_loc(error["loc"]))
    ctx: Mapping[str, Any] = error.get("ctx") or {}
    if "." in kind:  # one of ours, raised by a rule above
        carried = ctx.get("refusals")
        if isinstance(carried, tuple) and carried:
            return [(loc, r) for r in carried if isinstance(r, Refusal)]
        return [
            (
                loc,
                Refusal(
                    kind,
                    json_path(loc),
                    str(ctx.get("message", error["msg"])),
                    str(ctx.get("hint", default_hint(kind))),
                ),
            )
        ]
    name = str(loc[-1]) if loc else "document"
    if kind == "missing":
        return [_refusal("operator.missing_field", loc, f"required member {name!r} is missing")]
    if kind == "extra_forbidden":
        return [_refusal("operator.unknown_field", loc, f"unknown member {name!r}")]
    expected = _EXPECTED.get(kind)
    got = _json_kind(error.get("input"))
    if expected is None:
        return [_refusal("operator.type", loc, f"{error['msg']} (got {got})")]
    return [_refusal("operator.type", loc, f"expected {expected}, got {got}")]


def _order(loc: Loc) -> tuple[int, int]:
    """Document order: the schema's field order, then the plan's; unknown members last."""
    fields = list(OperatorInput.model_fields)
    top = fields.index(loc[0]) if loc and loc[0] in fields else len(fields)
    plan_fields = list(PlanInput.model_fields)
    inner = (
        plan_fields.index(loc[1])
        if len(loc) > 1 and loc[0] == "plan" and loc[1] in plan_fields
        else len(plan_fields)
    )
    return top, inner


def _capped() -> RefusalCap:
    return RefusalCap("operator.more_refusals", default_hint("operator.more_refusals"))


def _group(loc: Loc) -> str:
    """Refusals are capped per code under each top-level member (the document's own: "$")."""
    return json_path(loc[:1]) if len(loc) > 1 else "$"


def _ordered(found: Sequence[tuple[Loc, Refusal]]) -> tuple[Refusal, ...]:
    """In document order, at most a few of each code under each top-level member."""
    cap = _capped()
    for loc, refusal in dict.fromkeys(sorted(found, key=lambda item: _order(item[0]))):
        cap.add(refusal, _group(loc))
    return cap.refusals()


def _pass_one(
    model: type[_M], obj: object, base: Loc
) -> tuple[_M | None, list[tuple[Loc, Refusal]]]:
    try:
        return model.model_validate(obj, strict=True, context=_PASS_TWO_DONE), []
    except ValidationError as exc:
        found: list[tuple[Loc, Refusal]] = []
        for error in exc.errors():
            found.extend(_translate(error, base))
        return None, found


# --------------------------------------------------------------------------------------
# Public entry points.


def _unexplained(path: str) -> Refusal:
    # Unreachable while pydantic reports at least one error per failure; kept so that a
    # future pydantic cannot turn a refusal into a bare exception.
    return Refusal("operator.type", path, "the document was refused", default_hint("operator.type"))


def _containers(root: object, base: Loc) -> Iterator[tuple[list[Any] | dict[Any, Any], Loc, int]]:
    return containers(root, base, max_depth=JSON_MAX_DEPTH, max_entries=JSON_MAX_ENTRIES)


def _bounded_shape(root: object, base: Loc) -> tuple[object, list[tuple[Loc, Refusal]]]:
    """Bound the document's nesting and container sizes before any per-entry work.

    Every later step (surrogate cleaning, pydantic, the cross-entry rules, one refusal per
    bad entry) is linear in what it is given; without this a 1 MiB array of bad entries
    produced half a million refusals, and a few hundred nested arrays a RecursionError.
    Too deep refuses the document outright, and so do more than JSON_MAX_VALUES values in
    all (many containers of bad entries: pydantic alone took 230 MB to list their errors);
    an over-long container is refused and only its first JSON_MAX_ENTRIES entries are
    checked further.
    """
    found: list[tuple[Loc, Refusal]] = []
    values = 0
    for node, loc, depth in _containers(root, base):
        if depth > JSON_MAX_DEPTH:
            message = f"the document nests deeper than {JSON_MAX_DEPTH} levels here"
            raise Refused((_refusal("operator.json.too_deep", loc, message)[1],))
        values += min(len(node), JSON_MAX_ENTRIES)
        if len(node) > JSON_MAX_ENTRIES:
            what = "array" if isinstance(node, list) else "object"
            found.append(
                _refusal(
                    "operator.json.too_many_entries",
                    loc,
                    f"the {what} has {len(node)} entries, more than {JSON_MAX_ENTRIES}; "
                    f"only the first {JSON_MAX_ENTRIES} were checked",
                )
            )
    if values > JSON_MAX_VALUES:
        message = (
            f"the document's arrays and objects hold more than {JSON_MAX_VALUES} values "
            f"({values} counted); none was checked further"
        )
        raise Refused((_refusal("operator.json.too_many_values", base, message)[1],))
    return (_truncated(root) if found else root), found


def _truncated(node: object) -> object:
    # Recursion is safe here: _bounded_shape has already bounded the depth.
    if isinstance(node, list):
        return [_truncated(item) for item in node[:JSON_MAX_ENTRIES]]
    if isinstance(node, dict):
        return {
            key: _truncated(item) for key, item in itertools.islice(node.items(), JSON_MAX_ENTRIES)
        }
    return node


_SURROGATE = re.compile("[\ud800-\udfff]")


def _without_surrogates(value: object, loc: Loc, found: list[tuple[Loc, Refusal]]) -> object:
    """Replace unpaired surrogates (valid JSON escapes, invalid Unicode) and refuse each one.

    pydantic gives up on a whole object when a member name holds one, which would hide every
    other refusal of the document; cleaning first keeps them all reportable.
    """
    if isinstance(value, str):
        if _SURROGATE.search(value):
            found.append(
                _refusal(
                    "operator.text.surrogate",
                    loc,
                    "the text holds an unpaired UTF-16 surrogate escape",
                )
            )
            return _SURROGATE.sub("\ufffd", value)
        return value
    if isinstance(value, list):
        return [_without_surrogates(item, (*loc, i), found) for i, item in enumerate(value)]
    if isinstance(value, dict):
        cleaned: dict[object, object] = {}
        for key, item in value.items():
            name = key
            if isinstance(key, str) and _SURROGATE.search(key):
                name = _SURROGATE.sub("\ufffd", key)
                found.append(
                    _refusal(
                        "operator.text.surrogate",
                        (*loc, name),
                        "the member name holds an unpaired UTF-16 surrogate escape",
                    )
                )
            cleaned[name] = _without_surrogates(item, (*loc, str(name)), found)
        return cleaned
    return value


def validate_operator_object(obj: object) -> OperatorInput:
    """Validate decoded JSON; raise :class:`Refused` carrying every refusal found."""
    if not isinstance(obj, dict):
        raise Refused.one(
            "operator.type",
            "$",
            f"the operator input is {_json_kind(obj)}, not an object",
            default_hint("operator.type"),
        )
    obj, found = _bounded_shape(obj, ())
    obj = _without_surrogates(obj, (), found)
    assert isinstance(obj, dict)
    model, structural = _pass_one(OperatorInput, obj, ())
    found += structural
    found += _operator_cross_entry(obj)
    if found or model is None:
        raise Refused(_ordered(found) or (_unexplained("$"),))
    return model


def validate_plan_object(obj: object) -> PlanInput:
    """Validate a plan on its own (e.g. after CLI overrides); paths read ``$.plan...``."""
    base: Loc = ("plan",)
    if not isinstance(obj, dict):
        raise Refused.one(
            "operator.type",
            json_path(base),
            f"the plan is {_json_kind(obj)}, not an object",
            default_hint("operator.type"),
        )
    obj, found = _bounded_shape(obj, base)
    assert isinstance(obj, dict)
    model, structural = _pass_one(PlanInput, obj, base)
    found += structural
    found += _plan_cross_entry(obj, base)
    if found or model is None:
        raise Refused(_ordered(found) or (_unexplained(json_path(base)),))
    return model


class _Members(dict[str, Any]):
    """A decoded JSON object that remembers member names it saw more than once."""

    repeated: tuple[str, ...] = ()


def _members(pairs: list[tuple[str, Any]]) -> _Members:
    obj = _Members(pairs)
    if len(obj) != len(pairs):
        counts = Counter(name for name, _ in pairs)
        obj.repeated = tuple(name for name, count in counts.items() if count > 1)
    return obj


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _repeated_members(root: object) -> tuple[Refusal, ...]:
    cap = _capped()
    for node, loc, _ in _containers(root, ()):
        for name in getattr(node, "repeated", ()):
            at = (*loc, name)
            message = f"member {name!r} appears more than once"
            cap.add(_refusal("operator.json.duplicate_key", at, message)[1], _group(at))
    listed = sorted(cap.listed, key=lambda r: r.path)
    return (*listed, *cap.refusals()[len(listed) :])


def validate_operator_document(data: bytes) -> OperatorInput:
    """Decode UTF-8 JSON bytes and validate them; raise :class:`Refused` on any problem."""
    if len(data) > DOCUMENT_MAX_BYTES:
        raise Refused.one(
            "operator.json.too_large",
            "$",
            f"the operator input has {len(data)} bytes, more than {DOCUMENT_MAX_BYTES}",
            default_hint("operator.json.too_large"),
        )
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Refused.one(
            "operator.json.decode",
            "$",
            f"the operator input is not UTF-8 (byte {exc.start})",
            default_hint("operator.json.decode"),
        ) from None
    try:
        obj = json.loads(text, object_pairs_hook=_members, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise Refused.one(
            "operator.json.decode",
            "$",
            f"the operator input is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
            default_hint("operator.json.decode"),
        ) from None
    except RecursionError:
        raise Refused.one(
            "operator.json.too_deep",
            "$",
            f"the document nests deeper than {JSON_MAX_DEPTH} levels",
            default_hint("operator.json.too_deep"),
        ) from None
    except ValueError as exc:
        raise Refused.one(
            "operator.json.decode",
            "$",
            f"the operator input cannot be decoded: {exc}",
            default_hint("operator.json.decode"),
        ) from None
    repeated = _repeated_members(obj)
    try:
        model = validate_operator_object(obj)
    except Refused as refused:
        raise Refused((*repeated, *refused.refusals)) from None
    if repeated:
        raise Refused(tuple(repeated))
    return model


__all__ = [
    "ENV_ALIAS_PAIRS",
    "KEY_PATTERN",
    "TOOLKIT_NAMES",
    "AbsolutePath",
    "IntRange",
    "LowerHex",
    "OperatorInput",
    "PinnedFile",
    "PlanInput",
    "Rule",
    "SchemaVersion",
    "ServerBinary",
    "ToolkitDirectory",
    "environment_refusals",
    "secret_name_marker",
    "validate_operator_document",
    "validate_operator_object",
    "validate_plan_object",
]
