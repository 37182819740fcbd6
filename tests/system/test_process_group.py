"""The one process-group stopper against real child processes (FAKE host under tests/fake_hosts/).

Real processes need real time: every wait here is bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import trio

from cache_family.oracles.stage_server import child_environment
from cache_family.system import process_group
from cache_family.system.child import ChildCommand, run_child
from cache_family.system.process_group import (
    PROCESS_TAG_NAME,
    descendants,
    end_processes,
    is_kernel_thread,
    live_members,
    process_tag_of,
    stop_group,
    stop_group_blocking,
    tagged_processes,
)

CHILD_POLL_SECONDS = 0.01
IGNORES_SIGTERM = str(
    Path(__file__).resolve().parents[1] / "support" / "fake_hosts" / "fake_host_ignores_sigterm.py"
)
SLEEPER = "import signal\nwhile True: signal.pause()\n"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def ignoring_group(tmp_path: Path) -> tuple[trio.Process, list[int]]:
    """A leader and its grandchild, both ignoring SIGTERM, in a session of their own."""
    pids = tmp_path / "pids.json"
    process = await trio.lowlevel.open_process(
        [sys.executable, IGNORES_SIGTERM, str(free_port()), str(pids)],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    with trio.fail_after(30):
        while not pids.exists():
            await trio.sleep(CHILD_POLL_SECONDS)
    return process, list(json.loads(pids.read_text()))


async def test_a_group_ignoring_sigterm_is_killed_with_its_grandchild(tmp_path: Path) -> None:
    process, (leader, grandchild) = await ignoring_group(tmp_path)
    with trio.fail_after(30):
        stopped = await stop_group(process, grace=0.3, kill_wait=10)
    assert stopped.signalled and stopped.forced
    assert stopped.returncode == -signal.SIGKILL
    assert live_members(leader) == []
    assert not running(grandchild)


async def test_a_popen_leader_is_stopped_the_same_way(tmp_path: Path) -> None:
    pids = tmp_path / "pids.json"
    process = subprocess.Popen(
        [sys.executable, IGNORES_SIGTERM, str(free_port()), str(pids)],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    with trio.fail_after(30):
        while not pids.exists():
            await trio.sleep(CHILD_POLL_SECONDS)
    grandchild = json.loads(pids.read_text())[1]
    with trio.fail_after(30):
        stopped = await stop_group(process, grace=0.3, kill_wait=10)
    assert stopped.forced and process.returncode == -signal.SIGKILL
    assert not running(grandchild)


async def test_hurry_ends_the_grace_at_once(tmp_path: Path) -> None:
    process, (_, grandchild) = await ignoring_group(tmp_path)
    hurry = trio.Event()
    hurry.set()
    with trio.fail_after(30):  # far below the grace: only the hurry can end it in time
        stopped = await stop_group(process, grace=600, kill_wait=10, hurry=hurry)
    assert stopped.forced and not running(grandchild)


async def test_stopping_is_shielded_from_cancellation(tmp_path: Path) -> None:
    process, (_, grandchild) = await ignoring_group(tmp_path)
    with trio.fail_after(30), trio.CancelScope() as scope:
        scope.cancel()
        stopped = await stop_group(process, grace=0.3, kill_wait=10)
    assert stopped.forced and stopped.returncode == -signal.SIGKILL
    assert not running(grandchild)


async def test_an_obedient_leader_ends_within_the_grace() -> None:
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", SLEEPER], start_new_session=True
    )
    with trio.fail_after(30):
        stopped = await stop_group(process, grace=600, kill_wait=10)
    assert stopped.signalled and not stopped.forced
    assert stopped.returncode == -signal.SIGTERM


async def test_an_ended_group_is_not_signalled() -> None:
    process = await trio.lowlevel.open_process([sys.executable, "-c", ""], start_new_session=True)
    with trio.fail_after(30):
        await process.wait()
        stopped = await stop_group(process, grace=600, kill_wait=10)
    assert not stopped.signalled and not stopped.forced and stopped.returncode == 0


def popen_ignoring_group(tmp_path: Path) -> tuple[subprocess.Popen[bytes], list[int]]:
    """As :func:`ignoring_group`, for a caller outside trio."""
    pids = tmp_path / "pids.json"
    process = subprocess.Popen(
        [sys.executable, IGNORES_SIGTERM, str(free_port()), str(pids)],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while not pids.exists():
        assert time.monotonic() < deadline, "the fake host never wrote its pids"
        time.sleep(CHILD_POLL_SECONDS)
    return process, list(json.loads(pids.read_text()))


def test_the_blocking_stopper_kills_a_group_ignoring_sigterm(tmp_path: Path) -> None:
    process, (leader, grandchild) = popen_ignoring_group(tmp_path)
    stopped = stop_group_blocking(process, grace=0.3, kill_wait=10)
    assert stopped.signalled and stopped.forced
    assert stopped.returncode == -signal.SIGKILL
    assert live_members(leader) == [] and not running(grandchild)


def test_the_blocking_stopper_lets_an_obedient_leader_end_in_the_grace() -> None:
    process = subprocess.Popen([sys.executable, "-c", SLEEPER], start_new_session=True)
    stopped = stop_group_blocking(process, grace=600, kill_wait=10)
    assert stopped.signalled and not stopped.forced
    assert stopped.returncode == -signal.SIGTERM


def test_the_blocking_stopper_does_not_signal_an_ended_group() -> None:
    process = subprocess.Popen([sys.executable, "-c", ""], start_new_session=True)
    process.wait()
    stopped = stop_group_blocking(process, grace=600, kill_wait=10)
    assert not stopped.signalled and not stopped.forced and stopped.returncode == 0


def test_a_process_found_by_itself_ignoring_sigterm_is_killed(tmp_path: Path) -> None:
    process, (_, grandchild) = popen_ignoring_group(tmp_path)
    found = psutil.Process(process.pid)
    try:
        ended = end_processes([found], grace=0.3, kill_wait=10)
        assert ended.ended == [] and ended.forced == [process.pid] and ended.survivors == []
        assert found.returncode == -signal.SIGKILL
        # One by one, not as a group: the grandchild nobody named is not reached.
        assert running(grandchild)
    finally:
        os.killpg(process.pid, signal.SIGKILL)


def test_a_process_found_by_itself_that_obeys_ends_within_the_grace() -> None:
    process = subprocess.Popen([sys.executable, "-c", SLEEPER], start_new_session=True)
    found = psutil.Process(process.pid)
    ended = end_processes([found], grace=600, kill_wait=10)
    assert ended.ended == [process.pid] and ended.forced == ended.survivors == []
    assert ended.denied == []
    assert found.returncode == -signal.SIGTERM


# A tool child that leaves a daemon behind: setsid and a double fork (FAULT INJECTION), the
# daemon ignoring SIGTERM; the tool itself exits 0 at once.
DAEMONIZING_TOOL = """
import os, signal, sys
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        path = sys.argv[1]
        with open(path + ".tmp", "w") as handle:
            handle.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
        while True:
            signal.pause()
    os._exit(0)
os.wait()
while not os.path.exists(sys.argv[1]):
    pass
"""


async def test_a_tool_child_that_left_a_daemon_is_not_clean_and_the_daemon_is_ended(
    tmp_path: Path,
) -> None:
    daemon_file = tmp_path / "daemon"
    command = ChildCommand(
        argv=(sys.executable, "-c", DAEMONIZING_TOOL, str(daemon_file)),
        env={"PATH": "/usr/bin:/bin"},
        cwd=str(tmp_path),
        stdout_path=str(tmp_path / "out.log"),
        stderr_path=str(tmp_path / "err.log"),
        deadline=trio.current_time() + 60,
        process_tag="cf-test/cell-0000/correctness",
    )

    async def spawned(pid: int, create_time: float) -> None:
        del pid, create_time

    with trio.fail_after(60):
        ended = await run_child(command, spawned)
    daemon = int(daemon_file.read_text())
    assert ended.exit_code == 0 and not ended.forced
    assert ended.tagged_escapees == (daemon,) and ended.surviving_descendants == ()
    assert not ended.clean
    assert not running(daemon)


async def test_a_child_that_exits_leaving_a_background_process_in_its_group_is_not_clean(
    tmp_path: Path,
) -> None:
    """``sleep 1000 &`` stays in the child's group: the group outlives the child, is ended
    with it, and the outcome says so (no tag needed to find it)."""
    pid_file = tmp_path / "background.pid"
    command = ChildCommand(
        argv=("/bin/sh", "-c", f'sleep 1000 & echo $! > "{pid_file}"; exit 0'),
        env={"PATH": "/usr/bin:/bin"},
        cwd=str(tmp_path),
        stdout_path=str(tmp_path / "out.log"),
        stderr_path=str(tmp_path / "err.log"),
        deadline=trio.current_time() + 60,
        grace_seconds=5.0,
    )

    async def spawned(pid: int, create_time: float) -> None:
        del pid, create_time

    with trio.fail_after(60):
        ended = await run_child(command, spawned)
    background = int(pid_file.read_text())
    assert ended.exit_code == 0 and not ended.timed_out
    assert ended.outlived_by_group and ended.left_processes and not ended.clean
    assert not running(background)


def test_the_stage_server_oracle_passes_the_cell_tag_to_its_backend() -> None:
    """The oracle stage server starts llama-server in a session of its own with a filtered
    environment: the backend must keep the cell's tag, or a backend that outlives a killed
    stage server is out of custody's reach."""
    env = child_environment({"PATH": "/bin", "CACHE_FAMILY_CELL": "cf-x/cell-0000/new", "K": "v"})
    assert env == {"PATH": "/bin", "CACHE_FAMILY_CELL": "cf-x/cell-0000/new"}


@pytest.mark.parametrize("children_files", [True, False], ids=["children-files", "stat-scan"])
def test_descendants_are_the_whole_tree_with_psutils_create_times(
    children_files: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both ways of reading the tree: the threads' children files where the kernel has them
    # (Debian's does), and the pass over every process's stat where it does not.
    if children_files and not process_group._has_children_files():
        pytest.skip("this kernel lists no thread's children")
    if not children_files:
        monkeypatch.setattr(process_group, "_has_children_files", lambda: False)
    # A shell whose child shell runs a sleeper: a child and a grandchild.
    script = "sh -c 'sleep 30 & wait' & wait"
    with subprocess.Popen(["sh", "-c", script], start_new_session=True) as leader:
        try:
            deadline = time.monotonic() + 10
            found: dict[int, float] = {}
            while time.monotonic() < deadline and len(found) < 2:
                found = descendants(leader.pid)
            tree = psutil.Process(leader.pid).children(recursive=True)
            assert found == {child.pid: child.create_time() for child in tree}
            assert len(found) == 2 and leader.pid not in found
        finally:
            os.killpg(leader.pid, signal.SIGKILL)
    # A gone process has no descendants.
    assert descendants(leader.pid) == {}


def test_a_tag_behind_a_large_environment_is_read_in_full() -> None:
    # More than one read of /proc/PID/environ: the tag comes after 180 KiB of other values
    # (one value may hold at most 128 KiB).
    filler = {f"FILLER_{n}": "x" * (60 * 1024) for n in range(3)}
    # A tag of this test's own: another suite's children on the machine carry "run/cell" too.
    tag = f"run-{os.getpid()}/cell"
    env = {"PATH": "/usr/bin:/bin", **filler, PROCESS_TAG_NAME: tag}
    # The child says "ready" only once it runs with ``env``: before its exec, /proc/PID/environ
    # would still be this process's own. It then waits on its input without a second exec
    # (``exec sleep`` raced the scan: mid-exec, the kernel shows an empty environment).
    ready = ["sh", "-c", "echo ready; read line"]
    with subprocess.Popen(ready, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == b"ready\n"
            assert process_tag_of(child.pid) == tag
            found = tagged_processes(lambda seen: seen == tag)
            assert set(found) == {child.pid}
        finally:
            child.kill()


def test_an_environment_read_empty_mid_exec_is_read_again_fault_injection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Fault injection: the kernel's empty answer for a process in the middle of an exec is
    # scripted for the first reads; the real file then carries the tag.
    tag = f"run-{os.getpid()}/mid-exec"
    env = {"PATH": "/usr/bin:/bin", PROCESS_TAG_NAME: tag}
    real_read = process_group._read_proc_file
    empty_reads = {"left": 3}

    def empty_first(path: str, limit: int) -> bytes:
        if path.endswith("/environ") and empty_reads["left"] > 0:
            empty_reads["left"] -= 1
            return b""
        return real_read(path, limit)

    monkeypatch.setattr(process_group, "_read_proc_file", empty_first)
    ready = ["sh", "-c", "echo ready; read line"]
    with subprocess.Popen(ready, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == b"ready\n"
            assert process_tag_of(child.pid) == tag
            assert empty_reads["left"] == 0
            # A process whose environment stays empty has no tag, after a bounded number of tries.
            monkeypatch.setattr(process_group, "_read_proc_file", lambda path, limit: b"")
            assert process_tag_of(child.pid) is None
        finally:
            child.kill()


def test_a_kernel_threads_empty_environment_is_read_once_fault_injection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A root sweep reads the kernel's own threads too: their environment is always empty, and
    # waiting for it as for a process mid-exec cost every sweep 50 reads a thread.
    # Fault injection: the environment reads are scripted empty and counted.
    kernel = next(
        (int(p) for p in os.listdir("/proc") if p.isdigit() and is_kernel_thread(int(p))), None
    )
    if kernel is None:
        pytest.skip("no kernel thread is visible in this PID namespace")
    assert not is_kernel_thread(os.getpid())
    reads: list[str] = []
    real_read = process_group._read_proc_file

    def empty_environ(path: str, limit: int) -> bytes:
        if path.endswith("/environ"):
            reads.append(path)
            return b""
        return real_read(path, limit)

    monkeypatch.setattr(process_group, "_read_proc_file", empty_environ)
    assert process_tag_of(kernel) is None
    assert reads == [f"/proc/{kernel}/environ"]
    reads.clear()
    # A process of ours with an empty environment is read again, a bounded number of times.
    assert process_tag_of(os.getpid()) is None
    assert len(reads) == process_group.EMPTY_ENVIRON_TRIES
