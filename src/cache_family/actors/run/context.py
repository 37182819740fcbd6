"""What the matrix, row and cell actors of one run share: the stop, host settings and their
seams, pin hashing (``RowPins``), and the journal hook every live machine steps through.
Budgets, pin targets and plans are pure: ``states/budgets.py`` and ``states/plans.py``."""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, Protocol

import trio

from cache_family.actors.journal.writer import JournalWriter
from cache_family.actors.run import custody, stage_host
from cache_family.actors.run.private_exec import RowExec
from cache_family.errors import Refused
from cache_family.schemas.host_kinds import LLAMA_SERVER_READINESS, HostReadiness
from cache_family.schemas.journal import Record, Transition
from cache_family.schemas.measurement import (
    ClientCalibration,
    HostCleanup,
    HostEvent,
    HostReady,
    HostSpawned,
)
from cache_family.states.budgets import Budgets
from cache_family.states.cell import OnStep
from cache_family.states.plans import PinTarget
from cache_family.system.child import ChildRunner, run_child
from cache_family.system.http import LoopbackHttp
from cache_family.system.pins import (
    RACY_SECONDS,
    Budget,
    HashJob,
    HeldFile,
    HeldTree,
    hash_file,
    hash_files,
    pin_tree,
)
from cache_family.system.process_group import RunTag

StopKind = Literal["cancelled", "execution", "cell"]


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


class HostHandle(Protocol):
    """What the cell needs of host custody (``actors/custody.Host`` is the real one)."""

    port: int
    state_dir: str
    pid: int | None
    create_time: float | None

    @property
    def base_url(self) -> str: ...

    async def launch(self, argv: Sequence[str], env: Mapping[str, str]) -> HostSpawned: ...

    async def wait_ready(
        self, startup_seconds: float, http: LoopbackHttp | None = None
    ) -> HostReady: ...

    def still_same(self) -> bool: ...

    def replaced(self) -> bool: ...

    def note_descendants(self) -> None: ...

    def shorten_grace(self) -> None: ...

    async def cleanup(self) -> HostCleanup: ...


Observe = Callable[[HostEvent], Awaitable[None]]
HostOpener = Callable[[custody.HostConfig, Observe], AbstractAsyncContextManager[HostHandle]]


def real_host_opener(
    config: custody.HostConfig, observe: Observe
) -> AbstractAsyncContextManager[HostHandle]:
    return custody.host_custody(config, observe)


@dataclass(frozen=True, slots=True)
class PinResult:
    target: PinTarget
    observed_sha256: str | None  # None: could not be read (missing, unreadable, cancelled)
    problem: str = ""
    # "sha256": the bytes were hashed now; "identity": the row's held file is unchanged since
    # its bytes were hashed (``RowPins``).
    verified_by: str = "sha256"

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


def _hash_all(targets: Sequence[PinTarget], budget: Budget) -> list[PinResult]:
    """Every target, in one worker thread: the files together through ``hash_files``' pool,
    then each tree through ``pin_tree`` (the same pool). A file that cannot be hashed is
    hashed again alone, so its result names its own problem."""
    files = [target for target in targets if target.kind == "file"]
    results: dict[int, PinResult] = {}
    try:
        jobs = [HashJob(os.path.realpath(t.path, strict=True), f"$.pins.{t.name}") for t in files]
        pins = hash_files(jobs, budget)
        results = {id(t): PinResult(t, pin.sha256) for t, pin in zip(files, pins, strict=True)}
    except (Refused, OSError):
        results = {id(t): _hash_one(t, budget) for t in files}
    for target in targets:
        if target.kind == "tree":
            results[id(target)] = _hash_one(target, budget)
    return [results[id(target)] for target in targets]


async def hash_pins(targets: Sequence[PinTarget], seconds: float) -> list[PinResult]:
    """Re-hash every target under one budget in one worker thread (whose pool is pins').

    A cancelled caller cancels the budget, which the hashing threads check between 1 MiB
    chunks, so abandoning the thread costs at most one chunk of work each.
    """
    budget = Budget.seconds(max(seconds, 0.0), clock=time.monotonic)
    try:
        return await trio.to_thread.run_sync(_hash_all, targets, budget, abandon_on_cancel=True)
    except BaseException:
        budget.cancel()
        raise


class RowPins:
    """The pins of one row: a pinned file's or tree's bytes are hashed in full when the row
    first verifies it and at the row's final verification; in between, every verification
    checks only identities (device, inode, size, mtime and ctime in ns) through descriptors
    held across the row (``HeldFile``; a tree's directories and files: ``HeldTree``), and
    hashes it again only when an identity changed.

    ``close`` releases the held descriptors; the row calls it when it ends.
    """

    def __init__(self, hasher: PinHasher, *, racy_seconds: float = RACY_SECONDS) -> None:
        self._hasher = hasher
        self._racy_seconds = racy_seconds
        # (path, expected sha256) -> the file or tree held since its bytes were hashed and
        # matched.
        self._held: dict[tuple[str, str], HeldFile | HeldTree] = {}
        # Pin name -> how many times its bytes were hashed in full for this row.
        self.full_hashes: dict[str, int] = {}

    async def verify(
        self, targets: Sequence[PinTarget], seconds: float, *, final: bool = False
    ) -> list[PinResult]:
        results: dict[int, PinResult] = {}
        to_hash: list[PinTarget] = []
        for target in targets:
            key = (target.path, target.expected_sha256)
            held = self._held.get(key)
            if held is not None and not final and held.change() is None:
                results[id(target)] = PinResult(
                    target, target.expected_sha256, verified_by="identity"
                )
                continue
            self._release(key)
            to_hash.append(target)
        opened: dict[int, HeldFile | HeldTree] = {}
        try:
            for target in to_hash:
                # The path as pinned (a link is followed each time it is checked, so
                # re-pointing it is seen); the hash reports a missing file or bad tree itself.
                with contextlib.suppress(OSError, Refused):
                    opened[id(target)] = (
                        HeldFile(target.path)
                        if target.kind == "file"
                        else HeldTree(target.path, json_path=f"$.pins.{target.name}")
                    )
            # Every identity unchanged: nothing to hash, and no worker thread to wake for it
            # (still a checkpoint, as a hash would be).
            hashed: list[PinResult] = []
            if to_hash:
                hashed = await self._hasher(to_hash, seconds)
            else:
                await trio.lowlevel.checkpoint()
            for result in hashed:
                target = result.target
                self.full_hashes[target.name] = self.full_hashes.get(target.name, 0) + 1
                held_file = opened.pop(id(target), None)
                if held_file is not None:
                    result = self._hold(target, result, held_file)
                results[id(target)] = result
        finally:
            for left in opened.values():
                left.close()
        return [results[id(target)] for target in targets]

    @property
    def racy_seconds(self) -> float:
        """How old a file's change time must be when it is hashed for it to be held."""
        return self._racy_seconds

    def _hold(self, target: PinTarget, result: PinResult, held: HeldFile | HeldTree) -> PinResult:
        """Keep ``held`` for the row when its bytes were hashed unchanged and match the pin."""
        problem = held.change()
        if problem is not None:
            held.close()
            # What was hashed may be neither the old bytes nor the new ones.
            return PinResult(target, None, f"changed while it was hashed: {problem}")
        if result.matches and held.settled(self._racy_seconds, time.time_ns()):
            self._held[(target.path, target.expected_sha256)] = held
        else:
            held.close()
        return result

    def _release(self, key: tuple[str, str]) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            held.close()

    def close(self) -> None:
        for key in list(self._held):
            self._release(key)


RowPinsFactory = Callable[[PinHasher], RowPins]


def held_row_pins(hasher: PinHasher) -> RowPins:
    """A row's pins held by identity between their first and last full hash."""
    return RowPins(hasher)


@dataclass(slots=True)
class HostSettings:
    """How every cell of a run opens, pins and ends its host. ``host_opener``, ``pin_hasher``,
    ``row_pins`` and ``child_runner`` are seams: fault-injection tests give fake hosts,
    hashers, row pins and tool children there."""

    host_opener: HostOpener = real_host_opener
    pin_hasher: PinHasher = hash_pins
    # How a row verifies its pins between its first and last full hash (``RowPins``). None:
    # every verification hashes, which a fake hasher that answers by call (not by bytes)
    # needs to see each one.
    row_pins: RowPinsFactory | None = held_row_pins
    # Runs a tool child (the correctness tool) under its deadline.
    child_runner: ChildRunner = run_child
    grace_seconds: float = 5.0
    kill_wait_seconds: float = 5.0
    cleanup_bound_seconds: float = 30.0

    def pins_of_row(self) -> RowPins | None:
        """A fresh ``RowPins`` for one row, or None when identities are not checked."""
        return self.row_pins(self.pin_hasher) if self.row_pins is not None else None

    def host_config(
        self,
        label: str,
        cell_path: str,
        *,
        readiness: HostReadiness = LLAMA_SERVER_READINESS,
        process_tag: str = "",
    ) -> custody.HostConfig:
        """Custody's settings for one cell's host: state and logs under ``cell_path``."""
        return custody.HostConfig(
            label=label,
            state_parent=cell_path,
            log_dir=os.path.join(cell_path, "logs"),
            readiness=readiness,
            grace_seconds=self.grace_seconds,
            kill_wait_seconds=self.kill_wait_seconds,
            cleanup_bound_seconds=self.cleanup_bound_seconds,
            process_tag=process_tag,
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
    # The run's own client overhead, measured before the first ladder (None until then, or
    # when it could not be measured); every rung's completion record carries it.
    client_calibration: ClientCalibration | None = None
    # The current row's pins (a row's arms run with a context that names them).
    row_pins: RowPins | None = None
    # The current row's private copies its hosts run from (None: each cell makes its own).
    row_exec: RowExec | None = None
    # A stage server's dialect by (binary, pinned sha256), read once per run from its help:
    # the dialect is the pinned bytes', and every later cell runs bytes verified to be them.
    cli_admissions: dict[tuple[str, str], stage_host.CliAdmitted] = field(default_factory=dict)
    # This runner's share of every host's environment tag (``<process_tag>/<cell id>``):
    # cleanup ends what still carries its cell's tag, ``replay --reap`` what carries this.
    process_tag: str = field(default_factory=lambda: f"cf-{secrets.token_hex(8)}")

    def cell_process_tag(self, cell_id: str) -> str:
        return f"{self.process_tag}/{cell_id}"

    def tag_hosts_with_run(self, run_id: str, runner_pid: int, runner_create_time: float) -> None:
        """Name the run and this runner in every later host's tag (before the first host):
        ``replay --reap`` then ends a host only for its own run's journal, never while this
        runner lives (``system.process_group.RunTag``)."""
        token = self.process_tag.split(":", 1)[0]
        self.process_tag = RunTag(token, run_id, runner_pid, runner_create_time).text

    async def journal(self, record: Record) -> int:
        return await self.writer.append(record)

    async def verify_pins(
        self, targets: Sequence[PinTarget], seconds: float, *, final: bool = False
    ) -> list[PinResult]:
        """Verify pins through the row's ``RowPins`` when there is one (``final``: the row's
        last verification, which hashes every file in full), else hash them all."""
        if self.row_pins is not None:
            return await self.row_pins.verify(targets, seconds, final=final)
        return await self.hosts.pin_hasher(targets, seconds)

    def step_journal(
        self, machine: str, *, cell_id: str | None = None, row_index: int | None = None
    ) -> OnStep[StrEnum, StrEnum]:
        """The live machine's step callback: journal the ``transition`` (stamped now, in
        order; the actor waits for it to be durable) and tell the progress display."""

        def on_step(source: StrEnum, event: StrEnum, dest: StrEnum) -> None:
            self.writer.append_nowait(
                Transition(
                    machine=machine,
                    cell_id=cell_id,
                    row_index=row_index,
                    from_state=source.value,
                    event=event.value,
                    to_state=dest.value,
                )
            )
            if cell_id is not None and self.on_transition is not None:
                self.on_transition(cell_id, dest.value)

        return on_step


def is_cancellation(exc: BaseException) -> bool:
    """True for trio's Cancelled, also when a nursery delivers it inside an exception group."""
    if isinstance(exc, trio.Cancelled):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return any(is_cancellation(inner) for inner in exc.exceptions)
    return False
