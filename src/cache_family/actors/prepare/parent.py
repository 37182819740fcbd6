"""Native preparation: operator input in, ``cache-family-input.json`` out (README, "Using it").

The parent (``prepare-full`` / ``prepare-use-cases``) admits the input before any write
(:mod:`~cache_family.actors.prepare.admission`), creates the output directory and
``request.json``, and runs ``prepare-worker`` in its own session under the preparation
deadline (:mod:`~cache_family.actors.prepare.supervisor`). The worker pins tools, trees and
models (:mod:`~cache_family.actors.prepare.models`), plans rows and profiles, and writes
``observations.json`` bound to the SHA-256 of ``request.json``, with ``complete: false`` and
every refusal when it refuses. The parent publishes the prepared input fresh and atomically
only from a clean, timely, uncancelled worker, and on a late cancellation or deadline removes
only the file it wrote.
``prepare-full`` plans no use cases: it records a ``--use-case-corpus`` (which the
reference wrapper passes to both modes) as ``unused_corpus`` without reading it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Final, TextIO

import trio

from cache_family.actors.prepare.admission import Admission, admit
from cache_family.actors.prepare.supervisor import (
    GRACE_SECONDS,
    WorkerEvents,
    WorkerOutcome,
    supervise_worker,
    worker_environment,
)
from cache_family.console.refusals import print_refusals, say_failed
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


class InterruptLatch:
    """SIGINT/SIGTERM outside trio's receiver: remember the signal and cancel the budget."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.signum: int | None = None

    def fire(self, signum: int) -> None:
        if self.signum is None:
            self.signum = signum
        self.budget.cancel()

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        del frame
        self.fire(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[InterruptLatch]:
        previous = {
            sig: signal.signal(sig, self._handler) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


# --- the parent --------------------------------------------------------------------------------


@dataclass(slots=True)
class ParentReport:
    exit_code: int
    refusals: list[Refusal] = field(default_factory=list)
    published: Published | None = None
    revoked: bool = False
    worker: WorkerOutcome | None = None


def _late_refusal(budget: Budget, latch: InterruptLatch) -> tuple[int, Refusal] | None:
    if latch.signum is not None or budget.cancelled:
        name = signal.Signals(latch.signum).name if latch.signum else "a signal"
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
    if outcome.deadline_expired or outcome.returncode == ExitCode.WORKER_DEADLINE:
        return ExitCode.REFUSED_DURING_WORK, Refusal(
            "preparation.deadline_expired",
            "$.preparation_seconds",
            "the preparation deadline passed before the worker finished",
            f"raise preparation_seconds; {logs}",
        )
    if not outcome.clean:
        how = (
            f"exited with status {outcome.returncode}"
            if outcome.returncode is not None and outcome.returncode >= 0
            else f"was ended by signal {-(outcome.returncode or 0)}"
        )
        if outcome.killed:
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
    latch: InterruptLatch,
    *,
    environ: Mapping[str, str],
    stderr: TextIO,
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
            if latch.signum is not None:
                cancel.set()
            events = WorkerEvents(stderr)
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
                on_start=lambda pid: print(
                    f"preparation: worker pid {pid} started", file=stderr, flush=True
                ),
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
    latch: InterruptLatch,
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


def revoke_if_late(report: ParentReport, budget: Budget, latch: InterruptLatch) -> ParentReport:
    """After the write: a cancellation or an expired deadline revokes our own file only."""
    late = _late_refusal(budget, latch)
    if late is None or report.published is None:
        return report
    report.exit_code, refusal = late
    report.refusals.append(refusal)
    report.revoked = revoke(report.published)
    report.published = None
    return report


def run_prepare(
    command: str,
    input_path: str,
    output: str,
    overrides: Sequence[str],
    *,
    environ: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    grace_seconds: float = GRACE_SECONDS,
    budget_seconds: float | None = None,
    after_publish: Callable[[Budget], None] | None = None,
) -> int:
    """The parent command. ``budget_seconds`` and ``after_publish`` are test-only hooks
    (a budget below the schema's 30 s minimum; a callback right after the fresh write that
    may cancel or expire the budget); the CLI never passes them."""
    env = os.environ if environ is None else environ
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    try:
        admission = admit(command, input_path, output, overrides, environ=env)
    except Refused as refused:
        print_refusals(refused.refusals, err)
        return ExitCode.REFUSED
    budget = Budget.seconds(admission.budget_seconds if budget_seconds is None else budget_seconds)
    latch = InterruptLatch(budget)
    with latch.installed():
        try:
            os.mkdir(admission.output, 0o755)
        except OSError as exc:
            exists = isinstance(exc, FileExistsError)
            print_refusals(
                [
                    Refusal(
                        "preparation.output_exists" if exists else "preparation.output_unwritable",
                        "$.output",
                        f"output {admission.output} appeared before it could be created"
                        if exists
                        else f"output {admission.output} cannot be created: {exc.strerror}",
                        "choose a fresh output path in a writable directory",
                    )
                ],
                err,
            )
            return ExitCode.REFUSED
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
                    stderr=err,
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
    if report.refusals:
        print_refusals(report.refusals, err)
        if report.revoked:
            print(f"preparation: revoked {os.path.join(admission.output, INPUT_NAME)}", file=err)
        return report.exit_code
    assert report.published is not None
    print(f"Wrote {report.published.path}", file=out, flush=True)
    return ExitCode.OK


def _worker_budget_ms(remaining: float) -> int:
    margin = min(WORKER_MARGIN_SECONDS, remaining / 4)
    return max(1, min(3_600_000, int((remaining - margin) * 1000)))


def prepare_command(command: str, input: str, output: str, overrides: list[str]) -> int:
    """``cache-family prepare-full|prepare-use-cases --input ABS --output ABS [overrides]``."""
    code = run_prepare(command, input, output, overrides)
    say_prepare_failed(sys.stderr, command, input, output, code)
    return code


def say_prepare_failed(stream: TextIO, command: str, input: str, output: str, code: int) -> None:
    """The closing lines of a preparation that did not publish: what, evidence, next."""
    again = f"then run `cache-family {command}` again into a fresh --output"
    if code == ExitCode.REFUSED:
        say_failed(
            stream,
            command,
            "refused before any work (the refusals above)",
            f"{input}; nothing was written under {output}",
            f"fix what each refusal names (`cache-family validate --input {input}` lists the "
            f"operator input's), {again}",
        )
    elif code == ExitCode.REFUSED_DURING_WORK:
        say_failed(
            stream,
            command,
            "refused while observing (the refusals above)",
            f"{output}: request.json, observations.json (complete: false) and the worker logs",
            f"fix what each refusal names, {again}",
        )
    elif code == ExitCode.INTERRUPTED:
        say_failed(
            stream,
            command,
            "interrupted by a signal",
            f"{output} (whatever was observed; no prepared input was left)",
            f"when ready, {again}",
        )


# --- the worker --------------------------------------------------------------------------------
