"""Native preparation: operator input in, ``cache-family-input.json`` out (README, "Using it").

The parent (``prepare-full`` / ``prepare-use-cases``) admits the input before any write
(:mod:`~cache_family.actors.preparation_admission`), creates the output directory and
``request.json``, and runs ``prepare-worker`` in its own session under the preparation
deadline (:mod:`~cache_family.actors.preparation_supervisor`). The worker pins tools, trees and
models (:mod:`~cache_family.actors.preparation_models`), plans rows and profiles, and writes
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
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import FrameType
from typing import IO, Final, TextIO

import msgspec
import trio

from cache_family.actors.pins import Budget, FilePin, TreePin, pin_tree
from cache_family.actors.preparation_admission import Admission, admit, load_plan_catalog
from cache_family.actors.preparation_models import (
    Gathered,
    ModelLook,
    context_refusals,
    examine_models,
    hash_models,
    missing_observation,
    pin_files,
)
from cache_family.actors.preparation_supervisor import (
    GRACE_SECONDS,
    WorkerEvents,
    WorkerOutcome,
    supervise_worker,
    worker_environment,
)
from cache_family.actors.progress import say_failed
from cache_family.actors.publish import Published, publish_fresh, revoke
from cache_family.errors import Refusal, Refused, json_path
from cache_family.schemas.bounded import read_bounded
from cache_family.schemas.catalog import LoadedCatalog
from cache_family.schemas.catalog import packaged_catalog as _packaged_catalog
from cache_family.schemas.corpus import LoadedCorpus, load_corpus
from cache_family.schemas.operator import PlanInput
from cache_family.schemas.prepared import (
    OBSERVATIONS_MAX_BYTES,
    PREPARED_INPUT_MAX_BYTES,
    PREPARED_SCOPE,
    RELAYED_REFUSALS_MAX,
    REQUEST_MAX_BYTES,
    UNUSED_CORPUS_REASON,
    CatalogUsed,
    CorpusUsed,
    FilePinRecord,
    Mode,
    ModelObservation,
    Observations,
    ObservedSoFar,
    PreparationRequest,
    PreparedInput,
    RefusalRecord,
    SourceCommits,
    ToolPins,
    TreePinRecord,
    UnusedCorpus,
    UseCaseRecord,
    UseCaseSourceRecord,
    decode_document,
    encode_document,
    refuse_oversized_input,
)
from cache_family.states.planning import (
    ProfileInputs,
    build_profiles,
    check_selection,
    plan_rows,
    selected_presets,
)

EXIT_OK: Final = 0
EXIT_REFUSED: Final = 2
EXIT_REFUSED_DURING_WORK: Final = 3
EXIT_INTERRUPTED: Final = 130
# The worker's own code for "my budget ran out", so the parent can say which refusal it was.
WORKER_EXIT_DEADLINE: Final = 124

REQUEST_NAME: Final = "request.json"
OBSERVATIONS_NAME: Final = "observations.json"
INPUT_NAME: Final = "cache-family-input.json"
STDOUT_LOG: Final = "prepare.stdout.log"
STDERR_LOG: Final = "prepare.stderr.log"

# The worker's budget ends this much before the parent's, so it can refuse on its own terms.
WORKER_MARGIN_SECONDS: Final = 5.0
PROGRESS_INTERVAL_SECONDS: Final = 0.2


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
        return EXIT_INTERRUPTED, Refusal(
            "preparation.interrupted",
            "$",
            f"preparation was interrupted by {name}",
            "observations are kept in the output directory; run preparation again",
        )
    if budget.expired:
        return EXIT_REFUSED_DURING_WORK, Refusal(
            "preparation.deadline_expired",
            "$",
            "the preparation deadline passed",
            "raise preparation_seconds; observations are kept in the output directory",
        )
    return None


def _worker_refusal(outcome: WorkerOutcome, output: str) -> tuple[int, Refusal] | None:
    logs = f"see {os.path.join(output, STDERR_LOG)}"
    if outcome.cancelled:
        return EXIT_INTERRUPTED, Refusal(
            "preparation.interrupted",
            "$",
            "preparation was interrupted while the worker ran",
            f"observations are kept; {logs}",
        )
    if outcome.deadline_expired or outcome.returncode == WORKER_EXIT_DEADLINE:
        return EXIT_REFUSED_DURING_WORK, Refusal(
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
        return EXIT_REFUSED_DURING_WORK, _worker_refused(output, f"the preparation worker {how}")
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
    report = ParentReport(exit_code=EXIT_OK)
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
                    report.exit_code = EXIT_REFUSED_DURING_WORK
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
        report.exit_code = EXIT_REFUSED_DURING_WORK
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
        _print_refusals(refused.refusals, err)
        return EXIT_REFUSED
    budget = Budget.seconds(admission.budget_seconds if budget_seconds is None else budget_seconds)
    latch = InterruptLatch(budget)
    with latch.installed():
        try:
            os.mkdir(admission.output, 0o755)
        except OSError as exc:
            exists = isinstance(exc, FileExistsError)
            _print_refusals(
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
            return EXIT_REFUSED
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
                exit_code=EXIT_REFUSED_DURING_WORK,
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
        _print_refusals(report.refusals, err)
        if report.revoked:
            print(f"preparation: revoked {os.path.join(admission.output, INPUT_NAME)}", file=err)
        return report.exit_code
    assert report.published is not None
    print(f"Wrote {report.published.path}", file=out, flush=True)
    return EXIT_OK


def _worker_budget_ms(remaining: float) -> int:
    margin = min(WORKER_MARGIN_SECONDS, remaining / 4)
    return max(1, min(3_600_000, int((remaining - margin) * 1000)))


def _print_refusals(refusals: Sequence[Refusal], stream: TextIO) -> None:
    for refusal in refusals:
        print(f"refused: {refusal.line()}", file=stream, flush=True)


def prepare_command(command: str, input: str, output: str, overrides: list[str]) -> int:
    """``cache-family prepare-full|prepare-use-cases --input ABS --output ABS [overrides]``."""
    code = run_prepare(command, input, output, overrides)
    say_prepare_failed(sys.stderr, command, input, output, code)
    return code


def say_prepare_failed(stream: TextIO, command: str, input: str, output: str, code: int) -> None:
    """The closing lines of a preparation that did not publish: what, evidence, next."""
    again = f"then run `cache-family {command}` again into a fresh --output"
    if code == EXIT_REFUSED:
        say_failed(
            stream,
            command,
            "refused before any work (the refusals above)",
            f"{input}; nothing was written under {output}",
            f"fix what each refusal names (`cache-family validate --input {input}` lists the "
            f"operator input's), {again}",
        )
    elif code == EXIT_REFUSED_DURING_WORK:
        say_failed(
            stream,
            command,
            "refused while observing (the refusals above)",
            f"{output}: request.json, observations.json (complete: false) and the worker logs",
            f"fix what each refusal names, {again}",
        )
    elif code == EXIT_INTERRUPTED:
        say_failed(
            stream,
            command,
            "interrupted by a signal",
            f"{output} (whatever was observed; no prepared input was left)",
            f"when ready, {again}",
        )


# --- the worker --------------------------------------------------------------------------------


class EventWriter:
    """JSON lines on the worker's stdout for the parent's display; thread-safe, throttled."""

    def __init__(self, stream: IO[str], clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.clock = clock
        self._lock = threading.Lock()

    def emit(self, **event: object) -> None:
        line = json.dumps(event, separators=(",", ":"))
        with self._lock:
            self.stream.write(line + "\n")
            self.stream.flush()

    def phase(self, text: str) -> None:
        self.emit(event="phase", text=text)


class JsonProgress:
    """A :class:`ProgressSink` that reports hashed bytes as throttled JSON events."""

    def __init__(self, writer: EventWriter) -> None:
        self.writer = writer
        self._lock = threading.Lock()
        self.files = 0
        self.total = 0
        self.done = 0
        self._last = 0.0

    def begin(self, files: int, total_bytes: int) -> None:
        with self._lock:
            self.files, self.total, self.done = files, total_bytes, 0
        self.writer.emit(event="progress", files=files, done=0, total=total_bytes)

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            now = self.writer.clock()
            if now - self._last < PROGRESS_INTERVAL_SECONDS:
                return
            self._last = now
            done, total, files = self.done, self.total, self.files
        self.writer.emit(event="progress", files=files, done=done, total=total)

    def end(self) -> None:
        self.writer.emit(event="progress", files=self.files, done=self.done, total=self.total)


def _file_record(pin: FilePin) -> FilePinRecord:
    return FilePinRecord(path=pin.path, sha256=pin.sha256, size=pin.size)


def _tree_record(pin: TreePin) -> TreePinRecord:
    return TreePinRecord(path=pin.path, sha256=pin.sha256, files=pin.files, size=pin.size)


@dataclass(slots=True)
class WorkerRecord:
    """What the worker has observed so far: published with its refusals when it refuses."""

    phase: str = "reading the request"
    tools: dict[str, FilePinRecord] = field(default_factory=dict)
    native_build: TreePinRecord | None = None
    toolkit_directories: dict[str, TreePinRecord] = field(default_factory=dict)
    catalog: CatalogUsed | None = None
    corpus: CorpusUsed | None = None
    models: dict[str, ModelObservation] = field(default_factory=dict)
    models_hashed: bool = False

    def so_far(self) -> ObservedSoFar:
        # The same fields by the same names; ObservedSoFar refuses any field it does not have.
        return ObservedSoFar(**{f.name: getattr(self, f.name) for f in fields(self)})


def observe(
    request: PreparationRequest,
    budget: Budget,
    events: EventWriter,
    record: WorkerRecord | None = None,
) -> PreparedInput:
    """The worker's whole observation: pins, trees, models, rows and profiles.

    Every check runs and every refusal is gathered before the worker refuses, except that
    model bytes are hashed only when every cheaper check passed (hashing a 100 GB model
    to report one more refusal of an already refused plan would delay the answer by
    minutes), and that planning needs a catalog, a corpus and a cache root.
    """
    run = _Observing(request, budget, events, WorkerRecord() if record is None else record)
    _pin_tools(run)
    _pin_trees(run)
    _load_catalog(run)  # refuses now without a catalog, corpus or cache root
    _examine_models(run)  # refuses now when a model's layout or identity is wrong
    _hash_models(run)  # refuses now when bytes differ from a declared pin
    return _plan(run)


@dataclass(slots=True)
class _Observing:
    """One observation in progress: pins so far in ``record``, the rest of what steps found."""

    request: PreparationRequest
    budget: Budget
    events: EventWriter
    record: WorkerRecord
    gathered: Gathered = field(default_factory=Gathered)
    catalog: LoadedCatalog | None = None
    corpus: LoadedCorpus | None = None
    cache_root: str = ""
    looks: list[ModelLook] = field(default_factory=list)
    progress: JsonProgress = field(init=False)

    def __post_init__(self) -> None:
        self.progress = JsonProgress(self.events)

    def phase(self, text: str) -> None:
        self.record.phase = text
        self.events.phase(text)


def _pin_tools(run: _Observing) -> None:
    """Pin every tool and server binary; a server's declared pin must match its bytes."""
    run.phase("pinning tools and servers")
    operator = run.request.operator
    plan = operator.plan
    named = [
        ("correctness", operator.correctness, "$.correctness"),
        ("stage_server", operator.stage_server, "$.stage_server"),
    ]
    if operator.native_server is not None:
        named.append(("native_server", operator.native_server, "$.native_server"))
    if operator.artifact_tool is not None:
        named.append(("artifact_tool", operator.artifact_tool, "$.artifact_tool"))
    if plan.old_server is not None and plan.new_server is not None:
        named.append(("old_server", plan.old_server.path, "$.plan.old_server.path"))
        named.append(("new_server", plan.new_server.path, "$.plan.new_server.path"))
    tools = pin_files(named, run.budget, run.progress, run.gathered)
    run.record.tools = {name: _file_record(pin) for name, pin in tools.items()}
    for name, declared in (("old_server", plan.old_server), ("new_server", plan.new_server)):
        pin = tools.get(name)
        if pin is not None and declared is not None and declared.sha256 not in (None, pin.sha256):
            run.gathered.refusals.append(
                Refusal(
                    "preparation.server_pin_mismatch",
                    json_path(["plan", name, "sha256"]),
                    f"{name} {pin.path} has SHA-256 {pin.sha256}, "
                    f"not the declared {declared.sha256}",
                    "restore the binary or update its sha256 (or set it to null to fill it in)",
                )
            )


def _pin_trees(run: _Observing) -> None:
    """Pin the native build tree and every toolkit directory (whose declared pin must match)."""
    operator = run.request.operator
    run.phase("pinning the native build tree")
    try:
        native_build = pin_tree(
            operator.native_build, run.budget, json_path="$.native_build", progress=run.progress
        )
        run.record.native_build = _tree_record(native_build)
    except Refused as exc:
        run.gathered.add(exc)
    toolkits: dict[str, TreePinRecord] = {}
    if operator.toolkit_directories:
        run.phase("pinning toolkit directories")
    for name, toolkit in sorted(operator.toolkit_directories.items()):
        where = json_path(["toolkit_directories", name])
        try:
            pin = pin_tree(toolkit.path, run.budget, json_path=where, progress=run.progress)
        except Refused as exc:
            run.gathered.add(exc)
            continue
        if pin.sha256 == toolkit.sha256:
            toolkits[name] = _tree_record(pin)
            continue
        run.gathered.refusals.append(
            Refusal(
                "preparation.toolkit_pin_mismatch",
                f"{where}.sha256",
                f"toolkit {name} at {pin.path} has tree pin {pin.sha256}, "
                f"not the declared {toolkit.sha256}",
                "restore the toolkit or update its pin",
            )
        )
    run.record.toolkit_directories = toolkits


def _load_catalog(run: _Observing) -> None:
    """The plan's catalog, its corpus (prepare-use-cases) and the canonical cache root."""
    run.phase("loading the catalog and corpus")
    try:
        run.catalog, run.corpus = _catalog_and_corpus(run.request, run.record)
    except Refused as exc:
        run.gathered.add(exc)
        run.gathered.raise_any()
    plan = run.request.operator.plan
    try:
        run.cache_root = os.path.realpath(plan.cache_root, strict=True)
    except OSError:
        run.cache_root = ""
    if not run.cache_root or not Path(run.cache_root).is_dir():
        run.gathered.refusals.append(
            Refusal(
                "preparation.cache_root_missing",
                "$.plan.cache_root",
                f"cache root {plan.cache_root} is not a directory",
                "point plan.cache_root at the hub cache directory",
            )
        )
        run.gathered.raise_any()


def _examine_models(run: _Observing) -> None:
    """Find each selected model's files and check what their headers claim."""
    run.phase("examining models")
    assert run.catalog is not None
    operator = run.request.operator
    presets = selected_presets(operator.plan, run.catalog.catalog)
    run.looks = examine_models(presets, run.cache_root, operator.artifact_tool, run.gathered)
    run.record.models = {
        look.preset.key: missing_observation(look, operator.plan.model_sha256)
        for look in run.looks
        if not look.present
    }
    run.gathered.raise_any()


def _hash_models(run: _Observing) -> None:
    """Pin every present model's bytes (every shard of a split model)."""
    run.phase("hashing model bytes")
    declared = run.request.operator.plan.model_sha256
    models = hash_models(run.looks, declared, run.budget, run.progress, run.gathered)
    run.record.models, run.record.models_hashed = models, True
    run.gathered.raise_any()
    run.budget.check("$")


def _plan(run: _Observing) -> PreparedInput:
    """Plan the rows and build the profiles from the pins; the prepared input, size-checked."""
    run.phase("planning rows and profiles")
    record, operator = run.record, run.request.operator
    assert record.native_build is not None and run.catalog is not None
    pinned_plan = _pinned_plan(operator.plan, record.tools, record.models)
    corpus = run.corpus.corpus if run.corpus is not None else None
    rows = plan_rows(pinned_plan, run.catalog.catalog, corpus, record.models)
    run.gathered.refusals.extend(context_refusals(rows))
    run.gathered.raise_any()
    tools = ToolPins(
        correctness=record.tools["correctness"],
        stage_server=record.tools["stage_server"],
        native_server=record.tools.get("native_server"),
        artifact_tool=record.tools.get("artifact_tool"),
    )
    profiles = build_profiles(
        rows,
        ProfileInputs(
            operator=operator,
            tools=tools,
            native_build=record.native_build,
            toolkit_directories=record.toolkit_directories,
            old_server=record.tools.get("old_server"),
            new_server=record.tools.get("new_server"),
        ),
    )
    prepared = PreparedInput(
        schema_version=1,
        scope=PREPARED_SCOPE,
        mode=run.request.mode,
        plan=pinned_plan,
        catalog=_catalog_used(run.catalog),
        corpus=record.corpus,
        cache_root=run.cache_root,
        native_build=record.native_build,
        tools=tools,
        toolkit_directories=record.toolkit_directories,
        environment=dict(operator.environment),
        source_commits=SourceCommits(
            old=operator.old_source_commit,
            new=operator.new_source_commit,
            native=operator.native_source_commit,
        ),
        borrow_resident_hits=operator.borrow_resident_hits,
        cache_decoded_result_hits=operator.cache_decoded_result_hits,
        execution_seconds=operator.execution_seconds,
        cell_seconds=operator.cell_seconds,
        request_timeout_ms=operator.request_timeout_ms,
        rows=rows,
        row_count=len(rows),
        profiles=profiles,
        use_cases=_use_case_records(run.corpus),
        unused_corpus=(
            UnusedCorpus(path=run.request.unused_corpus, reason=UNUSED_CORPUS_REASON)
            if run.request.unused_corpus is not None
            else None
        ),
    )
    run.phase("checking the prepared input's size")
    refuse_oversized_input(encode_document(prepared), PREPARED_INPUT_MAX_BYTES)
    return prepared


def _use_case_records(corpus: LoadedCorpus | None) -> list[UseCaseRecord]:
    return [
        UseCaseRecord(
            key=use_case.key,
            label=use_case.label,
            prompt=use_case.prompt,
            prefix_tokens=use_case.prefix_tokens,
            source=UseCaseSourceRecord(**msgspec.structs.asdict(use_case.source)),
        )
        for use_case in (corpus.corpus.use_cases if corpus is not None else ())
    ]


def _catalog_and_corpus(
    request: PreparationRequest, record: WorkerRecord
) -> tuple[LoadedCatalog, LoadedCorpus | None]:
    """The plan's catalog and, for prepare-use-cases, its corpus, both still as admitted."""
    plan = request.operator.plan
    catalog = load_plan_catalog(plan)
    record.catalog = _catalog_used(catalog)
    corpus = None
    if request.mode == "use-cases":
        if plan.corpus is None or request.corpus_source is None:
            raise Refused.one(
                "preparation.corpus_missing",
                "$.plan.corpus",
                "prepare-use-cases needs a corpus",
                "give --use-case-corpus",
            )
        corpus = load_corpus(plan.corpus.path)
        if corpus.sha256 != plan.corpus.sha256:
            raise Refused.one(
                "preparation.corpus_pin_mismatch",
                "$.plan.corpus.sha256",
                f"corpus {corpus.path} changed since admission",
                "run preparation again",
            )
        record.corpus = CorpusUsed(
            path=corpus.path, sha256=corpus.sha256, source=request.corpus_source
        )
    elif plan.use_cases or plan.corpus is not None:
        raise Refused.one(
            "preparation.mode",
            "$.plan.use_cases",
            "prepare-full plans no use cases",
            "run prepare-use-cases",
        )
    check_selection(plan, catalog.catalog, corpus.corpus if corpus else None)
    return catalog, corpus


def _catalog_used(loaded: LoadedCatalog) -> CatalogUsed:
    packaged = loaded is _packaged_catalog()
    return CatalogUsed(
        path=loaded.path,
        sha256=loaded.sha256,
        synthetic=loaded.catalog.synthetic,
        packaged=packaged,
    )


def _pinned_plan(
    plan: PlanInput,
    tools: Mapping[str, FilePinRecord],
    observations: Mapping[str, ModelObservation],
) -> PlanInput:
    """The plan with server paths canonical, server pins observed and model pins observed."""
    document = plan.model_dump(mode="json")
    for name in ("old_server", "new_server"):
        if name in tools:
            document[name] = {"path": tools[name].path, "sha256": tools[name].sha256}
    document["model_sha256"] = {
        key: obs.sha256 for key, obs in observations.items() if obs.sha256 is not None
    }
    return PlanInput.model_validate(document, strict=True)


def _publish_refused(
    output_path: str, request_sha256: str, refusals: Sequence[Refusal], record: WorkerRecord
) -> Refusal | None:
    """Publish ``observations.json`` with ``complete: false``; a refusal if that fails."""
    partial = Observations(
        schema_version=1,
        request_sha256=request_sha256,
        scope=PREPARED_SCOPE,
        input=None,
        complete=False,
        refusals=[RefusalRecord(**refusal.as_dict()) for refusal in refusals],
        observed=record.so_far(),
    )
    try:
        publish_fresh(output_path, encode_document(partial))
    except Refused as refused:
        return refused.refusals[0]
    except OSError as exc:
        return Refusal(
            "preparation.io",
            "$",
            f"the refused observations could not be written: {exc.strerror}",
            "check the disk and the output directory",
        )
    return None


async def _worker(input_path: str, output_path: str, stderr: TextIO) -> int:
    budget = Budget(float("inf"))
    record = WorkerRecord()
    request_sha256: str | None = None
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def watch_signals() -> None:
                async for _ in signals:
                    budget.cancel()

            nursery.start_soon(watch_signals)
            try:
                raw = read_bounded(input_path, REQUEST_MAX_BYTES, what="preparation request")
                request_sha256 = raw.sha256
                request = decode_document(raw.data, PreparationRequest, what="preparation request")
                budget.deadline = time.monotonic() + request.worker_budget_ms / 1000
                if request.worker_deadline_monotonic_ns is not None:
                    budget.deadline = min(
                        budget.deadline, request.worker_deadline_monotonic_ns / 1e9
                    )
                events = EventWriter(sys.stdout)
                prepared = await trio.to_thread.run_sync(observe, request, budget, events, record)
                budget.check("$")
                observations = Observations(
                    schema_version=1,
                    request_sha256=raw.sha256,
                    scope=PREPARED_SCOPE,
                    input=prepared,
                )
                published = publish_fresh(output_path, encode_document(observations))
                try:
                    budget.check("$")
                except Refused:
                    revoke(published)
                    raise
                events.phase(f"observed {prepared.row_count} rows")
                code = EXIT_OK
            except Refused as refused:
                refusals = list(refused.refusals)
                if request_sha256 is not None:
                    failed = _publish_refused(output_path, request_sha256, refusals, record)
                    if failed is not None:
                        refusals.append(failed)
                _print_refusals(refusals, stderr)
                code = EXIT_REFUSED_DURING_WORK
                if budget.cancelled:
                    code = EXIT_INTERRUPTED
                elif "budget.deadline_expired" in refused.codes:
                    code = WORKER_EXIT_DEADLINE
            nursery.cancel_scope.cancel()
    return code


def worker_command(input: str, output: str) -> int:
    """Hidden ``cache-family prepare-worker --input REQUEST --output OBSERVATIONS``."""
    return trio.run(_worker, input, output, sys.stderr)
