"""The run journal: one hash-chained JSON line per record, the source every receipt is folded from.

Layout of ``journal.jsonl`` (one per run directory)::

    {"seq":1,"mono_ns":...,"wall_ns":...,"prev":"000...0","record":{"type":"run_started",...}}\\n
    {"seq":2,"mono_ns":...,"wall_ns":...,"prev":"<sha256 of line 1>","record":{...}}\\n

* ``seq`` starts at 1 and grows by exactly one per line.
* ``prev`` is the lowercase SHA-256 hex of the previous line's bytes, without its ``\\n``
  terminator. The first line's ``prev`` is :data:`GENESIS_PREV` (64 zeros).
* ``mono_ns`` is the writer's monotonic clock (trio's clock in a run) and ``wall_ns`` the wall
  clock, both in integer nanoseconds so that no float formatting question ever arises.
* ``record`` is one member of :data:`Record`, tagged by its ``type`` field.
* A finished journal ends with ``journal_sealed`` (see :class:`JournalSealed`); only a
  ``run_resumed`` may follow a seal, starting the next segment of the same chain.

Evolution rule: records are frozen and keyword-only; a new field gets a default and goes last;
no field is renamed, retyped or reordered; a new record type gets a new tag. An older reader
meeting a newer tag refuses it with ``journal.record.unknown_type`` instead of crashing, and
one meeting a field it does not know refuses it with ``journal.record.unknown_field``: every
struct of a line forbids unknown fields, because a field replay cannot see is a field it cannot
vouch for (an edited, re-chained journal could otherwise carry anything unnoticed).

Free-text fields (fault kinds, budgets, arms) are plain strings rather than literals so that a
newer writer's vocabulary never makes an older journal unreadable; the fold interprets them.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import operator
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Final, TypeAlias, get_args

import msgspec

from cache_family.errors import Refusal
from cache_family.schemas import arms
from cache_family.schemas.host_identity import HostIdentity
from cache_family.schemas.measurement import (
    CacheExpectation,
    ClientCalibration,
    HostCleanup,
    RungFacts,
)
from cache_family.schemas.workload_records import (
    OpenLoopStageMeasured,
    OverlapPointMeasured,
    SessionsMeasured,
    WorkloadOpened,
)

JOURNAL_FILENAME: Final = "journal.jsonl"
GENESIS_PREV: Final = "0" * 64


class _Record(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", forbid_unknown_fields=True
):
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
)

# The members of ``Record`` in order, read from the union so the two never disagree.
RECORD_TYPES: Final[tuple[type[_Record], ...]] = get_args(Record)
KNOWN_TAGS: Final[frozenset[str]] = frozenset(str(t.__struct_config__.tag) for t in RECORD_TYPES)


# What a newer writer's journal looks like to this reader: replay calls it unreadable (exit 2)
# and keeps verifying the chain around it.
UNKNOWN_TYPE: Final = "journal.record.unknown_type"
UNKNOWN_FIELD: Final = "journal.record.unknown_field"
NEWER_WRITER_CODES: Final = frozenset((UNKNOWN_TYPE, UNKNOWN_FIELD))


class JournalLine(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, gc=False):
    # Untracked by the cyclic collector (it holds only numbers, a string and a frozen record,
    # so it can close no cycle): a replay holds millions, and the collector would otherwise
    # walk them all again at every full collection.
    seq: int
    mono_ns: int
    wall_ns: int
    prev: str
    record: Record


class _LooseLine(msgspec.Struct, frozen=True, kw_only=True):
    """Just enough of a line to check the chain when its record cannot be typed."""

    seq: int
    prev: str
    record: msgspec.Raw


class _LooseRecord(msgspec.Struct, frozen=True):
    type: str


_ENCODER: Final = msgspec.json.Encoder(order="deterministic")
_DECODER: Final = msgspec.json.Decoder(JournalLine)
_LOOSE_DECODER: Final = msgspec.json.Decoder(_LooseLine)
_LOOSE_RECORD_DECODER: Final = msgspec.json.Decoder(_LooseRecord)
# A line's bytes up to its record: JournalLine's fields in declaration order.
_LINE_HEAD: Final = b'{"seq":%d,"mono_ns":%d,"wall_ns":%d,"prev":"%s","record":'
# A whole line from its head's fields and its encoded record, in one formatting step.
_LINE_FORMAT: Final = _LINE_HEAD + b"%s}"
_sha256: Final = hashlib.sha256


def line_sha256(line_bytes: bytes) -> str:
    return hashlib.sha256(line_bytes).hexdigest()


def encode_line(line: JournalLine) -> bytes:
    """The line's bytes WITHOUT the newline terminator (what ``prev`` hashes)."""
    return _ENCODER.encode(line)


def decode_line(line_bytes: bytes) -> JournalLine:
    return _DECODER.decode(line_bytes)


class JournalChain:
    """Pure appender: stamps ``seq`` and ``prev`` and returns each line's bytes.

    The writer actor and tests that build journals in memory share it, so both produce the
    same bytes for the same records and clocks.
    """

    __slots__ = ("next_seq", "prev")

    def __init__(self, *, next_seq: int = 1, prev: str = GENESIS_PREV) -> None:
        self.next_seq = next_seq
        self.prev = prev

    def line(self, record: Record, *, mono_ns: int, wall_ns: int) -> tuple[JournalLine, bytes]:
        """Chain one record; returns the line and its bytes including the ``\\n``."""
        line = JournalLine(
            seq=self.next_seq, mono_ns=mono_ns, wall_ns=wall_ns, prev=self.prev, record=record
        )
        return line, self.encode(record, mono_ns=mono_ns, wall_ns=wall_ns)

    def encode(self, record: Record, *, mono_ns: int, wall_ns: int) -> bytes:
        """Chain one record and return only its bytes (with the ``\\n``): the writer's hot path.

        The bytes are exactly ``encode_line`` of the :class:`JournalLine` (its fields in
        declaration order, integers as JSON writes them), without building that struct.
        """
        data = _LINE_FORMAT % (
            self.next_seq,
            mono_ns,
            wall_ns,
            self.prev.encode(),
            _ENCODER.encode(record),
        )
        self.prev = _sha256(data).hexdigest()
        self.next_seq += 1
        return data + b"\n"

    def encode_many(self, items: list[tuple[Record, int, int]]) -> list[bytes]:
        """``encode`` for each (record, mono_ns, wall_ns) in order, in one batch."""
        records, monos, walls = zip(*items, strict=True) if items else ((), (), ())
        return [data + b"\n" for data in self.encode_batch(records, monos, walls)]

    def encode_batch(
        self, records: Sequence[Record], monos: Sequence[int], walls: Sequence[int]
    ) -> list[bytes]:
        """Chain ``records`` (stamped ``monos[i]``, ``walls[i]``) and return each line's bytes
        WITHOUT the newline: the writer's hot path, so the loop does only what the per-line
        chain needs (one format, one SHA-256 per line). The records are encoded in one call;
        JSON strings escape every newline, so the encoded records split cleanly."""
        if not records:
            return []
        encoded = _ENCODER.encode_lines(records).split(b"\n")
        encoded.pop()  # the empty piece after the last newline
        out: list[bytes] = []
        append, line_format, sha256 = out.append, _LINE_FORMAT, _sha256
        first, prev = self.next_seq, self.prev.encode()
        for seq, mono_ns, wall_ns, record in zip(
            range(first, first + len(records)), monos, walls, encoded, strict=True
        ):
            data = line_format % (seq, mono_ns, wall_ns, prev, record)
            prev = sha256(data).hexdigest().encode()
            append(data)
        self.next_seq, self.prev = first + len(out), prev.decode()
        return out

    def seal(
        self, record: JournalSealed, before: hashlib._Hash, *, mono_ns: int, wall_ns: int
    ) -> tuple[JournalLine, bytes]:
        """Chain the seal line; ``before`` hashes every journal byte before it."""
        blank = JournalLine(
            seq=self.next_seq,
            mono_ns=mono_ns,
            wall_ns=wall_ns,
            prev=self.prev,
            record=msgspec.structs.replace(record, digest=""),
        )
        sealed = msgspec.structs.replace(record, digest=seal_digest(before, blank))
        return self.line(sealed, mono_ns=mono_ns, wall_ns=wall_ns)

    def __repr__(self) -> str:
        return f"<JournalChain next_seq={self.next_seq} prev={self.prev[:12]}…>"


def seal_digest(before: hashlib._Hash, line: JournalLine) -> str:
    """The digest a seal line holds: the bytes before it, then its own with ``digest`` empty."""
    record = line.record
    if not isinstance(record, JournalSealed):
        raise TypeError(f"not a seal line: {type(record).__name__}")
    digest = before.copy()
    digest.update(encode_line(msgspec.structs.replace(line, record=_unsigned(record))))
    return digest.hexdigest()


def _unsigned(record: JournalSealed) -> JournalSealed:
    return msgspec.structs.replace(record, digest="")


def seal_problems(data: bytes, read: JournalRead) -> list[Refusal]:
    """What is wrong with the seals of a journal's trusted lines (empty when all hold).

    Every ``journal_sealed`` must hold the digest of the bytes before it and of its own line,
    name its predecessor as its head, be written canonically, and be followed by nothing but a
    ``run_resumed`` (a later segment) or the end of the journal. The matrix's publication is
    followed by the seal and nothing else (``finish_run`` writes the two back to back; only a
    runner that died between them leaves a ``run_resumed`` there), so a record slipped in
    after the matrix, with the seal recomputed over it, is refused too.
    """
    lines = read.lines
    # Only seals, the matrix's publication and the line after each matter; they are found
    # over the whole column in C (``list.index``), so a long journal costs no Python per line.
    kinds = list(map(type, map(_RECORD, lines)))
    seals = _positions(kinds, JournalSealed)
    matrices = [
        p
        for p in _positions(kinds, ReceiptPublished)
        if isinstance(published := lines[p].record, ReceiptPublished)
        and published.scope == "matrix"
    ]
    follows_seal = {p + 1 for p in seals}
    follows_matrix = {p + 1 for p in matrices}
    problems: list[Refusal] = []
    running = hashlib.sha256()
    hashed = 0  # how many of data's bytes ``running`` holds
    cursor = _LineCursor(data)
    for position in sorted(follows_seal | follows_matrix | set(seals)):
        if position >= len(lines):
            continue
        line = lines[position]
        record = line.record
        where = f"$.journal[{position}]"
        if position in follows_seal and not isinstance(record, RunResumed):
            problems.append(
                Refusal(
                    "journal.seal.trailing_record",
                    where,
                    f"seq {line.seq}: a {_tag(record)} record follows the seal at seq "
                    f"{lines[position - 1].seq}; only run_resumed may",
                    _AFTER_THE_END,
                )
            )
        if position in follows_matrix and not isinstance(record, JournalSealed | RunResumed):
            problems.append(
                Refusal(
                    "journal.matrix.trailing_record",
                    where,
                    f"seq {line.seq}: a {_tag(record)} record follows the matrix's publication "
                    f"at seq {lines[position - 1].seq}; only the seal may (or run_resumed, when "
                    "the runner died between the two)",
                    _AFTER_THE_END,
                )
            )
        if not isinstance(record, JournalSealed):
            continue
        start, end = cursor.span(position)
        running.update(data[hashed:start])
        hashed = start
        if encode_line(line) != data[start:end]:
            problems.append(
                Refusal(
                    "journal.seal.noncanonical",
                    where,
                    f"seq {line.seq}: the seal line is not in its canonical form",
                    _SEAL_EDITED,
                )
            )
        elif seal_digest(running, line) != record.digest:
            problems.append(
                Refusal(
                    "journal.seal.digest",
                    where,
                    f"seq {line.seq}: the seal's digest does not match the journal's bytes "
                    "(an earlier line or the seal itself was edited)",
                    _SEAL_EDITED,
                )
            )
        if record.head_sha256 != line.prev or record.through_seq != line.seq - 1:
            problems.append(
                Refusal(
                    "journal.seal.head",
                    where,
                    f"seq {line.seq}: the seal names another head than its line",
                    _SEAL_EDITED,
                )
            )
    return problems


_RECORD: Final = operator.attrgetter("record")


def _positions(items: list[type], wanted: type) -> list[int]:
    """Every index of ``wanted`` in ``items``, each found by ``list.index`` (in C)."""
    found: list[int] = []
    position = -1
    while True:
        try:
            position = items.index(wanted, position + 1)
        except ValueError:
            return found
        found.append(position)


class _LineCursor:
    """Byte spans of a journal's lines by line number, moving forward only: the newlines
    between two asked-for lines are skipped in C (``re.finditer`` under ``islice``)."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._line = 0  # the line that starts at ``_offset``
        self._offset = 0

    def span(self, line: int) -> tuple[int, int]:
        """(start, end) of line ``line`` (0-based), ``end`` at its newline."""
        if line < self._line:
            raise ValueError(f"line {line} is behind the cursor at line {self._line}")
        if line > self._line:
            skipped = _NEWLINE.finditer(self._data, self._offset)
            newline = next(itertools.islice(skipped, line - self._line - 1, None))
            self._line, self._offset = line, newline.end()
        return self._offset, self._data.index(b"\n", self._offset)


_NEWLINE: Final = re.compile(b"\n")


_AFTER_THE_END: Final = (
    "the journal was extended after the run ended; compare its head with the one the run "
    "printed (replay --expect-head) or verify the head's signature"
)
_SEAL_EDITED: Final = "the journal's last segment was edited after the run sealed it"


def _tag(record: Record) -> str:
    return str(type(record).__struct_config__.tag)


def encode_journal(
    records: Iterable[Record], *, mono_ns_step: int = 1_000_000, wall_ns_start: int = 0
) -> bytes:
    """A whole journal for the given records with synthetic clocks (tests, examples)."""
    chain = JournalChain()
    return b"".join(
        chain.encode(record, mono_ns=i * mono_ns_step, wall_ns=wall_ns_start + i)
        for i, record in enumerate(records)
    )


# --- reading ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChainBreak:
    """The first place the journal stops being trustworthy.

    ``seq`` is the first sequence number that cannot be trusted (the line that is missing,
    torn, undecodable, out of place or whose bytes differ from what its successor recorded).
    """

    seq: int
    line_no: int
    code: str
    message: str

    def refusal(self) -> Refusal:
        return Refusal(
            self.code,
            f"$.journal[{self.line_no - 1}]",
            f"seq {self.seq}: {self.message}",
            "the journal was truncated or edited after it was written; receipts after this "
            "seq cannot be replayed",
        )


@dataclass(frozen=True, slots=True)
class JournalRead:
    """The trusted prefix of a journal and what, if anything, is wrong after it."""

    lines: tuple[JournalLine, ...]
    line_sha256s: tuple[str, ...]
    chain_break: ChainBreak | None = None
    # Records of a newer writer (or edited ones) this reader cannot type: an unknown type or
    # field (``NEWER_WRITER_CODES``); replay refuses them.
    unknown_types: tuple[Refusal, ...] = field(default_factory=tuple)
    torn_tail: bool = False

    @property
    def last_seq(self) -> int:
        return self.lines[-1].seq if self.lines else 0

    @property
    def first_bad_seq(self) -> int | None:
        return self.chain_break.seq if self.chain_break else None


def read_journal(data: bytes) -> JournalRead:
    """Verify the hash chain and decode every line; never raises for bad content.

    A missing final newline is a torn last line (a crash mid-write): it is reported and never
    used. Lines after the first break are not returned, because nothing vouches for them.
    """
    with _gc_paused():
        intact = _read_intact(data)
        return intact if intact is not None else _read_checked(data)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Decoding a journal allocates millions of objects that all stay alive; the cyclic
    collector would scan them again and again (about half of replay's time) for nothing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _read_intact(data: bytes) -> JournalRead | None:
    """The common case in one pass: every line decodes typed (in one ``decode_lines`` call),
    seqs run 1..n and each ``prev`` is its predecessor's SHA-256. None at the first doubt:
    ``_read_checked`` then finds and names the break line by line."""
    if not data.endswith(b"\n"):
        return None
    try:
        lines = _DECODER.decode_lines(data)
    except msgspec.DecodeError:
        return None
    raw_lines = data.split(b"\n")
    raw_lines.pop()
    if len(raw_lines) != len(lines):
        return None
    shas: list[str] = []
    prev = GENESIS_PREV
    sha256 = hashlib.sha256
    for seq, (line, raw) in enumerate(zip(lines, raw_lines, strict=True), start=1):
        if line.seq != seq or line.prev != prev:
            return None
        prev = sha256(raw).hexdigest()
        shas.append(prev)
    return JournalRead(lines=tuple(lines), line_sha256s=tuple(shas))


def _read_checked(data: bytes) -> JournalRead:
    torn = bool(data) and not data.endswith(b"\n")
    raw_lines = data.split(b"\n")
    raw_lines.pop()  # the empty piece after the last "\n", or the torn tail
    decoded: list[JournalLine] = []
    shas: list[str] = []
    unknown: list[Refusal] = []
    prev_sha = GENESIS_PREV
    prev_mismatch_at: int | None = None  # line number whose prev disagreed with its predecessor
    chain_break: ChainBreak | None = None

    for index, raw in enumerate(raw_lines):
        line_no = index + 1
        sha = line_sha256(raw)
        seq, prev, typed, problem = _decode_one(raw, line_no)
        if problem is not None and problem.code in NEWER_WRITER_CODES:
            unknown.append(problem)
            problem = None
        if prev_mismatch_at is not None and (problem is not None or seq != line_no):
            # An earlier line is already suspect; it is the first untrusted one.
            chain_break = _altered(prev_mismatch_at - 1)
            break
        if problem is not None:
            chain_break = ChainBreak(line_no, line_no, problem.code, problem.message)
            break
        if seq != line_no:
            chain_break = ChainBreak(
                line_no,
                line_no,
                "journal.seq.out_of_order",
                f"line {line_no} carries seq {seq}: a line was removed, inserted or reordered",
            )
            break
        if prev != prev_sha:
            if prev_mismatch_at is not None:
                # Two disagreements in a row: the line between them was itself altered.
                chain_break = _altered(line_no - 1)
                break
            prev_mismatch_at = line_no
        elif prev_mismatch_at is not None:
            # Only the predecessor's bytes disagree with what this line's predecessor recorded.
            chain_break = _altered(prev_mismatch_at - 1)
            break
        if typed is not None:
            decoded.append(typed)
        shas.append(sha)
        prev_sha = sha

    if chain_break is None and prev_mismatch_at is not None:
        # The mismatch was on the last line: the earlier of the two candidates is reported.
        chain_break = _altered(prev_mismatch_at - 1)
    if chain_break is None and torn:
        line_no = len(raw_lines) + 1
        chain_break = ChainBreak(
            line_no,
            line_no,
            "journal.line.torn",
            "the last line has no newline terminator (the writer stopped mid-line)",
        )
    trusted = chain_break.seq - 1 if chain_break else len(shas)
    return JournalRead(
        lines=tuple(line for line in decoded if line.seq <= trusted),
        line_sha256s=tuple(shas[:trusted]),
        chain_break=chain_break,
        unknown_types=tuple(u for u in unknown if _seq_of(u) <= trusted),
        torn_tail=torn,
    )


def _altered(seq: int) -> ChainBreak:
    seq = max(seq, 1)
    return ChainBreak(
        seq,
        seq,
        "journal.chain.broken",
        "the line's bytes differ from the SHA-256 its successor recorded (edited after writing)",
    )


def _seq_of(refusal: Refusal) -> int:
    return int(refusal.path.removeprefix("$.journal[").removesuffix("]")) + 1


def _unknown_field(exc: msgspec.DecodeError) -> str | None:
    """msgspec's "Object contains unknown field `x` - at `$...`", as "field `x` (at ...)"."""
    text = str(exc)
    if not text.startswith("Object contains unknown field"):
        return None
    return "field " + text.removeprefix("Object contains unknown field ").replace(" - at ", " at ")


def _decode_one(raw: bytes, line_no: int) -> tuple[int, str, JournalLine | None, Refusal | None]:
    """(seq, prev, typed line or None, problem or None) for one line's bytes."""
    try:
        typed = _DECODER.decode(raw)
    except msgspec.DecodeError as exc:
        unknown_field = _unknown_field(exc)
    else:
        return typed.seq, typed.prev, typed, None
    where = f"$.journal[{line_no - 1}]"
    try:
        loose = _LOOSE_DECODER.decode(raw)
        tag = _LOOSE_RECORD_DECODER.decode(loose.record).type
    except msgspec.DecodeError:
        return (
            line_no,
            "",
            None,
            Refusal(
                "journal.line.undecodable",
                where,
                f"line {line_no} is not a journal line",
                "the line was edited or corrupted",
            ),
        )
    if tag not in KNOWN_TAGS:
        return (
            loose.seq,
            loose.prev,
            None,
            Refusal(
                UNKNOWN_TYPE,
                where,
                f"record type {tag!r} at seq {loose.seq} is unknown to this version",
                "replay with the cache-family version that wrote the journal, or a newer one",
            ),
        )
    if unknown_field is not None:
        return (
            loose.seq,
            loose.prev,
            None,
            Refusal(
                UNKNOWN_FIELD,
                where,
                f"a {tag!r} record at seq {loose.seq} carries {unknown_field}, unknown to "
                "this version",
                "replay with the cache-family version that wrote the journal; a journal "
                "edited and re-chained by hand carries such fields too",
            ),
        )
    return (
        loose.seq,
        loose.prev,
        None,
        Refusal(
            "journal.line.undecodable",
            where,
            f"line {line_no}: a {tag!r} record does not match its schema",
            "the line was edited or corrupted",
        ),
    )
