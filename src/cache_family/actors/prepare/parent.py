"""Native preparation: operator input in, ``cache-family-input.json`` out (README, "Using it").

The input is admitted before any write; the worker runs in its own session under the preparation
deadline. The prepared input is published (fresh, atomically) only from a clean, timely,
uncancelled worker; a late cancellation or deadline removes only the file the parent wrote.
``prepare-full`` records a ``--use-case-corpus`` as ``unused_corpus`` without reading it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import trio

from cache_family.actors.prepare.admission import Admission, admit
from cache_family.actors.prepare.supervisor import (
    GRACE_SECONDS,
    EventSink,
    WorkerOutcome,
    supervise_worker,
    worker_environment,
)
from cache_family.errors import Refusal, Refused
from cache_family.exit_codes import ExitCode
from cache_family.schemas.bounded import read_bounded
from cache_family.schemas.prepared import (
    OBSERVATIONS_MAX_BYTES,
    PREPARED_INPUT_MAX_BYTES,
    RELAYED_REFUSALS_MAX,
    Mode,
    Observations,
    PreparationRequest,
    PreparedInput,
    decode_document,
    encode_document,
    refuse_oversized_input,
)
from cache_family.system.interrupts import Latch
from cache_family.system.pins import Budget
from cache_family.system.publish import Published, publish_fresh, revoke

# The worker's own code for "my budget ran out", so the parent can say which refusal it was.

REQUEST_NAME: Final = "request.json"
OBSERVATIONS_NAME: Final = "observations.json"
INPUT_NAME: Final = "cache-family-input.json"
STDOUT_LOG: Final = "prepare.stdout.log"
STDERR_LOG: Final = "prepare.stderr.log"

# The worker's budget ends this much before the parent's, so it can refuse on its own terms.
WORKER_MARGIN_SECONDS: Final = 5.0


# --- signals -----------------------------------------------------------------------------------


def preparation_latch(budget: Budget) -> Latch:
    """The one latch (``system/interrupts.py``), outside trio's receiver: it remembers the
    signal and cancels the preparation budget at once."""

    def cancel(signum: int) -> None:
        del signum
        budget.cancel()

    return Latch(on_signal=cancel)


# --- the parent --------------------------------------------------------------------------------


@dataclass(slots=True)
class ParentReport:
    exit_code: int
    refusals: list[Refusal] = field(default_factory=list)
    published: Published | None = None
    revoked: bool = False
    # The prepared input revoked (a late cancellation or deadline), for the console to name.
    revoked_path: str | None = None
    worker: WorkerOutcome | None = None


def _late_refusal(budget: Budget, latch: Latch) -> tuple[int, Refusal] | None:
    if latch.received or budget.cancelled:
        name = latch.received[0] if latch.received else "a signal"
        return ExitCode.INTERRUPTED, Refusal(
            "preparation.interrupted",
            "$",
            f"preparation was interrupted by {name}",
            "observations are kept in the output directory; run preparation again",
        )
    if budget.expired:
        return ExitCode.REFUSED_DURING_WORK, Refusal(
            "preparation.deadline_expired",
            "$",
            "the preparation deadline passed",
            "raise preparation_seconds; observations are kept in the output directory",
        )
    return None


def _worker_refusal(outcome: WorkerOutcome, output: str) -> tuple[int, Refusal] | None:
    logs = f"see {os.path.join(output, STDERR_LOG)}"
    if outcome.cancelled:
        return ExitCode.INTERRUPTED, Refusal(
            "preparation.interrupted",
            "$",
            "preparation was interrupted while the worker ran",
            f"observations are kept; {logs}",
        )
    if outcome.deadline_expired or outcome.exit_code == ExitCode.WORKER_DEADLINE:
        return ExitCode.REFUSED_DURING_WORK, Refusal(
            "preparation.deadline_expired",
            "$.preparation_seconds",
            "the preparation deadline passed before the worker finished",
            f"raise preparation_seconds; {logs}",
        )
    if not outcome.clean:
        how = (
            f"exited with status {outcome.exit_code}"
            if outcome.exit_code is not None and outcome.exit_code >= 0
            else f"was ended by signal {-(outcome.exit_code or 0)}"
        )
        if outcome.forced:
            how += " after SIGKILL"
        if outcome.stdout_truncated:
            how += "; its stdout exceeded the capture limit"
        return ExitCode.REFUSED_DURING_WORK, _worker_refused(
            output, f"the preparation worker {how}"
        )
    return None


def _worker_refused(output: str, message: str) -> Refusal:
    return Refusal(
        "preparation.worker_refused",
        "$",
        message,
        f"the worker's refusals are listed above and in {os.path.join(output, STDERR_LOG)}; "
        f"{OBSERVATIONS_NAME} keeps what it observed (complete: false)",
    )


def _load_observations(output: str) -> Observations:
    raw = read_bounded(
        os.path.join(output, OBSERVATIONS_NAME), OBSERVATIONS_MAX_BYTES, what="observations"
    )
    return decode_document(raw.data, Observations, what="observations")


def relayed_refusals(output: str, request_sha256: str) -> list[Refusal]:
    """The refusals a worker published in an incomplete ``observations.json`` for this
    request (at most :data:`RELAYED_REFUSALS_MAX`, then a count); none when there is none."""
    if not os.path.lexists(os.path.join(output, OBSERVATIONS_NAME)):
        return []
    try:
        observations = _load_observations(output)
    except Refused:
        return []
    return _relayed(observations, request_sha256, output)


def _relayed(observations: Observations, request_sha256: str, output: str) -> list[Refusal]:
    if observations.complete or observations.request_sha256 != request_sha256:
        return []
    relayed = []
    for record in observations.refusals[:RELAYED_REFUSALS_MAX]:
        try:
            relayed.append(Refusal(record.code, record.path, record.message, record.hint))
        except ValueError:  # not a dotted code: not one of ours, so not relayed as one
            continue
    left = len(observations.refusals) - RELAYED_REFUSALS_MAX
    if left > 0:
        relayed.append(
            Refusal(
                "preparation.more_refusals",
                "$",
                f"the worker refused {left} more times",
                f"every refusal is listed in {os.path.join(output, OBSERVATIONS_NAME)}",
            )
        )
    return relayed


def _read_observations(output: str, request_sha256: str, mode: Mode) -> PreparedInput:
    observations = _load_observations(output)
    if observations.request_sha256 != request_sha256:
        raise Refused.one(
            "preparation.request_mismatch",
            "$.request_sha256",
            "observations.json answers a different request.json",
            "run preparation again into a fresh output directory",
        )
    if observations.input is None:
        summary = _worker_refused(output, "the preparation worker published refused observations")
        raise Refused((*_relayed(observations, request_sha256, output), summary))
    if observations.input.mode != mode:
        raise Refused.one(
            "preparation.request_mismatch",
            "$.input.mode",
            f"observations were made for mode {observations.input.mode}, not {mode}",
            "run preparation again into a fresh output directory",
        )
    return observations.input


async def _parent(
    admission: Admission,
    request_sha256: str,
    budget: Budget,
    latch: Latch,
    *,
    environ: Mapping[str, str],
    events: EventSink | None,
    on_start: Callable[[int], None] | None,
    grace_seconds: float,
    after_publish: Callable[[Budget], None] | None,
) -> ParentReport:
    output = admission.output
    cancel = trio.Event()
    report = ParentReport(exit_code=ExitCode.OK)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def watch_signals() -> None:
                async for signum in signals:
                    latch.fire(signum)
                    cancel.set()

            nursery.start_soon(watch_signals)
            if latch.received:
                cancel.set()
            argv = [
                sys.executable,
                "-m",
                "cache_family.cli",
                "prepare-worker",
                "--input",
                os.path.join(output, REQUEST_NAME),
                "--output",
                os.path.join(output, OBSERVATIONS_NAME),
            ]
            outcome = await supervise_worker(
                argv,
                env=worker_environment(environ),
                cwd=output,
                stdout_log=os.path.join(output, STDOUT_LOG),
                stderr_log=os.path.join(output, STDERR_LOG),
                deadline=trio.current_time() + budget.remaining(),
                cancel=cancel,
                grace_seconds=grace_seconds,
                events=events,
                on_start=on_start,
            )
            report.worker = outcome
            refused = _worker_refusal(outcome, output)
            if refused is not None:
                report.refusals.extend(relayed_refusals(output, request_sha256))
            if refused is None:
                try:
                    prepared = _read_observations(output, request_sha256, admission.mode)
                except Refused as exc:
                    report.exit_code = ExitCode.REFUSED_DURING_WORK
                    report.refusals.extend(exc.refusals)
                    nursery.cancel_scope.cancel()
                    return report
                report = await _publish(output, prepared, budget, latch, report, after_publish)
            else:
                report.exit_code, refusal = refused
                report.refusals.append(refusal)
            nursery.cancel_scope.cancel()
    return report


async def _publish(
    output: str,
    prepared: PreparedInput,
    budget: Budget,
    latch: Latch,
    report: ParentReport,
    after_publish: Callable[[Budget], None] | None,
) -> ParentReport:
    late = _late_refusal(budget, latch)
    if late is not None:
        report.exit_code, refusal = late
        report.refusals.append(refusal)
        return report
    try:
        data = encode_document(prepared)
        refuse_oversized_input(data, PREPARED_INPUT_MAX_BYTES)
        report.published = publish_fresh(os.path.join(output, INPUT_NAME), data)
    except Refused as exc:
        report.exit_code = ExitCode.REFUSED_DURING_WORK
        report.refusals.extend(exc.refusals)
        return report
    if after_publish is not None:
        after_publish(budget)
    await trio.lowlevel.checkpoint()  # let a signal that arrived during the write be seen
    return revoke_if_late(report, budget, latch)


def revoke_if_late(report: ParentReport, budget: Budget, latch: Latch) -> ParentReport:
    """After the write: a cancellation or an expired deadline revokes our own file only."""
    late = _late_refusal(budget, latch)
    if late is None or report.published is None:
        return report
    report.exit_code, refusal = late
    report.refusals.append(refusal)
    report.revoked = revoke(report.published)
    report.revoked_path = report.published.path
    report.published = None
    return report


def prepare(
    command: str,
    input_path: str,
    output: str,
    overrides: Sequence[str],
    *,
    environ: Mapping[str, str] | None = None,
    events: EventSink | None = None,
    on_start: Callable[[int], None] | None = None,
    grace_seconds: float = GRACE_SECONDS,
    budget_seconds: float | None = None,
    after_publish: Callable[[Budget], None] | None = None,
) -> ParentReport:
    """The parent's work, printing nothing: what it published or refused. ``events`` gets the
    worker's event lines and ``on_start`` its pid (the console shows both). ``budget_seconds``
    and ``after_publish`` are test-only hooks (a budget below the schema's 30 s minimum; a
    callback right after the fresh write that may cancel or expire the budget); the CLI never
    passes them."""
    env = os.environ if environ is None else environ
    try:
        admission = admit(command, input_path, output, overrides, environ=env)
    except Refused as refused:
        return ParentReport(exit_code=ExitCode.REFUSED, refusals=list(refused.refusals))
    budget = Budget.seconds(admission.budget_seconds if budget_seconds is None else budget_seconds)
    latch = preparation_latch(budget)
    with latch.installed():
        try:
            os.mkdir(admission.output, 0o755)
        except OSError as exc:
            exists = isinstance(exc, FileExistsError)
            refusal = Refusal(
                "preparation.output_exists" if exists else "preparation.output_unwritable",
                "$.output",
                f"output {admission.output} appeared before it could be created"
                if exists
                else f"output {admission.output} cannot be created: {exc.strerror}",
                "choose a fresh output path in a writable directory",
            )
            return ParentReport(exit_code=ExitCode.REFUSED, refusals=[refusal])
        try:
            request_bytes = encode_document(
                PreparationRequest(
                    schema_version=1,
                    mode=admission.mode,
                    operator=admission.operator,
                    corpus_source=admission.corpus_source,
                    worker_budget_ms=(worker_ms := _worker_budget_ms(budget.remaining())),
                    worker_deadline_monotonic_ns=time.monotonic_ns() + worker_ms * 1_000_000,
                    unused_corpus=admission.unused_corpus,
                    workloads=admission.workloads,
                    native_output_tokens=admission.native_output_tokens,
                )
            )
            publish_fresh(os.path.join(admission.output, REQUEST_NAME), request_bytes)
            report = trio.run(
                functools.partial(
                    _parent,
                    admission,
                    hashlib.sha256(request_bytes).hexdigest(),
                    budget,
                    latch,
                    environ=env,
                    events=events,
                    on_start=on_start,
                    grace_seconds=grace_seconds,
                    after_publish=after_publish,
                )
            )
        except OSError as exc:
            report = ParentReport(
                exit_code=ExitCode.REFUSED_DURING_WORK,
                refusals=[
                    Refusal(
                        "preparation.io",
                        "$.output",
                        f"preparation could not read or write {exc.filename}: {exc.strerror}",
                        "check the disk and the output directory; what was written is kept",
                    )
                ],
            )
        # trio redelivered any signal it had not handed out to the latch when its receiver
        # closed: check once more with our own handlers still in place.
        report = revoke_if_late(report, budget, latch)
    return report


def _worker_budget_ms(remaining: float) -> int:
    margin = min(WORKER_MARGIN_SECONDS, remaining / 4)
    return max(1, min(3_600_000, int((remaining - margin) * 1000)))


# --- the worker --------------------------------------------------------------------------------
