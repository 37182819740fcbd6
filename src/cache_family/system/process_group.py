"""Ending a child's process group: SIGTERM, a bounded grace, SIGKILL, reap; shielded.

The one stopper for every child this tool starts in a session of its own (hosts in custody,
the preparation worker, a campaign's rows, the oracles' children), in trio code and in plain
threads alike. The grace covers every member of the group, not only its leader, because a
leader's helpers may outlive it. A process that left the group (``setsid``, a double fork) is
out of reach of group signals; two further nets find it: descendants recorded by (pid, create
time), and the environment tag (``PROCESS_TAG_NAME``) that ``/proc/PID/environ`` still shows
(a process that never inherited it, or cleared it and exec'd again, is not found this way).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import psutil
import trio

# Group members have no exit event to await: after the leader, they are polled this often.
POLL_SECONDS: Final = 0.02
# Every host (and tool child) carries ``CACHE_FAMILY_CELL=<run tag>/<cell id>`` in its explicit
# environment; cleanup and ``replay --reap`` look for it in ``/proc/PID/environ``.
PROCESS_TAG_NAME: Final = "CACHE_FAMILY_CELL"
# An exec-time environment is bounded by the kernel's argument limit; read no more than this.
ENVIRON_READ_LIMIT: Final = 8 * 1024 * 1024
# One read of a /proc file: a whole stat line, most environments.
PROC_READ_SIZE: Final = 64 * 1024
# A thread's children, as pids separated by spaces: bounded like an environment.
CHILDREN_READ_LIMIT: Final = 8 * 1024 * 1024
# Processes ended one by one (they have no parent of ours to wait on) get this long to go.
END_WAIT_SECONDS: Final = 2.0
# A tagged process may fork again while it is being ended: scan and end at most this often.
TAG_SWEEPS: Final = 5
# The kernel answers an empty environment for a process in the middle of an exec (its new
# memory has no environment yet): such a read is tried again this many times, yielding the CPU
# between tries, before the process is taken as having none.
EMPTY_ENVIRON_TRIES: Final = 50
# The kernel's flag of its own threads in /proc/PID/stat (include/linux/sched.h): they have no
# environment at all, and a root sweep reads theirs too.
PF_KTHREAD: Final = 0x00200000


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


def stop_group_blocking(
    leader: subprocess.Popen[Any], *, grace: float, kill_wait: float
) -> GroupStopped:
    """:func:`stop_group` for a caller outside trio (a Ray task, a plain thread): the same
    rule, bounded by about ``grace + kill_wait`` seconds; blocks the calling thread."""
    pgid = leader.pid
    signalled = forced = False
    if _running(leader, pgid):
        signalled = True
        _signal_group(pgid, signal.SIGTERM)
        forced = not _ended_by(leader, pgid, time.monotonic() + grace)
    if forced:
        _signal_group(pgid, signal.SIGKILL)
        _ended_by(leader, pgid, time.monotonic() + kill_wait)
    return GroupStopped(signalled=signalled, forced=forced, returncode=leader.poll())


@dataclass(frozen=True, slots=True)
class ProcessesEnded:
    ended: list[int]  # gone within the grace (on SIGTERM, or before it)
    forced: list[int]  # still running after the grace: SIGKILL was sent
    survivors: list[int]  # still running ``kill_wait`` after SIGKILL
    denied: list[tuple[str, int]]  # (signal name, pid): the kernel refused to deliver it


def end_processes(
    processes: Sequence[psutil.Process], *, grace: float, kill_wait: float
) -> ProcessesEnded:
    """The group stopper's rule for processes found one by one (no group of ours to signal):
    SIGTERM each, the grace, SIGKILL what is left, wait ``kill_wait``. psutil refuses to
    signal a pid that now names another process. Blocks the calling thread."""
    denied: list[tuple[str, int]] = []
    for process in processes:
        _signal_process(process, signal.SIGTERM, denied)
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for process in alive:
        _signal_process(process, signal.SIGKILL, denied)
    _, surviving = psutil.wait_procs(alive, timeout=kill_wait)
    return ProcessesEnded(
        ended=[p.pid for p in processes if p not in alive],
        forced=[p.pid for p in alive],
        survivors=[p.pid for p in surviving],
        denied=denied,
    )


def _signal_process(
    process: psutil.Process, signum: signal.Signals, denied: list[tuple[str, int]]
) -> None:
    try:
        process.send_signal(signum)
    except psutil.AccessDenied:
        denied.append((signum.name, process.pid))
    except psutil.Error:
        pass  # gone (or now another process, which psutil will not signal)


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


def _ended_by(leader: subprocess.Popen[Any], pgid: int, deadline: float) -> bool:
    """Wait for the leader, then poll the group, until ``deadline``; whether it all ended."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        leader.wait(timeout=max(deadline - time.monotonic(), 0.0))
    while _running(leader, pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


@dataclass(frozen=True, slots=True)
class RunTag:
    """The run part of a host's tag (before the first "/"): the runner's random token, the
    run it runs and the runner's own identity. ``replay --reap`` ends a tagged process only
    for the journal of that run, and never while that runner lives."""

    token: str
    run_id: str
    runner_pid: int
    runner_create_time: float

    @property
    def text(self) -> str:
        return f"{self.token}:{self.run_id}:{self.runner_pid}:{self.runner_create_time!r}"


def parse_run_tag(tag: str) -> RunTag | None:
    """The run part of ``tag`` as a :class:`RunTag`; None for a tag without one (a host of a
    version that tagged only a token, or no tag of ours)."""
    run, slash, _ = tag.partition("/")
    parts = run.split(":")
    if not slash or len(parts) != 4 or not all(parts):
        return None
    token, run_id, pid, created = parts
    try:
        return RunTag(token, run_id, int(pid), float(created))
    except ValueError:
        return None


def process_tag_of(pid: int) -> str | None:
    """The tag in ``pid``'s exec-time environment, or None (no tag, gone, not ours, a zombie)."""
    wanted = PROCESS_TAG_NAME.encode() + b"="
    data = b""
    for attempt in range(EMPTY_ENVIRON_TRIES):
        try:
            data = _read_proc_file(f"/proc/{pid}/environ", ENVIRON_READ_LIMIT)
        except OSError:
            return None
        if data or (attempt == 0 and is_kernel_thread(pid)):
            break  # a kernel thread has no environment to wait for
        os.sched_yield()
    for entry in data.split(b"\0"):
        if entry.startswith(wanted):
            return entry[len(wanted) :].decode("utf-8", "replace")
    return None


def is_kernel_thread(pid: int) -> bool:
    """Whether ``pid`` is a kernel thread (``PF_KTHREAD`` in its stat flags); False when gone."""
    try:
        stat = _read_proc_file(f"/proc/{pid}/stat", PROC_READ_SIZE)
        # "pid (comm) state ppid pgrp session tty_nr tpgid flags ...": flags is the 7th after.
        flags = int(stat[stat.rindex(b")") + 2 :].split(None, 7)[6])
    except (OSError, ValueError, IndexError):
        return False
    return bool(flags & PF_KTHREAD)


def tagged_processes(matches: Callable[[str], bool]) -> dict[int, float]:
    """Live processes of this user whose tag ``matches``: pid -> create time. Our own process
    is never one (the runner carries no tag, but a test harness might)."""
    own, uid = os.getpid(), os.getuid()
    found: dict[int, float] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit() or int(name) == own:
            continue
        pid = int(name)
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
        tag = process_tag_of(pid)
        if tag is None or not matches(tag):
            continue
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE:
                found[pid] = process.create_time()
    return found


def _read_proc_file(path: str, limit: int) -> bytes:
    """At most ``limit`` bytes of a ``/proc`` file, read a page-sized chunk at a time: a
    process's environment is a few KiB, and one read of the whole limit allocated (and gave
    back) 8 MiB for every process a scan looked at."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks: list[bytes] = []
        total = 0
        while total < limit:
            chunk = os.read(fd, min(PROC_READ_SIZE, limit - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def descendants(pid: int) -> dict[int, float]:
    """Every live descendant of ``pid`` (children, theirs, ...): pid -> create time, each as
    psutil gives it, so that identity checks compare like with like. As psutil's, a process
    created before ``pid`` is no descendant (its parent's pid was another's then); a gone
    ``pid`` has none. Children are read from each process's threads' ``children`` files,
    which a host of a few processes answers in a few reads, else (a kernel without them) from
    one pass over every ``/proc/*/stat``."""
    try:
        root_created = psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return {}
    children_of = _children_files if _has_children_files() else _children_by_scan()
    found: dict[int, float] = {}
    frontier = [pid]
    while frontier:
        for child in children_of(frontier.pop()):
            if child in found or child == pid:
                continue
            try:
                created = psutil.Process(child).create_time()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if created >= root_created:
                found[child] = created
                frontier.append(child)
    return found


@functools.cache
def _has_children_files() -> bool:
    """Whether this kernel lists a thread's children (``/proc/PID/task/TID/children``)."""
    return os.path.exists(f"/proc/self/task/{threading.get_native_id()}/children")


def _children_files(pid: int) -> list[int]:
    """``pid``'s children, from the ``children`` file of each of its threads (a process
    forked by any thread is listed by that thread); none when ``pid`` is gone."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    children: list[int] = []
    for thread in threads:
        try:
            listed = _read_proc_file(f"/proc/{pid}/task/{thread}/children", CHILDREN_READ_LIMIT)
        except OSError:
            continue  # the thread ended meanwhile
        children += [int(child) for child in listed.split()]
    return children


def _children_by_scan() -> Callable[[int], list[int]]:
    """Children by parent, from one pass over every process's ``stat``."""
    parents: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = _read_proc_file(f"/proc/{name}/stat", PROC_READ_SIZE)
            # "pid (comm) state ppid ...": the command may hold spaces and parentheses.
            ppid = int(stat[stat.rindex(b")") + 2 :].split(None, 2)[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        parents.setdefault(ppid, []).append(int(name))
    return lambda parent: parents.get(parent, [])


def still_same(pid: int, create_time: float) -> bool:
    """True while ``pid`` is still the live process that was spawned at ``create_time``."""
    try:
        process = psutil.Process(pid)
        return process.create_time() == create_time and process.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def pid_replaced(pid: int, create_time: float) -> bool:
    """True when ``pid`` names a live process created at another time than ``create_time``;
    False while it is that process, and when nothing (or only a zombie) is left at ``pid``."""
    try:
        process = psutil.Process(pid)
        return process.create_time() != create_time and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # another user's process now holds the pid


async def end_identified(known: Mapping[int, float]) -> tuple[list[int], list[int]]:
    """SIGKILL every process of ``known`` (pid -> create time) that is still itself; return
    (those that were alive, those still alive after ``END_WAIT_SECONDS``). Shielded."""
    alive = [pid for pid, created in known.items() if still_same(pid, created)]
    for pid in alive:
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            # psutil refuses to signal a pid that now names another process.
            if process.create_time() == known[pid]:
                process.kill()
    surviving = alive
    with trio.CancelScope(shield=True), trio.move_on_after(END_WAIT_SECONDS):
        while surviving:
            surviving = [pid for pid in surviving if still_same(pid, known[pid])]
            if surviving:
                await trio.sleep(POLL_SECONDS)
    return alive, surviving


async def end_tagged(tag: str) -> tuple[list[int], list[int]]:
    """End every live process carrying exactly ``tag``; (ended, survivors). Sweeps again while
    new tagged processes appear (one forked while its parent was being ended)."""
    ended: dict[int, float] = {}
    survivors: list[int] = []
    for _ in range(TAG_SWEEPS):
        # Reading every process's environ is blocking file I/O: off the event loop.
        with trio.CancelScope(shield=True):
            found = await trio.to_thread.run_sync(tagged_processes, lambda seen: seen == tag)
        if not found:
            break
        ended.update(found)
        _, survivors = await end_identified(found)
    return sorted(ended), survivors
