"""``replay --reap`` of a forged journal never ends a live run's hosts.

The attack: copy a killed run's journal, set its ``child_spawned`` tags to a live run's tag
(read from that run's journal), re-chain it and reap it. The reaper ends a tagged process only
when its tag names the reaped journal's run and that run is dead: its runner gone and no other
process holding the lock of the run directory it works in.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import psutil
import pytest
from cell_journal_builder import run_started

from cache_family.actors.audit.replay import replay
from cache_family.schemas.journal import ChildSpawned, Record, encode_journal
from cache_family.system.process_group import PROCESS_TAG_NAME, RunTag, parse_run_tag
from cache_family.system.run_lock import run_lock

HOST_WAITS = "import sys; print('ready', flush=True); sys.stdin.read()"
LIVE_RUN = "run-20261207T000000Z-live"
DEAD_RUNNER_CREATED = 1.0  # this test's pid created at 1.0: a runner that is gone


def spawn_host(tag: str, cwd: Path) -> subprocess.Popen[bytes]:
    """A run's host as the reaper sees one: its tag in its environment, working in ``cwd``."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), PROCESS_TAG_NAME: tag}
    host = subprocess.Popen(
        [sys.executable, "-c", HOST_WAITS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        cwd=cwd,
    )
    assert host.stdout is not None and host.stdout.readline() == b"ready\n"
    return host


def forged_journal(run_dir: Path, host: subprocess.Popen[bytes], tag: str, run_id: str) -> None:
    """A killed run's journal whose ``child_spawned`` names ``host`` with the copied ``tag``,
    re-chained (it verifies), its runner recorded as nobody's."""
    started = msgspec.structs.replace(run_started(), run_id=run_id)
    spawned = ChildSpawned(
        cell_id="cell-0000/native-serial",
        pid=host.pid,
        create_time=psutil.Process(host.pid).create_time(),
        argv_sha256=hashlib.sha256(b"argv").hexdigest(),
        effective_environment={PROCESS_TAG_NAME: tag},
    )
    records: list[Record] = [started, spawned]
    run_dir.mkdir(exist_ok=True)
    (run_dir / "journal.jsonl").write_bytes(encode_journal(records))


def live_tag(runner_created: float, run_id: str = LIVE_RUN) -> str:
    runner = RunTag("cf-0123456789abcdef", run_id, os.getpid(), runner_created)
    return f"{runner.text}/cell-0000/native-serial"


def alive(host: subprocess.Popen[bytes]) -> bool:
    return host.poll() is None


@pytest.fixture
def me_created() -> float:
    return psutil.Process().create_time()


def test_a_run_tag_round_trips_and_a_token_only_tag_names_no_run() -> None:
    tag = RunTag("cf-00ff", "run-20261207T000000Z-ab12", 4242, 1765100000.25)
    assert parse_run_tag(f"{tag.text}/cell-0003/native-serial") == tag
    assert parse_run_tag("cf-test0123456789/cell-0000/native-serial") is None
    assert parse_run_tag(tag.text) is None  # no cell part: not a host's tag


def test_a_forged_journal_naming_a_live_runs_tag_ends_nothing(
    tmp_path: Path, me_created: float
) -> None:
    """The live run's runner is this test process (alive): whether the forged journal keeps
    its own run id or copies the live one, the live run's host is left alone."""
    tag = live_tag(me_created)
    host = spawn_host(tag, tmp_path)
    try:
        forged_journal(tmp_path / "forged", host, tag, "run-20261207T000001Z-dead")
        report = replay(str(tmp_path / "forged"), reap=True, reap_grace_s=10)
        assert alive(host)
        assert any(f"belongs to run {LIVE_RUN}, not to this journal's" in ln for ln in report.lines)
        forged_journal(tmp_path / "forged-same-id", host, tag, LIVE_RUN)
        report = replay(str(tmp_path / "forged-same-id"), reap=True, reap_grace_s=10)
        assert alive(host)
        assert any(
            f"belongs to a live run: its runner, pid {os.getpid()}, is alive" in line
            for line in report.lines
        )
        assert not any("ended with SIGTERM" in line for line in report.lines)
    finally:
        host.kill()
        host.wait()


def test_a_host_of_a_run_whose_directory_is_locked_is_left_alone(tmp_path: Path) -> None:
    """Its runner is gone but another process (a resume, a reap) holds the lock of the run
    directory the host works in: that run is live, not the forged journal's to reap."""
    live = tmp_path / "live"
    state = live / "cell-0000" / "native-serial" / "state"
    state.mkdir(parents=True)
    (live / "journal.jsonl").write_bytes(b"")
    tag = live_tag(DEAD_RUNNER_CREATED)
    host = spawn_host(tag, state)
    try:
        forged_journal(tmp_path / "forged", host, tag, LIVE_RUN)
        with run_lock(str(live), what="a test's live resume"):
            report = replay(str(tmp_path / "forged"), reap=True, reap_grace_s=10)
        assert alive(host)
        assert any(
            f"works in {live}, whose lock another process holds" in line for line in report.lines
        )
        # The lock released and the runner gone: the run's own journal may reap it.
        reaped = replay(str(tmp_path / "forged"), reap=True, reap_grace_s=10)
        assert f"reap: ended with SIGTERM: [{host.pid}]" in reaped.lines
    finally:
        host.kill()
        host.wait()


def test_a_host_whose_tag_names_no_run_is_left_alone(tmp_path: Path) -> None:
    """A tag of only a token (an earlier version's host) cannot be tied to a run: the reaper
    does not end it on a journal's word."""
    tag = "cf-0123456789abcdef/cell-0000/native-serial"
    host = spawn_host(tag, tmp_path)
    try:
        forged_journal(tmp_path / "forged", host, tag, LIVE_RUN)
        report = replay(str(tmp_path / "forged"), reap=True, reap_grace_s=10)
        assert alive(host)
        assert any("carries a tag that names no run" in line for line in report.lines)
    finally:
        host.kill()
        host.wait()
