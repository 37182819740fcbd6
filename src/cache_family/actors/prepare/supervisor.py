"""Running the preparation worker: its own session, a deadline, cancellation, bounded capture.

The worker gets only the environment it is given. Whichever comes first of its exit,
cancellation and the deadline ends the wait; a worker still running then goes through the one
group stopper (``system/process_group.py``).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Final, Literal, Protocol

import trio

from cache_family.schemas.bounded import MIB
from cache_family.schemas.measurement import ProcessOutcome
from cache_family.system.process_group import stop_group

GRACE_SECONDS: Final = 12.0
KILL_WAIT_SECONDS: Final = 5.0
DRAIN_SECONDS: Final = 5.0
STDOUT_LOG_MAX_BYTES: Final = 16 * MIB
EVENT_LINE_MAX_BYTES: Final = 64 * 1024


class WorkerOutcome(ProcessOutcome, frozen=True, kw_only=True):
    """How the worker ended (``ProcessOutcome``'s words)."""

    exited_in_time: bool = False
    cancelled: bool = False
    deadline_expired: bool = False
    terminated: bool = False  # SIGTERM sent
    stdout_truncated: bool = False

    @property
    def clean(self) -> bool:
        return (
            self.exit_code == 0
            and self.exited_in_time
            and not (self.cancelled or self.deadline_expired or self.forced)
            and not self.stdout_truncated
        )


class EventSink(Protocol):
    """Receives each complete line the worker writes on stdout."""

    def handle(self, line: bytes) -> None: ...

    def close(self) -> None: ...


async def _pump_stdout(
    stream: trio.abc.ReceiveStream,
    log: IO[bytes],
    events: EventSink | None,
    seen: _Seen,
) -> None:
    written = 0
    pending = b""
    while True:
        chunk = await stream.receive_some(64 * 1024)
        if not chunk:
            break
        room = STDOUT_LOG_MAX_BYTES - written
        if len(chunk) > room:
            seen.stdout_truncated = True
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


@dataclass(slots=True)
class _Seen:
    """What supervision has seen so far; the frozen ``WorkerOutcome`` is made from it."""

    stdout_truncated: bool = False
    terminated: bool = False
    forced: bool = False


async def _stop_process(process: trio.Process, seen: _Seen, grace: float) -> None:
    stopped = await stop_group(process, grace=grace, kill_wait=KILL_WAIT_SECONDS)
    seen.terminated |= stopped.signalled
    seen.forced |= stopped.forced


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
    if cancel.is_set():
        return WorkerOutcome(pid=None, cancelled=True)
    seen = _Seen()
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
        if on_start is not None:
            on_start(process.pid)
        assert process.stdout is not None
        first: Literal["exited", "cancelled", "deadline"] | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_pump_stdout, process.stdout, out_log, events, seen)
                first = await _first_of(process, cancel, deadline)
                await _stop_process(process, seen, grace_seconds)
                # The pump ends at EOF; a pipe held open by a stray grandchild is not waited on.
                nursery.cancel_scope.deadline = trio.current_time() + DRAIN_SECONDS
        finally:
            await _stop_process(process, seen, grace_seconds)
            with trio.CancelScope(shield=True):
                await process.stdout.aclose()
    if events is not None:
        events.close()
    return WorkerOutcome(
        pid=process.pid,
        graceful=not seen.forced,
        forced=seen.forced,
        exit_code=process.returncode,
        exited_in_time=first == "exited",
        cancelled=first == "cancelled",
        deadline_expired=first == "deadline",
        terminated=seen.terminated,
        stdout_truncated=seen.stdout_truncated,
    )


def worker_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """PATH, and PYTHONPATH only when the parent itself runs from one; nothing else."""
    env = {"PATH": environ.get("PATH", os.defpath), "PYTHONSAFEPATH": "1"}
    if environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = environ["PYTHONPATH"]
    return env
