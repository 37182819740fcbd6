"""The planner: rows and profiles from a validated plan, a catalog, a corpus and observations.

Row order: for each prefix, for each use case, for each selected catalog case in catalog order
(``plan.cases`` order is ignored). Every token count a host is given must fit a ``uint32``, and
a row's prefix plus its one generated token must fit its ctx: otherwise the plan is refused
before any byte is observed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cache_family.errors import Refusal, Refused, json_path
from cache_family.schemas.arms import (
    NATIVE_PROFILE,
    NEW_PROFILE,
    OLD_PROFILE,
    OPENAI_PROFILE,
    HostProfileName,
)
from cache_family.schemas.catalog import Catalog, Preset
from cache_family.schemas.corpus import Corpus, UseCase
from cache_family.schemas.openai_host import OpenAIServing
from cache_family.schemas.operator import OperatorInput, PlanInput
from cache_family.schemas.prepared import (
    MAX_ROWS,
    PACKAGE_TOPOLOGIES,
    RUNTIME_SLICE_TOPOLOGIES,
    ArtifactProfile,
    CaseProfiles,
    ConcurrentBaselineTask,
    CorrectnessProfile,
    CorrectnessTask,
    FilePinRecord,
    HostProfile,
    ModelObservation,
    PairedServingTask,
    PrefixSource,
    PreparedRow,
    RowTasks,
    Rung,
    SerialBaselineTask,
    SkipReason,
    ToolkitPin,
    ToolPins,
    TreePinRecord,
)

USE_CASES_ALL = "all"
CTX_HEADROOM = 128  # tokens kept free after an overridden prefix
CONCURRENT_BASELINE_OUTPUT_TOKENS = 128
U32_MAX = 2**32 - 1
STARTUP_MARGIN_SECONDS = 14
STARTUP_MAX_SECONDS = 900
CORRECTNESS_MARGIN_SECONDS = 9


def _refusal(code: str, where: Sequence[str | int], message: str, hint: str) -> Refusal:
    return Refusal(code, json_path(where), message, hint)


def selected_presets(plan: PlanInput, catalog: Catalog) -> list[Preset]:
    """The catalog cases a plan selects, in catalog order; unknown keys are refused."""
    known = set(catalog.keys)
    refusals = [
        _refusal(
            "planning.unknown_case",
            ["plan", "cases", i],
            f"case {key!r} is not in the catalog",
            "use one of " + ", ".join(catalog.keys),
        )
        for i, key in enumerate(plan.cases)
        if key not in known
    ]
    refusals += [
        _refusal(
            "planning.unknown_case",
            ["plan", "model_sha256", key],
            f"model_sha256 names {key!r}, which is not in the catalog",
            "use one of " + ", ".join(catalog.keys),
        )
        for key in plan.model_sha256
        if key not in known
    ]
    if refusals:
        raise Refused(tuple(refusals))
    wanted = set(plan.cases) or known
    return [p for p in catalog.presets if p.key in wanted]


def selected_use_cases(plan: PlanInput, corpus: Corpus | None) -> list[UseCase | None]:
    """``[None]`` without use cases; else the selected corpus entries (all: corpus order)."""
    if not plan.use_cases:
        return [None]
    if corpus is None:
        raise Refused.one(
            "planning.corpus_missing",
            "$.plan.corpus",
            "use cases are selected without a corpus",
            "give plan.corpus or --use-case-corpus",
        )
    if plan.use_cases == [USE_CASES_ALL]:
        return list(corpus.use_cases)
    by_key = {u.key: u for u in corpus.use_cases}
    refusals = [
        _refusal(
            "planning.unknown_use_case",
            ["plan", "use_cases", i],
            f"use case {key!r} is not in the corpus",
            "use one of " + ", ".join(by_key),
        )
        for i, key in enumerate(plan.use_cases)
        if key not in by_key
    ]
    if refusals:
        raise Refused(tuple(refusals))
    return [by_key[key] for key in plan.use_cases]


def prefix_loop(plan: PlanInput) -> list[tuple[int | None, PrefixSource | None]]:
    if plan.prefix_tokens is not None:
        return [(plan.prefix_tokens, "override")]
    if plan.prefix_sweep:
        return [(p, "sweep") for p in plan.prefix_sweep]
    return [(None, None)]


def check_selection(plan: PlanInput, catalog: Catalog, corpus: Corpus | None) -> None:
    """Everything about the selection that can be refused before any byte is observed."""
    refusals: list[Refusal] = []
    presets: list[Preset] = []
    use_cases: list[UseCase | None] = [None]
    try:
        presets = selected_presets(plan, catalog)
    except Refused as refused:
        refusals.extend(refused.refusals)
    try:
        use_cases = selected_use_cases(plan, corpus)
    except Refused as refused:
        refusals.extend(refused.refusals)
    if refusals:
        raise Refused(tuple(refusals))
    count = _row_count(plan, presets, use_cases)
    if count > MAX_ROWS:
        raise Refused.one(
            "planning.too_many_rows",
            "$.plan",
            f"the plan has {count} rows, more than {MAX_ROWS}",
            "select fewer cases, use cases or prefixes",
        )
    bounds = bounds_refusals(plan, presets, use_cases)
    if bounds:
        raise Refused(tuple(bounds))


def _prefix_where(plan: PlanInput, source: PrefixSource, use_case: UseCase | None) -> str:
    if source == "override":
        return "$.plan.prefix_tokens"
    if source == "sweep":
        return "$.plan.prefix_sweep"
    if source == "use-case" and use_case is not None:
        return json_path(["plan", "corpus", "use_cases", use_case.key, "prefix_tokens"])
    return "$.plan.cases"


def bounds_refusals(
    plan: PlanInput, presets: Sequence[Preset], use_cases: Sequence[UseCase | None]
) -> list[Refusal]:
    """Every row's token counts against uint32 and its own ctx; one refusal per cause."""
    found: dict[tuple[str, str], tuple[Refusal, int]] = {}

    def add(code: str, where: str, message: str, hint: str) -> None:
        first, rows = found.get((code, where), (Refusal(code, where, message, hint), 0))
        found[(code, where)] = (first, rows + 1)

    lanes = plan.runtime_lane_count or max(plan.concurrency)
    lanes_where = "$.plan.runtime_lane_count" if plan.runtime_lane_count else "$.plan.concurrency"
    loop = prefix_loop(plan)
    requested = [p for p, _ in loop if p is not None]
    for loop_index, (explicit, explicit_source) in enumerate(loop):
        for use_case in use_cases:
            asked = requested or ([use_case.prefix_tokens] if use_case else [])
            for preset in presets:
                if preset.package_contract is not None and loop_index > 0:
                    continue  # planned once, at the first prefix
                prefix = effective_prefix(preset, explicit, explicit_source, use_case, asked)
                where = _prefix_where(plan, prefix.source, use_case)
                if prefix.source not in ("catalog", "package-contract") and (
                    prefix.tokens + CTX_HEADROOM > U32_MAX
                ):
                    add(
                        "planning.prefix_too_large",
                        where,
                        f"prefix {prefix.tokens} plus {CTX_HEADROOM} tokens of headroom is "
                        f"{prefix.tokens + CTX_HEADROOM}, more than {U32_MAX}",
                        f"use a prefix of at most {U32_MAX - CTX_HEADROOM} tokens",
                    )
                    continue
                if prefix.ctx > U32_MAX:
                    add(
                        "planning.ctx_too_large",
                        where,
                        f"{preset.key} would run with ctx {prefix.ctx}, more than {U32_MAX}",
                        "use a shorter prefix",
                    )
                    continue
                if prefix.tokens + 1 > prefix.ctx:
                    add(
                        "planning.prefix_exceeds_ctx",
                        where,
                        f"{preset.key}: prefix {prefix.tokens} and the token it generates do "
                        f"not fit in ctx {prefix.ctx}",
                        "use a shorter prefix or a catalog ctx that holds it",
                    )
                if plan.serving_ctx_size is None and prefix.ctx * lanes > U32_MAX:
                    add(
                        "planning.serving_ctx_too_large",
                        lanes_where,
                        f"{preset.key}: ctx {prefix.ctx} × {lanes} serving lanes is "
                        f"{prefix.ctx * lanes}, more than {U32_MAX}",
                        "use fewer lanes, a shorter prefix or an explicit serving_ctx_size",
                    )
                if prefix.ctx * plan.llama_parallel > U32_MAX:
                    add(
                        "planning.host_ctx_too_large",
                        "$.plan.llama_parallel",
                        f"{preset.key}: ctx {prefix.ctx} × llama_parallel "
                        f"{plan.llama_parallel} is {prefix.ctx * plan.llama_parallel}, "
                        f"more than {U32_MAX}",
                        "lower llama_parallel or use a shorter prefix",
                    )
    out = []
    for first, rows in found.values():
        if rows > 1:
            first = Refusal(
                first.code, first.path, f"{first.message} (and {rows - 1} more rows)", first.hint
            )
        out.append(first)
    return out


def _row_count(plan: PlanInput, presets: Sequence[Preset], use_cases: Sequence[object]) -> int:
    prefixes = len(prefix_loop(plan))
    packages = sum(1 for p in presets if p.package_contract is not None)
    return len(use_cases) * (prefixes * (len(presets) - packages) + packages)


@dataclass(frozen=True, slots=True)
class _Prefix:
    tokens: int
    ctx: int
    source: PrefixSource
    note: str | None


def effective_prefix(
    preset: Preset,
    explicit: int | None,
    explicit_source: PrefixSource | None,
    use_case: UseCase | None,
    requested_prefixes: Sequence[int],
) -> _Prefix:
    contract = preset.package_contract
    if contract is not None:
        note = None
        asked = sorted(set(requested_prefixes) - {contract.prefix_tokens})
        if asked:
            note = (
                f"layer package admission fixes ctx {contract.ctx} and prefix "
                f"{contract.prefix_tokens}; requested prefix(es) "
                f"{', '.join(map(str, asked))} not applied, row planned once"
            )
        return _Prefix(contract.prefix_tokens, contract.ctx, "package-contract", note)
    if explicit is not None and explicit_source is not None:
        tokens, source = explicit, explicit_source
    elif use_case is not None:
        tokens, source = use_case.prefix_tokens, "use-case"
    else:
        return _Prefix(preset.prefix_tokens, preset.ctx, "catalog", None)
    return _Prefix(tokens, max(preset.ctx, tokens + CTX_HEADROOM), source, None)


def output_relative(key: str, prefix_tokens: int, use_case: str | None) -> str:
    name = f"{key}-p{prefix_tokens}"
    return name if use_case is None else f"{use_case}/{name}"


def ladder(plan: PlanInput) -> list[Rung]:
    return [
        Rung(concurrency=c, requests=max(plan.concurrent_requests, c))
        for c in sorted(plan.concurrency)
    ]


def _tasks(
    plan: PlanInput,
    preset: Preset,
    ctx: int,
    present: bool,
    has_use_case: bool,
    native_output_tokens: int | None = None,
) -> RowTasks:
    package = preset.baseline_policy == "package-only"
    missing: SkipReason | None = None if present else "missing-model"
    baseline_skip: SkipReason | None = missing or (
        "layer-package-not-full-GGUF"
        if package
        else "skipped-by-request"
        if plan.skip_llama_server
        else None
    )
    paired_skip: SkipReason | None = missing or (
        "layer-package-not-full-GGUF"
        if package
        else "paired-servers-omitted"
        if plan.old_server is None or plan.new_server is None
        else None
    )
    rungs = ladder(plan)
    lanes = plan.runtime_lane_count or max(plan.concurrency)
    return RowTasks(
        correctness=CorrectnessTask(
            planned=present,
            skip_reason=missing,
            payload=preset.payload,
            stage_load_mode=preset.load_mode,
            state_layer_start=preset.state_layer_start,
            state_layer_end=preset.state_layer_end,
            state_stage_index=preset.state_stage_index,
            topologies=list(PACKAGE_TOPOLOGIES if package else RUNTIME_SLICE_TOPOLOGIES),
            admission="package" if package else "source",
            prompt_source="use-case" if has_use_case else "correctness-tool",
        ),
        serial_baseline=SerialBaselineTask(
            planned=baseline_skip is None, skip_reason=baseline_skip, runs=plan.llama_repeats
        ),
        concurrent_baseline=ConcurrentBaselineTask(
            planned=baseline_skip is None,
            skip_reason=baseline_skip,
            parallel=plan.llama_parallel,
            output_tokens=native_output_tokens or CONCURRENT_BASELINE_OUTPUT_TOKENS,
            rungs=rungs,
        ),
        paired_serving=PairedServingTask(
            planned=paired_skip is None,
            skip_reason=paired_skip,
            runtime_lanes=lanes,
            shared_ctx_size=plan.serving_ctx_size or ctx * lanes,
            output_tokens=plan.concurrent_output_tokens,
            rungs=rungs,
            ttft_slo_ms=plan.ttft_slo_ms,
            tpot_slo_ms=plan.tpot_slo_ms,
        ),
    )


def plan_rows(
    plan: PlanInput,
    catalog: Catalog,
    corpus: Corpus | None,
    observations: Mapping[str, ModelObservation],
    *,
    native_output_tokens: int | None = None,
) -> list[PreparedRow]:
    """Every planned row, in run order. ``observations`` holds one entry per selected key;
    ``native_output_tokens`` (preparation's ``--native-output-tokens``) replaces the native
    concurrent ladder's reference output length."""
    check_selection(plan, catalog, corpus)
    presets = selected_presets(plan, catalog)
    absent = [p.key for p in presets if p.key not in observations]
    if absent:
        raise Refused.one(
            "planning.unobserved_case",
            "$.plan.cases",
            f"no model observation for {', '.join(absent)}",
            "observe every selected case before planning",
        )
    use_cases = selected_use_cases(plan, corpus)
    loop = prefix_loop(plan)
    requested = [p for p, _ in loop if p is not None]
    rows: list[PreparedRow] = []
    seen: dict[str, int] = {}
    for loop_index, (explicit, explicit_source) in enumerate(loop):
        for use_case in use_cases:
            use_case_requested = requested or ([use_case.prefix_tokens] if use_case else [])
            for preset in presets:
                if preset.package_contract is not None and loop_index > 0:
                    continue  # the contract fixes the prefix: the first prefix planned it
                prefix = effective_prefix(
                    preset, explicit, explicit_source, use_case, use_case_requested
                )
                observation = observations[preset.key]
                relative = output_relative(
                    preset.key, prefix.tokens, use_case.key if use_case else None
                )
                if relative in seen:
                    raise Refused.one(
                        "planning.output_collision",
                        "$.plan",
                        f"rows {seen[relative]} and {len(rows)} both write {relative}",
                        "remove the repeated prefix or use case",
                    )
                seen[relative] = len(rows)
                rows.append(
                    PreparedRow(
                        index=len(rows),
                        key=preset.key,
                        family=preset.family,
                        model_id=preset.model_id,
                        payload=preset.payload,
                        load_mode=preset.load_mode,
                        artifact_kind=preset.artifact_kind,
                        baseline_policy=preset.baseline_policy,
                        synthetic=preset.synthetic,
                        use_case=use_case.key if use_case else None,
                        use_case_label=use_case.label if use_case else None,
                        prefix_tokens=prefix.tokens,
                        prefix_source=prefix.source,
                        prefix_note=prefix.note,
                        ctx=prefix.ctx,
                        n_gpu_layers=(
                            plan.n_gpu_layers
                            if plan.n_gpu_layers is not None
                            else preset.n_gpu_layers
                        ),
                        cache_hit_repeats=plan.cache_hit_repeats or preset.cache_hit_repeats,
                        layer_end=preset.layer_end,
                        activation_width=preset.activation_width,
                        kv_bytes_per_token=preset.kv_bytes_per_token,
                        output_relative=relative,
                        model_observation=observation,
                        tasks=_tasks(
                            plan,
                            preset,
                            prefix.ctx,
                            observation.present,
                            use_case is not None,
                            native_output_tokens,
                        ),
                    )
                )
    if len(rows) > MAX_ROWS:
        raise Refused.one(
            "planning.too_many_rows",
            "$.plan",
            f"the plan has {len(rows)} rows",
            "select fewer cases, use cases or prefixes",
        )
    return rows


# --- profiles ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeclaredServer:
    """The operator's OpenAI-compatible server as preparation pinned it (``openai_server``)."""

    binary: FilePinRecord
    tree: TreePinRecord
    source_commit: str
    serving: OpenAIServing


@dataclass(frozen=True, slots=True)
class ProfileInputs:
    """The observed pins and operator settings every profile is built from."""

    operator: OperatorInput
    tools: ToolPins
    native_build: TreePinRecord
    toolkit_directories: Mapping[str, TreePinRecord]
    old_server: FilePinRecord | None
    new_server: FilePinRecord | None
    openai_server: DeclaredServer | None = None


def artifact_profile(row: PreparedRow, tools: ToolPins) -> ArtifactProfile | None:
    """None for a single GGUF; else the artifact tool with the shard pins (package: none)."""
    if row.artifact_kind == "single-gguf":
        return None
    tool = tools.artifact_tool
    if tool is None:
        raise Refused.one(
            "preparation.artifact_tool_missing",
            "$.artifact_tool",
            f"{row.key} is a {row.artifact_kind} model but artifact_tool is null",
            "give the shard/package admission tool (skippy-package-builder)",
        )
    return ArtifactProfile(
        kind="complete-shards" if row.artifact_kind == "split-gguf" else "layer-package",
        tool=tool.path,
        tool_sha256=tool.sha256,
        shard_pins=list(row.model_observation.shard_pins),
    )


def _host(
    kind: HostProfileName,
    binary: FilePinRecord,
    commit: str,
    row: PreparedRow,
    artifact: ArtifactProfile | None,
    inputs: ProfileInputs,
    toolkits: dict[str, ToolkitPin],
    *,
    declared: DeclaredServer | None = None,
) -> HostProfile:
    """A host profile of ``row``'s model; a declared server runs from its own tree."""
    observation = row.model_observation
    assert observation.runtime_entrypoint is not None and observation.sha256 is not None
    cell = inputs.operator.cell_seconds
    tree = declared.tree if declared is not None else inputs.native_build
    return HostProfile(
        schema_version=1,
        host=kind,
        binary=binary.path,
        binary_sha256=binary.sha256,
        source_commit=commit,
        native_build=tree.path,
        native_build_sha256=tree.sha256,
        model=observation.runtime_entrypoint,
        model_sha256=observation.sha256,
        artifact=artifact,
        model_id=row.model_id,
        layer_end=row.layer_end,
        ctx_size=row.ctx,
        lane_count=1,
        n_gpu_layers=row.n_gpu_layers,
        port=1,
        environment=dict(inputs.operator.environment),
        toolkit_directories=toolkits,
        worker={},
        startup_timeout_secs=min(max(cell - STARTUP_MARGIN_SECONDS, 1), STARTUP_MAX_SECONDS),
        execution_timeout_secs=cell,
        openai=declared.serving if declared is not None else None,
    )


def build_profiles(rows: Sequence[PreparedRow], inputs: ProfileInputs) -> dict[str, CaseProfiles]:
    """One profile set per present key, from that key's first row (rows override per row)."""
    operator = inputs.operator
    toolkits = {
        name: ToolkitPin(path=pin.path, sha256=pin.sha256)
        for name, pin in sorted(inputs.toolkit_directories.items())
    }
    cell = operator.cell_seconds
    profiles: dict[str, CaseProfiles] = {}
    for row in rows:
        observation = row.model_observation
        if not observation.present or row.key in profiles:
            continue
        assert observation.runtime_entrypoint is not None and observation.sha256 is not None
        artifact = artifact_profile(row, inputs.tools)
        package = row.baseline_policy == "package-only"

        native_tool = inputs.tools.native_server
        declared = inputs.openai_server
        profiles[row.key] = CaseProfiles(
            correctness=CorrectnessProfile(
                schema_version=1,
                case_key=row.key,
                model_id=row.model_id,
                correctness=inputs.tools.correctness.path,
                correctness_sha256=inputs.tools.correctness.sha256,
                stage_server=inputs.tools.stage_server.path,
                stage_server_sha256=inputs.tools.stage_server.sha256,
                model=observation.runtime_entrypoint,
                model_sha256=observation.sha256,
                artifact=artifact,
                native_build=inputs.native_build.path,
                native_build_sha256=inputs.native_build.sha256,
                ctx_size=row.ctx,
                prefix_tokens=row.prefix_tokens,
                cache_hit_repeats=row.cache_hit_repeats,
                runtime_lane_count=operator.plan.runtime_lane_count or 1,
                source_port=1,
                restore_port=2,
                n_gpu_layers=row.n_gpu_layers,
                prompt=None,
                topologies=list(row.tasks.correctness.topologies),
                borrow_resident_hits=operator.borrow_resident_hits,
                cache_decoded_result_hits=operator.cache_decoded_result_hits,
                execution_seconds=cell,
                cell_seconds=max(cell - CORRECTNESS_MARGIN_SECONDS, 1),
                settings=dict(operator.environment),
                toolkit_directories=toolkits,
                layer_end=row.layer_end,
                activation_width=row.activation_width,
                payload=row.payload,
                stage_load_mode=row.load_mode,
                state_layer_start=row.tasks.correctness.state_layer_start,
                state_layer_end=row.tasks.correctness.state_layer_end,
                state_stage_index=row.tasks.correctness.state_stage_index,
            ),
            native=(
                _host(
                    NATIVE_PROFILE,
                    native_tool,
                    operator.native_source_commit,
                    row,
                    artifact,
                    inputs,
                    toolkits,
                )
                if native_tool is not None and not package
                else None
            ),
            old=(
                _host(
                    OLD_PROFILE,
                    inputs.old_server,
                    operator.old_source_commit,
                    row,
                    artifact,
                    inputs,
                    toolkits,
                )
                if inputs.old_server is not None and not package
                else None
            ),
            new=(
                _host(
                    NEW_PROFILE,
                    inputs.new_server,
                    operator.new_source_commit,
                    row,
                    artifact,
                    inputs,
                    toolkits,
                )
                if inputs.new_server is not None and not package
                else None
            ),
            openai=(
                _host(
                    OPENAI_PROFILE,
                    declared.binary,
                    declared.source_commit,
                    row,
                    artifact,
                    inputs,
                    toolkits,
                    declared=declared,
                )
                if declared is not None and not package
                else None
            ),
        )
    return profiles
