"""Measurement records: what one load run was asked, what each request did, and the summaries.

Evolution rule: a new field gets a default and goes last; no field is retyped, renamed or
reordered (every field is keyword only). Times are milliseconds unless the name says seconds;
``None`` means "not observed", never zero.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

RequestStatus = Literal["completed", "failed", "incomplete", "not-launched"]
"""completed: a valid final answer; failed: the server or protocol said no (malformed reply,
HTTP error, connection refused); incomplete: cut by a timeout or cancellation while in flight;
not-launched: never sent (the run stopped first)."""

StopType = Literal["limit", "word", "eos"]

TtftUnobserved = Literal["first_token_with_final", "client_stalled"]
"""Why a completed streamed request has no first-token time (nor a TPOT):
``first_token_with_final``, the stream carried no generated token before its final event
(llama-server holds back tokens that render no text), so the first token's arrival cannot be
told from the response's end; ``client_stalled``, the server's own per-event timings show the
client read its first token late (by more than its measured lag) or read the tokens in a burst
faster than the server made them (a TPOT below the server's own): the client was not
scheduled while the server streamed (``states/first_token.py``)."""
FIRST_TOKEN_WITH_FINAL: TtftUnobserved = "first_token_with_final"  # noqa: S105 - a reason
CLIENT_STALLED: TtftUnobserved = "client_stalled"


class ServerTimings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The server's own ``timings`` object from a llama-server ``/completion`` answer."""

    prompt_n: int | None = None
    prompt_ms: float | None = None
    predicted_n: int | None = None
    predicted_ms: float | None = None
    cache_n: int | None = None


class RequestRow(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One request of a roster. A roster always lists every planned request id exactly once."""

    request_id: int
    status: RequestStatus
    excluded_warmup: bool = False
    elapsed_ms: float | None = None
    # Time to the first event carrying a generated token; None for non-streamed (serial)
    # requests and when ``ttft_unobserved`` says why it could not be observed.
    ttft_ms: float | None = None
    # (elapsed - ttft) / max(tokens_predicted - 1, 1); None without a ttft.
    tpot_ms: float | None = None
    tokens_predicted: int | None = None
    tokens_evaluated: int | None = None
    timings: ServerTimings | None = None
    stop_type: StopType | None = None
    # SHA-256 hex of the UTF-8 generated text, and of the first generating chunk (streamed only).
    content_sha256: str | None = None
    first_chunk_sha256: str | None = None
    error: str | None = None
    # The server's own prompt accounting, whatever the dialect (native: ``tokens_evaluated``
    # and ``timings.cache_n``; OpenAI: ``usage.prompt_tokens`` and
    # ``usage.prompt_tokens_details.cached_tokens``): what the cache verdict is folded from.
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    # The server slot that answered (native ``id_slot``); a slot's first request is cold.
    slot_id: int | None = None
    # Why a completed streamed request has no ``ttft_ms``/``tpot_ms`` (never the elapsed
    # time instead). Unset (and not written) when they were observed or the request was not
    # streamed, so a row without it encodes as rows did before the field: older runs re-fold
    # and replay to the same bytes.
    ttft_unobserved: TtftUnobserved | UnsetType = UNSET
    # The server's own ``timings`` on the first event that carried a generated token, when it
    # reports timings on every event (llama-server's ``timings_per_token``): with ``timings``
    # (the final event's) they are the server's own first-token and per-token times. Unset
    # (not written) when the server reported none per event, as in rows from before the field.
    first_token_timings: ServerTimings | UnsetType = UNSET
    # How much later (ms) the client read its first token than the server's per-event timings
    # show it was there, at least: the largest (server time from the first token to a later
    # event) - (client time between reading the two); 0 when no later event says it was late.
    # Unset with ``first_token_timings``.
    first_token_late_ms: float | UnsetType = UNSET


class RungSummary(msgspec.Struct, frozen=True, kw_only=True):
    """Client metrics of one concurrency rung, computed from its roster (states/metrics.py)."""

    concurrency: int
    requested_requests: int
    # Successful requests: completed and not an excluded warmup.
    measured_requests: int
    makespan_seconds: float
    throughput_requests_per_sec: float
    output_tokens_per_sec: float
    # Requests meeting BOTH the TTFT and the TPOT objective, per second of makespan.
    goodput_requests_per_sec: float | None
    observed_completion_tokens: int
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p90_ms: float | None = None
    tpot_p99_ms: float | None = None
    latency_p50_ms: float | None = None
    latency_p90_ms: float | None = None
    latency_p99_ms: float | None = None
    failed_or_unlaunched_requests: int = 0
    # True only when every planned request completed.
    complete: bool = False
    # Measured requests whose first token arrived only with the final event: they have no
    # TTFT or TPOT, so the percentiles above leave them out (all of them: None). Unset (not
    # written) when there is none, so such a summary encodes as summaries did before.
    ttft_unobserved_requests: int | UnsetType = UNSET
    # The server's own first-token and per-token times (``states/first_token.py``), over the
    # measured requests whose server reported timings on every event: first-token time from
    # the server starting the prompt (its queue not included) to the first generated token;
    # per-token time between the first generated token and the last. Unset (not written)
    # when no request had them, so such a summary encodes as summaries did before.
    server_ttft_p50_ms: float | UnsetType = UNSET
    server_ttft_p90_ms: float | UnsetType = UNSET
    server_ttft_p99_ms: float | UnsetType = UNSET
    server_tpot_p50_ms: float | UnsetType = UNSET
    server_tpot_p90_ms: float | UnsetType = UNSET
    server_tpot_p99_ms: float | UnsetType = UNSET

    @property
    def ttft_unobserved_count(self) -> int:
        """``ttft_unobserved_requests``, 0 when unset."""
        count = self.ttft_unobserved_requests
        return 0 if isinstance(count, UnsetType) else count


class SerialSummary(msgspec.Struct, frozen=True, kw_only=True):
    """Serial baseline statistics over the warm (non-excluded) completed requests."""

    warm_mean_ms: float | None
    warm_median_ms: float | None
    excluded_runs: int
    warm_requests: int = 0
    # cache_n the server reported for each warm request, in request order; its minimum is the
    # weakest evidence that the prompt prefix was served from cache.
    warm_cache_n: tuple[int, ...] = ()
    warm_cache_n_min: int | None = None
    complete: bool = False


class CacheTally(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a rung's cache verdict needs of its rows (``states/cache_reuse.py``), tallied one
    row at a time: a few numbers per rung and per server slot, never one per request."""

    # Completed requests whose prompt accounting the server reported.
    seen: int = 0
    # Those whose cached tokens reached the rule's expectation.
    hits: int = 0
    expected_min: int | None = None
    # Every seen request named its slot.
    slotted: bool = True
    # (slot, lowest cached tokens, second lowest or None) for each slot seen.
    slots: tuple[tuple[int, int, int | None], ...] = ()
    # The lowest cached-token counts, ascending (as many as the cell's lanes, plus one).
    lowest: tuple[int, ...] = ()


class RequestDigest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What old/new parity compares of one request (``states/parity.py``)."""

    request_id: int
    status: RequestStatus
    content_sha256: str | None = None
    first_chunk_sha256: str | None = None


class RungFacts(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything a rung's receipt derives from its rows (``states/tally.py``): the load
    actor tallies it as rows end and journals it with ``rung_completed``; replay re-tallies
    the rows file and compares."""

    rows: int
    completed: int
    rung_summary: RungSummary | None = None
    serial_summary: SerialSummary | None = None
    # Refusal codes of a roster that could not be summarised.
    summary_refusals: tuple[str, ...] = ()
    first_content_with_final_ids: tuple[int, ...] = ()
    cache: CacheTally | None = None
    # A stage server's rung of at most parity's request cap: each request's digests, by id,
    # because the row's old/new parity is folded from the journal alone.
    digests: tuple[RequestDigest, ...] = ()


class ClientCalibration(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The run's own client timed against the calibration server on this machine, before the
    first ladder (``states/calibration.py``); times in ms."""

    requests: int
    # Client end-to-end latency minus the server's receipt-to-final-event time.
    overhead_p50_ms: float
    overhead_p90_ms: float
    overhead_max_ms: float
    # Client TTFT minus the server's receipt-to-first-content time.
    ttft_error_p50_ms: float | None = None
    server_ttft_ms: float = 0.0
    server_itl_ms: float = 0.0
    server_tokens: int = 0
    # A rung whose median latencies are within this many times overhead_p50_ms is flagged.
    near_factor: float = 10.0


class LoadRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What one load run (a serial baseline or one ladder rung) is asked to do."""

    base_url: str
    prompt: str
    requests: int
    concurrency: int
    output_tokens: int
    stream: bool
    request_timeout_ms: int
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    # Leading request ids of a rung excluded as warmup (a serial baseline always excludes id 0).
    warmup_requests: int = 0
    # Send ``ignore_eos: true`` (fixed output length): only for a synthetic catalog's tiny
    # random-weight models. A real catalog gets the reference's body exactly, without it.
    ignore_eos: bool = False


LoadStatus = Literal["completed", "incomplete", "failed", "not-launched"]


class LoadOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """The full result of one load run: the complete roster and, when computable, a summary."""

    request: LoadRequest
    prompt_sha256: str
    status: LoadStatus
    # The roster, when the run kept it (``LoadRun`` without a rows file); a run that streamed
    # its rows to a file keeps none of them.
    rows: tuple[RequestRow, ...]
    makespan_seconds: float | None = None
    rung_summary: RungSummary | None = None
    serial_summary: SerialSummary | None = None
    # Why the summary is missing or the run stopped early (a refusal code), if it did.
    stop_reason: str | None = None
    # The roster's tally (what the journal records of it); None for an outcome built by hand.
    facts: RungFacts | None = None
    # Requests cut by their own timeout (not by the cell budget).
    timed_out: int = 0


ReuseRule = Literal["exact-prefix", "checkpoint", "checkpoint-swa", "block"]
"""How a server reuses a cached prompt (``states/cache_reuse.py``): llama-server's exact-prefix
for plain attention, checkpoint for recurrent and hybrid models and checkpoint-swa for
sliding-window attention, which restores to the position before the checkpoint's last token;
block for a paged server that reuses whole blocks of the common prefix (its declared size)."""


class CacheExpectation(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a cell's cache verdicts are judged by, fixed when the cell opens (so a replay by a
    later version judges with the rule the run used). ``rule`` None: an architecture the
    rule table does not know; its rungs get no expected figures."""

    architecture: str | None
    rule: ReuseRule | None
    # llama-server's micro-batch (``-ub``), which places the earlier checkpoint; the cell never
    # passes ``-ub``, so it is the server's default.
    n_ubatch: int
    # The host's slots (``--parallel``): each slot's first request of the cell may be cold.
    lanes: int | None = None
    # A sliding-window family's window (the model header's ``<arch>.attention.sliding_window``),
    # which decides between a whole prefix and a checkpoint (None: unknown, or not such a family).
    sliding_window: int | None = None
    # The block rule's block size in tokens (left out of every other rule's record).
    block_size: int | msgspec.UnsetType = msgspec.UNSET


# Host custody records: what the cell actor journals about the one server process it owns.

# llama-server, or a Skippy stage server's current (``serve``) or legacy (``serve-openai``) CLI.
HostDialect = Literal["llama-server", "current", "legacy"]
CaptureStream = Literal["stdout", "stderr"]


class ProcessOutcome(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How one child we started in a process group of its own ended: the words every kind
    of child shares. A host's custody (``HostCleanup``), a supervised tool child or help probe
    (``system.child.ChildEnded``) and the preparation worker (``WorkerOutcome``) extend it.

    Its fields are the first fields of ``HostCleanup``, in that order: a Struct encodes its
    fields in declaration order (inherited first), and the journal's ``cleanup_outcome``
    bytes must not change."""

    # None: it never started.
    pid: int | None
    # It ended without SIGKILL (on its own or within the SIGTERM grace).
    graceful: bool = False
    # SIGKILL was sent to its process group.
    forced: bool = False
    # The leader's exit status (negative: the signal that ended it); None: not observed.
    exit_code: int | None = None
    # Processes still alive when the stopper gave up: a custody failure.
    surviving_descendants: tuple[int, ...] = ()


class HostCleanup(ProcessOutcome, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the end of one host session went: custody fills it, the journal's
    ``cleanup_outcome`` carries it and ``cell.json`` shows it. ``problems()`` is the verdict."""

    # Required here (the base defaults them for children that never started).
    graceful: bool
    forced: bool
    port_free: bool = False
    state_dir_removed: bool = False
    elapsed_ms: float | None = None
    detail: str = ""
    # Descendants (pid) that left the process group and had to be ended one by one: a custody
    # failure even when they are gone now.
    escaped_descendants: tuple[int, ...] = ()
    # Processes found only by the host's environment tag (they left the process group and
    # the recorded tree: a double fork, setsid) and ended one by one: a custody failure too.
    tagged_escapees: tuple[int, ...] = ()
    capture_truncated: bool = False
    oversized_lines: int = 0
    # A second interrupt shortened the SIGTERM grace (informative, not a failure by itself).
    grace_shortened: bool = False
    # Cleanup ran past its own time bound; whatever is False above was not confirmed.
    bounded_out: bool = False
    state_dir_error: str | None = None

    def problems(self) -> tuple[tuple[str, str], ...]:
        """(fault kind, what) for everything custody left undone or lost of the host's output:
        ``cleanup_forced`` / ``cleanup_unclean`` for the host, ``capture_truncated`` for its
        capture. Empty: clean custody."""
        host = []
        if self.forced:
            host.append("host needed SIGKILL")
        elif not self.graceful:
            host.append("host did not end gracefully")
        if self.escaped_descendants:
            host.append(f"descendants escaped the process group: {list(self.escaped_descendants)}")
        if self.tagged_escapees:
            host.append(
                "processes left the group and the recorded tree (found by the host's "
                f"environment tag): {list(self.tagged_escapees)}"
            )
        if self.surviving_descendants:
            host.append(f"descendants survived: {list(self.surviving_descendants)}")
        if not self.port_free:
            host.append("port still bound")
        if not self.state_dir_removed:
            why = f" ({self.state_dir_error})" if self.state_dir_error else ""
            host.append(f"state dir not removed{why}")
        if self.bounded_out:
            host.append("cleanup ran past its time bound")
        capture = []
        if self.capture_truncated:
            capture.append("host output capture was truncated")
        if self.oversized_lines:
            capture.append(f"{self.oversized_lines} oversized output line(s) were cut")
        kind = "cleanup_forced" if self.forced else "cleanup_unclean"
        return tuple(
            (name, "; ".join(found))
            for name, found in ((kind, host), ("capture_truncated", capture))
            if found
        )

    @property
    def clean(self) -> bool:
        return not self.problems()


class HostSpawned(msgspec.Struct, frozen=True, kw_only=True, tag="host.spawned"):
    label: str
    pid: int
    create_time: float
    port: int
    argv: tuple[str, ...]
    env: dict[str, str]
    state_dir: str
    stdout_log: str
    stderr_log: str


class HostMarkerSeen(msgspec.Struct, frozen=True, kw_only=True, tag="host.marker"):
    label: str
    pid: int
    stream: CaptureStream
    line: str
    after_seconds: float


class HostReady(msgspec.Struct, frozen=True, kw_only=True, tag="host.ready"):
    label: str
    pid: int
    after_seconds: float
    health_attempts: int


class HostFaulted(msgspec.Struct, frozen=True, kw_only=True, tag="host.fault"):
    label: str
    # custody.child_exited | custody.marker_timeout | custody.readiness_failed |
    # custody.spawn_failed
    code: str
    message: str
    pid: int | None = None
    exit_code: int | None = None


class HostCleaned(msgspec.Struct, frozen=True, kw_only=True, tag="host.cleanup"):
    label: str
    outcome: HostCleanup


HostEvent = HostSpawned | HostMarkerSeen | HostReady | HostFaulted | HostCleaned
