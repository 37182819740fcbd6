"""The cell (host) actor: one host session of one native arm, driven through ``CELL_TABLE``.

    pin-verify -> launch -> warmup -> ladder -> post-verify -> cleanup -> finalize

The actor never decides where to go next by itself: it fires an event at the cell machine
(``states/cell.py``), journals the transition the table returns and performs the step's
work. Every observation (pins, port, spawn, marker, readiness, each request, each rung, the
cleanup outcome) is journaled as it happens; ``cell.json`` is folded from the journal alone.

Budgets only shrink. The cell's deadline is ``min(run deadline, now + cell_seconds)`` (taken
when the cell opens); each request's is ``min(cell deadline, its start + request_timeout_ms)``
(the load actor applies it); the host's startup budget is the profile's startup timeout cut to
the cell deadline. Cleanup and finalize run shielded from cancellation and bounded in time, so
a cancelled or expired cell still ends its host and still publishes its receipt.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, suppress
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final, Literal, Protocol, TypeVar

import msgspec
import trio

from cache_family.actors import custody
from cache_family.actors.journal import JournalWriter, publish_cell_receipt
from cache_family.actors.load import BenchmarkPrompt, LoadRun, build_benchmark_prompt
from cache_family.actors.pins import Budget, hash_file, pin_tree
from cache_family.actors.prompts import PromptChoice
from cache_family.errors import Refused
from cache_family.schemas.journal import (
    Cancellation,
    CellOpened,
    ChildSpawned,
    CleanupOutcome,
    DeadlineExpired,
    Fault,
    ListeningMarkerSeen,
    PinDrift,
    PinObserved,
    PortReserved,
    Ready,
    Record,
    RequestOutcome,
    RungCompleted,
    RungPlan,
    Transition,
    WarmupExclusion,
)
from cache_family.schemas.measurement import (
    CleanupOutcome as HostCleanupOutcome,
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
)
from cache_family.schemas.prepared import HostProfile
from cache_family.schemas.receipts import CellReceipt
from cache_family.states.cell import (
    CellEvent,
    CellMachine,
    CellState,
    Machine,
    new_cell_machine,
)

ARM_SERIAL: Final = "native-serial"
ARM_CONCURRENT: Final = "native-concurrent"
COHORT_NATIVE: Final = "native"
# Directory of each native arm's cell inside its row directory (run layout).
ARM_DIRS: Final = {ARM_SERIAL: "native-serial", ARM_CONCURRENT: "sweep-native-concurrent"}

# The cell's own work (hashing, startup, requests) ends this long before the cell deadline, so
# that a request cut by the budget is still recorded by the load actor itself (with its elapsed
# time) and the cell reaches cleanup on its own rather than by cancellation.
MEASUREMENT_RESERVE_SECONDS: Final = 2.0
# Finalize (fold + publish) is shielded; this bounds it so a wedged disk cannot hang a run.
FINALIZE_BOUND_SECONDS: Final = 30.0
# Custody's own bound covers the host; this only guards the journal appends around it.
CLEANUP_JOURNAL_BOUND_SECONDS: Final = 10.0

StopKind = Literal["cancelled", "execution", "cell"]


# --- budgets ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Budgets:
    """The run's three budgets; each derived deadline is never later than its parent's."""

    run_deadline: float  # trio time
    cell_seconds: float
    request_timeout_ms: int

    def cell_deadline(self, now: float) -> float:
        return min(self.run_deadline, now + self.cell_seconds)

    @staticmethod
    def work_deadline(cell_deadline: float, now: float) -> float:
        """When the cell's measured work must end: the reserve before its deadline."""
        return max(cell_deadline - MEASUREMENT_RESERVE_SECONDS, now)

    @staticmethod
    def request_deadline(cell_deadline: float, started: float, request_timeout_ms: int) -> float:
        return min(cell_deadline, started + request_timeout_ms / 1000)

    @staticmethod
    def startup_seconds(cell_deadline: float, now: float, profile_startup: float) -> float:
        return max(min(profile_startup, cell_deadline - now), 0.001)


@dataclass(slots=True)
class RunStop:
    """Why the run is stopping, shared by every actor: the first signal, or the deadline."""

    run_deadline: float
    signal_name: str | None = None
    # Set by the supervisor's deadline watcher when execution_seconds ran out.
    deadline_hit: bool = False
    # Hosts in custody now; a second interrupt shortens their SIGTERM grace.
    live_hosts: list[HostHandle] = field(default_factory=list)

    def classify(self, cell_deadline: float, now: float) -> StopKind:
        if self.signal_name is not None:
            return "cancelled"
        if self.deadline_hit or now >= self.run_deadline:
            return "execution"
        if now >= cell_deadline:
            return "cell"
        return "cancelled"

    def shorten_grace(self) -> None:
        for host in list(self.live_hosts):
            host.shorten_grace()


# --- seams: hosts and pin hashing -------------------------------------------------------------


class HostHandle(Protocol):
    """What the cell needs of host custody (``actors/custody.Host`` is the real one)."""

    port: int
    state_dir: str
    pid: int | None
    create_time: float | None

    @property
    def base_url(self) -> str: ...

    async def launch(self, argv: Sequence[str], env: Mapping[str, str]) -> HostSpawned: ...

    async def wait_ready(self, startup_seconds: float) -> HostReady: ...

    def still_same(self) -> bool: ...

    def note_descendants(self) -> None: ...

    def shorten_grace(self) -> None: ...

    async def cleanup(self) -> HostCleanupOutcome: ...


Observe = Callable[[HostEvent], Awaitable[None]]
HostOpener = Callable[[custody.HostConfig, Observe], AbstractAsyncContextManager[HostHandle]]


def real_host_opener(
    config: custody.HostConfig, observe: Observe
) -> AbstractAsyncContextManager[HostHandle]:
    return custody.host_custody(config, observe)


@dataclass(frozen=True, slots=True)
class PinTarget:
    """One pinned thing a cell re-hashes before launch and after its ladder."""

    name: str
    path: str
    expected_sha256: str
    kind: Literal["file", "tree"]


@dataclass(frozen=True, slots=True)
class PinResult:
    target: PinTarget
    observed_sha256: str | None  # None: could not be read (missing, unreadable, cancelled)
    problem: str = ""

    @property
    def matches(self) -> bool:
        return self.observed_sha256 == self.target.expected_sha256


PinHasher = Callable[[Sequence[PinTarget], float], Awaitable[list[PinResult]]]


def _hash_one(target: PinTarget, budget: Budget) -> PinResult:
    try:
        if target.kind == "tree":
            observed = pin_tree(target.path, budget, json_path=f"$.pins.{target.name}").sha256
        else:
            canonical = os.path.realpath(target.path, strict=True)
            observed = hash_file(canonical, budget, json_path=f"$.pins.{target.name}").sha256
    except Refused as refused:
        return PinResult(target, None, str(refused))
    except OSError as exc:
        return PinResult(target, None, f"{target.path}: {exc.strerror or exc}")
    return PinResult(target, observed)


async def hash_pins_in_threads(targets: Sequence[PinTarget], seconds: float) -> list[PinResult]:
    """Re-hash every target in worker threads, at most one per core, under one budget.

    A cancelled caller cancels the budget, which every hashing thread checks between 1 MiB
    chunks, so abandoning the threads costs at most one chunk of work each.
    """
    budget = Budget.seconds(max(seconds, 0.0), clock=time.monotonic)
    limiter = trio.CapacityLimiter(max(1, os.cpu_count() or 1))
    results: list[PinResult | None] = [None] * len(targets)

    async def one(index: int, target: PinTarget) -> None:
        results[index] = await trio.to_thread.run_sync(
            _hash_one, target, budget, limiter=limiter, abandon_on_cancel=True
        )

    try:
        async with trio.open_nursery() as nursery:
            for index, target in enumerate(targets):
                nursery.start_soon(one, index, target)
    except BaseException:
        budget.cancel()
        raise
    return [result for result in results if result is not None]


@dataclass(slots=True)
class HostSettings:
    """How every cell of a run opens, pins and ends its host; tests replace the seams."""

    host_opener: HostOpener = real_host_opener
    pin_hasher: PinHasher = hash_pins_in_threads
    # 0: an ephemeral port per host (tests pin one to provoke a busy port).
    host_port: int = 0
    grace_seconds: float = 5.0
    kill_wait_seconds: float = 5.0
    cleanup_bound_seconds: float = 30.0

    def host_config(self, label: str, cell_path: str) -> custody.HostConfig:
        """Custody's settings for one cell's host: state and logs under ``cell_path``."""
        return custody.HostConfig(
            label=label,
            state_parent=cell_path,
            log_dir=os.path.join(cell_path, "logs"),
            port=self.host_port,
            grace_seconds=self.grace_seconds,
            kill_wait_seconds=self.kill_wait_seconds,
            cleanup_bound_seconds=self.cleanup_bound_seconds,
        )


@dataclass(slots=True)
class RunContext:
    """Everything the row and cell actors share within one run."""

    writer: JournalWriter
    run_dir: str
    budgets: Budgets
    stop: RunStop
    hosts: HostSettings = field(default_factory=HostSettings)
    # Called with (cell_id, state) at every transition, for the progress display.
    on_transition: Callable[[str, str], None] | None = None

    async def journal(self, record: Record) -> int:
        return await self.writer.append(record)


# --- the plan of one cell ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CellPlan:
    cell_id: str  # e.g. cell-0003/native-serial
    cell_dir: str  # relative to the run dir, e.g. cell-0003/sweep-native-concurrent
    row_index: int
    row_key: str
    arm: str
    kind: Literal["serial", "concurrent"]
    rungs: tuple[RungPlan, ...]
    output_tokens: int
    lanes: int
    # The host's --ctx-size: the row's context times the lanes (one row context per slot).
    ctx_size: int
    n_gpu_layers: int
    prefix_tokens: int
    ttft_slo_ms: float | None
    tpot_slo_ms: float | None
    # None: the prepared input has no native profile for the case (the cell is refused).
    profile: HostProfile | None
    prompt: PromptChoice
    pins: tuple[PinTarget, ...]
    # A reason this cell must not launch although planned (pins disagree with the plan).
    refusal: str | None = None
    # The row's preset is from a synthetic catalog (journaled so the cell's receipt says so).
    synthetic: bool = False


def pin_targets(profile: HostProfile) -> tuple[PinTarget, ...]:
    """Server binary, native build tree, model (every shard of a split one), toolkit trees."""
    targets = [
        PinTarget("binary", profile.binary, profile.binary_sha256, "file"),
        PinTarget("native_build", profile.native_build, profile.native_build_sha256, "tree"),
        PinTarget("model", profile.model, profile.model_sha256, "file"),
    ]
    if profile.artifact is not None:
        for shard in profile.artifact.shard_pins:
            targets.append(
                PinTarget(f"shard:{shard.name}", shard.logical_path, shard.sha256, "file")
            )
    for name, toolkit in sorted(profile.toolkit_directories.items()):
        targets.append(PinTarget(f"toolkit:{name}", toolkit.path, toolkit.sha256, "tree"))
    return tuple(targets)


def llama_server_argv(plan: CellPlan, profile: HostProfile, port: int) -> list[str]:
    """The host's exact command line (tools/server flags of the vendored llama.cpp)."""
    argv = [
        profile.binary,
        "--model",
        profile.model,
        "--ctx-size",
        str(plan.ctx_size),
        "--n-gpu-layers",
        str(plan.n_gpu_layers),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--parallel",
        str(plan.lanes),
        "--no-webui",
    ]
    threads = host_threads(profile)
    if threads is not None:
        argv += ["-t", threads]
    return argv


def host_threads(profile: HostProfile) -> str | None:
    """The operator's OMP_NUM_THREADS, also given to llama-server as ``-t``."""
    return thread_setting(profile.environment)


def thread_setting(environment: Mapping[str, str]) -> str | None:
    """OMP_NUM_THREADS when it is a positive whole number, else None.

    A thread count is a setting, not a secret, so it may appear on a host's command line and
    in the journal; anything else in the environment is journaled by name only.
    """
    value = environment.get("OMP_NUM_THREADS")
    return value if value and value.isdigit() and int(value) > 0 else None


def argv_sha256(argv: Sequence[str]) -> str:
    return hashlib.sha256(json.dumps(list(argv), separators=(",", ":")).encode()).hexdigest()


_CUSTODY_FAULT_KINDS: Final = {
    "custody.child_exited": "child_exited",
    "custody.marker_timeout": "marker_missing",
    "custody.readiness_failed": "readiness_failed",
    "custody.spawn_failed": "spawn_failed",
    "custody.port_busy": "port_busy",
    "custody.port_unavailable": "port_busy",
    "custody.state_dir": "spawn_failed",
    "custody.env_reserved": "spawn_failed",
    "custody.env_conflict": "spawn_failed",
}


def fault_kind(refused: Refused) -> str:
    code = refused.codes[0]
    if code in _CUSTODY_FAULT_KINDS:
        return _CUSTODY_FAULT_KINDS[code]
    if code.startswith("load.prompt") or code == "load.tokenize":
        return "prompt_failed"
    return "internal"


_State = TypeVar("_State", bound=StrEnum)
_Event = TypeVar("_Event", bound=StrEnum)


def fire_and_record(
    machine: Machine[_State, _Event, Any],
    event: _Event,
    *,
    cell_id: str | None = None,
    row_index: int | None = None,
) -> Transition:
    """Take ``event`` through the machine's table (refused where it has no step); the
    ``transition`` record that journals the step, named by the table (``cell`` or ``row``)."""
    before = machine.state
    step = machine.fire(event)
    return Transition(
        machine=machine.table.name,
        cell_id=cell_id,
        row_index=row_index,
        from_state=before.value,
        event=event.value,
        to_state=step.to.value,
    )


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
    )
    if result.matches:
        return (observed,)
    return observed, PinDrift(**msgspec.structs.asdict(observed))


def is_cancellation(exc: BaseException) -> bool:
    """True for trio's Cancelled, also when a nursery delivers it inside an exception group."""
    if isinstance(exc, trio.Cancelled):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return any(is_cancellation(inner) for inner in exc.exceptions)
    return False


class _Fault(Exception):
    """A fault the cell found itself (not a refusal from a lower layer)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


# --- the actor --------------------------------------------------------------------------------


class CellActor:
    """One host session. ``await CellActor(plan, ctx).run()`` returns the published receipt."""

    def __init__(self, plan: CellPlan, ctx: RunContext) -> None:
        self.plan = plan
        self.ctx = ctx
        self.machine: CellMachine = new_cell_machine(plan.cell_id)
        self.deadline = math.inf
        self.work_deadline = math.inf
        self.host: HostHandle | None = None
        self.prompt: BenchmarkPrompt | None = None
        self.receipt: CellReceipt | None = None
        # The cell's own directory: its receipt, its host's private state dir and logs.
        self.cell_path = os.path.join(ctx.run_dir, plan.cell_dir)
        self._opened_at: float | None = None
        self._cleanup_started: float | None = None
        self._cleanup_journaled = False
        self._faults_journaled: set[str] = set()
        self._stop_recorded = False
        self._argv: list[str] = []

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

    # -- journal and machine -------------------------------------------------------------

    async def _journal(self, record: Record) -> None:
        await self.ctx.journal(record)

    async def _fire(self, event: CellEvent) -> None:
        transition = fire_and_record(self.machine, event, cell_id=self.plan.cell_id)
        await self._journal(transition)
        if self.machine.state == CellState.CLEANUP and self._cleanup_started is None:
            self._cleanup_started = trio.current_time()
        if self.ctx.on_transition is not None:
            self.ctx.on_transition(self.plan.cell_id, transition.to_state)

    async def _fault(self, kind: str, detail: str, *, journaled: bool = False) -> None:
        """Record a fault and move to cleanup (or stay there)."""
        if not journaled:
            await self._journal(
                Fault(
                    cell_id=self.plan.cell_id,
                    kind=kind,
                    detail=detail[:2000],
                    pid=self.host.pid if self.host is not None else None,
                )
            )
        if self.machine.can_fire(CellEvent.FAULT):
            await self._fire(CellEvent.FAULT)

    async def _stopped(self) -> None:
        """Cancellation or a deadline reached this cell: journal which, fire the stop event."""
        if self._stop_recorded:
            return
        self._stop_recorded = True
        now = trio.current_time()
        kind = self.ctx.stop.classify(self.deadline, now)
        if kind == "cancelled":
            await self._journal(
                Cancellation(
                    cell_id=self.plan.cell_id,
                    signal=self.ctx.stop.signal_name or "",
                    detail=f"cancelled in state {self.machine.state.value}",
                )
            )
            event = CellEvent.CANCELLED
        else:
            await self._journal(
                DeadlineExpired(
                    cell_id=self.plan.cell_id,
                    budget=kind,
                    detail=f"expired in state {self.machine.state.value}",
                )
            )
            event = CellEvent.DEADLINE_EXPIRED
        if self.machine.can_fire(event):
            await self._fire(event)

    async def _deadline_reached(self) -> None:
        """The cell's work deadline passed without cancellation (the load actor stopped)."""
        if self._stop_recorded:
            return
        self._stop_recorded = True
        execution = self.deadline >= self.ctx.stop.run_deadline
        await self._journal(
            DeadlineExpired(
                cell_id=self.plan.cell_id,
                budget="execution" if execution else "cell",
                detail=f"work deadline passed in state {self.machine.state.value}",
            )
        )
        await self._fire(CellEvent.DEADLINE_EXPIRED)

    # -- the session ---------------------------------------------------------------------

    async def run(self) -> CellReceipt | None:
        """Run the whole session; Cancelled from outside propagates after finalize."""
        plan = self.plan
        now = trio.current_time()
        self._opened_at = now
        self.deadline = self.ctx.budgets.cell_deadline(now)
        self.work_deadline = Budgets.work_deadline(self.deadline, now)
        os.makedirs(os.path.join(self.cell_path, "logs"), exist_ok=True)
        try:
            await self._journal(
                CellOpened(
                    cell_id=plan.cell_id,
                    row_index=plan.row_index,
                    row_key=plan.row_key,
                    arm=plan.arm,
                    cohort=COHORT_NATIVE,
                    cell_dir=plan.cell_dir,
                    measurement_kind=plan.kind,
                    rungs=plan.rungs,
                    ttft_slo_ms=plan.ttft_slo_ms,
                    tpot_slo_ms=plan.tpot_slo_ms,
                    synthetic=plan.synthetic,
                )
            )
            with trio.CancelScope(deadline=self.deadline):
                await self._session()
        except BaseException as exc:
            await self._record_if_stopped(exc)
            raise
        finally:
            with trio.CancelScope(shield=True):
                await self._finish()
        return self.receipt

    async def _session(self) -> None:
        try:
            await self._pin_verify_and_host()
        except (Refused, _Fault) as failure:
            await self._record_failure(failure)
        except BaseException as exc:
            await self._record_if_stopped(exc)
            raise

    async def _record_failure(self, failure: Refused | _Fault) -> None:
        """A refusal from a lower layer or a fault the cell found: journal it, go to cleanup.

        A custody refusal its observer already journaled as a fault is not journaled twice.
        """
        if isinstance(failure, Refused):
            journaled = failure.codes[0] in self._faults_journaled
            await self._fault(fault_kind(failure), str(failure), journaled=journaled)
        else:
            await self._fault(failure.kind, failure.detail)

    async def _record_if_stopped(self, exc: BaseException) -> None:
        """When ``exc`` is a cancellation, journal (shielded) why the cell stopped."""
        if is_cancellation(exc):
            with trio.CancelScope(shield=True):
                await self._stopped()

    async def _pin_verify_and_host(self) -> None:
        plan = self.plan
        if plan.profile is None or plan.refusal is not None:
            raise _Fault(
                "profile_refused",
                plan.refusal or "the prepared input has no native host profile for this case",
            )
        if not await self._verify_pins("before"):
            await self._journal(
                Fault(cell_id=plan.cell_id, kind="pin_mismatch", detail="pins differ before launch")
            )
            await self._fire(CellEvent.PINS_MISMATCH)
            return
        hosts = self.ctx.hosts
        config = hosts.host_config(ARM_DIRS[plan.arm], self.cell_path)
        # Entering custody reserves the port and makes the private state dir; a busy port is
        # refused here, before anything is launched.
        live = self.ctx.stop.live_hosts
        try:
            async with hosts.host_opener(config, self._observe) as host:
                self.host = host
                live.append(host)
                try:
                    await self._journal(PortReserved(cell_id=plan.cell_id, port=host.port))
                    await self._fire(CellEvent.PINS_VERIFIED)
                    await self._in_custody(plan.profile, host)
                except (Refused, _Fault) as failure:
                    await self._record_failure(failure)
                except BaseException as exc:
                    await self._record_if_stopped(exc)
                    raise  # custody's exit ends the host, shielded and bounded
                # Normal path and faults alike: end the host now (custody's exit would too).
                await host.cleanup()
        finally:
            # Only now: a second interrupt during custody's own cleanup still reaches it.
            if self.host is not None and self.host in live:
                live.remove(self.host)

    async def _in_custody(self, profile: HostProfile, host: HostHandle) -> None:
        plan = self.plan
        # launch
        env = custody.host_environment(
            profile.environment,
            {name: pin.path for name, pin in profile.toolkit_directories.items()},
            profile.native_build,
            host.state_dir,
        )
        argv = llama_server_argv(plan, profile, host.port)
        self._argv = argv
        await host.launch(argv, env)
        now = trio.current_time()
        await host.wait_ready(
            Budgets.startup_seconds(self.work_deadline, now, float(profile.startup_timeout_secs))
        )
        host.note_descendants()
        await self._fire(CellEvent.HOST_READY)

        # warmup (cut-prompt-with-host-tokenizer, journal-warmup-rule): no completion request
        # is sent here. The benchmark prompt is cut by the host's own tokenizer and the warmup
        # rule journaled; the excluded warmup request is request 0 of the serial rung below.
        choice = plan.prompt
        self.prompt = await build_benchmark_prompt(host.base_url, choice.text, plan.prefix_tokens)
        serial = plan.kind == "serial"
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
                prompt_tokens=self.prompt.token_count,
                prompt_sha256=self.prompt.sha256,
            )
        )
        await self._fire(CellEvent.WARMUP_DONE)

        # ladder: strictly ascending rungs, one retained host checked at every rung
        previous = 0
        for index, rung in enumerate(plan.rungs):
            if rung.concurrency <= previous:
                raise _Fault(
                    "internal", f"rung {index} concurrency {rung.concurrency} is not ascending"
                )
            previous = rung.concurrency
            if not host.still_same():
                raise _Fault(
                    "host_identity_changed",
                    f"before rung {index}: pid {host.pid} is no longer the host spawned at "
                    f"{host.create_time}",
                )
            host.note_descendants()
            outcome = await self._rung(index, rung, host)
            if outcome.status != "completed" and trio.current_time() >= self.work_deadline:
                # The budget ran out: a deadline, not a fault of the host; the ladder stops.
                await self._deadline_reached()
                return
            if outcome.status != "completed":
                timed_out = any(
                    row.status == "incomplete" and row.error and "timeout" in row.error
                    for row in outcome.rows
                )
                raise _Fault(
                    "request_timeout" if timed_out else "request_failed",
                    f"rung {index} (concurrency {rung.concurrency}) ended {outcome.status}: "
                    f"{outcome.stop_reason or 'no reason given'}",
                )
        await self._fire(CellEvent.LADDER_DONE)

        # post-verify: drift keeps the observations, the fold marks the cell incomplete
        ok = await self._verify_pins("after")
        await self._fire(CellEvent.PINS_VERIFIED if ok else CellEvent.PINS_MISMATCH)

    async def _rung(self, index: int, rung: RungPlan, host: HostHandle) -> LoadOutcome:
        plan = self.plan
        assert self.prompt is not None
        serial = plan.kind == "serial"
        request = LoadRequest(
            base_url=host.base_url,
            prompt=self.prompt.text,
            requests=rung.requests,
            concurrency=rung.concurrency,
            output_tokens=plan.output_tokens,
            stream=not serial,
            request_timeout_ms=self.ctx.budgets.request_timeout_ms,
            ttft_slo_ms=None if serial else plan.ttft_slo_ms,
            tpot_slo_ms=None if serial else plan.tpot_slo_ms,
        )
        load = LoadRun(request, deadline=self.work_deadline)
        try:
            outcome = await load.run()
        except BaseException as exc:
            if is_cancellation(exc):
                # The roster is kept whatever stopped it: every planned id, launched or not.
                with trio.CancelScope(shield=True):
                    await self._journal_rung(
                        index, rung, load.outcome(stop_reason="cancelled"), host
                    )
            raise
        await self._journal_rung(index, rung, outcome, host)
        return outcome

    async def _journal_rung(
        self, index: int, rung: RungPlan, outcome: LoadOutcome, host: HostHandle
    ) -> None:
        for row in outcome.rows:
            await self._journal(
                RequestOutcome(
                    cell_id=self.plan.cell_id,
                    rung_index=index,
                    concurrency=rung.concurrency,
                    row=row,
                )
            )
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
                host_create_time=host.create_time if host.still_same() else None,
                stop_reason=outcome.stop_reason,
            )
        )

    # -- pins ------------------------------------------------------------------------------

    async def _verify_pins(self, phase: str) -> bool:
        remaining = self.work_deadline - trio.current_time()
        results = await self.ctx.hosts.pin_hasher(self.plan.pins, remaining)
        for result in results:
            for record in pin_records(self.plan.cell_id, phase, result):
                await self._journal(record)
        return all(result.matches for result in results)

    # -- custody events --------------------------------------------------------------------

    async def _observe(self, event: HostEvent) -> None:
        cell_id = self.plan.cell_id
        if isinstance(event, HostSpawned):
            argv = self._argv or list(event.argv)
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
                    host_threads=(
                        host_threads(self.plan.profile) if self.plan.profile is not None else None
                    ),
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
                    url=(self.host.base_url if self.host is not None else "") + "/health",
                    attempts=event.health_attempts,
                    elapsed_ms=event.after_seconds * 1000,
                )
            )
        elif isinstance(event, HostFaulted):
            self._faults_journaled.add(event.code)
            await self._journal(
                Fault(
                    cell_id=cell_id,
                    kind=_CUSTODY_FAULT_KINDS.get(event.code, "internal"),
                    detail=event.message[:2000],
                    pid=event.pid,
                )
            )
        elif isinstance(event, HostCleaned):
            await self._journal_cleanup(event.outcome)

    async def _journal_cleanup(self, outcome: HostCleanupOutcome) -> None:
        """Journal custody's whole cleanup outcome; the fold judges it (``states/fold.py``),
        so a truncated capture or an escaped descendant downgrades the cell in replay too."""
        if self._cleanup_journaled:
            return
        self._cleanup_journaled = True
        started = self._cleanup_started
        elapsed = None if started is None else (trio.current_time() - started) * 1000
        await self._journal(
            CleanupOutcome(
                cell_id=self.plan.cell_id,
                pid=outcome.pid,
                graceful=outcome.graceful,
                forced=outcome.forced,
                exit_code=outcome.exit_code,
                surviving_descendants=outcome.surviving_descendants,
                port_free=outcome.port_free,
                state_dir_removed=outcome.state_dir_removed,
                elapsed_ms=elapsed,
                escaped_descendants=outcome.escaped_descendants,
                capture_truncated=outcome.capture_truncated,
                oversized_lines=outcome.oversized_lines,
                grace_shortened=outcome.grace_shortened,
                bounded_out=outcome.bounded_out,
                state_dir_error=(outcome.state_dir_error or "")[:2000] or None,
            )
        )

    # -- cleanup and finalize --------------------------------------------------------------

    async def _finish(self) -> None:
        """Shielded: reach cleanup, record it, fold and publish ``cell.json``."""
        if self.machine.state not in (CellState.CLEANUP, CellState.FINALIZE, CellState.DONE):
            # Something unexpected escaped the session (a bug, a journal failure): record it.
            with trio.move_on_after(CLEANUP_JOURNAL_BOUND_SECONDS):
                await self._fault("internal", "the session ended outside the cell table")
        with trio.move_on_after(CLEANUP_JOURNAL_BOUND_SECONDS):
            if not self._cleanup_journaled:
                # No host was ever in custody (pins refused, port busy, no profile).
                self._cleanup_journaled = True
                await self._journal(
                    CleanupOutcome(
                        cell_id=self.plan.cell_id,
                        pid=None,
                        graceful=True,
                        forced=False,
                        exit_code=None,
                        port_free=True,
                        state_dir_removed=True,
                        elapsed_ms=0.0,
                        detail="nothing was launched",
                    )
                )
            if self.machine.state == CellState.CLEANUP:
                await self._fire(CellEvent.CLEANUP_DONE)
        if self.machine.state != CellState.FINALIZE:
            return
        with trio.move_on_after(FINALIZE_BOUND_SECONDS):
            relative = f"{self.plan.cell_dir}/cell.json"
            published = await publish_cell_receipt(
                self.ctx.writer, self.ctx.run_dir, self.plan.cell_id, relative
            )
            self.receipt = published.receipt
            await self._fire(CellEvent.RECEIPT_PUBLISHED)
