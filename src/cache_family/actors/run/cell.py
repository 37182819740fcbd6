"""The cell (host) actor: one host session of one host arm, driven by ``CELL_TABLE``."""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import suppress
from typing import Final

import msgspec
import trio

from cache_family.actors.journal.rows_file import RowFileWriter
from cache_family.actors.journal.writer import publish_cell_receipt, publish_receipt
from cache_family.actors.run import custody, stage_host
from cache_family.actors.run.chat_text import WrappedPrompt, wrapped_prompt
from cache_family.actors.run.context import HostHandle, PinResult, RunContext, is_cancellation
from cache_family.actors.run.engine import Handlers, drive
from cache_family.actors.run.hosts import HOST_KINDS
from cache_family.actors.run.load import BenchmarkPrompt, LoadRun, PromptCuts
from cache_family.actors.run.private_exec import PrivateCopy, copied_pins, make_private_copy
from cache_family.actors.run.server_metrics import Exposition, MetricsWatch, Reading
from cache_family.actors.run.workload_dialects import WorkloadHost, WorkloadHostLost
from cache_family.actors.run.workload_runners import WORKLOAD_RUNNERS
from cache_family.errors import Refused
from cache_family.schemas.gguf_header import read_gguf_header
from cache_family.schemas.journal import (
    Cancellation,
    CellOpened,
    ChildSpawned,
    CleanupOutcome,
    CliAdmission,
    DeadlineExpired,
    Fault,
    ListeningMarkerSeen,
    PinDrift,
    PinObserved,
    PortReserved,
    Ready,
    Record,
    RungCompleted,
    RungPlan,
    RungRows,
    WarmupExclusion,
)
from cache_family.schemas.measurement import (
    HostCleaned,
    HostEvent,
    HostFaulted,
    HostMarkerSeen,
    HostReady,
    HostSpawned,
    LoadOutcome,
    LoadRequest,
    RequestRow,
)
from cache_family.schemas.receipts import CellReceipt
from cache_family.schemas.request_rows import REQUESTS_FILENAME, RequestRowLine
from cache_family.schemas.workload_records import WORKLOAD_RECEIPT_NAME
from cache_family.states.budgets import Budgets
from cache_family.states.cache_reuse import reuse_rule
from cache_family.states.calibration import client_lag_ms
from cache_family.states.cell import (
    CELL_TABLE,
    CellAction,
    CellEvent,
    CellMachine,
    CellState,
    LiveMachine,
)
from cache_family.states.plans import (
    SOURCE_CORRECTNESS,
    CellPlan,
    PinTarget,
    argv_sha256,
    thread_setting,
)
from cache_family.states.server_metrics import TokenSummer
from cache_family.states.workload_fold import SCOPE_WORKLOAD, workload_bytes
from cache_family.system.host_load import load_average
from cache_family.system.http import LoopbackHttp
from cache_family.system.pin_watch import PinWatch, WatchedPin
from cache_family.system.process_group import PROCESS_TAG_NAME
from cache_family.system.publish import publish_fresh


def watch_pins(targets: Sequence[PinTarget]) -> PinWatch:
    """Watch ``targets`` from before their first hash to after their last: a change in
    between, even one undone before the last hash, is drift (blocking: call in a thread)."""
    return PinWatch(WatchedPin(t.name, t.path, t.kind == "tree") for t in targets)


def fault_kind(refused: Refused) -> str:
    code = refused.codes[0]
    if code in custody.FAULT_KIND_OF_CODE:
        return custody.FAULT_KIND_OF_CODE[code]
    if code.startswith("load.prompt") or code == "load.tokenize":
        return "prompt_failed"
    if code == "stage.cli_refused":
        return "cli_refused"
    return "internal"


def pin_records(cell_id: str, phase: str, result: PinResult) -> tuple[PinObserved | PinDrift, ...]:
    """What one re-hashed pin journals: the observation, and a drift record when it differs."""
    target = result.target
    observed = PinObserved(
        cell_id=cell_id,
        phase=phase,
        name=target.name,
        path=target.path,
        expected_sha256=target.expected_sha256,
        observed_sha256=result.observed_sha256,
        verified_by=result.verified_by,
    )
    if result.matches:
        return (observed,)
    return observed, PinDrift(**msgspec.structs.asdict(observed))


class _Fault(Exception):
    """A fault the cell found itself (not a refusal from a lower layer)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


class _Segment:
    """A load run's row sink: each row becomes a line of the cell's rows file as its request
    ends (``keep``: and is kept, for the warmup's one row that rung 0 continues from)."""

    def __init__(
        self, writer: RowFileWriter, rung_index: int, concurrency: int, *, keep: bool = False
    ) -> None:
        self.writer = writer
        self.rung_index = rung_index
        self.concurrency = concurrency
        self.first_line = writer.lines
        self.completed = 0
        self.kept: list[RequestRow] | None = [] if keep else None
        # The prompt tokens every request's count is held to (a chat host's), and the ids
        # of those the server counted otherwise.
        self.expected_prompt_tokens: int | None = None
        self.miscounted: list[tuple[int, int]] = []
        # The client's sums of the server's per-request figures (beside its own metrics).
        self.tokens = TokenSummer()

    def add(self, row: RequestRow) -> None:
        self.writer.add(
            RequestRowLine(rung_index=self.rung_index, concurrency=self.concurrency, row=row)
        )
        self.completed += row.status == "completed"
        self.tokens.add_row(row)
        if self.kept is not None:
            self.kept.append(row)
        expected, counted = self.expected_prompt_tokens, row.prompt_tokens
        if expected is not None and counted is not None and counted != expected:
            self.miscounted.append((row.request_id, counted))


def model_sliding_window(plan: CellPlan) -> int | None:
    """A sliding-window family's window, from its GGUF header (the pinned model's bytes):
    which reuse its verdicts expect. None for another family, or a header that names none."""
    if plan.profile is None or reuse_rule(plan.architecture) != "checkpoint-swa":
        return None
    try:
        return read_gguf_header(os.path.realpath(plan.profile.model)).sliding_window
    except (Refused, OSError):
        return None  # not a readable GGUF (a layer package): the cautious rule judges


# --- the actor --------------------------------------------------------------------------------


class CellActor:
    """One host session. ``await CellActor(plan, ctx).run()`` returns the published receipt."""

    def __init__(
        self, plan: CellPlan, ctx: RunContext, prompt_cuts: PromptCuts | None = None
    ) -> None:
        """``prompt_cuts``: the row's, so its arms cut a corpus prompt once."""
        self.plan = plan
        self.ctx = ctx
        self.prompt_cuts = prompt_cuts if prompt_cuts is not None else PromptCuts()
        # The host session's one HTTP client: readiness, the prompt cut and every rung.
        self.http = LoopbackHttp()
        self.machine: CellMachine = LiveMachine(
            CELL_TABLE, plan.cell_id, ctx.step_journal(CELL_TABLE.name, cell_id=plan.cell_id)
        )
        # What differs between the kinds of server (``actors/run/hosts.py``).
        self.host_kind = HOST_KINDS[plan.host_kind]
        # The model header's sliding window, read as the cell opens (a sliding-window family's).
        self.sliding_window: int | None = None
        self.deadline = math.inf
        self.work_deadline = math.inf
        self.host: HostHandle | None = None
        self.prompt: BenchmarkPrompt | None = None
        # A chat host's count of the prompt in its template (``_cut_prompt``), or why none.
        self._chat_prompt: WrappedPrompt | None = None
        self._chat_prompt_unchecked: str | None = None
        self.receipt: CellReceipt | None = None
        # The cell's own directory: its receipt, its host's private state dir and logs.
        self.cell_path = os.path.join(ctx.run_dir, plan.cell_dir)
        self._nursery: trio.Nursery | None = None
        self._release_host = trio.Event()
        self._host_ended = trio.Event()
        self._opened_at: float | None = None
        self._faults_journaled: set[str] = set()
        self._stop_recorded = False
        self._out_of_time = False
        self._warmup: tuple[RequestRow, ...] = ()
        # The cell's rows file (``requests.jsonl``): opened by the first load run, closed
        # (read-only) before the receipt is published.
        self._rows_file: RowFileWriter | None = None
        self._argv: list[str] = []
        # A stage server's dialect, read from its help in pin-verify.
        self.cli: stage_host.CliAdmitted | None = None
        # The private copy of the binary and native build the host runs from (pin-verify):
        # the row's (``RowExec``), or the cell's own when it runs outside a row.
        self._exec: PrivateCopy | None = None
        self._exec_owned = False
        self._exec_problem = ""
        # The launch pins, watched from before pin-verify's hash to after post-verify's.
        self._watch: PinWatch | None = None
        # The host session's request count when readiness sampled the host's process tree.
        self._requests_at_tree_note = -1
        # The host's metrics read that opens the next rung's interval: the one before the
        # serial warmup (rung 0's), then each rung's closing read (nothing reaches the host
        # between a rung's last answer and the next rung's first request).
        self._metrics_opening: Reading | None = None

    def __repr__(self) -> str:
        elapsed = "-"
        if self._opened_at is not None:
            with suppress(RuntimeError):
                elapsed = f"{trio.current_time() - self._opened_at:.1f}s"
        pid = self.host.pid if self.host is not None else None
        return (
            f"<CellActor {self.plan.cell_id} state={self.machine.state.value} pid={pid} "
            f"elapsed={elapsed}>"
        )

    async def _journal(self, record: Record) -> None:
        await self.ctx.journal(record)

    # -- the loop --------------------------------------------------------------------------

    async def run(self) -> CellReceipt | None:
        """Run the whole session; Cancelled from outside propagates after finalize."""
        plan = self.plan
        now = trio.current_time()
        self._opened_at = now
        self.deadline = self.ctx.budgets.cell_deadline(now)
        self.work_deadline = Budgets.work_deadline(self.deadline, now)
        os.makedirs(os.path.join(self.cell_path, "logs"), exist_ok=True)
        self.sliding_window = await trio.to_thread.run_sync(model_sliding_window, plan)
        with trio.CancelScope(shield=True):
            await self._journal(
                CellOpened(
                    cell_id=plan.cell_id,
                    row_index=plan.row_index,
                    row_key=plan.row_key,
                    arm=plan.arm.name,
                    cohort=plan.arm.cohort,
                    cell_dir=plan.cell_dir,
                    measurement_kind=plan.arm.kind.value,
                    rungs=plan.rungs,
                    ttft_slo_ms=plan.ttft_slo_ms,
                    tpot_slo_ms=plan.tpot_slo_ms,
                    synthetic=plan.synthetic,
                    cache_expectation=self.host_kind.expectation(plan, self.sliding_window),
                    ignore_eos=plan.synthetic,
                    load_average=load_average(),
                )
            )
        escaped: BaseException | None = None
        # The host's custody runs as a task of this nursery (started in pin-verify, ended by
        # the end-host action), so the loop's own cancel scopes never span it.
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                try:
                    with trio.CancelScope(deadline=self.deadline):
                        await self._loop()
                except BaseException as exc:
                    escaped = exc
                    nursery.cancel_scope.cancel()
                finally:
                    self._release_host.set()  # custody never outlives the loop
        finally:
            if self._watch is not None:
                self._watch.close()
            if self._exec is not None and self._exec_owned:
                custody.remove_tree(self._exec.root)  # the host has ended with custody
        if escaped is not None:
            raise escaped
        return self.receipt

    async def _loop(self) -> None:
        await drive(
            self,
            self.machine,
            _HANDLERS,
            sync=self.ctx.writer.sync,
            interrupted=self._interrupted,
        )

    async def _interrupted(self, exc: BaseException, stopping: bool) -> tuple[CellEvent, bool]:
        """A refusal or a fault of the cell is the ``fault`` event; anything else stops the
        cell (re-raised once it is finalized)."""
        if isinstance(exc, Refused | _Fault):
            return await self._failed(exc), False
        return await self._stopped(exc), True

    async def _failed(self, failure: Refused | _Fault) -> CellEvent:
        """Journal a failure (unless custody's observer already did) as the ``fault`` event."""
        if isinstance(failure, Refused):
            kind, detail = fault_kind(failure), str(failure)
            journaled = failure.codes[0] in self._faults_journaled
        else:
            kind, detail, journaled = failure.kind, failure.detail, False
        if not self.machine.can_fire(CellEvent.FAULT):
            raise failure  # finalize itself failed: nothing later could publish the receipt
        if not journaled:
            with trio.CancelScope(shield=True):
                await self._journal(
                    Fault(
                        cell_id=self.plan.cell_id,
                        kind=kind,
                        detail=detail[:2000],
                        pid=self.host.pid if self.host is not None else None,
                    )
                )
        return CellEvent.FAULT

    async def _stopped(self, exc: BaseException) -> CellEvent:
        """Cancellation or the cell deadline: journal which (once) as its event. Anything else
        escaping the work is a bug: journal it as an internal fault."""
        if not is_cancellation(exc):
            if not self.machine.can_fire(CellEvent.FAULT):
                raise exc
            return await self._failed(_Fault("internal", f"{type(exc).__name__}: {exc}"))
        kind = self.ctx.stop.classify(self.deadline, trio.current_time())
        event = CellEvent.CANCELLED if kind == "cancelled" else CellEvent.DEADLINE_EXPIRED
        if not self._stop_recorded:
            self._stop_recorded = True
            detail = f"in state {self.machine.state.value}"
            record: Record = (
                Cancellation(
                    cell_id=self.plan.cell_id,
                    signal=self.ctx.stop.signal_name or "",
                    detail=f"cancelled {detail}",
                )
                if kind == "cancelled"
                else DeadlineExpired(
                    cell_id=self.plan.cell_id, budget=kind, detail=f"expired {detail}"
                )
            )
            with trio.CancelScope(shield=True):
                await self._journal(record)
        if not self.machine.can_fire(event):
            raise exc
        return event

    async def _after_work(self, done: CellEvent) -> CellEvent:
        """``done``, or ``deadline-expired`` when the work stopped at the cell's work deadline
        (the load actor stopped on its own: a deadline, not a fault of the host)."""
        if not self._out_of_time:
            return done
        self._out_of_time = False
        self._stop_recorded = True
        execution = self.deadline >= self.ctx.stop.run_deadline
        await self._journal(
            DeadlineExpired(
                cell_id=self.plan.cell_id,
                budget="execution" if execution else "cell",
                detail=f"work deadline passed in state {self.machine.state.value}",
            )
        )
        return CellEvent.DEADLINE_EXPIRED

    # -- the states' work ------------------------------------------------------------------

    async def _pin_verify(self) -> CellEvent:
        """Re-hash the pins, then take the host into custody (which reserves the port)."""
        plan = self.plan
        if plan.profile is None or plan.refusal is not None:
            raise _Fault(
                "profile_refused",
                plan.refusal or "the prepared input has no native host profile for this case",
            )
        profile = plan.profile
        row_exec = self.ctx.row_exec

        def copy_and_watch() -> tuple[PrivateCopy | None, str, PinWatch]:
            """The private copy, then the watch on the pins launch checks (one worker hop)."""
            copy, problem = None, ""
            try:
                if row_exec is not None:
                    copy = row_exec.copy_for(profile.binary, profile.native_build)
                else:
                    copy = make_private_copy(profile.binary, profile.native_build, self.cell_path)
            except OSError as exc:
                # The pins (hashed by path then) say what is wrong; if they still match, the
                # cell is refused below: a host never runs from a path its pins did not hash.
                problem = f"{exc.filename or profile.binary}: {exc.strerror or exc}"
            return copy, problem, watch_pins(self._launch_pins(copy))

        self._exec, self._exec_problem, self._watch = await trio.to_thread.run_sync(copy_and_watch)
        self._exec_owned = row_exec is None and self._exec is not None
        if not await self._verify_pins("before", self._launch_pins()):
            await self._journal(
                Fault(cell_id=plan.cell_id, kind="pin_mismatch", detail="pins differ before launch")
            )
            return CellEvent.PINS_MISMATCH
        if self._exec is None:
            raise _Fault(
                "spawn_failed",
                f"cannot make the private copy the host runs from: {self._exec_problem}",
            )
        assert self._nursery is not None
        if self.host_kind.reads_cli:
            self.cli = await self._admit_cli()
        config = self.ctx.hosts.host_config(
            plan.arm.directory,
            self.cell_path,
            readiness=self.host_kind.readiness(plan, self.cli),
            process_tag=self.ctx.cell_process_tag(plan.cell_id),
        )
        # A busy port is refused here, before anything is launched.
        await self._nursery.start(self._custody, config)
        return CellEvent.PINS_VERIFIED

    async def _admit_cli(self) -> stage_host.CliAdmitted:
        """Read the stage server's dialect from the help of the private copy the host will run
        (its pin verified around each probe; each probe a child in custody under this cell's
        tag), journal it, and write ``cli-admission.json`` and ``stage.json``. The help is read
        once per run for each pinned binary (``RunContext.cli_admissions``); when the probes
        left processes running, every cell that relies on them is faulted."""
        plan, profile, copy = self.plan, self.plan.profile, self._exec
        assert profile is not None and copy is not None  # pin-verify made the private copy
        binary = next(t for t in self._launch_pins() if t.name == "binary")
        key = (profile.binary, profile.binary_sha256)
        admitted = self.ctx.cli_admissions.get(key)
        if admitted is None:

            async def same_bytes() -> bool:
                remaining = self.work_deadline - trio.current_time()
                [result] = await self.ctx.verify_pins([binary], remaining)
                return result.matches

            probe_dir = custody.make_private_dir(self.cell_path, "cli-probe")
            tag = self.ctx.cell_process_tag(plan.cell_id)
            try:
                env = self._host_env(probe_dir)

                async def journal_probe(argv: tuple[str, ...], pid: int, created: float) -> None:
                    await self._journal_probe(argv, {**env, PROCESS_TAG_NAME: tag}, pid, created)

                probes = stage_host.ProbeCustody(
                    runner=self.ctx.hosts.child_runner,
                    process_tag=tag,
                    probe_dir=probe_dir,
                    on_spawn=journal_probe,
                )
                admitted = await stage_host.admit_cli(
                    copy.binary, env, probes, same_bytes, pinned=profile.binary
                )
            finally:
                custody.remove_tree(probe_dir)
            self.ctx.cli_admissions[key] = admitted
        await self._journal(
            CliAdmission(
                cell_id=plan.cell_id,
                binary=profile.binary,
                binary_sha256=profile.binary_sha256,
                dialect=admitted.dialect,
                probes=tuple((p.command, p.exit_code) for p in admitted.probes),
            )
        )
        documents = {
            stage_host.CLI_ADMISSION_NAME: stage_host.cli_admission_document(
                profile.binary, profile.binary_sha256, admitted
            ),
            stage_host.STAGE_CONFIG_NAME: stage_host.stage_config_document(
                model_id=plan.model_id,
                model=profile.model,
                model_sha256=profile.model_sha256,
                layer_end=profile.layer_end,
                ctx_size=plan.ctx_size,
                lane_count=plan.lanes,
                n_gpu_layers=plan.n_gpu_layers,
            ),
        }
        for name, data in documents.items():
            await trio.to_thread.run_sync(publish_fresh, os.path.join(self.cell_path, name), data)
        if admitted.left_behind:
            raise _Fault(
                "help_probe_unclean",
                f"the stage server's help probes left processes running (ended now): "
                f"{admitted.left_behind}",
            )
        return admitted

    async def _journal_probe(
        self, argv: tuple[str, ...], env: Mapping[str, str], pid: int, create_time: float
    ) -> None:
        """A help probe's child, journaled as it starts (``replay --reap`` finds it)."""
        await self._journal(
            ChildSpawned(
                cell_id=self.plan.cell_id,
                role="help_probe",
                pid=pid,
                create_time=create_time,
                pgid=pid,
                argv_sha256=argv_sha256(argv),
                executable=argv[0],
                host_argv=argv,
                host_env_names=tuple(sorted(env)),
                effective_environment=custody.recorded_environment(env),
            )
        )

    def _launch_pins(self, copy: PrivateCopy | None = None) -> tuple[PinTarget, ...]:
        """The pins checked before launch: the binary and native build as their private
        copies (the bytes the host will run; ``copy``, else the cell's), the rest where
        they are."""
        copy = copy or self._exec
        if copy is None:
            return self.plan.pins
        return copied_pins(self.plan.pins, copy)

    def _host_env(self, state_dir: str) -> dict[str, str]:
        profile = self.plan.profile
        assert profile is not None
        copy = self._exec
        env = custody.host_environment(
            profile.environment,
            {name: pin.path for name, pin in profile.toolkit_directories.items()},
            copy.native_build if copy is not None and copy.native_build else profile.native_build,
            state_dir,
        )
        env.update(self.host_kind.environment)
        return env

    async def _custody(
        self, config: custody.HostConfig, *, task_status: trio.TaskStatus[HostHandle]
    ) -> None:
        """Hold the host in custody until the end-host action releases it (or the cell is
        cancelled); leaving custody ends the host, shielded and bounded."""
        live = self.ctx.stop.live_hosts
        try:
            async with self.ctx.hosts.host_opener(config, self._observe) as host:
                self.host = host
                live.append(host)
                await self._journal(PortReserved(cell_id=self.plan.cell_id, port=host.port))
                task_status.started(host)
                await self._release_host.wait()
        finally:
            # Only now: a second interrupt during custody's own cleanup still reaches it.
            if self.host in live:
                live.remove(self.host)
            self._host_ended.set()

    async def _post_verify(self) -> CellEvent:
        ok = await self._verify_pins("after")
        changed = self._watch.changes() if self._watch is not None else []
        if changed:
            await self._journal(
                Fault(
                    cell_id=self.plan.cell_id,
                    kind="pin_drift",
                    detail=f"pinned paths changed during the cell (seen as they changed, "
                    f"whatever the hashes say now): {', '.join(changed)}",
                )
            )
        return CellEvent.PINS_VERIFIED if ok and not changed else CellEvent.PINS_MISMATCH

    async def _verify_pins(self, phase: str, targets: Sequence[PinTarget] | None = None) -> bool:
        remaining = self.work_deadline - trio.current_time()
        final = phase == "after" and self.plan.last_of_row
        results = await self.ctx.verify_pins(targets or self.plan.pins, remaining, final=final)
        for result in results:
            for record in pin_records(self.plan.cell_id, phase, result):
                await self._journal(record)
        return all(result.matches for result in results)

    # -- the actions' effects --------------------------------------------------------------

    def _live_host(self) -> HostHandle:
        if self.host is None:
            raise _Fault("internal", f"no host in custody in state {self.machine.state.value}")
        return self.host

    async def _spawn_host(self) -> None:
        host, profile = self._live_host(), self.plan.profile
        assert profile is not None  # pin-verify refused a cell without one
        env = self._host_env(host.state_dir)
        assert self._exec is not None  # pin-verify refused a cell without its private copy
        # The private copy whose bytes pin-verify hashed, never the pinned path itself.
        self._argv = self.host_kind.argv(
            self.plan, self._exec.binary, host.port, self.cli, self.cell_path
        )
        await host.launch(self._argv, env)

    async def _await_readiness(self) -> None:
        host, profile = self._live_host(), self.plan.profile
        assert profile is not None
        now = trio.current_time()
        await host.wait_ready(
            Budgets.startup_seconds(self.work_deadline, now, float(profile.startup_timeout_secs)),
            self.http,
        )
        host.note_descendants()
        self._requests_at_tree_note = self.http.requests

    async def _cut_prompt(self) -> None:
        """The correctness arm's accepted prompt as is; a corpus text cut by the host. A chat
        host's count of it inside its template, which every request is held to."""
        choice, host = self.plan.prompt, self._live_host()
        if choice.source == SOURCE_CORRECTNESS:
            digest = hashlib.sha256(choice.text.encode()).hexdigest()
            tokens = self.plan.prompt_tokens or self.plan.prefix_tokens + 1
            self.prompt = BenchmarkPrompt(choice.text, tokens, digest)
        else:
            self.prompt = await self.prompt_cuts.cut(
                self.http, host.base_url, self.plan.prompt.text, self.plan.prefix_tokens
            )
        if self.host_kind.wraps_prompt_in_template(self.plan):
            wrapped = await wrapped_prompt(self.http, host.base_url, self.prompt.text)
            if isinstance(wrapped, str):
                self._chat_prompt_unchecked = wrapped
            else:
                self._chat_prompt = wrapped

    async def _journal_warmup_rule(self) -> None:
        plan, choice, prompt, chat = self.plan, self.plan.prompt, self.prompt, self._chat_prompt
        assert prompt is not None
        serial = plan.serial
        await self._journal(
            WarmupExclusion(
                cell_id=plan.cell_id,
                rung_index=0,
                request_ids=(0,) if serial else (),
                reason=(
                    "serial baseline: the first request warms the host and is excluded"
                    if serial
                    else "concurrent ladder: no request is excluded; rung 0's first request "
                    "may find the host's prompt cache cold"
                ),
                prompt_source=choice.source,
                prompt_entry=choice.entry_key,
                prompt_corpus_path=choice.corpus_path,
                prompt_corpus_sha256=choice.corpus_sha256,
                prompt_tokens=prompt.token_count,
                prompt_sha256=prompt.sha256,
                chat_prompt_tokens=chat.prompt_tokens if chat else None,
                chat_prompt_merged_tokens=chat.merged_tokens if chat else None,
                chat_prompt_unchecked=self._chat_prompt_unchecked,
                chat_message_tokens=chat.message_tokens if chat else None,
            )
        )

    def _metrics(self) -> MetricsWatch:
        """The host's metrics reads, around every rung and workload point."""
        return MetricsWatch(
            cell_id=self.plan.cell_id,
            base_url=self._live_host().base_url,
            path=self.host_kind.metrics_path(self.plan),
            http=self.http,
            journal=self._journal,
            deadline=self.deadline,
        )

    async def _send_warmup(self) -> None:
        """The serial cell's request 0 (excluded); a concurrent cell excludes none."""
        if not self.plan.serial:
            return
        self._metrics_opening = await self._metrics().before()
        rows = self._segment(0, keep=True)
        # The host kind's client, as every rung's.
        warm = self.host_kind.load_run(
            self.plan,
            self._request(RungPlan(concurrency=1, requests=1)),
            deadline=self.work_deadline,
            client=self.http,
            rows=rows,
        )
        outcome: LoadOutcome | None = None
        try:
            outcome = await warm.run()
        finally:
            with trio.CancelScope(shield=outcome is None):
                finished = outcome or warm.outcome(stop_reason="cancelled")
                rung = await self._journal_warmup(finished, rows)
        if rung is not None:
            self._judge(0, self.plan.rungs[0], rung)

    async def _journal_warmup(self, outcome: LoadOutcome, rows: _Segment) -> LoadOutcome | None:
        """Journal request 0 of rung 0; when it did not complete, rung 0 ends with it (the rest
        of its roster never launched) and that rung's outcome is returned."""
        self._warmup = tuple(rows.kept or ())
        await self._journal_segment(rows)
        self._check_counts(rows)
        if outcome.status == "completed":
            return None
        rung = self.plan.rungs[0]
        rest = self._segment(0)
        closed = self._load(self._request(rung), self._warmup, rest).outcome(outcome.stop_reason)
        await self._journal_rung(0, rung, closed, rest)
        return closed

    async def _run_rungs(self) -> None:
        """Strictly ascending rungs, one retained host checked before every rung."""
        host = self._live_host()
        previous = 0
        for index, rung in enumerate(self.plan.rungs):
            if rung.concurrency <= previous:
                raise _Fault(
                    "internal", f"rung {index} concurrency {rung.concurrency} is not ascending"
                )
            previous = rung.concurrency
            if not host.still_same():
                if not host.replaced():  # it exited: not a swap
                    raise _Fault(
                        "child_exited", f"before rung {index}: host pid {host.pid} has exited"
                    )
                raise _Fault(
                    "host_identity_changed",
                    f"before rung {index}: pid {host.pid} is no longer the host spawned at "
                    f"{host.create_time}",
                )
            # The tree was sampled at readiness: rung 0 samples it again only when a request
            # (the serial warmup) went to the host since.
            if index or self.http.requests != self._requests_at_tree_note:
                host.note_descendants()
            self._judge(index, rung, await self._rung(index, rung))
            if self._out_of_time:
                return

    def _judge(self, index: int, rung: RungPlan, outcome: LoadOutcome) -> None:
        """A load run that did not complete: out of time (the ladder stops), or a fault."""
        if outcome.status == "completed":
            return
        if trio.current_time() >= self.work_deadline:
            self._out_of_time = True
            return
        raise _Fault(
            "request_timeout" if outcome.timed_out else "request_failed",
            f"rung {index} (concurrency {rung.concurrency}) ended {outcome.status}: "
            f"{outcome.stop_reason or 'no reason given'}",
        )

    async def _warmed(self) -> CellEvent:
        """Warmup done: a workload arm runs its workload, every other arm its rungs."""
        done = CellEvent.WORKLOAD_READY if self.plan.arm.workload else CellEvent.WARMUP_DONE
        return await self._after_work(done)

    async def _run_workload(self) -> None:
        """The arm's workload (``actors/run/workloads.py``), by its measurement kind."""
        plan, prompt = self.plan, self.prompt
        assert plan.workloads is not None and prompt is not None  # planned, cut in warmup
        live = self._live_host()
        host = WorkloadHost(
            cell_id=plan.cell_id,
            base_url=live.base_url,
            http=self.http,
            journal=self._journal,
            deadline=self.work_deadline,
            request_timeout_ms=self.ctx.budgets.request_timeout_ms,
            architecture=plan.architecture,
            workloads=plan.workloads,
            workloads_sha256=plan.workloads_sha256,
            prompt_text=prompt.text,
            ignore_eos=plan.synthetic,
            host_alive=live.still_same,
            chat=self.host_kind.wraps_prompt_in_template(self.plan),
            metrics=self._metrics(),
            model_id=plan.model_id,
            model_path=plan.profile.model if plan.profile is not None else "",
            sliding_window=self.sliding_window,
            slots=plan.lanes,
            slot_context_tokens=plan.ctx_size // plan.lanes if plan.lanes else None,
        )
        try:
            finished = await WORKLOAD_RUNNERS[plan.arm.kind](host)
        except WorkloadHostLost as lost:
            # As a rung that failed with its host gone: a fault of the cell (the runner
            # journaled the stopped point first).
            raise _Fault("child_exited", f"during the workload: {lost}") from None
        if not finished:
            self._out_of_time = True

    async def _end_host(self) -> None:
        """Leave custody: custody ends the host and journals its cleanup (via ``_observe``).
        No load run follows cleanup, so the rows file is closed (read-only, fsynced) while
        the host ends; should that fail, finalize closes it again and reports it."""
        self._release_host.set()
        rows = self._rows_file
        if rows is not None:
            with suppress(OSError):
                await trio.to_thread.run_sync(rows.close)
        await self._host_ended.wait()

    async def _publish_receipt(self) -> None:
        if self._rows_file is not None:
            self._rows_file.close()  # no load run follows finalize
        if self.plan.arm.workload:
            await self._publish_workload()
        relative = f"{self.plan.cell_dir}/cell.json"
        published = await publish_cell_receipt(
            self.ctx.writer, self.ctx.run_dir, self.plan.cell_id, relative
        )
        self.receipt = published.receipt

    async def _publish_workload(self) -> None:
        """``workload.json``: the workload's verdicts folded from the journal (scope
        ``workload``, re-folded by replay), published before ``cell.json``."""
        writer, cell_id = self.ctx.writer, self.plan.cell_id
        through = await writer.sync()
        data = workload_bytes(writer.index, cell_id, through)
        await publish_receipt(
            writer,
            self.ctx.run_dir,
            f"{self.plan.cell_dir}/{WORKLOAD_RECEIPT_NAME}",
            data,
            scope=SCOPE_WORKLOAD,
            through=through,
            cell_id=cell_id,
        )

    # -- load runs -------------------------------------------------------------------------

    def _request(self, rung: RungPlan) -> LoadRequest:
        plan, serial = self.plan, self.plan.serial
        assert self.prompt is not None
        return LoadRequest(
            base_url=self._live_host().base_url,
            prompt=self.prompt.text,
            requests=rung.requests,
            concurrency=rung.concurrency,
            output_tokens=plan.output_tokens,
            stream=not serial,
            request_timeout_ms=self.ctx.budgets.request_timeout_ms,
            ttft_slo_ms=None if serial else plan.ttft_slo_ms,
            tpot_slo_ms=None if serial else plan.tpot_slo_ms,
            ignore_eos=plan.synthetic,
        )

    def _load(self, request: LoadRequest, sent: Sequence[RequestRow], rows: _Segment) -> LoadRun:
        """The host kind's load client (llama-server's /completion, a stage server's chat)."""
        return self.host_kind.load_run(
            self.plan,
            request,
            deadline=self.work_deadline,
            sent=sent,
            client=self.http,
            rows=rows,
            expectation=self.host_kind.expectation(self.plan, self.sliding_window),
            client_lag_ms=client_lag_ms(self.ctx.client_calibration),
        )

    async def _rung(self, index: int, rung: RungPlan) -> LoadOutcome:
        """One measured rung (rung 0 after its warmup, if any); its rows and completion are
        journaled also when it is cancelled (every planned id, launched or not)."""
        sent = self._warmup if index == 0 else ()
        metrics = self._metrics()
        before, self._metrics_opening = self._metrics_opening, None
        if before is None or (index > 0 and not isinstance(before, Exposition)):
            before = await metrics.before()
        rows = self._segment(index)
        load = self._load(self._request(rung), sent, rows)
        outcome: LoadOutcome | None = None
        try:
            outcome = await load.run()
        finally:
            with trio.CancelScope(shield=outcome is None):
                finished = outcome or load.outcome(stop_reason="cancelled")
                await self._journal_rung(index, rung, finished, rows)
        for row in sent:  # the serial warmup went to the host within rung 0's interval
            rows.tokens.add_row(row)
        self._metrics_opening = await metrics.after(before, "rung", index, rows.tokens.sums())
        self._check_counts(rows)
        return finished

    def _segment(self, index: int, *, keep: bool = False) -> _Segment:
        """Where the rows of rung ``index`` go as they end: the cell's rows file."""
        if self._rows_file is None:
            path = os.path.join(self.cell_path, REQUESTS_FILENAME)
            self._rows_file = RowFileWriter(path, REQUESTS_FILENAME)
        segment = _Segment(self._rows_file, index, self.plan.rungs[index].concurrency, keep=keep)
        if self._chat_prompt is not None:
            segment.expected_prompt_tokens = self._chat_prompt.prompt_tokens
        return segment

    @staticmethod
    def _check_counts(rows: _Segment) -> None:
        """A chat host that counted a request's prompt otherwise than its own rendering and
        tokenizing of it did not evaluate the prompt the cell designed: the cell faults."""
        if rows.miscounted:
            request_id, counted = rows.miscounted[0]
            raise _Fault(
                "prompt_token_count",
                f"rung {rows.rung_index}: {len(rows.miscounted)} request(s) counted otherwise "
                f"than the {rows.expected_prompt_tokens} prompt tokens designed (request "
                f"{request_id}: {counted})",
            )

    async def _journal_segment(self, rows: _Segment) -> None:
        """The segment's rows are written and fsynced, then journaled as one record."""
        written = rows.writer.checkpoint()
        await self._journal(
            RungRows(
                cell_id=self.plan.cell_id,
                rung_index=rows.rung_index,
                concurrency=rows.concurrency,
                path=written.path,
                first_line=rows.first_line,
                count=written.count - rows.first_line,
                completed=rows.completed,
                sha256=written.sha256,
            )
        )

    async def _journal_rung(
        self, index: int, rung: RungPlan, outcome: LoadOutcome, rows: _Segment
    ) -> None:
        """The rung's rows (those the warmup did not journal), then its completion."""
        host = self._live_host()
        await self._journal_segment(rows)
        calibration = self.ctx.client_calibration
        await self._journal(
            RungCompleted(
                cell_id=self.plan.cell_id,
                rung_index=index,
                concurrency=rung.concurrency,
                requested_requests=rung.requests,
                status=outcome.status,
                makespan_seconds=outcome.makespan_seconds,
                prompt_sha256=outcome.prompt_sha256,
                output_tokens=self.plan.output_tokens,
                host_pid=host.pid,
                # A host that exited (a signal mid-ladder ends it) is not a swapped one.
                host_create_time=None if host.replaced() else host.create_time,
                stop_reason=outcome.stop_reason,
                client_overhead_ms=calibration.overhead_p50_ms if calibration else None,
                client_overhead_factor=calibration.near_factor if calibration else None,
                tally=outcome.facts,
            )
        )

    # -- custody events --------------------------------------------------------------------

    async def _observe(self, event: HostEvent) -> None:
        cell_id = self.plan.cell_id
        if isinstance(event, HostSpawned):
            argv = self._argv or list(event.argv)
            profile = self.plan.profile
            await self._journal(
                ChildSpawned(
                    cell_id=cell_id,
                    role="host",
                    pid=event.pid,
                    create_time=event.create_time,
                    pgid=event.pid,
                    argv_sha256=argv_sha256(argv),
                    executable=argv[0] if argv else "",
                    host_argv=tuple(argv),
                    host_env_names=tuple(sorted(event.env)),
                    host_threads=thread_setting(profile.environment) if profile else None,
                    effective_environment=custody.recorded_environment(event.env),
                )
            )
        elif isinstance(event, HostMarkerSeen):
            await self._journal(
                ListeningMarkerSeen(
                    cell_id=cell_id,
                    pid=event.pid,
                    port=self.host.port if self.host is not None else 0,
                    marker=event.line,
                )
            )
        elif isinstance(event, HostReady):
            await self._journal(
                Ready(
                    cell_id=cell_id,
                    url=(self.host.base_url if self.host is not None else "")
                    + self.host_kind.readiness_path,
                    attempts=event.health_attempts,
                    elapsed_ms=event.after_seconds * 1000,
                )
            )
        elif isinstance(event, HostFaulted):
            self._faults_journaled.add(event.code)
            await self._journal(
                Fault(
                    cell_id=cell_id,
                    kind=custody.FAULT_KIND_OF_CODE.get(event.code, "internal"),
                    detail=event.message[:2000],
                    pid=event.pid,
                )
            )
        elif isinstance(event, HostCleaned):
            # The whole outcome: the fold judges it, so replay downgrades exactly as live did.
            # Custody has ended everything and removed the state dir before this: the record
            # shares the fsync of the receipt's fold (the table's ``fsync`` column says "later" for
            # the step into finalize), the next durable point.
            await self.ctx.writer.append(
                CleanupOutcome(cell_id=cell_id, cleanup=event.outcome), durable=False
            )


def _done(event: CellEvent) -> Callable[[CellActor], Awaitable[CellEvent]]:
    """The work of a state whose entering actions did everything: report it done."""

    async def work(actor: CellActor) -> CellEvent:
        return await actor._after_work(event)

    return work


# Each state's work: what it does before the machine takes its way out.
_WORK: Final[Mapping[CellState, Callable[[CellActor], Awaitable[CellEvent]]]] = {
    CellState.PIN_VERIFY: CellActor._pin_verify,
    CellState.NOT_LAUNCHED: _done(CellEvent.NOTHING_LAUNCHED),
    CellState.LAUNCH: _done(CellEvent.HOST_READY),
    CellState.WARMUP: CellActor._warmed,
    CellState.LADDER: _done(CellEvent.LADDER_DONE),
    CellState.WORKLOAD: _done(CellEvent.WORKLOAD_DONE),
    CellState.POST_VERIFY: CellActor._post_verify,
    CellState.CLEANUP: _done(CellEvent.CLEANUP_DONE),
    CellState.FINALIZE: _done(CellEvent.RECEIPT_PUBLISHED),
}

# The one effect handler of each action of the table.
_EFFECTS: Final[Mapping[CellAction, Callable[[CellActor], Awaitable[None]]]] = {
    CellAction.SPAWN_HOST: CellActor._spawn_host,
    CellAction.AWAIT_READINESS: CellActor._await_readiness,
    CellAction.CUT_PROMPT: CellActor._cut_prompt,
    CellAction.JOURNAL_WARMUP_RULE: CellActor._journal_warmup_rule,
    CellAction.SEND_WARMUP: CellActor._send_warmup,
    CellAction.RUN_RUNGS: CellActor._run_rungs,
    CellAction.RUN_WORKLOAD: CellActor._run_workload,
    CellAction.END_HOST: CellActor._end_host,
    CellAction.PUBLISH_RECEIPT: CellActor._publish_receipt,
}

# Checked here, at import: every state has its work, every action its one handler.
_HANDLERS: Final = Handlers("cell actor", CELL_TABLE, _WORK, _EFFECTS)
