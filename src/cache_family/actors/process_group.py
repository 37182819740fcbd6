"""Ending a child's process group: SIGTERM, a bounded grace, SIGKILL, reap; shielded.

The one stopper for every child this tool starts in a session of its own (hosts in custody,
the preparation worker, the native-parts server). The grace covers every member of the
group, not only its leader, because a leader's helpers may outlive it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass
from typing import Any, Final

import psutil
import trio

# Group members have no exit event to await: after the leader, they are polled this often.
POLL_SECONDS: Final = 0.02


# A child started with ``start_new_session=True``: its pid is also its process group's id.
Leader = trio.Process | subprocess.Popen[Any]


@dataclass(frozen=True, slots=True)
class GroupStopped:
    signalled: bool  # SIGTERM was sent: something in the group still ran
    forced: bool  # the grace ran out or was cut short: SIGKILL was sent
    returncode: int | None  # the leader's; None if even SIGKILL did not end it in time


async def stop_group(
    leader: Leader,
    *,
    grace: float,
    kill_wait: float,
    hurry: trio.Event | None = None,
) -> GroupStopped:
    """End the group ``leader`` leads and reap the leader; idempotent.

    Shielded from cancellation and bounded by about ``grace + kill_wait`` seconds. SIGTERM
    goes to the group even when the leader already died, since its helpers may still run.
    ``hurry`` (an operator's second interrupt), set before or during the grace, ends it.
    """
    pgid = leader.pid
    signalled = forced = False
    with trio.CancelScope(shield=True):
        if _running(leader, pgid):
            signalled = True
            _signal_group(pgid, signal.SIGTERM)
            with trio.move_on_after(grace):
                async with trio.open_nursery() as race:
                    hurried = trio.Event() if hurry is None else hurry
                    race.start_soon(_cancel_when_set, hurried, race.cancel_scope)
                    await _until_ended(leader, pgid)
                    race.cancel_scope.cancel()
            forced = _running(leader, pgid)
        if forced:
            _signal_group(pgid, signal.SIGKILL)
            with trio.move_on_after(kill_wait):
                await _until_ended(leader, pgid)
    return GroupStopped(signalled=signalled, forced=forced, returncode=leader.poll())


def live_members(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that still run. A reaper-less PID 1 may keep zombies
    forever, so psutil's status, not kill(0) alone, says whether a member still runs."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []  # not even a zombie is left
    except PermissionError:
        pass
    members = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                members.append(process.pid)
    return members


def _running(leader: Leader, pgid: int) -> bool:
    # poll() reaps the leader once it has exited, so its pid no longer counts as a member.
    return leader.poll() is None or bool(live_members(pgid))


async def _until_ended(leader: Leader, pgid: int) -> None:
    if isinstance(leader, trio.Process):
        await leader.wait()
    while _running(leader, pgid):
        await trio.sleep(POLL_SECONDS)


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)
