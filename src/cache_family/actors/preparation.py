"""Native preparation: operator input in, ``cache-family-input.json`` out, observing bytes.

``prepare-full`` / ``prepare-use-cases`` (the parent) and ``prepare-worker`` (its child):

1. Admission, before any write: bounded read of the operator input, CLI overrides and the
   mode's use-case selection applied, full validation (schema, catalog pin, selection), and
   the output checked: it must not exist, its parent must, and its canonical path must be
   disjoint from the native build, the cache root and every toolkit directory. A refusal
   here creates nothing (exit 2).
2. The parent creates the output directory, writes ``request.json`` and runs the worker as
   ``python -m cache_family.cli prepare-worker`` in its own session, with a minimal
   environment, under the preparation deadline; cancellation (SIGINT/SIGTERM to the parent)
   or the deadline stop it with SIGTERM, a grace period, then SIGKILL. Worker logs are kept
   as ``prepare.stdout.log`` / ``prepare.stderr.log``.
3. The worker pins tools, servers, the native build tree, toolkit trees and every model's
   bytes (threads, 1 MiB chunks, budget checked between chunks), plans the rows and builds
   the profiles, and writes ``observations.json`` bound to the SHA-256 of ``request.json``.
4. The parent accepts the observations only from a clean, timely, uncancelled worker whose
   ``request_sha256`` matches, then publishes ``cache-family-input.json`` fresh and
   atomically, re-checks cancellation and the deadline after the write (and again after its
   signal handling is taken down), and on a late refusal removes only the file it wrote.

The corpus of ``prepare-use-cases`` (which plans every use case, ``["all"]``) is the first of:
``--use-case-corpus ABS`` (``corpus.source`` "override"), ``$SKIPPY_CACHE_USECASE_CORPUS``
("environment"), the operator input's own ``plan.corpus``, whose bytes must match its declared
SHA-256 ("operator-plan"), and the repository's ``corpus/use-cases.json`` ("checked-in"). The
prepared input records the path, the SHA-256 of the bytes read and that source.
``prepare-full`` plans no use cases: it ignores ``plan.corpus`` and the environment variable
and refuses ``--use-case-corpus``.

Exit codes: 0 published; 2 input refused, nothing written; 3 refused during preparation,
observations kept; 130 interrupted. A worker that refuses still publishes ``observations.json``
with ``complete: false``, every refusal it found and what it had observed until then (pins
of tools, trees and models); the parent prints those refusals before its own summary.

Test-only parameters of :func:`run_prepare` (``budget_seconds``, ``after_publish``) are
reachable from Python only: never from the command line, the environment or the operator
input (whose ``preparation_seconds`` is at least 30).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any, Final, Literal, Protocol, TextIO

import msgspec
import trio

from cache_family.actors.pins import (
    Budget,
    FilePin,
    HashJob,
    ProgressSink,
    RichProgress,
    TreePin,
    canonical_regular_file,
    hash_files,
    is_terminal,
    pin_tree,
)
from cache_family.actors.publish import Published, publish_fresh, revoke
from cache_family.errors import Refusal, Refused, json_path
from cache_family.schemas.bounded import MIB, read_bounded
from cache_family.schemas.catalog import LoadedCatalog, Preset, load_catalog
from cache_family.schemas.catalog import packaged_catalog as _packaged_catalog
from cache_family.schemas.corpus import LoadedCorpus, default_corpus_path, load_corpus
from cache_family.schemas.gguf_header import (
    ZOO_SYNTHETIC_TAG,
    FileIdentity,
    file_identity,
    read_gguf_header,
)
from cache_family.schemas.operator import OperatorInput, PlanInput, validate_operator_object
from cache_family.schemas.prepared import (
    OBSERVATIONS_MAX_BYTES,
    PREPARED_INPUT_MAX_BYTES,
    PREPARED_SCOPE,
    RELAYED_REFUSALS_MAX,
    REQUEST_MAX_BYTES,
    CatalogUsed,
    CorpusSource,
    CorpusUsed,
    FilePinRecord,
    Mode,
    ModelObservation,
    Observations,
    ObservedSoFar,
    PreparationRequest,
    PreparedInput,
    RefusalRecord,
    ShardPin,
    SourceCommits,
    ToolPins,
    TreePinRecord,
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

OPERATOR_MAX_BYTES: Final = MIB
CORPUS_ENV: Final = "SKIPPY_CACHE_USECASE_CORPUS"
REQUEST_NAME: Final = "request.json"
OBSERVATIONS_NAME: Final = "observations.json"
INPUT_NAME: Final = "cache-family-input.json"
STDOUT_LOG: Final = "prepare.stdout.log"
STDERR_LOG: Final = "prepare.stderr.log"

GRACE_SECONDS: Final = 12.0
KILL_WAIT_SECONDS: Final = 5.0
DRAIN_SECONDS: Final = 5.0
# The worker's budget ends this much before the parent's, so it can refuse on its own terms.
WORKER_MARGIN_SECONDS: Final = 5.0
STDOUT_LOG_MAX_BYTES: Final = 16 * MIB
EVENT_LINE_MAX_BYTES: Final = 64 * 1024
PROGRESS_INTERVAL_SECONDS: Final = 0.2

COMMAND_MODES: Final[Mapping[str, Mode]] = {
    "prepare-full": "full",
    "prepare-use-cases": "use-cases",
}
OVERRIDE_FIELDS: Final[Mapping[str, str]] = {
    "--prefix-tokens": "prefix_tokens",
    "--runtime-lane-count": "runtime_lane_count",
    "--llama-parallel": "llama_parallel",
    "--llama-repeats": "llama_repeats",
    "--cache-hit-repeats": "cache_hit_repeats",
}
CORPUS_FLAG: Final = "--use-case-corpus"
U32_MAX: Final = 2**32 - 1


# --- overrides ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Overrides:
    plan_fields: Mapping[str, int]
    corpus: str | None


def parse_overrides(arguments: Sequence[str]) -> Overrides:
    """``--name VALUE`` (or ``--name=VALUE``) pairs; each name once; unknown names refused."""
    refusals: list[Refusal] = []
    values: dict[str, int] = {}
    corpus: str | None = None
    seen: set[str] = set()
    items = list(arguments)
    if items[:1] == ["--"]:
        items = items[1:]
    position = 0

    def refuse(code: str, message: str, hint: str) -> None:
        refusals.append(Refusal(code, "$.cli", message, hint))

    while position < len(items):
        token = items[position]
        name, has_inline, inline = token.partition("=")
        if not token.startswith("--") or name not in (*OVERRIDE_FIELDS, CORPUS_FLAG):
            refuse(
                "preparation.override.unknown",
                f"unknown argument {token!r}",
                "overrides are --use-case-corpus ABS, --prefix-tokens, --runtime-lane-count, "
                "--llama-parallel, --llama-repeats, --cache-hit-repeats N",
            )
            position += 1
            # an unknown --flag's value is part of the same mistake, not a second one
            if token.startswith("--") and not has_inline and position < len(items):
                position += 0 if items[position].startswith("--") else 1
            continue
        if has_inline:
            value: str | None = inline
            position += 1
        elif position + 1 < len(items):
            value = items[position + 1]
            position += 2
        else:
            value = None
            position += 1
        if name in seen:
            refuse(
                "preparation.override.duplicate",
                f"{name} is given more than once",
                "give each override at most once",
            )
            continue
        seen.add(name)
        if value is None:
            refuse(
                "preparation.override.missing_value", f"{name} has no value", f"write {name} VALUE"
            )
            continue
        if name == CORPUS_FLAG:
            if not Path(value).is_absolute():
                refuse(
                    "preparation.override.not_absolute",
                    f"{name} {value!r} is not an absolute path",
                    "give an absolute path",
                )
            corpus = value
            continue
        if not value.isascii() or not value.isdigit() or not 0 < int(value) <= U32_MAX:
            refuse(
                "preparation.override.bad_value",
                f"{name} {value!r} is not a whole number from 1 to {U32_MAX}",
                "give a positive whole number",
            )
            continue
        values[OVERRIDE_FIELDS[name]] = int(value)
    if refusals:
        raise Refused(tuple(refusals))
    return Overrides(plan_fields=values, corpus=corpus)


# --- admission ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admission:
    """Everything decided before the first write."""

    mode: Mode
    operator: OperatorInput
    catalog: LoadedCatalog
    corpus: LoadedCorpus | None
    corpus_source: CorpusSource | None
    output: str  # canonical parent + the new name
    budget_seconds: float


def _strict_json(data: bytes, what: str) -> Any:
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        names = [name for name, _ in items]
        if len(set(names)) != len(names):
            raise ValueError(f"a member name appears twice in one object ({names})")
        return dict(items)

    def constant(name: str) -> object:
        raise ValueError(f"{name} is not a JSON number")

    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=pairs, parse_constant=constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Refused.one(
            "operator.json.decode",
            "$",
            f"the {what} is not strict UTF-8 JSON: {exc}",
            "write one UTF-8 JSON object, each member once, without NaN or Infinity",
        ) from None


def _select_corpus(
    mode: Mode, overrides: Overrides, environ: Mapping[str, str], declared: object
) -> tuple[LoadedCorpus | None, CorpusSource | None]:
    """prepare-use-cases: --use-case-corpus, else $SKIPPY_CACHE_USECASE_CORPUS, else the
    plan's own corpus (checked against its pin), else the checked-in corpus. prepare-full
    selects none and refuses --use-case-corpus (reading a corpus it then ignored would
    suggest the prompts were used)."""
    if mode == "full":
        if overrides.corpus is not None:
            raise Refused.one(
                "preparation.override.corpus_for_full",
                "$.cli",
                f"prepare-full plans no use cases, so {CORPUS_FLAG} {overrides.corpus} "
                "would be ignored",
                f"drop {CORPUS_FLAG}, or run prepare-use-cases to plan every use case of it",
            )
        return None, None
    if overrides.corpus is not None:
        return load_corpus(overrides.corpus), "override"
    from_env = environ.get(CORPUS_ENV)
    if from_env:
        if not Path(from_env).is_absolute():
            raise Refused.one(
                "preparation.corpus_env_not_absolute",
                f"$env.{CORPUS_ENV}",
                f"{CORPUS_ENV}={from_env!r} is not an absolute path",
                "give an absolute path",
            )
        return load_corpus(from_env), "environment"
    if isinstance(declared, dict) and isinstance(declared.get("path"), str):
        loaded = load_corpus(declared["path"])
        _refuse_unless_declared("corpus", loaded.path, loaded.sha256, declared.get("sha256"))
        return loaded, "operator-plan"
    return load_corpus(default_corpus_path()), "checked-in"


def _refuse_unless_declared(
    what: Literal["catalog", "corpus"], path: str, sha256: str, declared: object
) -> None:
    """The plan's catalog or corpus must be the bytes its ``sha256`` declares."""
    if sha256 != declared:
        raise Refused.one(
            f"preparation.{what}_pin_mismatch",
            f"$.plan.{what}.sha256",
            f"{what} {path} has SHA-256 {sha256}, not the declared one",
            f"restore the {what} or update plan.{what}.sha256",
        )


def load_plan_catalog(plan: PlanInput) -> LoadedCatalog:
    """The catalog a plan names (its bytes must match the pin), else the packaged one."""
    if plan.catalog is None:
        return _packaged_catalog()
    loaded = load_catalog(plan.catalog.path)
    _refuse_unless_declared("catalog", loaded.path, loaded.sha256, plan.catalog.sha256)
    return loaded


def _inside(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip("/") + "/")


def _check_output(output: str, operator: OperatorInput) -> str:
    if not Path(output).is_absolute():
        raise Refused.one(
            "preparation.output_not_absolute",
            "$.output",
            f"output {output!r} is not absolute",
            "give an absolute path for a directory that does not exist yet",
        )
    if os.path.lexists(output):
        raise Refused.one(
            "preparation.output_exists",
            "$.output",
            f"output {output} already exists",
            "choose a fresh output path; preparation never writes into an existing one",
        )
    parent = os.path.dirname(output.rstrip("/")) or "/"
    if not Path(parent).is_dir():
        raise Refused.one(
            "preparation.output_parent_missing",
            "$.output",
            f"the parent directory of {output} does not exist",
            "create the parent directory first",
        )
    canonical = os.path.join(os.path.realpath(parent), os.path.basename(output.rstrip("/")))
    guarded = [
        ("$.native_build", operator.native_build),
        ("$.plan.cache_root", operator.plan.cache_root),
    ]
    guarded += [
        (json_path(["toolkit_directories", name]), toolkit.path)
        for name, toolkit in operator.toolkit_directories.items()
    ]
    refusals = []
    for where, tree in guarded:
        tree_canonical = os.path.realpath(tree)
        if _inside(canonical, tree_canonical) or _inside(tree_canonical, canonical):
            refusals.append(
                Refusal(
                    "preparation.output_not_disjoint",
                    where,
                    f"output {canonical} overlaps {tree_canonical}",
                    "write the prepared input outside the build, cache and toolkit trees",
                )
            )
    if refusals:
        raise Refused(tuple(refusals))
    return canonical


def admit(
    command: str,
    input_path: str,
    output: str,
    overrides: Sequence[str],
    *,
    environ: Mapping[str, str],
) -> Admission:
    """Every check that needs no write; raises :class:`Refused` (exit 2) with all it found."""
    mode = COMMAND_MODES.get(command)
    if mode is None:
        raise Refused.one(
            "preparation.command",
            "$.cli",
            f"unknown command {command!r}",
            "use prepare-full or prepare-use-cases",
        )
    parsed = parse_overrides(overrides)
    raw = read_bounded(input_path, OPERATOR_MAX_BYTES, what="operator input")
    document = _strict_json(raw.data, "operator input")
    if not isinstance(document, dict):
        raise Refused.one(
            "operator.type", "$", "the operator input is not an object", "write one JSON object"
        )
    refusals: list[Refusal] = []
    plan = document.get("plan")
    corpus: LoadedCorpus | None = None
    corpus_source: CorpusSource | None = None
    try:
        corpus, corpus_source = _select_corpus(
            mode, parsed, environ, plan.get("corpus") if isinstance(plan, dict) else None
        )
    except Refused as refused:
        refusals.extend(refused.refusals)
    if isinstance(plan, dict):
        plan = dict(plan)
        plan.update(parsed.plan_fields)
        # Without a usable corpus the plan is validated as a full one: its refusal is enough.
        plan["use_cases"] = ["all"] if corpus is not None else []
        plan["corpus"] = (
            {"path": corpus.path, "sha256": corpus.sha256} if corpus is not None else None
        )
        document = {**document, "plan": plan}
    try:
        operator = validate_operator_object(document)
    except Refused as refused:
        raise Refused((*refusals, *refused.refusals)) from None
    try:
        catalog = load_plan_catalog(operator.plan)
        check_selection(operator.plan, catalog.catalog, corpus.corpus if corpus else None)
    except Refused as refused:
        refusals.extend(refused.refusals)
    try:
        canonical_output = _check_output(output, operator)
    except Refused as refused:
        refusals.extend(refused.refusals)
    if refusals:
        raise Refused(tuple(refusals))
    return Admission(
        mode=mode,
        operator=operator,
        catalog=catalog,
        corpus=corpus,
        corpus_source=corpus_source,
        output=canonical_output,
        budget_seconds=float(operator.preparation_seconds),
    )


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


# --- supervising the worker --------------------------------------------------------------------


@dataclass(slots=True)
class WorkerOutcome:
    returncode: int | None = None
    exited_in_time: bool = False
    cancelled: bool = False
    deadline_expired: bool = False
    terminated: bool = False  # SIGTERM sent
    killed: bool = False  # SIGKILL needed
    stdout_truncated: bool = False
    pid: int | None = None

    @property
    def clean(self) -> bool:
        return (
            self.returncode == 0
            and self.exited_in_time
            and not (self.cancelled or self.deadline_expired or self.killed)
            and not self.stdout_truncated
        )


class EventSink(Protocol):
    """Receives each complete line the worker writes on stdout."""

    def handle(self, line: bytes) -> None: ...

    def close(self) -> None: ...


class WorkerEvents:
    """Renders the worker's JSON-lines events: phase lines always, a bar on a terminal."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.bar = RichProgress(stream, "hashing") if is_terminal(stream) else None
        self.phases: list[str] = []

    def handle(self, line: bytes) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        kind = event.get("event")
        if kind == "phase" and isinstance(event.get("text"), str):
            self.phases.append(event["text"])
            if self.bar is not None:
                self.bar.end()
            print(f"preparation: {event['text']}", file=self.stream, flush=True)
        elif kind == "progress" and self.bar is not None:
            done, total = event.get("done"), event.get("total")
            if isinstance(done, int) and isinstance(total, int):
                self.bar.set_completed(done, total, f"hashing {event.get('files', '?')} file(s)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.end()


async def _pump_stdout(
    stream: trio.abc.ReceiveStream,
    log: IO[bytes],
    events: EventSink | None,
    outcome: WorkerOutcome,
) -> None:
    written = 0
    pending = b""
    while True:
        chunk = await stream.receive_some(64 * 1024)
        if not chunk:
            break
        room = STDOUT_LOG_MAX_BYTES - written
        if len(chunk) > room:
            outcome.stdout_truncated = True
        if room > 0:
            log.write(chunk[:room])
            log.flush()
            written += min(room, len(chunk))
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) > EVENT_LINE_MAX_BYTES:
            pending = b""  # an event line is never this long: drop it
        if events is not None:
            for line in lines:
                events.handle(line)


async def _stop_process(process: trio.Process, outcome: WorkerOutcome, grace: float) -> None:
    """SIGTERM the worker's process group, wait ``grace``, then SIGKILL; shielded, bounded."""
    with trio.CancelScope(shield=True):
        if process.returncode is not None:
            return
        outcome.terminated = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with trio.move_on_after(grace):
            await process.wait()
        if process.returncode is None:
            outcome.killed = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            with trio.move_on_after(KILL_WAIT_SECONDS):
                await process.wait()


async def _first_of(
    process: trio.Process, cancel: trio.Event, deadline: float
) -> Literal["exited", "cancelled", "deadline"]:
    """Wait for whichever comes first: the process exits, ``cancel`` is set, the deadline."""
    ended: list[Literal["exited", "cancelled"]] = []
    async with trio.open_nursery() as waiters:
        waiters.cancel_scope.deadline = deadline

        async def exits() -> None:
            await process.wait()
            ended.append("exited")
            waiters.cancel_scope.cancel()

        async def cancelled() -> None:
            await cancel.wait()
            ended.append("cancelled")
            waiters.cancel_scope.cancel()

        waiters.start_soon(exits)
        waiters.start_soon(cancelled)
    return ended[0] if ended else "deadline"


async def supervise_worker(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str,
    stdout_log: str,
    stderr_log: str,
    deadline: float,
    cancel: trio.Event,
    grace_seconds: float = GRACE_SECONDS,
    events: EventSink | None = None,
    on_start: Callable[[int], None] | None = None,
) -> WorkerOutcome:
    """Run the worker until it exits, ``cancel`` is set or ``deadline`` (trio time) passes."""
    outcome = WorkerOutcome()
    if cancel.is_set():
        outcome.cancelled = True
        return outcome
    with open(stdout_log, "xb") as out_log, open(stderr_log, "xb") as err_log:
        process = await trio.lowlevel.open_process(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err_log,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
        )
        outcome.pid = process.pid
        if on_start is not None:
            on_start(process.pid)
        assert process.stdout is not None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_pump_stdout, process.stdout, out_log, events, outcome)
                first = await _first_of(process, cancel, deadline)
                outcome.exited_in_time = first == "exited"
                outcome.cancelled = first == "cancelled"
                outcome.deadline_expired = first == "deadline"
                await _stop_process(process, outcome, grace_seconds)
                # The pump ends at EOF; a pipe held open by a stray grandchild is not waited on.
                nursery.cancel_scope.deadline = trio.current_time() + DRAIN_SECONDS
        finally:
            with trio.CancelScope(shield=True):
                await _stop_process(process, outcome, grace_seconds)
                await process.stdout.aclose()
        outcome.returncode = process.returncode
    if events is not None:
        events.close()
    return outcome


def worker_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """PATH, and PYTHONPATH only when the parent itself runs from one; nothing else."""
    env = {"PATH": environ.get("PATH", os.defpath), "PYTHONSAFEPATH": "1"}
    if environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = environ["PYTHONPATH"]
    return env


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
                    worker_budget_ms=_worker_budget_ms(budget.remaining()),
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
    return run_prepare(command, input, output, overrides)


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


class _Gathered:
    """Refusals of every check so far, so one run reports them all; cancellation or the
    deadline (a ``budget.*`` refusal) ends the run at once, with what was gathered."""

    def __init__(self) -> None:
        self.refusals: list[Refusal] = []

    def add(self, refused: Refused) -> None:
        budget = [r for r in refused.refusals if r.code.startswith("budget.")]
        if budget:
            raise Refused((*self.refusals, budget[0]))
        self.refusals.extend(refused.refusals)

    def raise_any(self) -> None:
        if self.refusals:
            raise Refused(tuple(self.refusals))


def _pin_files(
    named: Sequence[tuple[str, str, str]],
    budget: Budget,
    progress: ProgressSink,
    gathered: _Gathered,
) -> dict[str, FilePin]:
    """Pin (name, path, json_path) triples: canonical regular files, hashed in parallel.

    A file that is missing, not regular or unreadable is refused into ``gathered``; the
    others are still pinned.
    """
    jobs: list[tuple[str, HashJob]] = []
    for name, path, where in named:
        try:
            jobs.append(
                (name, HashJob(canonical_regular_file(path, what=name, json_path=where), where))
            )
        except Refused as exc:
            gathered.add(exc)
    try:
        pins = hash_files([job for _, job in jobs], budget, progress=progress)
    except Refused as exc:
        gathered.add(exc)
        return {}
    return {name: pin for (name, _), pin in zip(jobs, pins, strict=True)}


# --- models: layout, identity, bytes ------------------------------------------------------------

PACKAGE_MANIFEST_MAX_BYTES: Final = 4 * MIB


@dataclass(frozen=True, slots=True)
class _Identity:
    """What a model's bytes claim to be, and the bytes the claim was read from."""

    source: Literal["gguf-header", "package-manifest"]
    architecture: str
    block_count: int
    context_length: int | None
    synthetic_marker: str | None
    file_identity: FileIdentity | None = None  # a GGUF header's file, as it was read
    manifest_sha256: str | None = None  # the manifest bytes that were parsed


@dataclass(slots=True)
class _ModelLook:
    preset: Preset
    requested: str
    kind: Literal["single-gguf", "split-gguf-first-shard", "layer-package-tree"] | None = None
    canonical: str | None = None
    entrypoint: str | None = None
    pinned: str | None = None
    root: str = "/"  # the canonical cache root every file must stay inside
    shards: list[tuple[str, str, str]] = field(default_factory=list)  # name, logical, canonical
    identity: _Identity | None = None

    @property
    def present(self) -> bool:
        return self.kind is not None

    @property
    def files(self) -> list[tuple[str, str]]:
        """(pin name, canonical path) of every file whose bytes are pinned."""
        key = self.preset.key
        if self.kind == "split-gguf-first-shard":
            return [(f"{key}/{name}", canonical) for name, _, canonical in self.shards]
        return [(key, self.pinned)] if self.pinned is not None else []


def _look_at_model(preset: Preset, root: str) -> _ModelLook:
    """Find a model's files without reading their bytes; refusals for a broken layout."""
    requested = os.path.join(root, preset.snapshot_relative)
    look = _ModelLook(preset=preset, requested=requested, root=root)
    where = _case_where(preset.key)
    if not os.path.lexists(requested):
        return look

    def inside(path: str, what: str) -> str:
        canonical = os.path.realpath(path)
        if not _inside(canonical, root):
            raise Refused.one(
                "preparation.model_outside_cache_root",
                where,
                f"{what} {path} resolves to {canonical}, outside the cache root {root}",
                "keep every snapshot link pointing into the cache's own blobs",
            )
        if not os.path.exists(canonical):
            raise Refused.one(
                "preparation.model_unreadable",
                where,
                f"{what} {path} is a dangling link",
                "repair or re-download the model",
            )
        return canonical

    if preset.artifact_kind == "layer-package":
        canonical = inside(requested, "layer package")
        if not Path(canonical).is_dir():
            raise Refused.one(
                "preparation.package_not_directory",
                where,
                f"layer package {requested} is not a directory",
                "a layer package is the snapshot directory holding manifest.json",
            )
        manifest = os.path.join(canonical, "manifest.json")
        if not os.path.lexists(manifest):
            raise Refused.one(
                "preparation.package_manifest_missing",
                where,
                f"layer package {canonical} has no manifest.json",
                "repair the package",
            )
        look.kind, look.canonical, look.entrypoint = "layer-package-tree", canonical, canonical
        look.pinned = inside(manifest, "package manifest")
        return look
    if preset.artifact_kind == "split-gguf":
        directory = inside(os.path.dirname(requested), "snapshot directory")
        look.kind = "split-gguf-first-shard"
        look.entrypoint = os.path.join(directory, os.path.basename(requested))
        missing = []
        for name in preset.shard_names:
            logical = os.path.join(directory, name)
            if not os.path.lexists(logical):
                missing.append(name)
                continue
            look.shards.append((name, logical, inside(logical, "shard")))
        if missing:
            raise Refused.one(
                "preparation.split_shard_missing",
                where,
                f"{preset.key} needs all {len(preset.shard_names)} shards; missing "
                + ", ".join(missing),
                "download every shard of the split model into the same snapshot",
            )
        look.canonical = look.pinned = look.shards[0][2]
        return look
    look.kind = "single-gguf"
    look.canonical = look.entrypoint = look.pinned = inside(requested, "model")
    return look


def _case_where(key: str) -> str:
    return json_path(["plan", "cases", key])


def _identity_where(key: str) -> str:
    return json_path(["plan", "model_sha256", key])


def _not_the_preset(preset: Preset, path: str, differences: Sequence[str]) -> Refusal:
    return Refusal(
        "preparation.model_identity_mismatch",
        _identity_where(preset.key),
        f"{preset.key} ({preset.model_id}) at {path}: " + "; ".join(differences),
        "put the model the catalog names at its snapshot path, or plan against a catalog "
        "that describes these bytes (a zoo's own catalog.json for zoo models)",
    )


def _synthetic_refusal(preset: Preset, path: str) -> Refusal:
    return Refusal(
        "preparation.synthetic_model_in_real_catalog",
        _identity_where(preset.key),
        f"{preset.key} at {path} is a synthetic random-weight zoo model "
        f"({ZOO_SYNTHETIC_TAG}), but its catalog preset is not marked synthetic",
        "plan zoo models against the zoo's catalog.json, never as a real family",
    )


def _gguf_identity(look: _ModelLook) -> tuple[_Identity | None, list[Refusal]]:
    """Compare the entrypoint's (split: first shard's) header with the preset."""
    preset = look.preset
    assert look.pinned is not None
    header = read_gguf_header(look.pinned, json_path=_identity_where(preset.key))
    differences = []
    architecture, block_count = header.architecture, header.block_count
    if architecture is None:
        differences.append("the GGUF header has no general.architecture")
    elif architecture != preset.architecture:
        differences.append(
            f"general.architecture is {architecture!r}, the catalog says {preset.architecture!r}"
        )
    if architecture is not None and block_count is None:
        differences.append(f"the GGUF header has no {architecture}.block_count")
    elif block_count is not None and preset.layer_end not in {
        block_count,
        # Converters count next-token-prediction layers in block_count (GLM-4.7-Flash:
        # 47 trunk layers + 1); the catalog's layer_end counts the trunk.
        block_count - header.nextn_predict_layers,
    }:
        extra = header.nextn_predict_layers
        trunk = f" ({block_count - extra} without its {extra} prediction layer(s))" if extra else ""
        differences.append(
            f"{architecture}.block_count is {block_count}{trunk}, the catalog's layer_end is "
            f"{preset.layer_end}"
        )
    if look.kind == "split-gguf-first-shard" and header.split_count != len(preset.shard_names):
        differences.append(
            f"split.count is {header.split_count}, the catalog names "
            f"{len(preset.shard_names)} shards"
        )
    synthetic = ZOO_SYNTHETIC_TAG in header.tags
    refusals = [_not_the_preset(preset, look.pinned, differences)] if differences else []
    if synthetic and not preset.synthetic:
        refusals.append(_synthetic_refusal(preset, look.pinned))
    if refusals or architecture is None or block_count is None:
        return None, refusals
    return (
        _Identity(
            source="gguf-header",
            architecture=architecture,
            block_count=block_count,
            context_length=header.context_length,
            synthetic_marker=ZOO_SYNTHETIC_TAG if synthetic else None,
            file_identity=header.identity,
        ),
        [],
    )


def _package_first_file_tags(look: _ModelLook, manifest: Mapping[str, Any]) -> tuple[str, ...]:
    """The ``general.tags`` of the package's first listed GGUF, when the manifest lists one."""
    files = manifest.get("files")
    first = files[0] if isinstance(files, list) and files else None
    relative = first.get("path") if isinstance(first, dict) else None
    if not isinstance(relative, str) or not relative.endswith(".gguf") or look.canonical is None:
        return ()
    path = os.path.realpath(os.path.join(look.canonical, relative))
    if not _inside(path, look.root):
        raise Refused.one(
            "preparation.model_outside_cache_root",
            _identity_where(look.preset.key),
            f"layer package file {relative} resolves to {path}, outside the cache",
            "keep every package link pointing into the cache's own blobs",
        )
    return read_gguf_header(path, json_path=_identity_where(look.preset.key)).tags


def _package_identity(look: _ModelLook) -> tuple[_Identity | None, list[Refusal]]:
    """Compare a layer package manifest's architecture and layer_count with the preset."""
    preset = look.preset
    assert look.pinned is not None
    where = _identity_where(preset.key)
    raw = read_bounded(
        look.pinned, PACKAGE_MANIFEST_MAX_BYTES, what="layer package manifest", json_path=where
    )
    manifest = _strict_json(raw.data, "layer package manifest")
    architecture = manifest.get("architecture") if isinstance(manifest, dict) else None
    layer_count = manifest.get("layer_count") if isinstance(manifest, dict) else None
    if (
        not isinstance(architecture, str)
        or not isinstance(layer_count, int)
        or isinstance(layer_count, bool)
    ):
        return None, [
            Refusal(
                "preparation.package_manifest_invalid",
                where,
                f"layer package manifest {look.pinned} does not state its architecture "
                "(a string) and layer_count (a whole number)",
                "rebuild the package with a builder that records what it was cut from",
            )
        ]
    assert isinstance(manifest, dict)
    differences = []
    if architecture != preset.architecture:
        differences.append(
            f"the manifest's architecture is {architecture!r}, the catalog says "
            f"{preset.architecture!r}"
        )
    if layer_count != preset.layer_end:
        differences.append(
            f"the manifest's layer_count is {layer_count}, the catalog's layer_end is "
            f"{preset.layer_end}"
        )
    tags = manifest.get("tags")
    synthetic = (isinstance(tags, list) and ZOO_SYNTHETIC_TAG in tags) or (
        ZOO_SYNTHETIC_TAG in _package_first_file_tags(look, manifest)
    )
    refusals = [_not_the_preset(preset, look.pinned, differences)] if differences else []
    if synthetic and not preset.synthetic:
        refusals.append(_synthetic_refusal(preset, look.pinned))
    if refusals:
        return None, refusals
    return (
        _Identity(
            source="package-manifest",
            architecture=architecture,
            block_count=layer_count,
            context_length=None,
            synthetic_marker=ZOO_SYNTHETIC_TAG if synthetic else None,
            manifest_sha256=raw.sha256,
        ),
        [],
    )


def examine_models(
    presets: Sequence[Preset], cache_root: str, artifact_tool: str | None, gathered: _Gathered
) -> list[_ModelLook]:
    """Layout, file kind and identity of every selected model, all refusals gathered; no
    model byte beyond a GGUF header or a package manifest is read."""
    looks: list[_ModelLook] = []
    for preset in presets:
        try:
            look = _look_at_model(preset, cache_root)
        except Refused as exc:
            gathered.add(exc)
            continue
        looks.append(look)
        if not look.present:
            continue
        where = _case_where(preset.key)
        regular = True
        for name, path in look.files:
            try:
                canonical_regular_file(path, what=name, json_path=where)
            except Refused as exc:
                gathered.add(exc)
                regular = False
        if not regular:
            continue
        try:
            if look.kind == "layer-package-tree":
                look.identity, refusals = _package_identity(look)
            else:
                look.identity, refusals = _gguf_identity(look)
        except Refused as exc:
            gathered.add(exc)
            continue
        gathered.refusals.extend(refusals)
    needing_tool = [
        look.preset.key
        for look in looks
        if look.present and look.preset.artifact_kind != "single-gguf"
    ]
    if needing_tool and artifact_tool is None:
        gathered.refusals.append(
            Refusal(
                "preparation.artifact_tool_missing",
                "$.artifact_tool",
                f"{', '.join(needing_tool)} need the artifact tool (split or layer package "
                "models) but artifact_tool is null",
                "give the shard/package admission tool (skippy-package-builder)",
            )
        )
    return looks


def _missing(look: _ModelLook, declared: Mapping[str, str]) -> ModelObservation:
    return ModelObservation(
        status="missing-model",
        requested=look.requested,
        declared_revision=look.preset.revision,
        declared_byte_sha256=declared.get(look.preset.key),
    )


def _changed_since_read(look: _ModelLook, pin: FilePin) -> bool:
    """Whether the bytes hashed can differ from those whose identity was read."""
    identity = look.identity
    assert identity is not None
    if identity.manifest_sha256 is not None:
        return identity.manifest_sha256 != pin.sha256
    try:
        now = file_identity(os.stat(pin.path))
    except OSError:
        return True
    return now != identity.file_identity or pin.size != now[2]


def hash_models(
    looks: Sequence[_ModelLook],
    declared: Mapping[str, str],
    budget: Budget,
    progress: ProgressSink,
    gathered: _Gathered,
) -> dict[str, ModelObservation]:
    """Pin every present model's bytes and record what it is; declared pins must match."""
    named = [
        (name, path, _case_where(look.preset.key)) for look in looks for name, path in look.files
    ]
    pins = _pin_files(named, budget, progress, gathered)
    observations: dict[str, ModelObservation] = {}
    for look in looks:
        key = look.preset.key
        if not look.present:
            observations[key] = _missing(look, declared)
            continue
        if not all(name in pins for name, _ in look.files) or look.identity is None:
            continue
        shards = [
            ShardPin(
                name=name,
                logical_path=logical,
                canonical=canonical,
                sha256=pins[f"{key}/{name}"].sha256,
                size=pins[f"{key}/{name}"].size,
            )
            for name, logical, canonical in look.shards
        ]
        first = pins[look.files[0][0]]
        identity = look.identity
        if _changed_since_read(look, first):
            gathered.refusals.append(
                Refusal(
                    "preparation.model_changed",
                    _case_where(key),
                    f"{first.path} changed between reading what it is and hashing it",
                    "leave the model files alone during preparation and run it again",
                )
            )
            continue
        expected = declared.get(key)
        if expected is not None and expected != first.sha256:
            gathered.refusals.append(
                Refusal(
                    "preparation.model_pin_mismatch",
                    _identity_where(key),
                    f"{key} at {first.path} has SHA-256 {first.sha256}, "
                    f"not the declared {expected}",
                    "restore the model bytes or update plan.model_sha256",
                )
            )
        assert look.kind is not None
        observations[key] = ModelObservation(
            status="present",
            kind=look.kind,
            canonical=look.canonical,
            runtime_entrypoint=look.entrypoint,
            pinned_file=first.path,
            sha256=first.sha256,
            size=first.size,
            shard_pins=shards,
            requested=look.requested,
            declared_revision=look.preset.revision,
            declared_byte_sha256=expected,
            identity_source=identity.source,
            architecture=identity.architecture,
            block_count=identity.block_count,
            context_length=identity.context_length,
            synthetic_marker=identity.synthetic_marker,
        )
    return observations


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
        return ObservedSoFar(
            phase=self.phase,
            tools=dict(self.tools),
            native_build=self.native_build,
            toolkit_directories=dict(self.toolkit_directories),
            catalog=self.catalog,
            corpus=self.corpus,
            models=dict(self.models),
            models_hashed=self.models_hashed,
        )


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
    record = WorkerRecord() if record is None else record
    gathered = _Gathered()
    operator = request.operator
    plan = operator.plan
    progress = JsonProgress(events)

    def phase(text: str) -> None:
        record.phase = text
        events.phase(text)

    phase("pinning tools and servers")
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
    tools = _pin_files(named, budget, progress, gathered)
    record.tools = {name: _file_record(pin) for name, pin in tools.items()}
    for name, declared in (("old_server", plan.old_server), ("new_server", plan.new_server)):
        if (
            name in tools
            and declared is not None
            and declared.sha256 not in (None, tools[name].sha256)
        ):
            gathered.refusals.append(
                Refusal(
                    "preparation.server_pin_mismatch",
                    json_path(["plan", name, "sha256"]),
                    f"{name} {tools[name].path} has SHA-256 {tools[name].sha256}, "
                    f"not the declared {declared.sha256}",
                    "restore the binary or update its sha256 (or set it to null to fill it in)",
                )
            )

    phase("pinning the native build tree")
    native_build: TreePin | None = None
    try:
        native_build = pin_tree(
            operator.native_build, budget, json_path="$.native_build", progress=progress
        )
        record.native_build = _tree_record(native_build)
    except Refused as exc:
        gathered.add(exc)
    toolkits: dict[str, TreePinRecord] = {}
    if operator.toolkit_directories:
        phase("pinning toolkit directories")
    for name, toolkit in sorted(operator.toolkit_directories.items()):
        where = json_path(["toolkit_directories", name])
        try:
            pin = pin_tree(toolkit.path, budget, json_path=where, progress=progress)
        except Refused as exc:
            gathered.add(exc)
            continue
        if pin.sha256 != toolkit.sha256:
            gathered.refusals.append(
                Refusal(
                    "preparation.toolkit_pin_mismatch",
                    f"{where}.sha256",
                    f"toolkit {name} at {pin.path} has tree pin {pin.sha256}, "
                    f"not the declared {toolkit.sha256}",
                    "restore the toolkit or update its pin",
                )
            )
            continue
        toolkits[name] = _tree_record(pin)
    record.toolkit_directories = dict(toolkits)

    phase("loading the catalog and corpus")
    catalog = _load_catalog_and_corpus(request, record, gathered)
    if catalog is None:
        gathered.raise_any()
    assert catalog is not None
    loaded_catalog, corpus = catalog
    try:
        cache_root = os.path.realpath(plan.cache_root, strict=True)
    except OSError:
        cache_root = ""
    if not cache_root or not Path(cache_root).is_dir():
        gathered.refusals.append(
            Refusal(
                "preparation.cache_root_missing",
                "$.plan.cache_root",
                f"cache root {plan.cache_root} is not a directory",
                "point plan.cache_root at the hub cache directory",
            )
        )
        gathered.raise_any()

    phase("examining models")
    presets = selected_presets(plan, loaded_catalog.catalog)
    looks = examine_models(presets, cache_root, operator.artifact_tool, gathered)
    record.models = {
        look.preset.key: _missing(look, plan.model_sha256) for look in looks if not look.present
    }
    gathered.raise_any()

    phase("hashing model bytes")
    observations = hash_models(looks, plan.model_sha256, budget, progress, gathered)
    record.models, record.models_hashed = dict(observations), True
    gathered.raise_any()
    budget.check("$")

    phase("planning rows and profiles")
    assert native_build is not None
    pinned_plan = _pinned_plan(plan, tools, observations)
    rows = plan_rows(
        pinned_plan, loaded_catalog.catalog, corpus.corpus if corpus else None, observations
    )
    tool_pins = ToolPins(
        correctness=_file_record(tools["correctness"]),
        stage_server=_file_record(tools["stage_server"]),
        native_server=_file_record(tools["native_server"]) if "native_server" in tools else None,
        artifact_tool=_file_record(tools["artifact_tool"]) if "artifact_tool" in tools else None,
    )
    profiles = build_profiles(
        rows,
        ProfileInputs(
            operator=operator,
            tools=tool_pins,
            native_build=_tree_record(native_build),
            toolkit_directories=toolkits,
            old_server=_file_record(tools["old_server"]) if "old_server" in tools else None,
            new_server=_file_record(tools["new_server"]) if "new_server" in tools else None,
        ),
    )
    prepared = PreparedInput(
        schema_version=1,
        scope=PREPARED_SCOPE,
        mode=request.mode,
        plan=pinned_plan,
        catalog=_catalog_used(loaded_catalog),
        corpus=record.corpus,
        cache_root=cache_root,
        native_build=_tree_record(native_build),
        tools=tool_pins,
        toolkit_directories=toolkits,
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
        use_cases=[
            UseCaseRecord(
                key=use_case.key,
                label=use_case.label,
                prompt=use_case.prompt,
                prefix_tokens=use_case.prefix_tokens,
                source=UseCaseSourceRecord(**msgspec.structs.asdict(use_case.source)),
            )
            for use_case in (corpus.corpus.use_cases if corpus is not None else ())
        ],
    )
    phase("checking the prepared input's size")
    refuse_oversized_input(encode_document(prepared), PREPARED_INPUT_MAX_BYTES)
    return prepared


def _load_catalog_and_corpus(
    request: PreparationRequest, record: WorkerRecord, gathered: _Gathered
) -> tuple[LoadedCatalog, LoadedCorpus | None] | None:
    """The plan's catalog and, for prepare-use-cases, its corpus, both still as admitted."""
    plan = request.operator.plan
    try:
        catalog = load_plan_catalog(plan)
    except Refused as exc:
        gathered.add(exc)
        return None
    record.catalog = _catalog_used(catalog)
    corpus = None
    try:
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
    except Refused as exc:
        gathered.add(exc)
        return None
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
    plan: PlanInput, tools: Mapping[str, FilePin], observations: Mapping[str, ModelObservation]
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
