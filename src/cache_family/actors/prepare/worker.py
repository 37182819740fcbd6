"""The preparation worker: pins tools, trees and models, plans rows, writes observations.json."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Final

import msgspec
import trio

from cache_family.actors.prepare.admission import load_plan_catalog
from cache_family.actors.prepare.models import (
    Gathered,
    ModelLook,
    context_refusals,
    examine_models,
    hash_models,
    missing_observation,
    pin_files,
)
from cache_family.errors import Refusal, Refused, json_path
from cache_family.exit_codes import ExitCode
from cache_family.schemas.bounded import read_bounded
from cache_family.schemas.catalog import LoadedCatalog
from cache_family.schemas.catalog import packaged_catalog as _packaged_catalog
from cache_family.schemas.corpus import LoadedCorpus, load_corpus
from cache_family.schemas.operator import PlanInput
from cache_family.schemas.prepared import (
    PREPARED_INPUT_MAX_BYTES,
    PREPARED_SCOPE,
    REQUEST_MAX_BYTES,
    UNUSED_CORPUS_REASON,
    CatalogUsed,
    CorpusUsed,
    FilePinRecord,
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
    DeclaredServer,
    ProfileInputs,
    build_profiles,
    check_selection,
    plan_rows,
    selected_presets,
)
from cache_family.system.pins import Budget, FilePin, TreePin, pin_tree
from cache_family.system.publish import publish_fresh, revoke

PROGRESS_INTERVAL_SECONDS: Final = 0.2


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
    # The declared OpenAI-compatible server's own tree (None: native_build, or no server).
    openai_tree: TreePinRecord | None = None

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
    if operator.openai_server is not None:
        named.append(("openai_server", operator.openai_server.binary, "$.openai_server.binary"))
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
    declared = operator.openai_server
    if declared is not None and declared.tree is not None:
        run.phase("pinning the declared server's tree")
        try:
            tree = pin_tree(
                declared.tree, run.budget, json_path="$.openai_server.tree", progress=run.progress
            )
            run.record.openai_tree = _tree_record(tree)
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
    rows = plan_rows(
        pinned_plan,
        run.catalog.catalog,
        corpus,
        record.models,
        native_output_tokens=run.request.native_output_tokens,
    )
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
            openai_server=_declared_server(run),
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
        workloads=run.request.workloads,
        native_output_tokens=run.request.native_output_tokens,
    )
    run.phase("checking the prepared input's size")
    refuse_oversized_input(encode_document(prepared), PREPARED_INPUT_MAX_BYTES)
    return prepared


def _declared_server(run: _Observing) -> DeclaredServer | None:
    """The operator's OpenAI-compatible server with its parts as pinned (its tree: its own, or
    the native build's)."""
    declared = run.request.operator.openai_server
    if declared is None:
        return None
    tree = run.record.openai_tree if declared.tree is not None else run.record.native_build
    assert tree is not None  # pinned, or preparation refused before planning
    return DeclaredServer(
        binary=run.record.tools["openai_server"],
        tree=tree,
        source_commit=declared.source_commit or "",
        serving=declared.serving,
    )


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


@dataclass(frozen=True, slots=True)
class WorkerResult:
    """How the worker ended: its exit code and the refusals to print (none on success)."""

    exit_code: int
    refusals: tuple[Refusal, ...] = ()


async def observe_request(input_path: str, output_path: str) -> WorkerResult:
    """The worker's work: read the request, observe, publish ``observations.json`` (complete
    or refused); prints nothing (``console/preparation.py`` does)."""
    budget = Budget(float("inf"))
    refusals: list[Refusal] = []
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
                code = ExitCode.OK
            except Refused as refused:
                refusals = list(refused.refusals)
                if request_sha256 is not None:
                    failed = _publish_refused(output_path, request_sha256, refusals, record)
                    if failed is not None:
                        refusals.append(failed)
                code = ExitCode.REFUSED_DURING_WORK
                if budget.cancelled:
                    code = ExitCode.INTERRUPTED
                elif "budget.deadline_expired" in refused.codes:
                    code = ExitCode.WORKER_DEADLINE
            nursery.cancel_scope.cancel()
    return WorkerResult(exit_code=code, refusals=tuple(refusals))
