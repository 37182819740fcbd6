"""Helpers several test modules share (they were in test_run_signals.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import trio
from run_harness import make_prepared

from cache_family.actors.run.custody import port_is_free, still_same
from cache_family.schemas.journal import (
    ChildSpawned,
    PortReserved,
    read_journal,
)

CLI = Path(sys.executable).parent / "cache-family"


HARNESS = Path(__file__).parent / "fake_hosts" / "fault_injection_run.py"


# seconds: an upper bound on process events, never a pause; a real run reaching a native
# ladder on a loaded 2-core machine took over 30 s to get there, so the bound is generous.
WAIT = 600


CHILD_POLL_SECONDS = 0.02  # polling a real child process (no event to await)


def behave(prepared: Path, **behaviour: Any) -> None:
    server = prepared.parent / "tools" / "fake-llama-server"
    (server.parent / (server.name + ".behaviour.json")).write_text(json.dumps(behaviour))


class Fifo:
    """The test's end of the FAKE host's notification FIFO (held open for writing too, so
    the read end never reports end-of-file between host notifications)."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path = path
        self.read_fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self.keep_fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        self.buffer = b""

    async def next_line(self) -> str:
        with trio.fail_after(WAIT):
            while b"\n" not in self.buffer:
                await trio.lowlevel.wait_readable(self.read_fd)
                self.buffer += os.read(self.read_fd, 4096)
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode()

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.keep_fd)


class Seam:
    """The test's ends of the FAULT-INJECTION harness's seam (``fault_injection_run.py``): the
    run says when it reached the seam, and blocks there until released."""

    def __init__(self, tmp_path: Path, name: str) -> None:
        self.name = name
        self.notify = Fifo(tmp_path / "seam-notify")
        self.release_path = tmp_path / "seam-release"
        os.mkfifo(self.release_path)
        # Read-write: the harness's open for reading never waits for a writer.
        self.release_fd = os.open(self.release_path, os.O_RDWR)

    async def reached(self) -> None:
        assert await self.notify.next_line() == f"at {self.name}"

    def release(self) -> None:
        os.write(self.release_fd, b"go\n")

    def close(self) -> None:
        self.notify.close()
        os.close(self.release_fd)


async def start_run(
    prepared: Path, out: Path, logs: Path, seam: Seam | None = None
) -> trio.Process:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(logs)}
    command = [str(CLI)]
    if seam is not None:
        command = [sys.executable, str(HARNESS), seam.name, str(seam.notify.path)]
        command.append(str(seam.release_path))
    with open(logs / "run.stdout", "wb") as stdout, open(logs / "run.stderr", "wb") as stderr:
        return await trio.lowlevel.open_process(
            [*command, "run", "--input", str(prepared), "--output", str(out)],
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            env=env,
        )


async def wait_exit(process: trio.Process) -> int:
    with trio.fail_after(WAIT):
        return await process.wait()


def journal_records(out: Path, kind: type, *, live: bool = False) -> list[Any]:
    """The journal's records of ``kind``; ``live``: the run may be writing a line right now,
    so only its complete lines are read."""
    data = (out / "journal.jsonl").read_bytes()
    if live:
        data = data[: data.rfind(b"\n") + 1]
    read = read_journal(data)
    assert read.chain_break is None and not read.torn_tail
    return [line.record for line in read.lines if isinstance(line.record, kind)]


def assert_no_orphan_and_ports_free(out: Path) -> None:
    spawned = journal_records(out, ChildSpawned)
    assert spawned, "the run journaled no host"
    for child in spawned:
        assert not still_same(child.pid, child.create_time), f"host {child.pid} survived"
    for reserved in journal_records(out, PortReserved):
        assert port_is_free(reserved.port), f"port {reserved.port} still bound"
    alive = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if any(str(out) in part for part in (p.info["cmdline"] or []))
    ]
    assert alive == []


def logs_dir(tmp_path: Path) -> Path:
    logs = tmp_path / "logs"
    logs.mkdir()
    return logs


@dataclass
class StalledRun:
    """A real `cache-family run` whose FAKE host holds every streamed reply open."""

    out: Path
    logs: Path
    process: trio.Process
    fifo: Fifo


async def start_stalled_run(
    tmp_path: Path,
    *,
    keys: Sequence[str] = ("qwen3_dense",),
    out: Path | None = None,
    seam: Seam | None = None,
    **behaviour: Any,
) -> StalledRun:
    prepared = make_prepared(tmp_path / "p", keys=keys)
    fifo = Fifo(tmp_path / "notify")
    behave(prepared, stream_delay=3600, notify_fifo=str(fifo.path), **behaviour)
    out = out or tmp_path / "out"
    logs = logs_dir(tmp_path)
    return StalledRun(out, logs, await start_run(prepared, out, logs, seam), fifo)


def stop(run: StalledRun) -> None:
    run.fifo.close()
    if run.process.returncode is None:
        run.process.kill()


async def poll_journal_until(out: Path, process: trio.Process, wanted: Any) -> Any:
    """Yield until a complete journal line satisfies ``wanted`` (bounded by WAIT) and return
    that record: the run's own journal says where it is, so the next signal lands at a known
    point."""
    path = out / "journal.jsonl"
    with trio.fail_after(WAIT):
        while True:
            assert process.returncode is None and process.poll() is None, "the run ended early"
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                data = b""
            complete = data[: data.rfind(b"\n") + 1]
            if complete:
                for line in read_journal(complete).lines:
                    if wanted(line.record):
                        return line.record
            # The run is a real child process with no event to wait on: poll its journal
            # without spinning a core the run under test needs.
            await trio.sleep(CHILD_POLL_SECONDS)
