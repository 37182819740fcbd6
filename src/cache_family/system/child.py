"""A supervised tool child: its own process group, an explicit environment, a deadline.

At its deadline or on cancellation its whole group is ended by the one group stopper, then every
process still carrying its environment tag; a cancellation is re-raised once they are gone.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import psutil
import trio

from cache_family.schemas.measurement import ProcessOutcome
from cache_family.system.process_group import PROCESS_TAG_NAME, end_tagged, stop_group

# The reference child runner's stop: 12 s graceful, then 1 s after SIGKILL.
GRACE_SECONDS: Final = 12.0
KILL_WAIT_SECONDS: Final = 1.0


@dataclass(frozen=True, slots=True)
class ChildCommand:
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    stdout_path: str
    stderr_path: str
    deadline: float  # trio time
    grace_seconds: float = GRACE_SECONDS
    kill_wait_seconds: float = KILL_WAIT_SECONDS
    # ``CACHE_FAMILY_CELL``: added to the environment; what still carries it at the end is
    # killed. Empty: no tag, no such sweep.
    process_tag: str = ""


class ChildEnded(ProcessOutcome, frozen=True, kw_only=True):
    """How a supervised child ended (``ProcessOutcome``'s words). ``pid`` None: it never
    started (``spawn_error`` says why)."""

    create_time: float | None = None
    elapsed_seconds: float = 0.0
    timed_out: bool = False
    spawn_error: str | None = None
    # Processes found only by the child's tag after its group was stopped (they left the
    # group); ``surviving_descendants``: those of them, or of the group, alive after SIGKILL.
    tagged_escapees: tuple[int, ...] = ()
    # Members of its process group still ran after the child had exited by itself (a process
    # it started in the background) and were ended with the group.
    outlived_by_group: bool = False

    @property
    def left_processes(self) -> bool:
        """It left something running behind it: in its group, outside it, or past SIGKILL."""
        return self.outlived_by_group or bool(self.tagged_escapees or self.surviving_descendants)

    @property
    def clean(self) -> bool:
        return (
            self.exit_code == 0
            and not self.timed_out
            and not self.forced
            and not self.left_processes
        )


OnSpawn = Callable[[int, float], Awaitable[None]]
ChildRunner = Callable[[ChildCommand, OnSpawn], Awaitable[ChildEnded]]


async def run_child(command: ChildCommand, on_spawn: OnSpawn) -> ChildEnded:
    """Run ``command`` to its end or its deadline; ``on_spawn(pid, create_time)`` is awaited
    (shielded) right after the spawn, so the child is journaled before anything else."""
    started = trio.current_time()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        out = os.open(command.stdout_path, flags, 0o600)
    except OSError as exc:
        return ChildEnded(pid=None, spawn_error=f"stdout log: {exc.strerror}")
    try:
        err = os.open(command.stderr_path, flags, 0o600)
    except OSError as exc:
        os.close(out)
        return ChildEnded(pid=None, spawn_error=f"stderr log: {exc.strerror}")
    env = dict(command.env)
    if command.process_tag:
        env[PROCESS_TAG_NAME] = command.process_tag
    try:
        process = await trio.lowlevel.open_process(
            list(command.argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=env,
            cwd=command.cwd,
            start_new_session=True,
        )
    except OSError as exc:
        return ChildEnded(
            pid=None,
            elapsed_seconds=trio.current_time() - started,
            spawn_error=f"cannot start {_first(command.argv)}: {exc.strerror or exc}",
        )
    finally:
        os.close(out)
        os.close(err)
    try:
        create_time = psutil.Process(process.pid).create_time()
    except psutil.NoSuchProcess:
        create_time = 0.0
    timed_out = forced = outlived = False
    tagged: list[int] = []
    surviving: list[int] = []
    try:
        with trio.CancelScope(shield=True):
            await on_spawn(process.pid, create_time)
        with trio.move_on_at(command.deadline) as scope:
            await process.wait()
        timed_out = scope.cancelled_caught
    finally:
        exited = process.returncode is not None and not timed_out
        stopped = await stop_group(
            process, grace=command.grace_seconds, kill_wait=command.kill_wait_seconds
        )
        forced = stopped.forced
        # The child had exited by itself, yet the stopper still found its group running.
        outlived = exited and stopped.signalled
        if command.process_tag:
            tagged, surviving = await end_tagged(command.process_tag)
    return ChildEnded(
        pid=process.pid,
        graceful=not forced,
        forced=forced,
        exit_code=process.returncode,
        surviving_descendants=tuple(surviving),
        create_time=create_time,
        elapsed_seconds=trio.current_time() - started,
        timed_out=timed_out,
        tagged_escapees=tuple(tagged),
        outlived_by_group=outlived,
    )


def _first(argv: Sequence[str]) -> str:
    return argv[0] if argv else "?"
