"""Receipts: ``cell.json`` per host session and the native part of ``row.json``.

Encoded canonically by ``encode_receipt`` (fields in definition order, keys sorted, two-space
indent, one trailing newline), so the same journal always gives the same bytes, which replay
checks. New fields get defaults and go last; ``schema_version`` changes only when a meaning
changes.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from cache_family.schemas.measurement import HostCleanup, RequestRow, RungSummary, SerialSummary
from cache_family.schemas.production import ProducerRow
from cache_family.schemas.request_rows import RowsFileDigest
from cache_family.schemas.server_metrics import ServerMetricsVerdict

CELL_SCHEMA_VERSION: Final = 1
ROW_SCHEMA_VERSION: Final = 1

#: The one wording every receipt level (``cell.json``, ``row.json``, the matrix's scope) uses
#: for evidence from a synthetic catalog's tiny random-weight models: their figures exercise
#: the tool, they never describe a model's or a server's performance.
SYNTHETIC_EVIDENCE_CLASS: Final = (
    "synthetic: tiny random-weight zoo model; plumbing evidence, not a performance claim"
)


#: How every receipt level's ``evidence_class`` starts for a trained model's figures; the rest
#: names the model, the host's CPU, threads, load and GPUs (``states/fold/lines.py``).
REAL_EVIDENCE_PREFIX: Final = "real model "


def evidence_class(synthetic: bool) -> str | None:
    """A receipt's ``evidence_class``: the synthetic label, or None for real evidence."""
    return SYNTHETIC_EVIDENCE_CLASS if synthetic else None


ReceiptStatus = Literal[
    # The measured chain, best first (states/receipts.py orders it):
    "completed",
    "incomplete",
    "failed",
    "refused",
    # Statuses of things that were never measured; a downgrade leaves them as they are:
    "missing-model",
    "not-launched",
    "not-run",
    "skipped",
    "unavailable",
    "unmeasured",
]

TerminalRefusal = Literal["cancelled", "deadline_expired", "interrupt_finish_failed"]


class HostIdentity(msgspec.Struct, frozen=True, kw_only=True):
    pid: int
    create_time: float
    pgid: int | None = None
    argv_sha256: str = ""
    executable: str = ""


class PinEntry(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    path: str
    expected_sha256: str
    observed_sha256: str | None
    matches: bool


class FaultEntry(msgspec.Struct, frozen=True, kw_only=True):
    """A fault the fold saw; ``seq`` None for one the fold inferred (e.g. journal ended)."""

    seq: int | None
    kind: str
    state: str
    detail: str = ""


class Readiness(msgspec.Struct, frozen=True, kw_only=True):
    port: int | None = None
    marker_seen: bool = False
    marker: str | None = None
    ready: bool = False
    url: str | None = None
    attempts: int = 0
    elapsed_ms: float | None = None


class CacheVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """Expected versus observed prompt-cache hits of one rung (``states/cache_reuse.py``).

    A hit is a completed request whose server-reported cached tokens reach what the
    architecture's reuse rule expects. ``expected_hits`` leaves out one cold request for each
    server slot the rung is the first of the cell to use; ``observed_cached_tokens_min`` is
    the weakest of the other (warm) requests. ``shortfall``: fewer hits than expected.
    """

    expected_hits: int | None = None
    observed_hits: int | None = None
    expected_cached_tokens: int | None = None
    observed_cached_tokens_min: int | None = None
    shortfall: bool | None = None
    rule: str | None = None


class RungReceipt(msgspec.Struct, frozen=True, kw_only=True):
    rung_index: int
    concurrency: int
    requested_requests: int
    # The load run's status, or "not-run" when the rung never reported.
    status: str
    makespan_seconds: float | None = None
    prompt_sha256: str | None = None
    output_tokens: int | None = None
    host_pid: int | None = None
    host_create_time: float | None = None
    # True when the rung ran against the same retained host (pid and create time) as launch.
    host_retained: bool | None = None
    stop_reason: str | None = None
    warmup_excluded_ids: tuple[int, ...] = ()
    rows: tuple[RequestRow, ...] = ()
    rung_summary: RungSummary | None = None
    serial_summary: SerialSummary | None = None
    # Refusal codes of the metrics functions when the roster could not be summarised.
    summary_refusals: tuple[str, ...] = ()
    # None when the cell journaled no cache expectation (a cell from before verdicts).
    cache_verdict: CacheVerdict | None = None
    # The run's client overhead (ms, ``ClientCalibration.overhead_p50_ms``) and whether this
    # rung's median latencies came within ``ClientCalibration.near_factor`` times it (None: the
    # overhead or the latencies were not measured): a flagged rung measures the client too.
    client_overhead_ms: float | None = None
    near_client_overhead: bool | None = None
    # Completed streamed requests whose first token arrived only with the final event: their
    # TTFT is not observable (null; in runs recorded before ``ttft_unobserved``, their latency).
    first_content_with_final_ids: tuple[int, ...] = ()
    # The host's own Prometheus counters over the rung, labelled as the server's, beside the
    # client's sum of the per-request figures (``states/server_metrics.py``). Unset (not
    # written) for a rung whose cell journaled no read, as in runs from before the reads.
    server_metrics: ServerMetricsVerdict | msgspec.UnsetType = msgspec.UNSET


class Measurement(msgspec.Struct, frozen=True, kw_only=True):
    kind: str  # serial | concurrent
    complete: bool
    rungs: tuple[RungReceipt, ...] = ()
    # The measurement's own receipt level (the fold's ``_measurement_status``): ``completed``
    # when every planned rung completed with a summarisable roster and no stop came;
    # ``incomplete`` when evidence is partial or a terminal refusal downgraded it; ``failed``
    # when rungs ran and produced nothing usable; ``not-run`` when no rung ever reported;
    # ``unmeasured`` when none was planned. None only in a receipt from before this field.
    status: ReceiptStatus | None = None
    # The cell's terminal refusal, which downgrades this level as it does the cell's.
    terminal_refusal: TerminalRefusal | None = None
    # The request bodies (/completion or chat): True when they carried ``ignore_eos`` (a
    # synthetic catalog), False for the reference's body exactly; None when not journaled.
    ignore_eos: bool | None = None
    # Rung indices whose cache verdict fell short of the architecture's reuse rule.
    cache_shortfall_rungs: tuple[int, ...] = ()
    # Set when the cell had more than ``INLINE_ROWS_MAX`` request rows: they are in this file
    # (``schemas/request_rows.py``) and every rung's ``rows`` is empty; None: rows are inline.
    rows_file: RowsFileDigest | None = None
    # Rung indices whose server totals disagree with the client's per-request sums. Unset
    # (not written) when no rung's metrics were read, as in runs from before the reads.
    server_metrics_disagreeing_rungs: tuple[int, ...] | msgspec.UnsetType = msgspec.UNSET


class ChatPromptCount(msgspec.Struct, frozen=True, kw_only=True):
    """A chat host's count of the cell's prompt as one user message (its own rendering and
    tokenizing), which every request was held to; ``merged_tokens``: message tokens lost where
    the message meets the template (0: the same tokens the other hosts were sent)."""

    prompt_tokens: int
    message_tokens: int
    merged_tokens: int


class CellReceipt(msgspec.Struct, frozen=True, kw_only=True):
    schema_version: int = CELL_SCHEMA_VERSION
    receipt: str = "cell"
    run_id: str
    request_sha256: str
    catalog_sha256: str
    cell_id: str
    row_index: int | None
    row_key: str | None
    arm: str | None
    cohort: str | None
    cell_dir: str | None
    host: HostIdentity | None
    status: ReceiptStatus
    terminal_refusal: TerminalRefusal | None
    # Both-arms parity may use this cell only when it is completed with clean custody.
    accepted_for_parity: bool
    faults: tuple[FaultEntry, ...]
    lifecycle: tuple[str, ...]
    final_state: str
    readiness: Readiness
    # The pins observed before launch and re-observed after the ladder (the reference's names).
    before_identity: tuple[PinEntry, ...]
    after_identity: tuple[PinEntry, ...]
    pins_drifted: bool
    cleanup: HostCleanup | None
    measurement: Measurement
    journal_through_seq: int
    # From a synthetic catalog: ``evidence_class`` is then SYNTHETIC_EVIDENCE_CLASS.
    synthetic: bool = False
    evidence_class: str | None = None
    # A chat host's count of the prompt (absent for a host sent token ids, or one that
    # renders nothing).
    chat_prompt: ChatPromptCount | msgspec.UnsetType = msgspec.UNSET


class RungBrief(msgspec.Struct, frozen=True, kw_only=True):
    rung_index: int
    concurrency: int
    status: str
    rung_summary: RungSummary | None = None
    serial_summary: SerialSummary | None = None


class ArmObservation(msgspec.Struct, frozen=True, kw_only=True):
    arm: str
    planned: str  # planned | skipped | unavailable
    status: ReceiptStatus
    reason: str | None = None
    cell_id: str | None = None
    cell_dir: str | None = None
    terminal_refusal: TerminalRefusal | None = None
    accepted_for_parity: bool = False
    rungs: tuple[RungBrief, ...] = ()


class CorrectnessTopology(msgspec.Struct, frozen=True, kw_only=True):
    """One topology of the row's correctness arm and the figures the report projects from it.

    The figures are copied from the accepted state-handoff report; the prompt text never is.
    """

    # one-stage | split-stage0 | split-middle | split-final | package-stage1
    topology: str
    # pass | failed-process | refused (the reference's evidence status)
    status: str
    reason: str | None = None
    # Relative to the run dir: where state-handoff.json and the tool's logs are kept.
    evidence_dir: str | None = None
    cache_storage_bytes: int | None = None
    cache_hit_import_ms: tuple[float, ...] = ()
    cache_hit_decode_ms: tuple[float, ...] = ()
    cache_hit_total_ms: float | None = None
    recompute_total_ms: float | None = None
    benchmark_prompt_token_count: int | None = None
    # The report's own suffix-prefill check: a capability of its own, apart from sizing.
    suffix_prefill_matches: bool | None = None
    # The gate's refusal codes (``handoff.*``) when status is refused.
    refusal_codes: tuple[str, ...] = ()


class CorrectnessObservation(msgspec.Struct, frozen=True, kw_only=True):
    """The row's correctness arm.

    ``status`` is ``completed`` (every planned topology passed the gate with one shared prompt),
    ``failed-or-incomplete``, or ``not-run`` with its reason (no tool, missing model, stopped).
    """

    status: str
    reason: str | None = None
    planned_topologies: tuple[str, ...] = ()
    topologies: tuple[CorrectnessTopology, ...] = ()
    # SHA-256 of the accepted benchmark prompt text that drives every later request of the row.
    prompt_sha256: str | None = None
    terminal_refusal: TerminalRefusal | None = None
    # Exact suffix prefill held in every topology (None: not every report said).
    suffix_prefill_matches: bool | None = None


CORRECTNESS_UNRECORDED: Final = CorrectnessObservation(status="not-run")


PARITY_SCOPE: Final = "same_typed_OpenAI_delta_protocol_not_cross_native_chunk_parity"
PARITY_UNAVAILABLE: Final = "custody_or_lifecycle_failure"


class ParityVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """Old/new parity of one rung (reference ``accepted_parity``). ``unavailable_reason`` is
    set when either cell or rung was not fully accepted; ``error`` when the two rosters
    cannot be compared (another prompt, output length or request-id set)."""

    concurrency: int
    complete: bool
    matches: bool
    scope: str = PARITY_SCOPE
    comparable_requests: int = 0
    mismatch_request_ids: tuple[int, ...] = ()
    first_generated_mismatch_request_ids: tuple[int, ...] = ()
    unavailable_request_ids: tuple[int, ...] = ()
    unavailable_reason: str | None = None
    error: str | None = None


class ObservationEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of the row's observations in the reference's order: the serial baseline,
    then per rung native concurrent, skippy old, skippy new and their parity."""

    cohort: str  # native-serial | native-concurrent | skippy-old | skippy-new | old-new-parity
    concurrency: int | None = None
    status: str | None = None
    cell_id: str | None = None
    parity: ParityVerdict | None = None


class RowReceipt(msgspec.Struct, frozen=True, kw_only=True):
    """The native part of ``row.json``: the host arms of one planned row."""

    schema_version: int = ROW_SCHEMA_VERSION
    receipt: str = "row"
    run_id: str
    request_sha256: str
    catalog_sha256: str
    row_index: int
    row_key: str | None
    case_key: str | None
    prefix_tokens: int | None
    use_case: str | None
    row_dir: str | None
    model_status: str
    # Verdict over the planned native arms ("unmeasured" when none was planned).
    status: ReceiptStatus
    reason: str | None
    terminal_refusal: TerminalRefusal | None
    lifecycle: tuple[str, ...]
    final_state: str
    observations: tuple[ArmObservation, ...]
    journal_through_seq: int
    # The correctness arm, folded from its topology and verdict records (``row_opened``'s
    # status and reason where it never ran, e.g. a missing model).
    correctness: CorrectnessObservation = CORRECTNESS_UNRECORDED
    # From a synthetic catalog: ``evidence_class`` is then SYNTHETIC_EVIDENCE_CLASS.
    synthetic: bool = False
    evidence_class: str | None = None
    # Old/new parity per rung (empty unless paired serving was planned).
    parity: tuple[ParityVerdict, ...] = ()
    # The reference's observation order (1 rung: 5 entries with paired serving, 2: 9).
    observation_order: tuple[ObservationEntry, ...] = ()
    # The row's production-cache-bench.json entry (schemas/production.py).
    producer_report_row: ProducerRow | None = None
    # Never promoted automatically (the reference's member, always null).
    promotion: None = None


_ENCODER: Final = msgspec.json.Encoder(order="deterministic")
_CELL_DECODER: Final = msgspec.json.Decoder(CellReceipt)
_ROW_DECODER: Final = msgspec.json.Decoder(RowReceipt)


def encode_receipt(receipt: CellReceipt | RowReceipt) -> bytes:
    """Canonical bytes of a receipt: deterministic order, indent 2, trailing newline."""
    return msgspec.json.format(_ENCODER.encode(receipt), indent=2) + b"\n"


def decode_cell_receipt(data: bytes) -> CellReceipt:
    return _CELL_DECODER.decode(data)


def decode_row_receipt(data: bytes) -> RowReceipt:
    return _ROW_DECODER.decode(data)
