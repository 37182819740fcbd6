"""``cache-family run --input PREPARED --output FRESH``: the matrix supervisor.

Nothing is written unless admission passes (refusals exit 2). SIGINT/SIGTERM never meet Python's
defaults (``system/interrupts.py``): the first is a run-wide cancellation, a second shortens
every host's SIGTERM grace, cleanup always runs, and any signal makes the exit code 130.
``cache-family-matrix.json`` is always published, one entry per planned row. Rows from a
synthetic catalog are plumbing evidence, never performance claims, and are labelled so at every
level.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import secrets
import signal
import stat
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Final, TypeAlias

import psutil
import trio

from cache_family import __version__
from cache_family.actors.audit.run_files import bind_run_files
from cache_family.actors.journal.writer import (
    JOURNAL_READ_LIMIT,
    JournalWriter,
    journal_path,
    publish_receipt,
)
from cache_family.actors.run.context import HostSettings, RunContext, RunStop
from cache_family.actors.run.prompts import PromptSelector
from cache_family.actors.run.report_files import publish_report_files
from cache_family.actors.run.row import RowActor, run_private_copies
from cache_family.actors.run.run_progress import (
    RunProgressSink,
    SilentRunProgress,
    synthetic_mark,
)
from cache_family.actors.run.self_calibration import calibrate_client
from cache_family.errors import Refusal, Refused
from cache_family.schemas.bounded import read_bounded
from cache_family.schemas.journal import (
    Cancellation,
    DeadlineExpired,
    InterruptFinishFailed,
    PlannedRowBrief,
    RowsSelected,
    RunFilesBound,
    RunResumed,
    RunStarted,
    UseCaseSourceBrief,
    read_journal,
)
from cache_family.schemas.matrix import (
    MATRIX_FILENAME,
    FailedMatrix,
    MatrixReceipt,
    encode_matrix,
)
from cache_family.schemas.prepared import (
    PREPARED_INPUT_MAX_BYTES,
    PreparedInput,
    PreparedRow,
    decode_document,
)
from cache_family.schemas.row_result import RowResult
from cache_family.states.budgets import Budgets
from cache_family.states.fold import JournalIndex
from cache_family.states.matrix import fold_matrix
from cache_family.states.plans import thread_setting
from cache_family.system import interrupts
from cache_family.system.host_load import load_average, observe_host
from cache_family.system.publish import (
    fsync_dir,
    overlapping_trees,
    publish_fresh,
    trees_holding,
)

# The run reads whatever preparation may publish, and no more.
RUN_INPUT_MAX_BYTES: Final = PREPARED_INPUT_MAX_BYTES


# --- admission ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AdmittedRun:
    prepared: PreparedInput
    input_path: str
    request_sha256: str
    output: str
    prompts: PromptSelector
    # Journaled after run_started when the run runs only some rows (--rows, --shard).
    selection: RowsSelected | None = None
    # The run directory as the handle opened when it was made (or resumed) names it
    # (``RunHandle.path``): every write of the run goes through it, so a parent of ``output``
    # flipped to a link meanwhile moves none of them. None: through ``output`` (a caller
    # that made the directory itself, as tests do).
    handle_path: str | None = None

    @property
    def run_dir(self) -> str:
        """Where the run reads and writes its directory (``output`` is what is shown)."""
        return self.handle_path or self.output


def admit_run(input_path: str, output: str, *, fixed_corpus_path: str | None = None) -> AdmittedRun:
    """Every check that needs no output directory; raises ``Refused`` with all it found."""
    problems: list[Refusal] = []
    for name, value in (("input", input_path), ("output", output)):
        if not os.path.isabs(value):
            problems.append(
                Refusal(
                    "run.not_absolute",
                    f"$.{name}",
                    f"--{name} {value!r} is not an absolute path",
                    "give absolute paths",
                )
            )
    if problems:
        raise Refused(tuple(problems))
    output = os.path.normpath(output)
    parent = os.path.dirname(output)
    try:
        parent_mode = os.lstat(parent).st_mode
    except OSError:
        parent_mode = 0
    if not stat.S_ISDIR(parent_mode):
        problems.append(
            Refusal(
                "run.output_parent",
                "$.output",
                f"the parent of {output} is not a real directory",
                "create the parent directory (not a symlink) first",
            )
        )
    if os.path.lexists(output):
        problems.append(_output_exists(output))
    try:
        raw = read_bounded(input_path, RUN_INPUT_MAX_BYTES, what="prepared input")
        prepared = decode_document(raw.data, PreparedInput, what="prepared input")
        prompts = PromptSelector(prepared, fixed_corpus_path=fixed_corpus_path)
        prompts.check()
    except Refused as refused:
        raise Refused((*problems, *refused.refusals)) from None
    problems.extend(_output_overlaps(output, prepared))
    if problems:
        raise Refused(tuple(problems))
    return AdmittedRun(
        prepared=prepared,
        input_path=raw.path,
        request_sha256=raw.sha256,
        output=output,
        prompts=prompts,
    )


def guarded_trees(prepared: PreparedInput) -> list[tuple[str, str]]:
    """(where, path) of every tree a run reads pinned bytes from: its output stays outside."""
    return [
        ("$.native_build.path", prepared.native_build.path),
        ("$.cache_root", prepared.cache_root),
        *(
            (f"$.toolkit_directories.{name}.path", toolkit.path)
            for name, toolkit in prepared.toolkit_directories.items()
        ),
    ]


def _output_overlaps(output: str, prepared: PreparedInput) -> list[Refusal]:
    """An output inside the native build or the model cache (or holding one) changes pinned
    bytes: every row would fail its own pin check. Refused as preparation refuses it (by path
    here; ``make_fresh_dir`` checks again by the identity of the parent it creates under)."""
    try:
        parent = os.path.realpath(os.path.dirname(output))
        canonical = os.path.join(parent, os.path.basename(output))
        overlaps = overlapping_trees(canonical, guarded_trees(prepared))
    except OSError as exc:  # a link flipped while it was resolved
        return [_parent_changed(output, exc)]
    return [_not_disjoint(canonical, tree, where) for where, tree in overlaps]


def _not_disjoint(output: str, tree: str, where: str) -> Refusal:
    return Refusal(
        "run.output_not_disjoint",
        "$.output",
        f"output {output} overlaps {tree} (the prepared input's {where[2:]})",
        "write the run outside the native build, the model cache and the toolkit trees",
    )


def _parent_changed(output: str, exc: OSError) -> Refusal:
    return Refusal(
        "run.output_parent",
        "$.output",
        f"the parent of {output} is not a real directory, or changed while the run directory "
        f"was made ({exc.strerror or exc})",
        "give an output whose parent is a real directory (not a symlink) that nothing else "
        "changes while the run starts",
    )


def _output_exists(output: str) -> Refusal:
    return Refusal(
        "run.output_exists",
        "$.output",
        f"{output} already exists",
        "a run writes into a fresh directory; choose a new --output",
    )


# --- the outcome ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MatrixOutcome:
    status: str
    receipt: MatrixReceipt | FailedMatrix
    interrupted: bool
    # SHA-256 of the journal's seal line, the head an auditor checks a later replay against;
    # None when the journal could not be sealed.
    journal_head: str | None = None


# --- the supervisor -----------------------------------------------------------------------------


SignalHandler: TypeAlias = Callable[[int, FrameType | None], Any] | int | None


def check_interrupt_finish(originals: Mapping[int, SignalHandler]) -> str | None:
    """The interrupt-finish check, made before the matrix is folded: SIGINT/SIGTERM must still
    be turned into cancellation (nobody replaced the run's handlers) and every handler the run
    displaced must be one that can be put back. None when restoring will succeed, else why not."""
    problems: list[str] = []
    for signum, original in originals.items():
        name = signal.Signals(signum).name
        current = signal.getsignal(signum)
        if current is original or current in (signal.SIG_DFL, signal.SIG_IGN, None):
            problems.append(f"{name} is no longer turned into cancellation ({current!r})")
        if original is None:
            problems.append(f"{name}'s previous handler was not set from Python; cannot restore")
    return "; ".join(problems) or None


@dataclass(slots=True)
class _Signals:
    """What the run's signal watcher saw. A signal counts as a cancellation only while the
    matrix can still say so; one that lands after its fold began is ``late``."""

    received: int = 0
    folded: bool = False
    late: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Resumption:
    """What ``run --resume`` decided before the run continues (``actors/run/resume.py``): the
    ``run_resumed`` record to journal first, the rows kept as they are, and the moves of the
    rerun rows' directories (and the interrupted segment's report files) to perform once
    that record is durable."""

    record: RunResumed
    kept_rows: frozenset[int]
    moves: tuple[tuple[str, str], ...] = ()
    # The run's id (its first run_started's): the resumed segment's hosts are tagged with it.
    run_id: str = ""


async def supervise(
    admitted: AdmittedRun,
    hosts: HostSettings | None = None,
    progress: RunProgressSink | None = None,
    resumption: Resumption | None = None,
    early: interrupts.Latch | None = None,
) -> MatrixOutcome:
    """Run every row in order under the run's budgets and signals; publish the matrix.

    SIGINT/SIGTERM stay turned into cancellation from before the first row until the matrix
    is published and the journal closed: journaling the unreached rows, the interrupt-finish
    check, the fold and the publication never meet Python's default handlers. A matrix
    receipt is always written: the folded one, or the failed fallback. ``early`` holds the
    signals that arrived before the receiver opened: the first is the run's cancellation."""
    prepared = admitted.prepared
    run_dir = admitted.run_dir
    progress = progress or SilentRunProgress()
    # The display reads what the run journals: rows, cells, transitions, rungs.
    writer = JournalWriter(
        journal_path(run_dir), resume=resumption is not None, on_record=progress.record
    )
    stop = RunStop(run_deadline=trio.current_time() + prepared.execution_seconds)
    ctx = RunContext(
        writer=writer,
        run_dir=run_dir,
        budgets=Budgets(
            run_deadline=stop.run_deadline,
            cell_seconds=float(prepared.cell_seconds),
            request_timeout_ms=prepared.request_timeout_ms,
        ),
        stop=stop,
        hosts=hosts or HostSettings(),
    )
    seen = _Signals()
    receipt: MatrixReceipt | FailedMatrix | None = None
    head: str | None = None
    originals: dict[int, SignalHandler] = {
        signum: signal.getsignal(signum) for signum in interrupts.SIGNALS
    }
    try:
        with trio.open_signal_receiver(*interrupts.SIGNALS) as signals:
            async with trio.open_nursery() as writer_nursery:
                await writer_nursery.start(writer.run)
                try:
                    async with trio.open_nursery() as watchers:
                        rows_scope = trio.CancelScope()
                        watchers.start_soon(
                            _watch_signals, signals, ctx, rows_scope, progress, seen, early
                        )
                        receipt, head = await _run_and_publish(
                            admitted, ctx, progress, rows_scope, watchers, seen, originals,
                            resumption,
                        )  # fmt: skip
                        watchers.cancel_scope.cancel()
                finally:
                    with trio.CancelScope(shield=True):
                        await writer.aclose()
        # The receiver is closed: the displaced handlers are back.
        restored = {signum: signal.getsignal(signum) for signum in interrupts.SIGNALS}
        if restored != originals:
            progress.note("interrupt finish: SIGINT/SIGTERM handlers were not restored")
    except Exception as exc:
        progress.note(f"run failed: {describe_failure(exc)}")
        if receipt is None:
            receipt = await _publish_failed(admitted, describe_failure(exc), progress)
    finally:
        progress.close()
    for name in seen.late:
        progress.note(f"{name} after the matrix was folded: the run had already finished")
    return MatrixOutcome(
        status=receipt.status,
        receipt=receipt,
        interrupted=stop.signal_name is not None or seen.received > 0,
        journal_head=head,
    )


async def _run_and_publish(
    admitted: AdmittedRun,
    ctx: RunContext,
    progress: RunProgressSink,
    rows_scope: trio.CancelScope,
    watchers: trio.Nursery,
    seen: _Signals,
    originals: Mapping[int, SignalHandler],
    resumption: Resumption | None,
) -> tuple[MatrixReceipt | FailedMatrix, str | None]:
    writer = ctx.writer
    results: dict[int, RowResult] = {}
    if resumption is None:
        started = _run_started(admitted)
        assert started.runner_pid is not None and started.runner_create_time is not None
        ctx.tag_hosts_with_run(started.run_id, started.runner_pid, started.runner_create_time)
        await writer.append(started)
        if admitted.selection is not None:
            await writer.append(admitted.selection)
    else:
        resumed = resumption.record
        assert resumed.runner_pid is not None and resumed.runner_create_time is not None
        ctx.tag_hosts_with_run(resumption.run_id, resumed.runner_pid, resumed.runner_create_time)
        await writer.append(resumed)
        await trio.to_thread.run_sync(_move_aside, ctx.run_dir, resumption.moves)
        for index in resumption.kept_rows:
            results[index] = RowResult(index=index, status="kept", launched=False)
    progress.start(admitted.output, ctx.budgets)
    # The deadline stops rows only: unreached rows and the matrix are journaled regardless.
    deadline_scope = trio.CancelScope()
    watchers.start_soon(_watch_deadline, ctx, rows_scope, progress, deadline_scope)
    with rows_scope:
        unfinished = [row for row in admitted.prepared.rows if row.index not in results]
        async with run_private_copies(admitted.prepared, unfinished, ctx.run_dir) as copies:
            await _calibrate(ctx, progress)
            await _rows(admitted, dataclasses.replace(ctx, row_exec=copies), progress, results)
    deadline_scope.cancel()
    await _journal_unreached(admitted, ctx, results)
    # Checked before the fold, so a failure downgrades the matrix itself.
    problem = check_interrupt_finish(originals)
    if problem is not None:
        await writer.append(InterruptFinishFailed(detail=problem[:2000]))
        progress.note(f"interrupt finish failed: {problem}")

    # From here on a signal changes nothing: the report files and the matrix are folded.
    seen.folded = True
    try:
        receipt = await finish_run(writer, ctx.run_dir)
    except BaseException as exc:
        with trio.CancelScope(shield=True):
            progress.note(f"matrix not folded: {exc!r}")
            failed = await _publish_failed(admitted, repr(exc), progress)
        if not isinstance(exc, Exception):
            raise
        return failed, None
    return receipt, writer.head_sha256


async def finish_run(writer: JournalWriter, run_dir: str) -> MatrixReceipt:
    """How every run (and resumed run) ends: the report files, the list of every file in
    the run directory (``run_files``), the matrix, then the seal;
    afterwards nothing can be appended and ``writer.head_sha256`` is the journal's head."""
    await publish_report_files(writer, run_dir)
    # Every file the run wrote, bound before the matrix (which its own publication binds).
    files = await trio.to_thread.run_sync(bind_run_files, run_dir)
    await writer.append(RunFilesBound(files=files))
    receipt = await publish_matrix_receipt(writer, run_dir)
    await writer.seal(matrix_status=receipt.status, terminal_refusal=receipt.terminal_refusal)
    return receipt


async def _publish_failed(
    admitted: AdmittedRun, detail: str, progress: RunProgressSink
) -> FailedMatrix:
    """The matrix of a run whose own pipeline failed (the reference's failed receipt)."""
    receipt = FailedMatrix(detail=detail[:2000], request_sha256=admitted.request_sha256)
    try:
        await trio.to_thread.run_sync(
            publish_fresh, os.path.join(admitted.run_dir, MATRIX_FILENAME), encode_matrix(receipt)
        )
    except OSError as exc:
        # The folded matrix may already be on disk (its publication record was what failed).
        progress.note(f"failed matrix not written: {exc}")
    return receipt


async def publish_matrix_receipt(
    writer: JournalWriter, run_dir: str, *, on_fold: Callable[[], None] | None = None
) -> MatrixReceipt:
    """Fold the matrix from the durable journal file (exactly what replay reads), publish it
    fresh and journal the publication. ``on_fold`` is called just before the journal is
    synced for the fold: whatever is appended later is not in the matrix."""
    if on_fold is not None:
        on_fold()
    through = await writer.sync()
    path = journal_path(run_dir)

    def fold() -> MatrixReceipt:
        read = read_journal(read_bounded(path, JOURNAL_READ_LIMIT, what="journal").data)
        if read.chain_break is not None:
            raise Refused((read.chain_break.refusal(),))
        return fold_matrix(JournalIndex(read.lines), through_seq=through)

    receipt = await trio.to_thread.run_sync(fold)
    await publish_receipt(
        writer, run_dir, MATRIX_FILENAME, encode_matrix(receipt), scope="matrix", through=through
    )
    return receipt


def _move_aside(run_dir: str, moves: Sequence[tuple[str, str]]) -> None:
    """Move an interrupted segment's files aside (relative source, relative target)."""
    for source, target in moves:
        path = os.path.join(run_dir, source)
        if os.path.lexists(path):
            os.makedirs(os.path.dirname(os.path.join(run_dir, target)), exist_ok=True)
            os.rename(path, os.path.join(run_dir, target))
    fsync_dir(run_dir)


async def _journal_unreached(
    admitted: AdmittedRun, ctx: RunContext, results: dict[int, RowResult]
) -> None:
    """Rows a cancellation or the deadline kept from starting are journaled, never launched."""
    for row in admitted.prepared.rows:
        if row.index not in results:
            actor = RowActor(row, admitted.prepared, ctx, admitted.prompts)
            results[row.index] = await actor.journal_unreached()


def _run_started(admitted: AdmittedRun) -> RunStarted:
    prepared = admitted.prepared
    threads = thread_setting(prepared.environment)
    catalog = prepared.catalog
    return RunStarted(
        run_id=f"run-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(4)}",
        request_sha256=admitted.request_sha256,
        catalog_sha256=catalog.sha256,
        tool_version=__version__,
        input_path=admitted.input_path,
        execution_seconds=prepared.execution_seconds,
        cell_seconds=prepared.cell_seconds,
        request_timeout_ms=prepared.request_timeout_ms,
        operator_threads=threads,
        planned_rows=tuple(planned_brief(prepared, row) for row in prepared.rows),
        catalog_path=catalog.path,
        catalog_synthetic=catalog.synthetic,
        catalog_packaged=catalog.packaged,
        runner_pid=os.getpid(),
        runner_create_time=psutil.Process().create_time(),
        host=admitted.selection.host
        if admitted.selection is not None and admitted.selection.host is not None
        else observe_host(os.environ),
        load_average=load_average(),
    )


def planned_brief(prepared: PreparedInput, row: PreparedRow) -> PlannedRowBrief:
    """One row of the plan as ``run_started`` (or ``rows_selected``) names it."""
    return PlannedRowBrief(
        index=row.index,
        case=row.key,
        prefix_tokens=row.prefix_tokens,
        use_case=row.use_case,
        model_status=row.model_observation.status,
        output_relative=row.output_relative,
        synthetic=row.synthetic,
        family=row.family,
        model_id=row.model_id,
        payload=row.payload,
        stage_load_mode=row.load_mode,
        use_case_label=row.use_case_label,
        resident_kv_bytes_per_token=row.kv_bytes_per_token,
        use_case_source=_use_case_source(prepared, row.use_case),
    )


def _use_case_source(prepared: PreparedInput, key: str | None) -> UseCaseSourceBrief | None:
    record = next((u for u in prepared.use_cases if u.key == key), None) if key else None
    if record is None:
        return None
    source = record.source
    return UseCaseSourceBrief(
        dataset=source.dataset, config=source.config, split=source.split, row_idx=source.row_idx
    )


async def _calibrate(ctx: RunContext, progress: RunProgressSink) -> None:
    """Before the first ladder: the client's own overhead on this machine, journaled (the
    matrix receipt reports it, and every rung's receipt is judged against it)."""
    calibrated = await calibrate_client()
    await ctx.writer.append(calibrated)
    ctx.client_calibration = calibrated.calibration
    if calibrated.error is not None:
        progress.note(f"client self-calibration: {calibrated.error}")


async def _rows(
    admitted: AdmittedRun, ctx: RunContext, progress: RunProgressSink, results: dict[int, RowResult]
) -> None:
    for row in admitted.prepared.rows:
        if row.index in results:
            continue  # kept by a resume
        progress.row_started(row)
        started = trio.current_time()
        actor = RowActor(row, admitted.prepared, ctx, admitted.prompts)
        try:
            await actor.run()
        finally:
            if actor.result is not None:
                results[row.index] = actor.result
                progress.row_finished(row, actor.result, trio.current_time() - started)


async def _watch_signals(
    signals: Any,
    ctx: RunContext,
    rows_scope: trio.CancelScope,
    progress: RunProgressSink,
    seen: _Signals,
    early: interrupts.Latch | None = None,
) -> None:
    async for name in _signal_names(signals, early):
        seen.received += 1
        if seen.folded:
            # The matrix is being folded or published: nothing is left to cancel, and
            # publication is never skipped.
            seen.late.append(name)
        elif ctx.stop.signal_name is None and not ctx.stop.deadline_hit:
            ctx.stop.signal_name = name
            # Stamped before the rows see the cancellation, so every later fold sees it.
            ctx.writer.append_nowait(
                Cancellation(cell_id=None, signal=name, detail="run cancelled by signal")
            )
            rows_scope.cancel()
            progress.note(f"{name}: cancelling; hosts are being cleaned up (again to hurry)")
        else:
            if ctx.stop.signal_name is None:
                ctx.stop.signal_name = name
            ctx.stop.shorten_grace()
            progress.note(f"{name} again: shortening the hosts' SIGTERM grace")


async def _signal_names(signals: Any, early: interrupts.Latch | None) -> AsyncIterator[str]:
    """The signals held from before the receiver opened, then the receiver's. The watcher
    starts once run_started (or run_resumed) is stamped, so an early one is journaled after
    it, as the run's first cancellation."""
    for name in early.take() if early is not None else ():
        yield name
    async for signum in signals:
        yield signal.Signals(signum).name


async def _watch_deadline(
    ctx: RunContext,
    rows_scope: trio.CancelScope,
    progress: RunProgressSink,
    deadline_scope: trio.CancelScope,
) -> None:
    with deadline_scope:
        await trio.sleep_until(ctx.stop.run_deadline)
        if ctx.stop.signal_name is None:
            ctx.stop.deadline_hit = True
            ctx.writer.append_nowait(
                DeadlineExpired(cell_id=None, budget="execution", detail="execution_seconds spent")
            )
            rows_scope.cancel()
            progress.note("execution deadline reached: stopping the run")


# --- what the command says about it (console/commands.py prints) ----------------------


def is_interrupt(exc: BaseException) -> bool:
    """A KeyboardInterrupt, alone or as the only thing in (nested) exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(KeyboardInterrupt)
        return rest is None
    return isinstance(exc, KeyboardInterrupt)


def final_line(admitted: AdmittedRun, outcome: MatrixOutcome) -> str:
    """The run's last line on stdout: the matrix status and path, "(synthetic)" when the
    catalog was synthetic."""
    matrix = os.path.join(admitted.output, MATRIX_FILENAME)
    return f"{outcome.status}: {matrix}{synthetic_mark(admitted.prepared.catalog.synthetic)}"


def describe_failure(exc: BaseException) -> str:
    """The leaf exceptions of a (nested) group: a full disk reads as "OSError: [Errno 28] No
    space left on device", not as "Exceptions from Trio nursery"."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe_failure(inner) for inner in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"


def unwritten_matrix(admitted: AdmittedRun, reason: str | None) -> str:
    """What to say when the matrix could not be written: never its (missing) path."""
    why = f" ({reason})" if reason else " (see the error above)"
    return (
        f"no {MATRIX_FILENAME} could be written{why}; the journal and the receipts that "
        f"were written are kept in {admitted.output}"
    )


def make_fresh_dir(path: str, guarded: Sequence[tuple[str, str]] = ()) -> RunHandle:
    """Create the run directory ``path`` (absolute, normalized), fresh; its handle.

    Its parent is opened once as a directory descriptor without following a link; that
    directory's identity, not its path, is checked against the ``guarded`` trees, the run
    directory is made under the descriptor and opened through it, and the path is then
    checked to name what was made (a parent flipped to a symlink meanwhile is refused, and
    what was made removed). The run writes through the handle from then on: a parent flipped
    later moves none of its files. Every OSError is a typed refusal."""
    parent, name = os.path.split(path)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        parent_fd = os.open(parent, flags)
    except OSError as exc:
        raise Refused((_parent_changed(path, exc),)) from None
    try:
        try:
            inside = trees_holding(parent_fd, guarded)
        except OSError as exc:
            raise Refused((_parent_changed(path, exc),)) from None
        if inside:
            raise Refused(tuple(_not_disjoint(path, tree, where) for where, tree in inside))
        try:
            os.mkdir(name, 0o755, dir_fd=parent_fd)
        except FileExistsError:
            raise Refused((_output_exists(path),)) from None
        except OSError as exc:
            raise Refused.one(
                "run.output_unwritable",
                "$.output",
                f"cannot create {path}: {exc.strerror}",
                "check the parent directory's permissions",
            ) from None
        handle: int | None = None
        try:
            handle = os.open(name, flags, dir_fd=parent_fd)
            made = os.fstat(handle)
            named = os.stat(path)
            problem = None if os.path.samestat(made, named) else OSError(errno.EXDEV, "moved")
        except OSError as exc:
            problem = exc
        if problem is not None:
            if handle is not None:
                os.close(handle)
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=parent_fd)
            raise Refused((_parent_changed(path, problem),)) from None
        assert handle is not None
        return RunHandle(handle)
    finally:
        os.close(parent_fd)


class RunHandle:
    """An open descriptor of a run directory, and the path that reaches the directory through
    it for this process and its children while it lives (``/proc/<pid>/fd/<fd>``): no
    rename or link of a parent changes what that path names. Close it once the run ended."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.path = f"/proc/{os.getpid()}/fd/{fd}"

    @classmethod
    def open(cls, path: str) -> RunHandle:
        """The handle of an existing run directory (``run --resume``); OSError if it is not
        one (a link in its place is refused)."""
        return cls(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> RunHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
