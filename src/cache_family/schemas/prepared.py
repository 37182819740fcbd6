"""Preparation documents: ``request.json``, ``observations.json`` and
``cache-family-input.json``.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal, Self, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    computed_field,
    model_serializer,
    model_validator,
)

from cache_family.errors import Refusal, Refused, json_path
from cache_family.schemas.arms import (
    NATIVE_PROFILE,
    NEW_PROFILE,
    OLD_PROFILE,
    OPENAI_PROFILE,
    HostProfileName,
)
from cache_family.schemas.bounded import MIB, read_bounded
from cache_family.schemas.catalog import payload_refusal
from cache_family.schemas.json_shape import containers
from cache_family.schemas.openai_host import OpenAIServing
from cache_family.schemas.operator import (
    LowerHex,
    OperatorInput,
    PlanInput,
    environment_refusals,
)
from cache_family.schemas.workload import WorkloadsPin

_M = TypeVar("_M", bound=BaseModel)

PREPARED_SCHEMA_VERSION: Final = 1
PREPARED_SCOPE: Final = "observed_local_bytes_and_declared_source_commits_not_build_attestation"
MODEL_CUSTODY: Final = "observed_local_bytes_not_model_admission"
SOURCE_COMMIT_PROVENANCE: Final = "caller-declared build provenance, not proof of what was built"
MISSING_MODEL_POLICY: Final = "retain_row_without_launch"
PARITY_REQUIREMENT: Final = "old-new-generated-digests-match"
MAX_ROWS: Final = 8192

REQUEST_MAX_BYTES: Final = 2 * MIB
#: The one cap on ``cache-family-input.json``: preparation refuses to publish more, and the
#: run reads at most this much.
PREPARED_INPUT_MAX_BYTES: Final = 32 * MIB
# observations.json holds the input one indentation level deeper, plus a few members.
OBSERVATIONS_MAX_BYTES: Final = PREPARED_INPUT_MAX_BYTES + PREPARED_INPUT_MAX_BYTES // 4
# A worker that refuses lists its refusals in observations.json; the parent relays this many.
RELAYED_REFUSALS_MAX: Final = 200

# Topologies the correctness arm runs, by load mode (reference §5 step 4).
RUNTIME_SLICE_TOPOLOGIES: Final = ("one-stage", "split-stage0", "split-middle", "split-final")
PACKAGE_TOPOLOGIES: Final = ("package-stage1",)

_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True, hide_input_in_errors=True)

Sha256 = Annotated[
    str,
    AfterValidator(
        LowerHex(
            (64,),
            "prepared.bad_sha256",
            "SHA-256",
            "re-run preparation; never edit prepared documents by hand",
        )
    ),
]
Mode = Literal["full", "use-cases"]
SkipReason = Literal[
    "missing-model",
    "layer-package-not-full-GGUF",
    "skipped-by-request",
    "paired-servers-omitted",
]
PrefixSource = Literal["override", "sweep", "use-case", "catalog", "package-contract"]
ObservationStatus = Literal["present", "missing-model"]
ObservedKind = Literal["single-gguf", "split-gguf-first-shard", "layer-package-tree"]
IdentitySource = Literal["gguf-header", "package-manifest"]
CorpusSource = Literal["override", "environment", "operator-plan", "checked-in"]


class _Strict(BaseModel):
    model_config = _STRICT


def _without_absent_extensions(document: Any, data: Any) -> Any:
    """A document without a workload file, a native output override or a declared server
    encodes without those members, byte for byte as before they existed."""
    if isinstance(data, dict):
        for member in ("workloads", "native_output_tokens", "openai", "openai_tree"):
            if getattr(document, member, None) is None:
                data.pop(member, None)
    return data


# --- pins --------------------------------------------------------------------------------------


class FilePinRecord(_Strict):
    """A regular file's canonical path and the SHA-256 of its bytes."""

    path: str
    sha256: Sha256
    size: int


class TreePinRecord(_Strict):
    """A directory's canonical path and its tree pin (reference "Tree pin")."""

    path: str
    sha256: Sha256
    files: int
    size: int


class ShardPin(_Strict):
    """One file of a split model: the snapshot name the runtime opens, and the bytes behind it."""

    name: str
    logical_path: str
    canonical: str
    sha256: Sha256
    size: int


class ToolPins(_Strict):
    correctness: FilePinRecord
    stage_server: FilePinRecord
    native_server: FilePinRecord | None
    artifact_tool: FilePinRecord | None


class SourceCommits(_Strict):
    old: str
    new: str
    native: str
    provenance: Literal["caller-declared build provenance, not proof of what was built"] = (
        SOURCE_COMMIT_PROVENANCE
    )


class CatalogUsed(_Strict):
    """Which catalog planned the rows: the packaged one or a named (e.g. zoo) file."""

    path: str
    sha256: Sha256
    synthetic: bool
    packaged: bool


class CorpusUsed(_Strict):
    path: str
    sha256: Sha256
    source: CorpusSource


class UseCaseSourceRecord(_Strict):
    dataset: str | None = None
    config: str | None = None
    split: str | None = None
    row_idx: int | None = None
    provenance: str | None = None


class UseCaseRecord(_Strict):
    """A planned use case, copied from the pinned corpus so the run never re-reads it."""

    key: str
    label: str
    prompt: str
    prefix_tokens: int
    source: UseCaseSourceRecord


# --- rows --------------------------------------------------------------------------------------


class ModelObservation(_Strict):
    """What preparation found at ``cache_root/snapshot_relative``.

    ``missing-model``: nothing there; the row is kept and never launched. ``present``: the
    bytes were hashed. ``runtime_entrypoint`` is what a runtime is given: the canonical file,
    except for a split model (the first shard's snapshot path, so sibling discovery by name
    works) and a layer package (its canonical directory). ``sha256`` pins the canonical bytes
    of the entrypoint (layer package: of ``model-package.json``, at ``pinned_file``).

    ``architecture``, ``block_count`` and ``context_length`` are what the bytes say about
    themselves: a GGUF header's ``general.architecture``, ``<arch>.block_count`` and
    ``<arch>.context_length`` (a split model: its first shard's), or for a schema-1 layer
    package its manifest's ``layer_count`` and its metadata artifact's architecture and
    context; a package is also admitted by the artifact tool's ``admit-package`` for its
    preset's stage, which verifies the selected artifacts' bytes. Preparation refuses
    a model whose claims differ from its catalog preset. ``synthetic_marker`` is the zoo's
    mark of random-weight bytes, when the bytes carry one. ``missing_reason`` says why a
    synthetic catalog holds no model for a preset (the zoo could not build one), so such a row
    is a missing model with that reason, never a stand-in.
    """

    status: ObservationStatus
    requested: str
    declared_revision: str
    declared_byte_sha256: Sha256 | None
    kind: ObservedKind | None = None
    canonical: str | None = None
    runtime_entrypoint: str | None = None
    pinned_file: str | None = None
    sha256: Sha256 | None = None
    size: int | None = None
    shard_pins: list[ShardPin] = Field(default_factory=list)
    custody: Literal["observed_local_bytes_not_model_admission"] = MODEL_CUSTODY
    identity_source: IdentitySource | None = None
    architecture: str | None = None
    block_count: int | None = None
    context_length: int | None = None
    synthetic_marker: str | None = None
    # missing-model only: why a synthetic catalog has no model here (the zoo's own reason).
    missing_reason: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        present_fields = (
            self.kind,
            self.canonical,
            self.runtime_entrypoint,
            self.pinned_file,
            self.sha256,
            self.size,
        )
        if self.status == "present" and any(v is None for v in present_fields):
            raise ValueError("a present model needs kind, canonical, entrypoint, file, pin, size")
        if self.status == "missing-model" and (
            any(v is not None for v in present_fields) or self.shard_pins
        ):
            raise ValueError("a missing model has no observed fields")
        if (self.kind == "split-gguf-first-shard") != bool(self.shard_pins):
            raise ValueError("shard pins are recorded exactly for a split model")
        claims = (self.architecture, self.block_count, self.context_length, self.synthetic_marker)
        if self.identity_source is None and any(v is not None for v in claims):
            raise ValueError("identity claims need the identity_source they were read from")
        if self.status == "missing-model" and self.identity_source is not None:
            raise ValueError("a missing model has no identity")
        return self

    @property
    def present(self) -> bool:
        return self.status == "present"


class Rung(_Strict):
    concurrency: int
    requests: int


class CorrectnessTask(_Strict):
    planned: bool
    skip_reason: SkipReason | None
    payload: Literal["resident-kv", "kv-recurrent"]
    stage_load_mode: Literal["runtime-slice", "layer-package"]
    state_layer_start: int
    state_layer_end: int
    state_stage_index: int
    topologies: list[str]
    admission: Literal["source", "package"]
    # The use-case prompt when the row has a use case, else the correctness tool's own.
    prompt_source: Literal["use-case", "correctness-tool"]


class SerialBaselineTask(_Strict):
    planned: bool
    skip_reason: SkipReason | None
    runs: int  # llama_repeats, the first excluded as warmup
    warmup_excluded: int = 1
    output_tokens: int = 1
    prompt_source: Literal["correctness-benchmark-prompt"] = "correctness-benchmark-prompt"


class ConcurrentBaselineTask(_Strict):
    planned: bool
    skip_reason: SkipReason | None
    parallel: int
    output_tokens: int
    rungs: list[Rung]


class PairedServingTask(_Strict):
    planned: bool
    skip_reason: SkipReason | None
    runtime_lanes: int
    shared_ctx_size: int
    output_tokens: int
    rungs: list[Rung]
    ttft_slo_ms: int
    tpot_slo_ms: int
    greedy_fastpath: bool = True
    parity_requirement: Literal["old-new-generated-digests-match"] = PARITY_REQUIREMENT


class RowTasks(_Strict):
    correctness: CorrectnessTask
    serial_baseline: SerialBaselineTask
    concurrent_baseline: ConcurrentBaselineTask
    paired_serving: PairedServingTask


class PreparedRow(_Strict):
    """One planned (prefix, use case or none, catalog case); ``cell-NNNN`` is ``index``.

    ``model_observation`` is written once per key in the document's ``models`` member, not in
    every row (a use-case sweep repeats each key dozens of times): it is left out when a row
    is encoded and filled in from ``models`` when the document is read.
    """

    index: int
    key: str
    family: str
    model_id: str
    payload: Literal["resident-kv", "kv-recurrent"]
    load_mode: Literal["runtime-slice", "layer-package"]
    artifact_kind: Literal["single-gguf", "split-gguf", "layer-package"]
    baseline_policy: Literal["monolithic", "package-only"]
    synthetic: bool
    use_case: str | None
    use_case_label: str | None
    prefix_tokens: int
    prefix_source: PrefixSource
    prefix_note: str | None
    ctx: int
    n_gpu_layers: int
    cache_hit_repeats: int
    layer_end: int
    activation_width: int
    kv_bytes_per_token: int | None
    output_relative: str
    model_observation: ModelObservation = Field(exclude=True)
    tasks: RowTasks


# --- profiles ----------------------------------------------------------------------------------


class ToolkitPin(_Strict):
    path: str
    sha256: Sha256


class ArtifactProfile(_Strict):
    """How the artifact tool admits a non-single model: all shards, or a layer package."""

    kind: Literal["complete-shards", "layer-package"]
    tool: str
    tool_sha256: Sha256
    shard_pins: list[ShardPin]


class CorrectnessProfile(_Strict):
    schema_version: Literal[1]
    case_key: str
    model_id: str
    correctness: str
    correctness_sha256: Sha256
    stage_server: str
    stage_server_sha256: Sha256
    model: str
    model_sha256: Sha256
    artifact: ArtifactProfile | None
    native_build: str
    native_build_sha256: Sha256
    ctx_size: int
    prefix_tokens: int
    cache_hit_repeats: int
    runtime_lane_count: int
    source_port: int  # placeholder; the run takes fresh ephemeral ports
    restore_port: int  # placeholder
    n_gpu_layers: int
    prompt: str | None
    topologies: list[str]
    borrow_resident_hits: bool
    cache_decoded_result_hits: bool
    execution_seconds: int
    cell_seconds: int
    settings: dict[str, str]
    toolkit_directories: dict[str, ToolkitPin]
    layer_end: int
    activation_width: int
    payload: Literal["resident-kv", "kv-recurrent"]
    stage_load_mode: Literal["runtime-slice", "layer-package"]
    state_layer_start: int
    state_layer_end: int
    state_stage_index: int


class HostProfile(_Strict):
    schema_version: Literal[1]
    host: HostProfileName
    binary: str
    binary_sha256: Sha256
    source_commit: str
    native_build: str
    native_build_sha256: Sha256
    model: str
    model_sha256: Sha256
    artifact: ArtifactProfile | None
    model_id: str
    layer_end: int
    ctx_size: int
    lane_count: int
    n_gpu_layers: int
    port: int  # placeholder; the run binds a fresh port
    environment: dict[str, str]
    toolkit_directories: dict[str, ToolkitPin]
    worker: dict[str, Any]
    startup_timeout_secs: int
    execution_timeout_secs: int
    # A declared OpenAI-compatible server's launch and dialects (``host`` is "openai"); left
    # out of every other profile's encoding.
    openai: OpenAIServing | None = None

    @model_serializer(mode="wrap")
    def _absent_extensions_left_out(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _without_absent_extensions(self, handler(self))


#: Each host profile's member of a case's encoded profiles (what the paths of refusals name).
_MEMBERS: Final[dict[HostProfileName, str]] = {
    NATIVE_PROFILE: "native",
    OLD_PROFILE: "old",
    NEW_PROFILE: "new",
    OPENAI_PROFILE: "openai",
}


class CaseProfiles(_Strict):
    correctness: CorrectnessProfile
    native: HostProfile | None
    old: HostProfile | None
    new: HostProfile | None
    # A declared OpenAI-compatible server's profile for the case (left out when absent).
    openai: HostProfile | None = None

    @model_serializer(mode="wrap")
    def _absent_extensions_left_out(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _without_absent_extensions(self, handler(self))

    def hosts(self) -> dict[HostProfileName, HostProfile]:
        """The case's host profiles by profile name, those it has. The encoding keeps the
        reference's members (``native``, ``old``, ``new``: reference-contracts §2, strict),
        and a declared server's beside them; everything else reads the profiles by name."""
        named: dict[HostProfileName, HostProfile | None] = {
            NATIVE_PROFILE: self.native,
            OLD_PROFILE: self.old,
            NEW_PROFILE: self.new,
            OPENAI_PROFILE: self.openai,
        }
        return {name: profile for name, profile in named.items() if profile is not None}

    def host(self, name: HostProfileName) -> HostProfile | None:
        """The host profile an arm names (``Arm.profile``)."""
        return self.hosts().get(name)


# --- the documents -----------------------------------------------------------------------------


UNUSED_CORPUS_REASON: Final = (
    "prepare-full plans no use cases: this corpus was accepted because the reference wrapper "
    "passes --use-case-corpus to both modes, and was not read; full rows take their prompt "
    "from the first entry of the packaged corpus"
)


class UnusedCorpus(_Strict):
    """A ``--use-case-corpus`` given to prepare-full: recorded, never read, never used."""

    path: str
    reason: str


class PreparedInput(_Strict):
    """``cache-family-input.json``: the run's only input.

    On disk, ``models`` maps every planned key to its one model observation and rows carry
    none of their own; in memory each row holds its key's observation (see
    :class:`PreparedRow`).
    """

    schema_version: Literal[1]
    scope: Literal["observed_local_bytes_and_declared_source_commits_not_build_attestation"]
    mode: Mode
    plan: PlanInput
    catalog: CatalogUsed
    corpus: CorpusUsed | None
    cache_root: str
    native_build: TreePinRecord
    tools: ToolPins
    toolkit_directories: dict[str, TreePinRecord]
    environment: dict[str, str]
    source_commits: SourceCommits
    borrow_resident_hits: bool
    cache_decoded_result_hits: bool
    execution_seconds: int
    cell_seconds: int
    request_timeout_ms: int
    rows: list[PreparedRow]
    row_count: int
    profiles: dict[str, CaseProfiles]
    missing_model_policy: Literal["retain_row_without_launch"] = MISSING_MODEL_POLICY
    # The corpus entries the rows use (corpus order); empty for prepare-full.
    use_cases: list[UseCaseRecord] = Field(default_factory=list)
    # prepare-full only: the --use-case-corpus it was given and did not use.
    unused_corpus: UnusedCorpus | None = None
    # The workload file given with --workloads, pinned; absent (not null) without one, so a
    # preparation without workloads writes the same bytes as before the field existed.
    workloads: WorkloadsPin | None = None
    # --native-output-tokens, when given: every row's native concurrent ladder asks for this
    # many output tokens per request instead of the reference's 128. Absent when not given,
    # so a prepared input without the override keeps its bytes.
    native_output_tokens: Annotated[int, Field(ge=1, le=2**32 - 1)] | None = None

    @model_serializer(mode="wrap")
    def _absent_extensions_left_out(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _without_absent_extensions(self, handler(self))

    @model_validator(mode="before")
    @classmethod
    def _rows_from_models(cls, data: Any) -> Any:
        """Give each encoded row the observation of its key from ``models``."""
        if not isinstance(data, dict) or "models" not in data:
            return data
        data = dict(data)
        models = data.pop("models")
        rows = data.get("rows")
        if not isinstance(models, dict) or not isinstance(rows, list):
            # pydantic turns a ValueError into a validation error, never a TypeError
            raise ValueError("models must be an object and rows a list")  # noqa: TRY004
        filled = []
        # Only a text key can name a model; any other (a list, an object) is left for the
        # row's own schema to refuse, never looked up (an unhashable key would raise).
        keys = {r.get("key") for r in rows if isinstance(r, dict) and isinstance(r.get("key"), str)}
        for row in rows:
            if isinstance(row, dict):
                if "model_observation" in row:
                    raise ValueError("a row repeats its model observation outside models")
                key = row.get("key")
                if isinstance(key, str) and key in models:
                    row = {**row, "model_observation": models[key]}
            filled.append(row)
        unused = sorted(set(models) - keys)
        if unused:
            raise ValueError(f"models names keys no row plans: {unused}")
        data["rows"] = filled
        return data

    @computed_field  # type: ignore[prop-decorator]
    @property
    def models(self) -> dict[str, ModelObservation]:
        """Each planned key's model observation, once (rows are encoded without theirs)."""
        return {row.key: row.model_observation for row in self.rows}

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        problems = prepared_input_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def profile(self, key: str) -> CaseProfiles | None:
        return self.profiles.get(key)


def prepared_input_problems(doc: PreparedInput) -> list[str]:
    """Rules that tie rows, profiles and the plan together (a hand edit cannot break them)."""
    out: list[str] = []
    if doc.row_count != len(doc.rows):
        out.append(f"row_count {doc.row_count} but {len(doc.rows)} rows")
    if len(doc.rows) > MAX_ROWS:
        out.append(f"{len(doc.rows)} rows, more than {MAX_ROWS}")
    for position, row in enumerate(doc.rows):
        if row.index != position:
            out.append(f"row at position {position} has index {row.index}")
    repeated = [name for name, n in Counter(r.output_relative for r in doc.rows).items() if n > 1]
    if repeated:
        out.append(f"output_relative repeated: {sorted(repeated)}")
    first: dict[str, ModelObservation] = {}
    for row in doc.rows:
        if first.setdefault(row.key, row.model_observation) != row.model_observation:
            out.append(f"rows of {row.key} hold different model observations")
    present = {r.key for r in doc.rows if r.model_observation.present}
    missing = {r.key for r in doc.rows if not r.model_observation.present}
    if present & missing:
        out.append(f"keys both present and missing: {sorted(present & missing)}")
    if set(doc.profiles) != present:
        out.append(f"profiles for {sorted(doc.profiles)} but present keys are {sorted(present)}")
    for key, profiles in doc.profiles.items():
        if profiles.correctness.case_key != key:
            out.append(f"profile {key} names case {profiles.correctness.case_key}")
    pins = {r.key: r.model_observation.sha256 for r in doc.rows if r.model_observation.present}
    if dict(doc.plan.model_sha256) != pins:
        out.append("plan.model_sha256 differs from the observed pins of the present rows")
    known = {u.key for u in doc.use_cases}
    if len(known) != len(doc.use_cases):
        out.append("use_cases repeats a key")
    unknown = sorted({r.use_case for r in doc.rows if r.use_case is not None} - known)
    if unknown:
        out.append(f"rows name use cases missing from use_cases: {unknown}")
    if doc.mode == "full" and doc.use_cases:
        out.append("mode full carries no use cases")
    if doc.mode != "full" and doc.unused_corpus is not None:
        out.append(f"mode {doc.mode} records no unused corpus")
    expected_use_cases = ["all"] if doc.mode == "use-cases" else []
    if doc.plan.use_cases != expected_use_cases:
        out.append(f"mode {doc.mode} needs plan.use_cases {expected_use_cases}")
    plan_corpus = doc.plan.corpus
    if (plan_corpus is None) != (doc.corpus is None) or (
        plan_corpus is not None
        and doc.corpus is not None
        and (plan_corpus.path, plan_corpus.sha256) != (doc.corpus.path, doc.corpus.sha256)
    ):
        out.append("corpus differs from plan.corpus")
    out.extend(_environment_problems(doc))
    return out


def _environment_problems(doc: PreparedInput) -> list[str]:
    """Every environment map handed to a host or the correctness tool obeys the operator's
    rules, so an edited prepared input cannot pass a secret-looking name to a child."""
    maps: dict[str, dict[str, str]] = {"environment": doc.environment}
    for key, profiles in doc.profiles.items():
        maps[f"profiles.{key}.correctness.settings"] = profiles.correctness.settings
        for name, profile in profiles.hosts().items():
            maps[f"profiles.{key}.{_MEMBERS[name]}.environment"] = profile.environment
    return [
        f"{where}: {refusal.code}: {refusal.message}"
        for where, env in maps.items()
        for refusal in environment_refusals(env)
    ]


class PreparationRequest(_Strict):
    """``request.json``: what the parent asks the preparation worker to observe."""

    schema_version: Literal[1]
    mode: Mode
    operator: OperatorInput  # after overrides and the mode's use-case selection
    corpus_source: CorpusSource | None
    # Whole milliseconds the worker may spend; the parent keeps a grace margin of its own.
    worker_budget_ms: Annotated[int, Field(ge=1, le=3_600_000)]
    # The same end on the host's monotonic clock (CLOCK_MONOTONIC is one clock for every
    # process of a host), so the worker's start-up time cannot eat the parent's margin.
    worker_deadline_monotonic_ns: Annotated[int, Field(ge=0)] | None = None
    # prepare-full: the --use-case-corpus it accepts and records as unused (never read).
    unused_corpus: str | None = None
    # --workloads, pinned by the parent; left out of the bytes when absent (as in the input).
    workloads: WorkloadsPin | None = None
    # --native-output-tokens: the native ladder's output tokens per request (None: 128).
    native_output_tokens: Annotated[int, Field(ge=1, le=2**32 - 1)] | None = None

    @model_serializer(mode="wrap")
    def _absent_extensions_left_out(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _without_absent_extensions(self, handler(self))


class RefusalRecord(_Strict):
    """One refusal as the worker wrote it, for the parent to relay to the operator."""

    code: str
    path: str
    message: str
    hint: str


class ObservedSoFar(_Strict):
    """What a worker that refused had observed before it stopped (pins are of real bytes)."""

    phase: str  # the step the worker was in when it refused
    tools: dict[str, FilePinRecord] = Field(default_factory=dict)
    native_build: TreePinRecord | None = None
    toolkit_directories: dict[str, TreePinRecord] = Field(default_factory=dict)
    catalog: CatalogUsed | None = None
    corpus: CorpusUsed | None = None
    models: dict[str, ModelObservation] = Field(default_factory=dict)
    # Model bytes are hashed only once every cheaper check has passed.
    models_hashed: bool = False
    # The tree of the operator's declared OpenAI-compatible server, where it names its own
    # (left out otherwise).
    openai_tree: TreePinRecord | None = None

    @model_serializer(mode="wrap")
    def _absent_extensions_left_out(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _without_absent_extensions(self, handler(self))


class Observations(_Strict):
    """``observations.json``: the worker's answer, bound to the request's exact bytes.

    Complete: ``input`` is the prepared input. A worker that refused publishes
    ``complete: false``, its ``refusals`` and what it ``observed`` so far, and no input.
    """

    schema_version: Literal[1]
    request_sha256: Sha256
    scope: Literal["observed_local_bytes_and_declared_source_commits_not_build_attestation"]
    input: PreparedInput | None
    complete: bool = True
    refusals: list[RefusalRecord] = Field(default_factory=list)
    observed: ObservedSoFar | None = None

    @model_validator(mode="after")
    def _complete_or_refused(self) -> Self:
        if self.complete and (self.input is None or self.refusals or self.observed):
            raise ValueError("complete observations hold the input and nothing else")
        if not self.complete and (self.input is not None or not self.refusals):
            raise ValueError("incomplete observations hold refusals and no input")
        return self


def refuse_oversized_input(encoded: bytes, limit: int = PREPARED_INPUT_MAX_BYTES) -> None:
    """Refuse an encoded prepared input the run would not read."""
    if len(encoded) > limit:
        raise Refused.one(
            "preparation.input_too_large",
            "$",
            f"the prepared input would be {len(encoded)} bytes, more than the run's "
            f"{limit}-byte limit",
            "plan fewer rows: fewer cases, use cases or prefixes per preparation",
        )


# --- encoding and loading ----------------------------------------------------------------------


def encode_document(model: BaseModel) -> bytes:
    """The one JSON encoding of these documents: sorted members, two-space indent, newline."""
    return (
        json.dumps(model.model_dump(mode="json"), indent=2, sort_keys=True, ensure_ascii=False)
        + "\n"
    ).encode("utf-8")


@dataclass(frozen=True, slots=True)
class LoadedPreparedInput:
    input: PreparedInput
    sha256: str
    path: str


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        repeated = sorted(name for name, n in Counter(names).items() if n > 1)
        raise ValueError(f"repeated member name(s) {repeated}")
    return dict(pairs)


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def loads_strict_json(data: bytes) -> Any:
    """UTF-8 JSON with each member name once per object and no NaN or Infinity; raises
    ``UnicodeDecodeError``, ``ValueError`` or ``RecursionError`` otherwise."""
    return json.loads(
        data.decode("utf-8"), object_pairs_hook=_no_repeats, parse_constant=_reject_constant
    )


# No prepared document nests deeper than a few levels, no list or map in it is longer than
# the rows (MAX_ROWS), and the largest holds about 80 values per row; past these bounds a
# document is refused before validation, whose work (and memory: one error per bad value)
# would otherwise grow with whatever the file holds.
PREPARED_MAX_DEPTH: Final = 32
PREPARED_MAX_VALUES: Final = 250 * MAX_ROWS


def _shape_refusal(root: object, what: str) -> Refusal | None:
    hint = "re-run preparation; never edit prepared documents by hand"
    total = 0
    for node, loc, depth in containers(
        root, (), max_depth=PREPARED_MAX_DEPTH, max_entries=MAX_ROWS
    ):
        where = json_path(loc)
        if depth > PREPARED_MAX_DEPTH:
            return Refusal(
                "prepared.decode", where, f"{what} nests deeper than {PREPARED_MAX_DEPTH}", hint
            )
        if len(node) > MAX_ROWS:
            return Refusal(
                "prepared.decode",
                where,
                f"{what} has a list or map of {len(node)} entries, more than {MAX_ROWS}",
                hint,
            )
        total += len(node)
        if total > PREPARED_MAX_VALUES:
            return Refusal(
                "prepared.decode", "$", f"{what} holds more than {PREPARED_MAX_VALUES} values", hint
            )
    return None


def _payload_refusals(root: object) -> list[Refusal]:
    """Every ``payload`` member of a prepared document that is not a production cache mode
    (rows, correctness tasks and profiles all carry one), reported with that reason."""
    found: list[Refusal] = []
    stack: list[tuple[object, tuple[str | int, ...]]] = [(root, ())]
    while stack:
        node, loc = stack.pop()
        if isinstance(node, dict):
            refusal = payload_refusal(
                node.get("payload"), json_path((*loc, "payload")), "prepared.payload.not_production"
            )
            if refusal is not None:
                found.append(refusal)
            stack.extend((v, (*loc, str(k))) for k, v in node.items() if isinstance(v, dict | list))
        elif isinstance(node, list):
            stack.extend((v, (*loc, i)) for i, v in enumerate(node) if isinstance(v, dict | list))
    return sorted(found, key=lambda r: r.path)


def decode_document(data: bytes, model: type[_M], *, what: str) -> _M:
    """Decode strict JSON bytes into ``model``; every problem becomes a refusal."""
    try:
        obj = loads_strict_json(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Refused.one(
            "prepared.decode",
            "$",
            f"{what} is not strict UTF-8 JSON: {exc}",
            "re-run preparation; never edit prepared documents by hand",
        ) from None
    shape = _shape_refusal(obj, what)
    if shape is not None:
        raise Refused((shape,))
    payloads = _payload_refusals(obj)
    if payloads:
        raise Refused(tuple(payloads))
    try:
        return model.model_validate(obj, strict=True)
    except ValidationError as exc:
        refusals = [
            Refusal(
                "prepared.invalid",
                json_path(tuple(p for p in err["loc"] if isinstance(p, str | int))),
                f"{what}: {err['msg']}",
                "re-run preparation; never edit prepared documents by hand",
            )
            for err in exc.errors()
        ]
        raise Refused(tuple(refusals)) from None


def read_prepared_input(path: str) -> LoadedPreparedInput:
    """Read ``cache-family-input.json`` (absolute, regular, ≤ 32 MiB) with its byte pin."""
    raw = read_bounded(path, PREPARED_INPUT_MAX_BYTES, what="prepared input")
    doc = decode_document(raw.data, PreparedInput, what="prepared input")
    return LoadedPreparedInput(input=doc, sha256=raw.sha256, path=raw.path)


def load_prepared_input(path: str) -> PreparedInput:
    """The run's entry point: ``cache-family-input.json`` validated, or :class:`Refused`."""
    return read_prepared_input(path).input
