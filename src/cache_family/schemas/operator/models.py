"""The operator input's models: strict pydantic models of schema_version 1 and its plan.

Field names and order follow the reference contracts (§1, §2); do not reorder. A model built
directly runs the cross checks itself after its own validation, so it is never weaker than one
returned by ``validate_operator_object``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Final, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from cache_family.errors import Refusal, json_path
from cache_family.schemas.openai_host import OpenAIServing, serving_refusals
from cache_family.schemas.operator.cross_checks import _operator_cross_entry, _plan_cross_entry
from cache_family.schemas.operator.limits import (
    CASES_MAX,
    CONCURRENCY_MAX_RUNGS,
    ENV_MAX_ENTRIES,
    ENV_SECRET_MARKERS,
    ENV_SECRET_WORDS,
    ENV_VALUE_MAX_BYTES,
    KEY_PATTERN,
    PREFIX_SWEEP_MAX,
    TOOLKIT_MAX_ENTRIES,
    TOOLKIT_NAMES,
    USE_CASES_ALL,
    USE_CASES_MAX,
    Loc,
)
from cache_family.schemas.operator.values import (
    _BUDGET,
    AbsPath,
    CommitHex,
    Count1024,
    Count65536,
    GpuLayers,
    IntRange,
    PositiveU32,
    Rule,
    Rung,
    SchemaVersion,
    Sha256Hex,
)

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


# Where the declaration sits in the operator input: its refusals' paths start here.
_SERVING_AT: Final[Loc] = ("openai_server", "serving")


def _admitted_serving(serving: OpenAIServing) -> OpenAIServing:
    """The declaration's own rules (``openai_host.*``), each path rooted in the document."""
    found = [
        (_SERVING_AT, replace(refusal, path=json_path(_SERVING_AT) + refusal.path[1:]))
        for refusal in serving_refusals(serving)
    ]
    if found:
        raise _as_validation_failure(found)
    return serving


class OpenAIServer(BaseModel):
    """An OpenAI-compatible server run as a host of every case: its pinned parts (the server
    binary, or the interpreter of a pinned tree and a module) and its declaration. It serves the
    case's own model file, pinned as every host's is."""

    model_config = _STRICT

    binary: Annotated[
        AbsPath, Field(description="the server, or the interpreter inside tree; byte-pinned")
    ]
    tree: Annotated[
        AbsPath | None,
        Field(description="its build or interpreter tree; tree-pinned; null = native_build"),
    ] = None
    source_commit: Annotated[
        CommitHex | None, Field(description="declared provenance only; null = none declared")
    ] = None
    serving: Annotated[
        OpenAIServing,
        AfterValidator(_admitted_serving),
        Field(description="how it is started and spoken to (openai_host.* refusals)"),
    ]


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
    openai_server: Annotated[
        OpenAIServer | None,
        Field(description="an OpenAI-compatible server run as a host of every case"),
    ] = None

    @model_serializer(mode="wrap")
    def _undeclared_server_left_out(self, handler: SerializerFunctionWrapHandler) -> Any:
        # An input without the declaration encodes byte for byte as before the member existed.
        data = handler(self)
        if self.openai_server is None and isinstance(data, dict):
            data.pop("openai_server", None)
        return data

    @model_validator(mode="after")
    def _cross_entry_rules(self, info: ValidationInfo) -> Self:
        if not _pass_two_done(info):
            found = _operator_cross_entry(self.model_dump(mode="json"), include_plan=False)
            if found:
                raise _as_validation_failure(found)
        return self
