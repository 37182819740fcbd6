"""The journal's records: one frozen, tagged msgspec Struct per kind of line, and their union.

Free-text fields (fault kinds, budgets, arms) are plain strings rather than literals so that a
newer writer's vocabulary never makes an older journal unreadable; the fold interprets them.
"""

from __future__ import annotations

from typing import ClassVar, Final, TypeAlias, get_args

import msgspec

from cache_family.schemas import arms
from cache_family.schemas.host_identity import HostIdentity
from cache_family.schemas.measurement import (
    CacheExpectation,
    ClientCalibration,
    HostCleanup,
    RungFacts,
)
from cache_family.schemas.server_metrics import CounterDelta, TokenSums
from cache_family.schemas.workload_records import (
    ChatTemplateMeasured,
    OpenLoopStageMeasured,
    OverlapPointMeasured,
    ReuseProbed,
    SessionsMeasured,
    TraceReplayed,
    TraceRequestReplayed,
    WorkloadOpened,
    WorkloadStopped,
)


class _Record(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", forbid_unknown_fields=True
):
    """What every record shares: its ``type`` tag, and how records may evolve.

    Records are frozen and keyword-only; a new field gets a default and goes last; no field
    is renamed, retyped or reordered; a new record type gets a new tag. An older reader
    meeting a newer tag refuses it with ``journal.record.unknown_type`` instead of crashing,
    and one meeting a field it does not know refuses it with ``journal.record.unknown_field``:
    every struct of a line forbids unknown fields, because a field replay cannot see is a
    field it cannot vouch for (an edited, re-chained journal could otherwise carry anything).
    """

    # State changes are flushed and fsynced before the writer acknowledges them.
    durable: ClassVar[bool] = False


class RungPlan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    concurrency: int
    requests: int


class ArmPlan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One arm of a row as planned: ``planned``, or why it will not run."""

    arm: str
    status: str = "planned"  # planned | skipped | unavailable
    reason: str | None = None


class UseCaseSourceBrief(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where a use case's prompt came from (the report's prompt-sources table)."""

    dataset: str | None = None
    config: str | None = None
    split: str | None = None
    row_idx: int | None = None


class PlannedRowBrief(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One planned row as ``run_started`` names it, so the journal alone holds the whole plan."""

    index: int
    case: str
    prefix_tokens: int
    use_case: str | None
    model_status: str
    output_relative: str
    # The row's preset is from a synthetic (zoo) catalog: plumbing evidence only.
    synthetic: bool = False
    # What the row's production-cache-bench.json entry names (the plan cell's effective
    # catalog case and use case). Journals written before these were recorded read as empty.
    family: str = ""
    model_id: str = ""
    payload: str = ""
    stage_load_mode: str = ""
    use_case_label: str | None = None
    resident_kv_bytes_per_token: int | None = None
    use_case_source: UseCaseSourceBrief | None = None


# --- run level ---------------------------------------------------------------------------


class RunStarted(_Record, tag="run_started", frozen=True, kw_only=True):
    durable: ClassVar[bool] = True
    run_id: str
    request_sha256: str
    catalog_sha256: str
    tool_version: str = ""
    # The prepared input the run was admitted with (its bytes are ``request_sha256``).
    input_path: str = ""
    # The run's budgets as prepared; None in journals written before they were recorded.
    execution_seconds: int | None = None
    cell_seconds: int | None = None
    request_timeout_ms: int | None = None
    # The operator's thread count (OMP_NUM_THREADS, also every host's ``-t``), only when it is
    # a positive whole number: no other environment value is ever journaled.
    operator_threads: str | None = None
    planned_rows: tuple[PlannedRowBrief, ...] = ()
    # The catalog that planned the rows (its bytes are ``catalog_sha256``): its path, whether
    # it is a synthetic (tiny random-weight zoo) catalog, and whether it is the packaged one.
    # Journals written before these were recorded read as "", False, False.
    catalog_path: str = ""
    catalog_synthetic: bool = False
    catalog_packaged: bool = False
    # The runner process itself (pid and psutil create time), so that `replay --reap` can
    # refuse while the run is still going. None in journals written before they were recorded.
    runner_pid: int | None = None
    runner_create_time: float | None = None
    # The machine the run measured on and its load average (1, 5, 15 min) when it started:
    # what a real model's figures name beside them. None in journals written before.
    host: HostIdentity | None = None
    load_average: tuple[float, float, float] | None = None


class RowsSelected(_Record, tag="rows_selected", frozen=True, kw_only=True):
    """The run runs only some rows of its prepared input (``run --rows`` or ``--shard``);
    journaled right after ``run_started``, only then, so a whole run's journal is unchanged.

    It binds the prepared input's bytes and the row set: ``run_started.planned_rows`` holds the
    selected rows and ``unselected_rows`` the rest of the plan, so a campaign merging shards
    knows the whole plan from any one of them. Keys are ``states/selection.row_key``'s."""

    durable: ClassVar[bool] = True
    prepared_sha256: str
    how: str  # rows | shard
    row_keys: tuple[str, ...]
    shard_index: int | None = None
    shard_count: int | None = None
    unselected_rows: tuple[PlannedRowBrief, ...] = ()
    # The machine that ran the selected rows (the campaign's merge names it for each row).
    host: HostIdentity | None = None


class Cancellation(_Record, tag="cancellation", frozen=True, kw_only=True):
    """Cancellation seen (SIGINT/SIGTERM). ``cell_id`` None: the whole run."""

    durable: ClassVar[bool] = True
    cell_id: str | None = None
    signal: str = ""
    detail: str = ""


class DeadlineExpired(_Record, tag="deadline_expired", frozen=True, kw_only=True):
    durable: ClassVar[bool] = True
    cell_id: str | None = None
    budget: str = "execution"  # execution | cell | request
    detail: str = ""


class InterruptFinishFailed(_Record, tag="interrupt_finish_failed", frozen=True, kw_only=True):
    """Restoring the signal handlers at the end of a run failed."""

    durable: ClassVar[bool] = True
    detail: str = ""


class ClientCalibrated(_Record, tag="client_calibrated", frozen=True, kw_only=True):
    """Before the first ladder: the run's own client timed against the calibration server;
    ``calibration`` None and ``error`` set when it could not be measured."""

    calibration: ClientCalibration | None = None
    error: str | None = None


# --- identity ------------------------------------------------------------------------------


class RowOpened(_Record, tag="row_opened", frozen=True, kw_only=True):
    durable: ClassVar[bool] = True
    row_index: int
    row_key: str
    case_key: str
    prefix_tokens: int | None = None
    use_case: str | None = None
    row_dir: str = ""  # relative to the run directory, e.g. "cell-0003"
    model_status: str = "present"  # present | missing-model
    arms: tuple[ArmPlan, ...] = ()
    # What happened to the row's correctness arm; row.json shows it as {"status", "reason"}.
    correctness_status: str = "not-run"
    correctness_reason: str | None = None
    # The row's preset is from a synthetic (zoo) catalog: its receipts say so.
    synthetic: bool = False
    # The host's load average (1, 5, 15 min) when the row opened (None before it was kept).
    load_average: tuple[float, float, float] | None = None


# ``CellOpened.cohort``: llama-server's own /completion, or a stage server's OpenAI chat (whose
# rungs keep per-request digests for parity).
COHORT_NATIVE: Final = arms.COHORT_NATIVE
COHORT_OPENAI: Final = arms.COHORT_OPENAI


class CellOpened(_Record, tag="cell_opened", frozen=True, kw_only=True):
    """One host session of one arm; ``cell_id`` is unique within the run."""

    durable: ClassVar[bool] = True
    cell_id: str
    row_index: int
    row_key: str
    arm: str  # native-serial | native-concurrent | skippy-old | skippy-new
    cohort: str
    cell_dir: str  # relative to the run directory
    measurement_kind: str = "concurrent"  # serial | concurrent
    rungs: tuple[RungPlan, ...] = ()
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    # The cell's row is synthetic; repeated here because a cell's fold reads only the run-wide
    # lines and its own, never ``row_opened``.
    synthetic: bool = False
    # What the cell's cache verdicts are judged by (None: a cell from before verdicts).
    cache_expectation: CacheExpectation | None = None
    # Whether its request bodies (/completion or chat) carry ``ignore_eos`` (synthetic only).
    ignore_eos: bool | None = None
    # The host's load average (1, 5, 15 min) when the cell opened (None before it was kept).
    load_average: tuple[float, float, float] | None = None


class Transition(_Record, tag="transition", frozen=True, kw_only=True):
    """One step of a machine table; ``machine`` is "cell" (cell_id set) or "row" (row_index)."""

    durable: ClassVar[bool] = True
    machine: str
    cell_id: str | None = None
    row_index: int | None = None
    from_state: str
    event: str
    to_state: str


# --- cell observations ----------------------------------------------------------------------


class PinObserved(_Record, tag="pin_observed", frozen=True, kw_only=True):
    cell_id: str | None
    phase: str  # before | after
    name: str
    path: str
    expected_sha256: str
    # None: the bytes could not be read (missing, unreadable, cancelled while hashing).
    observed_sha256: str | None
    # "sha256": hashed now; "identity": the row's held file is unchanged since it was hashed
    # (actors/run_context.RowPins); "" in journals written before it was recorded.
    verified_by: str = ""


class PinDrift(_Record, tag="pin_drift", frozen=True, kw_only=True):
    durable: ClassVar[bool] = True
    cell_id: str | None
    phase: str
    name: str
    path: str
    expected_sha256: str
    observed_sha256: str | None
    verified_by: str = ""


class PortReserved(_Record, tag="port_reserved", frozen=True, kw_only=True):
    cell_id: str
    port: int


class ChildSpawned(_Record, tag="child_spawned", frozen=True, kw_only=True):
    """A child process we own; ``replay --reap`` matches it by pid AND create time."""

    # Durable so that a crash right after spawning still leaves the pid for --reap.
    durable: ClassVar[bool] = True
    cell_id: str | None
    role: str = "host"
    pid: int
    create_time: float  # psutil.Process.create_time()
    pgid: int | None = None
    argv_sha256: str
    executable: str = ""
    host_argv: tuple[str, ...] = ()
    # Names only: the values of a child's environment are never journaled.
    host_env_names: tuple[str, ...] = ()
    # llama-server ``-t`` (the operator's OMP_NUM_THREADS), or None when not pinned.
    host_threads: str | None = None
    # The child's whole environment with device ids redacted (``custody.recorded_environment``);
    # None in journals written before it was recorded.
    effective_environment: dict[str, str] | None = None


class ListeningMarkerSeen(_Record, tag="listening_marker_seen", frozen=True, kw_only=True):
    cell_id: str
    pid: int
    port: int
    marker: str


class Ready(_Record, tag="ready", frozen=True, kw_only=True):
    cell_id: str
    url: str
    attempts: int = 1
    elapsed_ms: float | None = None


class WarmupExclusion(_Record, tag="warmup_exclusion", frozen=True, kw_only=True):
    """The warmup rule of a cell's first rung, and where its benchmark prompt came from."""

    cell_id: str
    rung_index: int
    request_ids: tuple[int, ...]
    reason: str
    prompt_source: str = ""  # e.g. use-case | fixed-corpus-entry
    prompt_entry: str = ""
    prompt_corpus_path: str = ""
    prompt_corpus_sha256: str = ""
    # The prompt as cut by the host's own tokenizer.
    prompt_tokens: int | None = None
    prompt_sha256: str = ""
    # A chat host: the prompt tokens it counts for the prompt as one user message (its own
    # rendering and tokenizing), which every request's count is held to, and the message
    # tokens merged into the template where they meet (0: the message's tokens intact, the
    # same the other hosts are sent); or why it was not checked (it renders or tokenizes
    # nothing).
    chat_prompt_tokens: int | None = None
    chat_prompt_merged_tokens: int | None = None
    chat_prompt_unchecked: str | None = None
    # The message's own tokens by the chat host's tokenizer (no template, no BOS).
    chat_message_tokens: int | None = None


class RungRows(_Record, tag="rung_rows", frozen=True, kw_only=True):
    """Rows of one rung written to the cell's rows file (``schemas/request_rows.py``) and
    fsynced before this record: lines ``first_line`` to ``first_line + count - 1`` of
    ``path`` (relative to the cell's directory). ``sha256`` is the digest of the file from its
    first byte through this segment's last, so each segment checks everything before it too.
    A rung has one segment; a serial rung 0 has two (its warmup request, then the rest)."""

    cell_id: str
    rung_index: int
    concurrency: int
    path: str
    first_line: int
    count: int
    # Rows of the segment whose status is ``completed``.
    completed: int
    sha256: str


class RungCompleted(_Record, tag="rung_completed", frozen=True, kw_only=True):
    """A rung's load run ended (any status); the retained host's identity is re-checked."""

    cell_id: str
    rung_index: int
    concurrency: int
    requested_requests: int
    status: str  # completed | incomplete | failed | not-launched (schemas.measurement.LoadStatus)
    makespan_seconds: float | None = None
    prompt_sha256: str | None = None
    output_tokens: int | None = None
    host_pid: int | None = None
    host_create_time: float | None = None
    stop_reason: str | None = None
    # The run's client overhead (``ClientCalibrated``'s p50) when the rung ran, so the rung's
    # receipt can say whether its latencies came near it.
    client_overhead_ms: float | None = None
    client_overhead_factor: float | None = None
    # What the fold needs of the rung's rows, tallied by the load actor as they ended
    # (``states/tally.py``); replay re-tallies the rows file and compares.
    tally: RungFacts | None = None


class Fault(_Record, tag="fault", frozen=True, kw_only=True):
    """Something went wrong; the cell goes to cleanup. ``kind`` is a plain word (custody's
    ``FAULT_KIND_OF_CODE``, ``HostCleanup.problems``, the cell actor's own faults)."""

    durable: ClassVar[bool] = True
    cell_id: str | None
    kind: str
    detail: str = ""
    pid: int | None = None


class CleanupOutcome(_Record, tag="cleanup_outcome", frozen=True, kw_only=True):
    """Custody ended the cell's host; ``cleanup`` says how (``cell.json`` shows it as is)."""

    durable: ClassVar[bool] = True
    cell_id: str
    cleanup: HostCleanup


class ReceiptPublished(_Record, tag="receipt_published", frozen=True, kw_only=True):
    """A receipt file was published; replay refolds it through ``through_seq`` and compares."""

    durable: ClassVar[bool] = True
    scope: str  # cell | row | matrix
    cell_id: str | None = None
    row_index: int | None = None
    path: str  # relative to the run directory
    sha256: str
    through_seq: int


class RunResumed(_Record, tag="run_resumed", frozen=True, kw_only=True):
    """``cache-family run --resume`` continued this journal after its runner stopped.

    Starts a new segment: the lines of every row in ``rerun_rows`` (and of its cells) and the
    run-wide cancellations, deadline expiries and interrupt failures before this record stop
    counting for anything folded after it; the rows in ``kept_rows`` keep their receipts. The
    directories of rerun rows were moved under ``superseded_dir`` (``moved`` names them).
    """

    durable: ClassVar[bool] = True
    resumed_after_seq: int
    kept_rows: tuple[int, ...] = ()
    rerun_rows: tuple[int, ...] = ()
    superseded_dir: str = ""
    moved: tuple[str, ...] = ()
    runner_pid: int | None = None
    runner_create_time: float | None = None
    # Journaled children of the stopped runner that were still alive and were ended.
    reaped_pids: tuple[int, ...] = ()
    # Bytes of a torn last line (the runner died mid-write) cut off before resuming.
    torn_tail_bytes: int = 0
    detail: str = ""


class ReportFailed(_Record, tag="report_failed", frozen=True, kw_only=True):
    """A report file of the run (``production-cache-bench.json`` / ``.md``) was not written."""

    durable: ClassVar[bool] = True
    path: str
    detail: str = ""


class BoundFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One file of the run directory as it stood when the run bound its files."""

    path: str  # relative to the run directory
    sha256: str
    size: int


class RunFilesBound(_Record, tag="run_files", frozen=True, kw_only=True):
    """Every file the run wrote into its directory, by SHA-256, journaled just before the
    matrix's publication (the matrix is bound by its own ``receipt_published``). Replay finds
    an edited, missing or extra file against the last of these (``actors/audit/run_files.py``).
    Journals from before this record bind no file list."""

    durable: ClassVar[bool] = True
    files: tuple[BoundFile, ...] = ()


class JournalSealed(_Record, tag="journal_sealed", frozen=True, kw_only=True):
    """The last line of a finished journal (segment), anchoring every byte before it.

    ``digest`` is the SHA-256 of the journal's bytes before this line followed by this line's
    own bytes with ``digest`` empty, so an edit of any earlier line or of this one is found;
    ``head_sha256`` is the previous line's SHA-256 (its ``prev``). Only ``run_resumed`` may
    follow a seal.
    """

    durable: ClassVar[bool] = True
    through_seq: int
    head_sha256: str
    matrix_status: str | None = None
    terminal_refusal: str | None = None
    digest: str = ""


# --- the correctness arm ---------------------------------------------------------------------


class CorrectnessTopologyRan(_Record, tag="correctness_topology", frozen=True, kw_only=True):
    """One planned topology of a row's correctness arm: how its child ended and what the gate
    said of its report. The prompt text is never journaled, only its SHA-256."""

    durable: ClassVar[bool] = True
    row_index: int
    topology_index: int
    topology: str
    status: str  # pass | failed-process | refused (the reference's evidence status)
    reason: str | None = None
    # The gate's refusal codes (``handoff.*``), empty when it accepted the report.
    refusal_codes: tuple[str, ...] = ()
    evidence_dir: str = ""  # relative to the run dir: cell-NNNN/correctness/topology-NN
    argv_sha256: str = ""
    pid: int | None = None
    exit_code: int | None = None
    forced: bool = False
    elapsed_ms: float | None = None
    prompt_sha256: str | None = None
    benchmark_prompt_token_count: int | None = None
    suffix_prefill_matches: bool | None = None
    cache_storage_bytes: int | None = None
    cache_hit_import_ms: tuple[float, ...] = ()
    cache_hit_decode_ms: tuple[float, ...] = ()
    cache_hit_total_ms: float | None = None
    recompute_total_ms: float | None = None


class CorrectnessVerdict(_Record, tag="correctness_verdict", frozen=True, kw_only=True):
    """The row's correctness stage: ``completed`` only when every planned topology passed with
    one identical non-empty prompt, whose SHA-256 then pins every later request of the row."""

    durable: ClassVar[bool] = True
    row_index: int
    status: str  # completed | failed-or-incomplete | not-run
    reason: str | None = None
    planned_topologies: tuple[str, ...] = ()
    prompt_sha256: str | None = None
    # Exact suffix prefill (the K-token prefix then the suffix token gives the recompute's
    # token) held in every topology: its own capability, apart from prefix/context sizing.
    suffix_prefill_matches: bool | None = None


class CliAdmission(_Record, tag="cli_admission", frozen=True, kw_only=True):
    """A stage server's dialect, read from its own help before launch (``cli-admission.json``)."""

    cell_id: str
    binary: str
    binary_sha256: str
    dialect: str  # current | legacy
    # (command, exit code or None when it ran past its cap) of each help probe, in order.
    probes: tuple[tuple[str, int | None], ...] = ()


class ServerMetricsRead(_Record, tag="server_metrics", frozen=True, kw_only=True):
    """The host's own Prometheus counters read before and after one rung (``scope`` "rung",
    ``index`` its rung index) or workload point (``scope`` the workload kind, ``index`` the
    point's), journaled right after it with the client's sums of the same requests' figures.

    ``status`` "read": ``counters`` holds every counter sample's delta; "none": the host
    serves no metrics (``reason`` says why; nothing is guessed); "refused": an exposition
    could not be used (``refusal_code``, ``schemas/refusal_codes.SERVER_METRICS_REFUSAL_CODES``).
    """

    cell_id: str
    scope: str
    index: int
    status: str  # read | none | refused (schemas/server_metrics.MetricsStatus)
    reason: str | None = None
    refusal_code: str | None = None
    path: str | None = None
    # The two expositions' sizes (bytes), as read.
    before_bytes: int | None = None
    after_bytes: int | None = None
    counters: tuple[CounterDelta, ...] = ()
    client: TokenSums | None = None


Record: TypeAlias = (
    RunStarted
    | Cancellation
    | DeadlineExpired
    | InterruptFinishFailed
    | RowOpened
    | CellOpened
    | Transition
    | PinObserved
    | PinDrift
    | PortReserved
    | ChildSpawned
    | ListeningMarkerSeen
    | Ready
    | WarmupExclusion
    | RungRows
    | RungCompleted
    | Fault
    | CleanupOutcome
    | ReceiptPublished
    | RunResumed
    | ReportFailed
    | RunFilesBound
    | JournalSealed
    | CorrectnessTopologyRan
    | CorrectnessVerdict
    | CliAdmission
    | ClientCalibrated
    | RowsSelected
    | WorkloadOpened
    | OverlapPointMeasured
    | SessionsMeasured
    | OpenLoopStageMeasured
    | WorkloadStopped
    | ChatTemplateMeasured
    | ReuseProbed
    | TraceRequestReplayed
    | TraceReplayed
    | ServerMetricsRead
)

# The members of ``Record`` in order, read from the union so the two never disagree.
RECORD_TYPES: Final[tuple[type[_Record], ...]] = get_args(Record)
KNOWN_TAGS: Final[frozenset[str]] = frozenset(str(t.__struct_config__.tag) for t in RECORD_TYPES)
