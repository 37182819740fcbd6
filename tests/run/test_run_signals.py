"""SIGINT/SIGTERM delivered to a real ``cache-family run`` process with real host custody.

The host is the FAKE ``fake_run_llama_server.py`` (a real child process speaking llama-server's
HTTP and listening line); it tells the test through a FIFO when a streamed request arrived or
when it received SIGTERM, so every signal is sent at a known point without sleeping. Each test
checks the published receipts, that no host process survived and that the port is free.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio
from run_harness import make_prepared
from signal_harness import (  # noqa: F401
    CHILD_POLL_SECONDS,
    CLI,
    HARNESS,
    WAIT,
    Fifo,
    Seam,
    StalledRun,
    assert_no_orphan_and_ports_free,
    behave,
    journal_records,
    logs_dir,
    poll_journal_until,
    start_run,
    start_stalled_run,
    stop,
    wait_exit,
)

from cache_family.actors.audit.replay import replay
from cache_family.actors.run.custody import still_same
from cache_family.errors import Refused
from cache_family.schemas.journal import (
    Cancellation,
    ChildSpawned,
    CleanupOutcome,
    ReceiptPublished,
    RowOpened,
    RunStarted,
    read_journal,
)
from cache_family.schemas.matrix import MATRIX_FILENAME, decode_matrix
from cache_family.schemas.receipts import decode_cell_receipt, decode_row_receipt


async def test_sigint_mid_ladder_downgrades_every_receipt_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    run = await start_stalled_run(tmp_path)
    out, process, fifo = run.out, run.process, run.fifo
    try:
        event, pid = (await fifo.next_line()).split()
        assert event == "stream"  # the concurrent ladder's first request is in the host
        process.send_signal(signal.SIGINT)
        code = await wait_exit(process)
    finally:
        stop(run)
    assert code == 130
    matrix = decode_matrix((out / MATRIX_FILENAME).read_bytes())
    assert matrix.status == "incomplete" and matrix.terminal_refusal == "cancelled"
    row = decode_row_receipt((out / "cell-0000" / "row.json").read_bytes())
    assert row.status == "incomplete" and row.terminal_refusal == "cancelled"
    sweep = decode_cell_receipt(
        (out / "cell-0000" / "sweep-native-concurrent" / "cell.json").read_bytes()
    )
    assert sweep.status == "incomplete" and sweep.terminal_refusal == "cancelled"
    assert sweep.host is not None and sweep.host.pid == int(pid)
    assert sweep.cleanup is not None and sweep.cleanup.clean  # SIGTERM ended it gracefully
    assert [r.status for r in sweep.measurement.rungs[0].rows] == ["incomplete", "not-launched"]
    serial = decode_cell_receipt((out / "cell-0000" / "native-serial" / "cell.json").read_bytes())
    assert serial.status == "completed"  # finished before the signal: never lowered
    assert [c.signal for c in journal_records(out, Cancellation) if c.cell_id is None] == ["SIGINT"]
    assert_no_orphan_and_ports_free(out)
    assert not list(out.glob("cell-0000/*/*-state-*"))  # private state dirs removed
    assert replay(str(out)).exit_code == 0


async def test_sigterm_then_a_second_signal_shortens_the_grace_but_cleans_up(
    tmp_path: Path,
) -> None:
    # The ladder's host ignores SIGTERM (it only reports it), so custody must SIGKILL it;
    # the hosts' grace is long, so only the second signal can have ended it.
    long_grace = Seam(tmp_path, "long-grace")
    run = await start_stalled_run(tmp_path, seam=long_grace, ignore_sigterm="after_stream")
    out, process, fifo = run.out, run.process, run.fifo
    try:
        assert (await fifo.next_line()).startswith("stream ")
        process.send_signal(signal.SIGTERM)
        assert (await fifo.next_line()).startswith("sigterm ")  # cleanup's grace has begun
        process.send_signal(signal.SIGINT)
        code = await wait_exit(process)
        # That the second signal ended the grace is the journal's word (grace_shortened,
        # below), never a wall-clock reading a loaded machine could stretch.
    finally:
        stop(run)
        long_grace.close()
    assert code == 130
    sweep = decode_cell_receipt(
        (out / "cell-0000" / "sweep-native-concurrent" / "cell.json").read_bytes()
    )
    assert sweep.status == "incomplete" and sweep.terminal_refusal == "cancelled"
    assert sweep.cleanup is not None and sweep.cleanup.forced and not sweep.cleanup.clean
    outcome = next(
        r for r in journal_records(out, CleanupOutcome) if r.cell_id.endswith("concurrent")
    ).cleanup
    assert outcome.grace_shortened and outcome == sweep.cleanup  # cell.json shows it as is
    assert outcome.escaped_descendants == ()
    matrix = decode_matrix((out / MATRIX_FILENAME).read_bytes())
    assert matrix.terminal_refusal == "cancelled"
    assert_no_orphan_and_ports_free(out)
    assert replay(str(out)).exit_code == 0


async def test_an_existing_output_is_refused_and_left_untouched(tmp_path: Path) -> None:
    prepared = make_prepared(tmp_path / "p")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    process = await start_run(prepared, out, logs_dir(tmp_path))
    assert await wait_exit(process) == 2
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert "run.output_exists" in (tmp_path / "logs" / "run.stderr").read_text()
    relative = await start_run(prepared, Path("relative-out"), tmp_path / "logs")
    assert await wait_exit(relative) == 2
    assert not (Path.cwd() / "relative-out").exists()


async def test_a_second_signal_after_the_rows_still_publishes_the_cancelled_matrix(
    tmp_path: Path,
) -> None:
    """SIGINT mid-ladder, then SIGTERM once the rows are over (the unreached rows journaled,
    the matrix not yet folded): the run still journals every row, publishes the matrix and
    exits 130.

    This test once polled the journal for the unreached row and then signalled: on a loaded
    machine the run had often published and closed its receiver by then, and Python's default
    SIGTERM action (restored with the receiver) killed it (-15). The run's latch now stays
    until exit, and the seam makes the moment exact."""
    seam = Seam(tmp_path, "rows-over")
    run = await start_stalled_run(tmp_path, keys=("qwen3_dense", "llama"), seam=seam)
    out, logs, process, fifo = run.out, run.logs, run.process, run.fifo
    try:
        assert (await fifo.next_line()).startswith("stream ")
        process.send_signal(signal.SIGINT)
        await seam.reached()  # every row has ended (the unreached ones journaled)
        process.send_signal(signal.SIGTERM)
        seam.release()
        code = await wait_exit(process)
    finally:
        seam.close()
        stop(run)
    stderr = (logs / "run.stderr").read_text()
    assert code == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    matrix = decode_matrix((out / MATRIX_FILENAME).read_bytes())
    assert matrix.status == "incomplete" and matrix.terminal_refusal == "cancelled"
    opened = journal_records(out, RowOpened)
    assert len(opened) == len(matrix.rows) > 1  # every planned row is journaled
    later = {r.result.status for r in matrix.rows[1:]}
    assert "not-launched" in later and later <= {"not-launched", "missing-model"}
    assert [c.signal for c in journal_records(out, Cancellation) if c.cell_id is None] == ["SIGINT"]
    published = journal_records(out, ReceiptPublished)
    assert published[-1].scope == "matrix"
    assert_no_orphan_and_ports_free(out)
    assert replay(str(out)).exit_code == 0


async def test_a_run_killed_mid_ladder_replays_as_unfinished_and_reap_ends_its_host(
    tmp_path: Path,
) -> None:
    run = await start_stalled_run(tmp_path)
    out, process, fifo = run.out, run.process, run.fifo
    try:
        event, pid = (await fifo.next_line()).split()
        assert event == "stream"
        process.kill()  # SIGKILL: no cleanup, no receipt, no matrix
        assert await wait_exit(process) == -signal.SIGKILL
    finally:
        stop(run)
    host = psutil.Process(int(pid))
    assert host.is_running()  # the orphaned host is still in the concurrent ladder
    report = await trio.to_thread.run_sync(lambda: replay(str(out), reap=True, reap_grace_s=10))
    assert report.exit_code == 1 and not report.differs
    assert report.identical == ["cell-0000/native-serial/cell.json"]
    assert report.unfinished is not None
    assert report.unfinished.startswith("cell cell-0000/native-concurrent opened at seq ")
    assert f"no {MATRIX_FILENAME} was published" in report.unfinished
    assert any(line.startswith("reap: ended with SIGTERM: ") for line in report.lines)
    assert_no_orphan_and_ports_free(out)  # the journaled host is gone, its port free


async def test_reap_is_refused_while_the_runner_lives_and_touches_nothing(
    tmp_path: Path,
) -> None:
    run = await start_stalled_run(tmp_path)
    out, logs, process, fifo = run.out, run.logs, run.process, run.fifo
    try:
        event, pid = (await fifo.next_line()).split()
        assert event == "stream"
        (started,) = journal_records(out, RunStarted, live=True)
        assert started.runner_pid == process.pid
        assert started.runner_create_time == psutil.Process(process.pid).create_time()
        host = psutil.Process(int(pid))
        with pytest.raises(Refused) as refused:
            await trio.to_thread.run_sync(lambda: replay(str(out), reap=True, reap_grace_s=10))
        assert refused.value.codes == ["replay.reap.run_alive"]
        # The same through the command line: a refusal line, exit 2.
        ran = await trio.run_process(
            [str(CLI), "replay", str(out), "--reap"],
            capture_stdout=True, capture_stderr=True, check=False,
            env={"PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        assert ran.returncode == 2
        assert ran.stderr.decode().startswith("refused: replay.reap.run_alive at ")
        # Nothing was signalled: the host is still serving and the run still runs.
        assert host.is_running() and host.status() != psutil.STATUS_ZOMBIE
        assert process.poll() is None
        cleaned = journal_records(out, CleanupOutcome, live=True)
        assert [c for c in cleaned if c.cleanup.pid == host.pid] == []
        process.send_signal(signal.SIGINT)
        code = await wait_exit(process)
    finally:
        stop(run)
    assert code == 130, (logs / "run.stderr").read_text()
    assert_no_orphan_and_ports_free(out)
    # Once the runner is gone, reap is allowed again (and finds nothing left to end).
    report = await trio.to_thread.run_sync(lambda: replay(str(out), reap=True, reap_grace_s=10))
    assert report.exit_code == 0


def daemons(directory: Path) -> dict[int, float]:
    """Every daemon that wrote its pid, with its create time (0.0, never a live process's,
    once it is gone and reaped)."""
    found = {}
    for path in directory.iterdir():
        if path.name.isdigit():
            found[int(path.name)] = 0.0
            with contextlib.suppress(psutil.NoSuchProcess):
                found[int(path.name)] = psutil.Process(int(path.name)).create_time()
    return found


def kill_all(found: dict[int, float]) -> None:
    for pid, created in found.items():
        if still_same(pid, created):
            psutil.Process(pid).kill()


async def test_host_daemons_made_on_sigterm_are_ended_by_tag_and_downgrade_the_cells(
    tmp_path: Path,
) -> None:
    """Each host leaves a setsid + double-fork daemon from its SIGTERM handler: the group stop
    looks graceful, yet custody finds every daemon by the cell's environment tag, ends it and
    journals it, and the cells are not completed."""
    prepared = make_prepared(tmp_path / "p")
    (tmp_path / "daemons").mkdir()
    behave(prepared, daemonize="on_sigterm", daemon_dir=str(tmp_path / "daemons"))
    out = tmp_path / "out"
    logs = logs_dir(tmp_path)
    process = await start_run(prepared, out, logs)
    try:
        code = await wait_exit(process)
        found = daemons(tmp_path / "daemons")
    finally:
        if process.returncode is None:
            process.kill()
    try:
        assert code == 1, (logs / "run.stderr").read_text()
        outcomes = [r.cleanup for r in journal_records(out, CleanupOutcome)]
        tagged = sorted(pid for outcome in outcomes for pid in outcome.tagged_escapees)
        assert tagged == sorted(found) and len(found) == 2  # one daemon per native cell
        assert all(outcome.graceful and not outcome.surviving_descendants for outcome in outcomes)
        assert not any(still_same(pid, created) for pid, created in found.items())
        for name in ("native-serial", "sweep-native-concurrent"):
            receipt = decode_cell_receipt((out / "cell-0000" / name / "cell.json").read_bytes())
            assert receipt.status != "completed"
            assert receipt.cleanup is not None and receipt.cleanup.tagged_escapees
        assert_no_orphan_and_ports_free(out)
        assert replay(str(out)).exit_code == 0
    finally:
        kill_all(found)


async def test_reap_ends_a_tagged_daemon_of_a_killed_run(tmp_path: Path) -> None:
    """The host daemonized at start-up (out of the group and the tree), then the runner was
    SIGKILLed: ``replay --reap`` finds the daemon by the run's tag and ends it."""
    (tmp_path / "daemons").mkdir()
    run = await start_stalled_run(
        tmp_path, daemonize="at_start", daemon_dir=str(tmp_path / "daemons")
    )
    out, process, fifo = run.out, run.process, run.fifo
    found: dict[int, float] = {}
    try:
        event, pid = (await fifo.next_line()).split()
        assert event == "stream"
        process.kill()
        assert await wait_exit(process) == -signal.SIGKILL
        found = daemons(tmp_path / "daemons")
        # The serial cell's custody already ended its daemon; the ladder's is an orphan now.
        orphans = [d for d, c in found.items() if still_same(d, c)]
        assert len(found) == 2 and len(orphans) == 1
        assert orphans[0] not in [p.pid for p in psutil.Process(int(pid)).children(True)]
        report = await trio.to_thread.run_sync(lambda: replay(str(out), reap=True, reap_grace_s=5))
        assert any("carries the run's environment tag" in line for line in report.lines)
        assert not any(still_same(d, c) for d, c in found.items())
        assert_no_orphan_and_ports_free(out)
    finally:
        stop(run)
        kill_all(found)


# --- signals at the edges: one test per moment, each reached through a seam that blocks ----


def assert_interrupted_cleanly(logs: Path, code: int) -> str:
    stderr = (logs / "run.stderr").read_text()
    assert code == 130, stderr  # never -15 / -2 / 143: no signal meets Python's defaults
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    return stderr


async def run_to_seam(
    tmp_path: Path, seam_name: str, **behaviour: Any
) -> tuple[Path, Path, trio.Process, Seam]:
    prepared = make_prepared(tmp_path / "p")
    if behaviour:
        behave(prepared, **behaviour)
    seam = Seam(tmp_path, seam_name)
    out, logs = tmp_path / "out", logs_dir(tmp_path)
    process = await start_run(prepared, out, logs, seam)
    await seam.reached()
    return out, logs, process, seam


@pytest.mark.parametrize(
    ("seam_name", "signum"),
    [
        ("before-output", signal.SIGTERM),
        ("run-dir", signal.SIGTERM),
        ("run-dir", signal.SIGINT),
    ],
)
async def test_a_signal_before_the_receiver_opens_ends_in_130_with_a_cancelled_matrix(
    tmp_path: Path, seam_name: str, signum: signal.Signals
) -> None:
    """Before the run's first side effect (admission passed, no output yet), or once its
    directory exists but before the supervisor listens: the signal is held, and the run
    journals its start, the cancellation and every row as never launched."""
    out, logs, process, seam = await run_to_seam(tmp_path, seam_name)
    try:
        assert out.exists() is (seam_name == "run-dir")
        process.send_signal(signum)
        seam.release()
        code = await wait_exit(process)
    finally:
        seam.close()
        if process.returncode is None:
            process.kill()
    assert_interrupted_cleanly(logs, code)
    matrix = decode_matrix((out / MATRIX_FILENAME).read_bytes())
    assert matrix.status == "incomplete" and matrix.terminal_refusal == "cancelled"
    assert {r.result.status for r in matrix.rows} <= {"not-launched", "missing-model"}
    lines = read_journal((out / "journal.jsonl").read_bytes()).lines
    assert isinstance(lines[0].record, RunStarted)
    assert isinstance(lines[1].record, Cancellation) and lines[1].record.signal == signum.name
    assert journal_records(out, ChildSpawned) == []  # nothing was launched
    assert replay(str(out)).exit_code == 0


async def test_a_signal_after_the_rows_before_the_fold_exits_130_and_changes_no_receipt(
    tmp_path: Path,
) -> None:
    out, logs, process, seam = await run_to_seam(tmp_path, "rows-over")
    try:
        process.send_signal(signal.SIGTERM)
        seam.release()
        code = await wait_exit(process)
    finally:
        seam.close()
        if process.returncode is None:
            process.kill()
    stderr = assert_interrupted_cleanly(logs, code)
    assert "SIGTERM after the matrix was folded" in stderr
    matrix = decode_matrix((out / MATRIX_FILENAME).read_bytes())
    assert matrix.status == "completed"  # every row had ended: the signal cancels nothing
    # The journal is sealed as finished: the closing lines suggest no resume (it would refuse).
    assert "--resume" not in stderr
    assert "run: next: nothing is left to resume: `cache-family replay " in stderr
    assert journal_records(out, Cancellation) == []
    assert_no_orphan_and_ports_free(out)
    assert replay(str(out)).exit_code == 0


async def test_a_signal_after_the_matrix_is_published_exits_130_not_by_the_signal(
    tmp_path: Path,
) -> None:
    out, logs, process, seam = await run_to_seam(tmp_path, "published")
    try:
        assert (out / MATRIX_FILENAME).is_file()
        process.send_signal(signal.SIGTERM)
        seam.release()
        code = await wait_exit(process)
    finally:
        seam.close()
        if process.returncode is None:
            process.kill()
    stderr = assert_interrupted_cleanly(logs, code)
    assert "SIGTERM after the matrix was published" in stderr
    assert decode_matrix((out / MATRIX_FILENAME).read_bytes()).status == "completed"
    assert (logs / "run.stdout").read_text().startswith("completed: ")
    assert replay(str(out)).exit_code == 0


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
async def test_a_second_signal_after_publication_does_not_kill_the_process(
    tmp_path: Path, second: signal.Signals
) -> None:
    """SIGINT mid-ladder cancels the run; a second signal once the matrix is published (the
    supervisor's receiver is closed) is only counted: exit 130, never -15 or -2."""
    seam = Seam(tmp_path, "published")
    run = await start_stalled_run(tmp_path, seam=seam)
    out, logs, process, fifo = run.out, run.logs, run.process, run.fifo
    try:
        assert (await fifo.next_line()).startswith("stream ")
        process.send_signal(signal.SIGINT)
        await seam.reached()
        process.send_signal(second)
        seam.release()
        code = await wait_exit(process)
    finally:
        seam.close()
        stop(run)
    assert_interrupted_cleanly(logs, code)
    matrix = decode_matrix((out / MATRIX_FILENAME).read_bytes())
    assert matrix.status == "incomplete" and matrix.terminal_refusal == "cancelled"
    assert [c.signal for c in journal_records(out, Cancellation) if c.cell_id is None] == ["SIGINT"]
    assert_no_orphan_and_ports_free(out)
    assert replay(str(out)).exit_code == 0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_a_signal_after_the_last_line_still_exits_130_and_changes_no_receipt(
    tmp_path: Path, signum: signal.Signals
) -> None:
    """The run has printed its last line and its command returned: the process is about to
    exit (Python's finalization used to put the default actions back here, and a signal then
    ended it as -15 or -2). The seam holds it at that moment: the signal still makes it 130,
    the sealed receipts stay as they are, and no resume is suggested."""
    out, logs, process, seam = await run_to_seam(tmp_path, "exiting")
    try:
        assert (logs / "run.stdout").read_text().startswith("completed: ")
        sealed = {name: (out / name).read_bytes() for name in ("journal.jsonl", MATRIX_FILENAME)}
        process.send_signal(signum)
        seam.release()
        code = await wait_exit(process)
    finally:
        seam.close()
        if process.returncode is None:
            process.kill()
    stderr = assert_interrupted_cleanly(logs, code)
    assert f"{signum.name} after the run's last line: the run had finished" in stderr
    assert "--resume" not in stderr
    assert {name: (out / name).read_bytes() for name in sealed} == sealed
    assert replay(str(out)).exit_code == 0
