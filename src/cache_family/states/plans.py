"""What a row, its cells and its correctness arm will do, decided from the prepared input alone
(no I/O): the arm list, each cell's plan with its pins, the correctness plan, and the host's
exact command line. The actors in ``actors/run/`` perform these plans."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from cache_family.schemas.arms import (
    CORRECTNESS,
    NATIVE_CONCURRENT,
    NATIVE_SERIAL,
    OPENAI_CONCURRENT,
    OPENAI_PROFILE,
    OPENAI_WORKLOAD_ARMS,
    PAIRED_ARMS,
    STAGE_WORKLOAD_ARMS,
    WORKLOAD_ARMS,
    Arm,
    HostKind,
    MeasurementKind,
    arm_named,
)
from cache_family.schemas.host_kinds import HostKindFacts, TaskSource, host_kind_facts
from cache_family.schemas.journal import ArmPlan, RowOpened, RungPlan
from cache_family.schemas.prepared import HostProfile, PreparedInput, PreparedRow, SkipReason
from cache_family.schemas.workload import WorkloadFile, WorkloadsPin
from cache_family.states.chat_pieces import CHAT_ALPHABET
from cache_family.states.correctness import CorrectnessSpec
from cache_family.states.handoff import PACKAGE_LAYER_COUNT
from cache_family.states.workloads import CHAT_TEMPLATE_ROOM_PER_MESSAGE, chat_starts_needed

CORRECTNESS_NOT_STARTED: Final = "correctness_not_started"

# Journaled as the prompt's origin, so a reader knows why this text was used.
SOURCE_USE_CASE: Final = "use-case"
SOURCE_FIXED_CORPUS_ENTRY: Final = "fixed-corpus-entry"
SOURCE_CORRECTNESS: Final = "correctness-benchmark-prompt"

# How the plan's skip reasons read in a row's arm list.
_UNPLANNED: Final[dict[str, tuple[str, str]]] = {
    "layer-package-not-full-GGUF": (
        "unavailable",
        "package-only model: no full GGUF, so no monolithic baseline",
    ),
    "skipped-by-request": ("skipped", "skip_llama_server is set in the plan"),
    "missing-model": ("skipped", "missing-model"),
    "paired-servers-omitted": ("skipped", "paired-servers-omitted"),
}


@dataclass(frozen=True, slots=True)
class PromptChoice:
    """The source text of one row's benchmark prompt and where it came from."""

    text: str
    source: str  # correctness-benchmark-prompt | use-case | fixed-corpus-entry
    corpus_path: str
    corpus_sha256: str
    entry_key: str

    @property
    def label(self) -> str:
        """The origin in one line, e.g. ``fixed-corpus-entry tool_calling@/…/use-cases.json``."""
        return f"{self.source} {self.entry_key}@{self.corpus_path}"


def accepted_prompt(text: str, topology: str) -> PromptChoice:
    """The correctness arm's accepted benchmark prompt, used as is (never cut again)."""
    return PromptChoice(
        text=text, source=SOURCE_CORRECTNESS, corpus_path="", corpus_sha256="", entry_key=topology
    )


@dataclass(frozen=True, slots=True)
class PinTarget:
    """One pinned thing a cell re-hashes before launch and after its ladder."""

    name: str
    path: str
    expected_sha256: str
    kind: Literal["file", "tree"]


def thread_setting(environment: Mapping[str, str]) -> str | None:
    """OMP_NUM_THREADS when it is a positive whole number, else None.

    A thread count is a setting, not a secret: it is given to llama-server as ``-t`` and to
    the correctness oracle's llama.cpp contexts.
    """
    value = environment.get("OMP_NUM_THREADS")
    return value if value and value.isdigit() and int(value) > 0 else None


def argv_sha256(argv: Sequence[str]) -> str:
    return hashlib.sha256(json.dumps(list(argv), separators=(",", ":")).encode()).hexdigest()


# --- the plan of one cell ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CellPlan:
    cell_id: str  # e.g. cell-0003/native-serial
    cell_dir: str  # relative to the run dir, e.g. cell-0003/sweep-native-concurrent
    row_index: int
    row_key: str
    # Its name, directory, cohort, measurement kind and host kind.
    arm: Arm
    rungs: tuple[RungPlan, ...]
    output_tokens: int
    lanes: int
    # The host's --ctx-size: the row's context times the lanes (one row context per slot).
    ctx_size: int
    n_gpu_layers: int
    prefix_tokens: int
    ttft_slo_ms: float | None
    tpot_slo_ms: float | None
    # None: the prepared input has no host profile for the case (the cell is refused).
    profile: HostProfile | None
    prompt: PromptChoice
    pins: tuple[PinTarget, ...]
    # A reason this cell must not launch although planned (pins disagree with the plan).
    refusal: str | None = None
    # The row's preset is from a synthetic catalog (journaled so the cell's receipt says so).
    synthetic: bool = False
    # The model's GGUF ``general.architecture``: which cache reuse rule judges its rungs.
    architecture: str | None = None
    # Tokens of the correctness arm's accepted prompt (its tool's count: K + 1).
    prompt_tokens: int | None = None
    model_id: str = ""
    # The row's last cell: its post-verify hashes every pinned file in full (the row's
    # ``RowPins`` otherwise checks only identities between its first and last hash).
    last_of_row: bool = False
    # A workload arm's workload file (the prepared input's pin); None for every other arm.
    workloads: WorkloadFile | None = None
    # The host's ``--cache-ram`` (MiB): 0 for workloads that judge slot reuse, so no host-side
    # prompt cache restores what the slots no longer hold. None: llama-server's default.
    cache_ram_mib: int | None = None
    # The SHA-256 of the workload file's bytes, as the prepared input pinned them.
    workloads_sha256: str = ""

    @property
    def serial(self) -> bool:
        return self.arm.serial

    @property
    def host_kind(self) -> HostKind:
        assert self.arm.host_kind is not None  # a cell plan is only made for a host arm
        return self.arm.host_kind


def pin_targets(profile: HostProfile) -> tuple[PinTarget, ...]:
    """Server binary, native build tree, model (every shard of a split one), toolkit trees."""
    targets = [
        PinTarget("binary", profile.binary, profile.binary_sha256, "file"),
        PinTarget("native_build", profile.native_build, profile.native_build_sha256, "tree"),
        PinTarget("model", profile.model, profile.model_sha256, "file"),
    ]
    if profile.artifact is not None:
        for shard in profile.artifact.shard_pins:
            targets.append(
                PinTarget(f"shard:{shard.name}", shard.logical_path, shard.sha256, "file")
            )
    for name, toolkit in sorted(profile.toolkit_directories.items()):
        targets.append(PinTarget(f"toolkit:{name}", toolkit.path, toolkit.sha256, "tree"))
    return tuple(targets)


def llama_server_argv(plan: CellPlan, binary: str, port: int) -> list[str]:
    """The native host's exact command line (tools/server flags of the vendored llama.cpp)."""
    profile = plan.profile
    assert profile is not None  # pin-verify refuses a cell without one
    argv = [
        binary,
        "--model",
        profile.model,
        "--ctx-size",
        str(plan.ctx_size),
        "--n-gpu-layers",
        str(plan.n_gpu_layers),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--parallel",
        str(plan.lanes),
        "--no-webui",
        # Prometheus counters at /metrics, read around every rung and workload point.
        "--metrics",
    ]
    # The operator's OMP_NUM_THREADS, also given to llama-server as ``-t``.
    threads = thread_setting(profile.environment)
    if threads is not None:
        argv += ["-t", threads]
    if plan.cache_ram_mib is not None:
        argv += ["--cache-ram", str(plan.cache_ram_mib)]
    return argv


# --- the plan of one row ----------------------------------------------------------------------


def row_dir_name(index: int) -> str:
    return f"cell-{index:04d}"


def _arm_plan(arm: Arm, planned: bool, skip_reason: SkipReason | None) -> ArmPlan:
    if planned:
        return ArmPlan(arm=arm.name)
    status, reason = _UNPLANNED.get(skip_reason or "", ("skipped", skip_reason or "not planned"))
    return ArmPlan(arm=arm.name, status=status, reason=reason)


def arm_plans(row: PreparedRow) -> tuple[ArmPlan, ...]:
    """The row's host arms in run order: the two native baselines always (planned, or skipped
    with the plan's reason), the paired arms only when paired serving is planned."""
    tasks = row.tasks
    serial, concurrent = tasks.serial_baseline, tasks.concurrent_baseline
    arms = [
        _arm_plan(NATIVE_SERIAL, serial.planned, serial.skip_reason),
        _arm_plan(NATIVE_CONCURRENT, concurrent.planned, concurrent.skip_reason),
    ]
    if tasks.paired_serving.planned:
        # Planned only when both old and new servers are bound (the plan's rule).
        arms += [ArmPlan(arm=arm.name) for arm in PAIRED_ARMS]
    return tuple(arms)


def workload_arm_plans(prepared: PreparedInput, row: PreparedRow) -> tuple[ArmPlan, ...]:
    """The workload arms a row runs after its host arms: one per workload the prepared
    input's workload file chooses (none without one), on the native host; skipped with the
    native baseline's reason when that host is not planned for the row. The overlap sweep
    also runs on the old and new stage servers (their chat dialect) when both are bound."""
    pin = prepared.workloads
    if pin is None:
        return ()
    native = row.tasks.concurrent_baseline
    plans = [
        _arm_plan(arm, native.planned, native.skip_reason)
        for arm in WORKLOAD_ARMS
        if _chosen(pin, arm)
    ]
    if row.tasks.paired_serving.planned:
        # As the paired host arms: only when both old and new stage servers are bound.
        plans += [
            _chat_workload_plan(arm, pin, row) for arm in STAGE_WORKLOAD_ARMS if _chosen(pin, arm)
        ]
    return tuple(plans)


def _chosen(pin: WorkloadsPin, arm: Arm) -> bool:
    """Whether the workload file chooses the workload ``arm`` measures."""
    chosen = {
        MeasurementKind.PREFIX_OVERLAP: pin.workloads.prefix_overlap,
        MeasurementKind.SESSIONS: pin.workloads.multi_turn,
        MeasurementKind.OPEN_LOOP: pin.workloads.open_loop,
        MeasurementKind.TRACE: pin.workloads.trace,
    }
    return chosen[arm.kind] is not None


def declared_arm_plans(prepared: PreparedInput, row: PreparedRow) -> tuple[ArmPlan, ...]:
    """The arms of a declared OpenAI-compatible server, after every other arm, only for a case
    whose prepared profiles hold one (none otherwise, so such a run journals what it did
    before): its ladder, sized and skipped as the native baseline's so the two pair rung for
    rung, then each workload the workload file chooses, in its chat dialect as the stage
    servers send them (skipped with the native baseline's reason when that is not planned)."""
    profiles = prepared.profile(row.key)
    if profiles is None or profiles.host(OPENAI_PROFILE) is None:
        return ()
    native = row.tasks.concurrent_baseline
    plans = [_arm_plan(OPENAI_CONCURRENT, native.planned, native.skip_reason)]
    pin = prepared.workloads
    if pin is None:
        return tuple(plans)
    for arm in OPENAI_WORKLOAD_ARMS:
        if not _chosen(pin, arm):
            continue
        planned = _arm_plan(arm, native.planned, native.skip_reason)
        plans.append(planned if planned.status != "planned" else _chat_workload_plan(arm, pin, row))
    return tuple(plans)


def _chat_workload_plan(arm: Arm, pin: WorkloadsPin, row: PreparedRow) -> ArmPlan:
    """A workload in the chat dialect: its text prompts each start with a character of their
    own, so a workload needing more than the chat alphabet holds is skipped, saying so, rather
    than faulting its cells. The trace replay writes each distinct hash id of its window as a
    message of its own: on a synthetic (zoo) row, whose GGUF has a byte-level vocabulary and so
    the byte alphabet as its chat pieces, a window with more ids than that is skipped, as the
    replay would refuse it (``trace.vocabulary``). Another model's pieces are chosen from its
    vocabulary as the cell opens (word pieces hold at least ``MIN_WORD_PIECES``), so only the
    replay can tell; so can it for a pin without the count."""
    if arm.kind != MeasurementKind.TRACE:
        needed = chat_starts_needed(pin.workloads, arm.kind)
        if needed <= len(CHAT_ALPHABET):
            return ArmPlan(arm=arm.name)
        reason = (
            f"workload.overlap.vocabulary: the chat dialect's {arm.kind.value} needs "
            f"{needed} distinct first characters, the alphabet has {len(CHAT_ALPHABET)}"
        )
        return ArmPlan(arm=arm.name, status="skipped", reason=reason)
    needed = chat_starts_needed(pin.workloads, arm.kind, pin.trace_distinct_ids)
    if not row.synthetic or needed <= len(CHAT_ALPHABET):
        return ArmPlan(arm=arm.name)
    reason = (
        f"trace.vocabulary: the chat dialect's trace window has {pin.trace_distinct_ids} "
        f"distinct hash ids, needing {needed} distinct first characters with the template's "
        f"calibration; the byte alphabet of a synthetic model's chat pieces has "
        f"{len(CHAT_ALPHABET)}"
    )
    return ArmPlan(arm=arm.name, status="skipped", reason=reason)


def _workload_sizes(
    workloads: WorkloadFile, arm: Arm, row: PreparedRow, lanes: int
) -> tuple[int, int, int, int | None]:
    """(output tokens, slots, --ctx-size, --cache-ram) of a workload arm's host. Overlap: a
    slot per prefix group (on a stage server too: its ``stage.json`` lanes and context); sessions:
    a slot per user (each request names its slot); both without the host-side prompt cache.
    Open loop: the concurrent host of the arm's kind, ``lanes`` (the native baseline's, or the
    paired stage servers' lanes)."""
    margin = 8
    if arm.kind == MeasurementKind.PREFIX_OVERLAP:
        overlap = workloads.prefix_overlap
        assert overlap is not None  # planned only when chosen
        per_slot = overlap.prompt_tokens + overlap.output_tokens + margin
        return overlap.output_tokens, overlap.groups, per_slot * overlap.groups, 0
    if arm.kind == MeasurementKind.SESSIONS:
        sessions = workloads.multi_turn
        assert sessions is not None
        longest = (
            sessions.system_prompt_tokens
            + sessions.user_context_tokens
            + sessions.turns * (sessions.question_tokens + sessions.answer_tokens)
        )
        if _facts(arm).wraps_prompt_in_template:
            # Room for the chat template around each message (system, then two per turn).
            longest += CHAT_TEMPLATE_ROOM_PER_MESSAGE * (1 + 2 * sessions.turns)
        return sessions.answer_tokens, sessions.users, (longest + margin) * sessions.users, 0
    if arm.kind == MeasurementKind.TRACE:
        # As open loop; the replay refuses a windowed request whose scaled prompt and answer
        # do not fit one slot (``trace.length.beyond_context``).
        trace = workloads.trace
        assert trace is not None
        return trace.output_tokens_cap, lanes, row.ctx * lanes, None
    arrivals = workloads.open_loop
    assert arrivals is not None
    return arrivals.output_tokens, lanes, row.ctx * lanes, None


def row_opened_record(
    *,
    row_index: int,
    row_key: str,
    case_key: str,
    prefix_tokens: int,
    use_case: str | None,
    row_dir: str,
    present: bool,
    arms: tuple[ArmPlan, ...],
    synthetic: bool,
    load_average: tuple[float, float, float] | None = None,
) -> RowOpened:
    """``row_opened`` as every row journals it: its correctness arm not run yet (its own
    records replace this once it ran), or never, because the model is missing."""
    return RowOpened(
        row_index=row_index,
        row_key=row_key,
        case_key=case_key,
        prefix_tokens=prefix_tokens,
        use_case=use_case,
        row_dir=row_dir,
        model_status="present" if present else "missing-model",
        arms=arms,
        correctness_status="not-run",
        correctness_reason=CORRECTNESS_NOT_STARTED if present else "missing-model",
        synthetic=synthetic,
        load_average=load_average,
    )


def _facts(arm: Arm) -> HostKindFacts:
    assert arm.host_kind is not None  # only a host arm has a host profile and a cell plan
    return host_kind_facts(arm.host_kind)


def host_profile(
    prepared: PreparedInput, row: PreparedRow, arm: Arm
) -> tuple[HostProfile | None, str | None]:
    """The case's host profile for ``arm`` and, if it disagrees with the plan, why."""
    facts = _facts(arm)
    assert arm.profile is not None  # a host arm names its profile
    profiles = prepared.profile(row.key)
    profile = profiles.host(arm.profile) if profiles is not None else None
    subject = facts.profile_word or arm.name
    if profile is None:
        return None, f"the prepared input has no {subject} host profile for this case"
    observed = row.model_observation.sha256
    if profile.model_sha256 != observed:
        return profile, (
            f"{subject} profile pins model {profile.model_sha256}, "
            f"{facts.model_disagreement} {observed}"
        )
    server = prepared.tools.native_server if facts.server_tool == "native_server" else None
    if server is not None and profile.binary_sha256 != server.sha256:
        return profile, (
            f"{subject} profile pins server {profile.binary_sha256}, "
            f"preparation pinned {server.sha256}"
        )
    return profile, None


def exec_pairs(
    prepared: PreparedInput, row: PreparedRow, arms: Sequence[ArmPlan]
) -> list[tuple[str, str | None]]:
    """(binary, native build) of each planned host arm that has a usable profile."""
    pairs: list[tuple[str, str | None]] = []
    for plan in arms:
        if plan.status != "planned":
            continue
        profile, refusal = host_profile(prepared, row, _host_arm(plan.arm))
        if profile is not None and refusal is None:
            pairs.append((profile.binary, profile.native_build))
    return pairs


def _host_arm(name: str) -> Arm:
    return arm_named(name)


@dataclass(frozen=True, slots=True)
class _HostSizes:
    """What the prepared tasks of an arm's host kind give its cell (before a workload's own)."""

    rungs: tuple[RungPlan, ...]
    output_tokens: int
    lanes: int
    ctx_size: int
    ttft_slo_ms: float
    tpot_slo_ms: float
    # The model id requests name ("": the host serves one model and needs none).
    model_id: str


def _baseline_sizes(
    prepared: PreparedInput, row: PreparedRow, arm: Arm, profile: HostProfile | None
) -> _HostSizes:
    """The native baselines: the serial runs or the concurrent ladder on ``--parallel`` slots."""
    concurrent = row.tasks.concurrent_baseline
    if arm.serial:
        serial = row.tasks.serial_baseline
        rungs: tuple[RungPlan, ...] = (RungPlan(concurrency=1, requests=serial.runs),)
        output_tokens = serial.output_tokens
    else:
        rungs = tuple(
            RungPlan(concurrency=r.concurrency, requests=r.requests) for r in concurrent.rungs
        )
        output_tokens = concurrent.output_tokens
    return _HostSizes(
        rungs=rungs,
        output_tokens=output_tokens,
        lanes=concurrent.parallel,
        # llama-server splits --ctx-size across its --parallel slots (no unified KV when
        # the slot count is explicit), so every slot gets the row's context this way.
        ctx_size=row.ctx * concurrent.parallel,
        ttft_slo_ms=float(prepared.plan.ttft_slo_ms),
        tpot_slo_ms=float(prepared.plan.tpot_slo_ms),
        # llama-server serves its one model to any request; an OpenAI server by its name.
        model_id=profile.model_id if profile is not None and _facts(arm).names_model else "",
    )


def _paired_sizes(
    _prepared: PreparedInput, row: PreparedRow, _arm: Arm, profile: HostProfile | None
) -> _HostSizes:
    """The paired serving task: one retained host across the whole ordered ladder, its runtime
    lanes sharing one context, requests naming the profile's model id."""
    paired = row.tasks.paired_serving
    return _HostSizes(
        rungs=tuple(RungPlan(concurrency=r.concurrency, requests=r.requests) for r in paired.rungs),
        output_tokens=paired.output_tokens,
        lanes=paired.runtime_lanes,
        ctx_size=paired.shared_ctx_size,
        ttft_slo_ms=float(paired.ttft_slo_ms),
        tpot_slo_ms=float(paired.tpot_slo_ms),
        model_id=profile.model_id if profile is not None else row.model_id,
    )


_SIZES: Final[
    Mapping[TaskSource, Callable[[PreparedInput, PreparedRow, Arm, HostProfile | None], _HostSizes]]
] = {"baselines": _baseline_sizes, "paired": _paired_sizes}


def cell_plan(
    prepared: PreparedInput,
    row: PreparedRow,
    arm: Arm,
    prompt: PromptChoice,
    prompt_tokens: int | None,
) -> CellPlan:
    """One host session of ``arm``: its rungs, sizes and pins, sized by the prepared tasks of
    its host kind."""
    row_dir = row_dir_name(row.index)
    profile, refusal = host_profile(prepared, row, arm)
    sizes = _SIZES[_facts(arm).sized_by](prepared, row, arm, profile)
    rungs, output_tokens, lanes, ctx_size = (
        sizes.rungs,
        sizes.output_tokens,
        sizes.lanes,
        sizes.ctx_size,
    )
    workloads = prepared.workloads.workloads if prepared.workloads is not None else None
    cache_ram: int | None = None
    if arm.workload:
        assert workloads is not None  # a workload arm is planned only with a workload file
        rungs = ()
        output_tokens, lanes, ctx_size, cache_ram = _workload_sizes(workloads, arm, row, lanes)
    return CellPlan(
        cell_id=f"{row_dir}/{arm.name}",
        cell_dir=f"{row_dir}/{arm.directory}",
        row_index=row.index,
        row_key=row.output_relative,
        arm=arm,
        rungs=rungs,
        output_tokens=output_tokens,
        lanes=lanes,
        ctx_size=ctx_size,
        n_gpu_layers=row.n_gpu_layers,
        prefix_tokens=row.prefix_tokens,
        ttft_slo_ms=sizes.ttft_slo_ms,
        tpot_slo_ms=sizes.tpot_slo_ms,
        profile=profile,
        prompt=prompt,
        pins=pin_targets(profile) if profile is not None else (),
        refusal=refusal,
        synthetic=row.synthetic,
        architecture=row.model_observation.architecture,
        prompt_tokens=prompt_tokens,
        model_id=sizes.model_id,
        workloads=workloads if arm.workload else None,
        cache_ram_mib=cache_ram,
        workloads_sha256=prepared.workloads.sha256
        if arm.workload and prepared.workloads is not None
        else "",
    )


@dataclass(frozen=True, slots=True)
class CorrectnessPlan:
    row_index: int
    arm_dir: str  # relative to the run dir: cell-NNNN/correctness
    spec: CorrectnessSpec
    operator_env: Mapping[str, str]
    toolkits: Mapping[str, str]
    native_build: str
    pins: tuple[PinTarget, ...]
    # Why the arm cannot run at all (no profile, profile disagrees with the plan).
    refusal: str | None = None

    @property
    def subject(self) -> str:
        return f"{self.arm_dir}"


def correctness_plan(
    prepared: PreparedInput, row: PreparedRow, prompt: str | None
) -> CorrectnessPlan:
    """The correctness arm of a row: the case's profile, the row's own sizes. ``prompt``: the
    row's use-case prompt, handed to the tool (None: the tool's own)."""
    profiles = prepared.profile(row.key)
    task = row.tasks.correctness
    refusal: str | None = None
    if profiles is None:
        refusal = "correctness_profile_missing: the prepared input has no profile for the case"
    profile = profiles.correctness if profiles is not None else None
    if profile is not None:
        if profile.case_key != row.key:
            refusal = f"correctness_profile_mismatch: profile is for {profile.case_key}"
        elif profile.model_sha256 != row.model_observation.sha256:
            refusal = "correctness_profile_mismatch: the profile pins another model"
        elif profile.correctness_sha256 != prepared.tools.correctness.sha256:
            refusal = "correctness_profile_mismatch: the profile pins another tool"
    spec = CorrectnessSpec(
        tool=profile.correctness if profile else prepared.tools.correctness.path,
        model=profile.model if profile else "",
        model_id=row.model_id,
        stage_server=profile.stage_server if profile else prepared.tools.stage_server.path,
        layer_end=row.layer_end,
        ctx_size=row.ctx,
        n_gpu_layers=row.n_gpu_layers,
        activation_width=row.activation_width,
        load_mode=row.load_mode,
        payload=row.payload,
        prefix_tokens=row.prefix_tokens,
        repeats=row.cache_hit_repeats,
        lanes=profile.runtime_lane_count if profile else 1,
        borrow_resident_hits=profile.borrow_resident_hits if profile else False,
        cache_decoded_result_hits=profile.cache_decoded_result_hits if profile else False,
        prompt=prompt,
        topologies=tuple(task.topologies),
        # The synthetic zoo's package has its own layer count; a real one is DeepSeek3's.
        package_layer_count=row.layer_end if row.synthetic else PACKAGE_LAYER_COUNT,
    )
    pins: tuple[PinTarget, ...] = ()
    if profile is not None:
        pins = (
            PinTarget("correctness", profile.correctness, profile.correctness_sha256, "file"),
            PinTarget("stage_server", profile.stage_server, profile.stage_server_sha256, "file"),
            # The pinned file: a layer package is pinned by its manifest.
            PinTarget(
                "model",
                row.model_observation.pinned_file or profile.model,
                profile.model_sha256,
                "file",
            ),
            *(
                PinTarget(f"shard:{shard.name}", shard.logical_path, shard.sha256, "file")
                for shard in (profile.artifact.shard_pins if profile.artifact else ())
            ),
            PinTarget("native_build", profile.native_build, profile.native_build_sha256, "tree"),
            *(
                PinTarget(f"toolkit:{name}", pin.path, pin.sha256, "tree")
                for name, pin in sorted(profile.toolkit_directories.items())
            ),
        )
    return CorrectnessPlan(
        row_index=row.index,
        arm_dir=f"{row_dir_name(row.index)}/{CORRECTNESS.directory}",
        spec=spec,
        operator_env=dict(profile.settings) if profile else {},
        toolkits={n: p.path for n, p in profile.toolkit_directories.items()} if profile else {},
        native_build=profile.native_build if profile else prepared.native_build.path,
        pins=pins,
        refusal=refusal,
    )
