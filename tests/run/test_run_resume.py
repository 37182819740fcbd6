"""``cache-family run --resume`` and the journal's seal.

The resume test is a real run of the zoo against the real llama-server, killed with SIGKILL
while its second row is in flight (the run's own journal says when), then resumed through the
installed entry point: the finished row is kept without a second launch, the killed one runs
again, and replay reproduces every receipt, the superseded ones included.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest
import trio
from real_run_harness import CLI, cli, operator_for
from replay_harness import build_run, journal_lines, write_lines
from signal_harness import poll_journal_until, wait_exit

from cache_family.actors.audit.replay import replay
from cache_family.actors.run.resume import plan_resumption
from cache_family.errors import Refused
from cache_family.oracles.native_parts import Parts
from cache_family.schemas.journal import (
    ChildSpawned,
    JournalChain,
    JournalSealed,
    Record,
    RowOpened,
    RunResumed,
    RunStarted,
    decode_line,
    encode_journal,
    read_journal,
)
from cache_family.schemas.matrix import MATRIX_FILENAME
from cache_family.schemas.production import PRODUCTION_JSON, PRODUCTION_MD


def records(out: Path, kind: type) -> list[Any]:
    read = read_journal((out / "journal.jsonl").read_bytes())
    assert read.chain_break is None
    return [line.record for line in read.lines if isinstance(line.record, kind)]


# --- the seal -------------------------------------------------------------------------------


def test_a_finished_journal_ends_with_its_seal_and_replays(tmp_path: Path) -> None:
    build_run(tmp_path)
    lines = journal_lines(tmp_path)
    seal = decode_line(lines[-1]).record
    assert isinstance(seal, JournalSealed) and seal.terminal_refusal is None
    assert seal.head_sha256 == hashlib.sha256(lines[-2]).hexdigest()
    assert seal.through_seq == len(lines) - 1 and seal.matrix_status == "completed"
    report = replay(str(tmp_path))
    assert report.exit_code == 0
    head = hashlib.sha256(lines[-1]).hexdigest()
    assert f"journal: sealed at seq {len(lines)}, head sha256 {head}" in report.lines


def test_an_edit_of_the_last_line_that_keeps_its_fields_is_detected(tmp_path: Path) -> None:
    build_run(tmp_path)
    lines = journal_lines(tmp_path)
    # The seal's own clock changes; every field is still there and well typed.
    edited = lines[-1].replace(b'"wall_ns":', b'"wall_ns":1', 1)
    assert decode_line(edited).record == decode_line(lines[-1]).record
    write_lines(tmp_path, [*lines[:-1], edited])
    report = replay(str(tmp_path))
    assert report.exit_code == 1 and report.differs
    assert any("seal's digest does not match" in line for line in report.lines)


def test_an_edit_of_the_line_before_the_seal_breaks_the_chain(tmp_path: Path) -> None:
    build_run(tmp_path)
    lines = journal_lines(tmp_path)
    lines[-2] = lines[-2].replace(b'"wall_ns":', b'"wall_ns":1', 1)
    write_lines(tmp_path, lines)
    report = replay(str(tmp_path))
    assert report.exit_code == 1 and report.first_bad_seq == len(lines) - 1


def test_a_record_appended_after_the_seal_is_refused(tmp_path: Path) -> None:
    build_run(tmp_path)
    lines = journal_lines(tmp_path)
    last = decode_line(lines[-1])
    chain = JournalChain(next_seq=last.seq + 1, prev=hashlib.sha256(lines[-1]).hexdigest())
    forged: Record = RowOpened(row_index=7, row_key="x", case_key="x")
    _, data = chain.line(forged, mono_ns=last.mono_ns + 1, wall_ns=last.wall_ns + 1)
    (tmp_path / "journal.jsonl").write_bytes(b"".join(line + b"\n" for line in lines) + data)
    report = replay(str(tmp_path))
    assert report.exit_code == 1 and report.differs
    assert any("follows the seal" in line for line in report.lines)
    assert report.unfinished is not None and "the journal is not sealed" in report.unfinished


def test_the_writer_refuses_to_append_after_its_seal(tmp_path: Path) -> None:
    from cache_family.actors.journal.writer import JournalWriter

    async def main() -> None:
        writer = JournalWriter(str(tmp_path / "journal.jsonl"))
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            await writer.append(RunStarted(run_id="r", request_sha256="1", catalog_sha256="2"))
            head = await writer.seal(matrix_status="completed", terminal_refusal=None)
            with pytest.raises(Refused) as refused:
                writer.append_nowait(RowOpened(row_index=0, row_key="x", case_key="x"))
            assert refused.value.codes == ["journal.sealed"]
            await writer.aclose()
        data = (tmp_path / "journal.jsonl").read_bytes()
        assert head == hashlib.sha256(data.splitlines()[-1]).hexdigest()

    trio.run(main)


# --- resume admission -------------------------------------------------------------------------


def test_resume_refuses_a_run_that_finished(tmp_path: Path) -> None:
    build_run(tmp_path)
    before = (tmp_path / "journal.jsonl").read_bytes()
    with pytest.raises(Refused) as refused:
        plan_resumption(str(tmp_path))
    assert refused.value.codes == ["run.resume.finished"]
    assert (tmp_path / "journal.jsonl").read_bytes() == before


def test_resume_refuses_while_the_runner_lives(tmp_path: Path) -> None:
    me = psutil.Process()
    started = RunStarted(
        run_id="r",
        request_sha256="1" * 64,
        catalog_sha256="2" * 64,
        runner_pid=me.pid,
        runner_create_time=me.create_time(),
    )
    (tmp_path / "journal.jsonl").write_bytes(encode_journal([started]))
    with pytest.raises(Refused) as refused:
        plan_resumption(str(tmp_path))
    assert refused.value.codes == ["replay.reap.run_alive"]
    assert not (tmp_path / "superseded").exists()


def test_resume_refuses_an_edited_journal(tmp_path: Path) -> None:
    build_run(tmp_path)
    lines = journal_lines(tmp_path)
    lines[3] = lines[3].replace(b'"wall_ns":', b'"wall_ns":1', 1)
    write_lines(tmp_path, lines[:-3])  # not sealed, but edited
    with pytest.raises(Refused) as refused:
        plan_resumption(str(tmp_path))
    assert refused.value.codes == ["journal.chain.broken"]


# --- a real run killed with SIGKILL, then resumed ----------------------------------------------


@pytest.mark.native
async def test_resume_after_sigkill_keeps_the_finished_row_and_replays_identically(
    native_parts: Parts, oracle_tools: Path, tmp_path: Path
) -> None:
    operator = operator_for(native_parts, oracle_tools, tmp_path, ["qwen3_dense", "llama"])
    # A longer ladder, so the kill lands while it is in flight even on a loaded machine.
    document = json.loads(operator.read_text())
    document["plan"]["concurrent_requests"] = 12
    operator.write_text(json.dumps(document))
    prepared_dir = tmp_path / "prepared"
    prepare = await trio.to_thread.run_sync(
        lambda: cli("prepare-full", "--input", str(operator), "--output", str(prepared_dir),
                    cwd=tmp_path)
    )  # fmt: skip
    assert prepare.returncode == 0, prepare.stderr
    out = tmp_path / "run"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    prepared = prepared_dir / "cache-family-input.json"
    process = await trio.lowlevel.open_process(
        [str(CLI), "run", "--input", str(prepared), "--output", str(out)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        # The second row's ladder host is up: the first row and the second row's serial cell
        # published their receipts, the ladder is in flight.
        ladder_host = await poll_journal_until(
            out,
            process,
            lambda r: isinstance(r, ChildSpawned) and r.cell_id == "cell-0001/native-concurrent",
        )
        assert isinstance(ladder_host, ChildSpawned)
        # Stopped first, so the orphan is certainly alive when resume looks: a running host
        # may die on its own once its runner is gone (its log pipe breaks), which is also
        # fine for the product but would leave nothing to reap.
        os.kill(ladder_host.pid, signal.SIGSTOP)
        process.kill()
        assert await wait_exit(process) == -signal.SIGKILL
    finally:
        if process.returncode is None:
            process.kill()
    assert not (out / MATRIX_FILENAME).exists()
    first_row = (out / "cell-0000" / "row.json").read_bytes()
    killed = replay(str(out))
    assert killed.unfinished is not None and not killed.differs

    resumed = await trio.to_thread.run_sync(
        lambda: subprocess.run(
            [str(CLI), "run", "--resume", str(out)],
            env=env, capture_output=True, text=True, timeout=600, check=False,
        )
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert "resume: keeping rows [0], re-running rows [1]" in resumed.stderr
    final, head = resumed.stdout.splitlines()
    assert final.startswith("completed: ")
    last_line = (out / "journal.jsonl").read_bytes().splitlines()[-1]
    assert head == f"journal head: sha256 {hashlib.sha256(last_line).hexdigest()}"

    [resume] = records(out, RunResumed)
    assert (resume.kept_rows, resume.rerun_rows) == ((0,), (1,))
    assert resume.moved == ("cell-0001",) and resume.superseded_dir == "superseded/attempt-1"
    # The reaped host of the killed row was the dead runner's.
    assert ladder_host.pid in resume.reaped_pids
    assert all(not psutil.pid_exists(p) for p in resume.reaped_pids)
    # The finished row was not launched again: one host per arm, one row_opened.
    launches = [c.cell_id for c in records(out, ChildSpawned) if c.role == "host"]
    assert sorted(c for c in launches if c and c.startswith("cell-0000/")) == [
        "cell-0000/native-concurrent",
        "cell-0000/native-serial",
    ]
    assert [r.row_index for r in records(out, RowOpened)].count(0) == 1
    assert [r.row_index for r in records(out, RowOpened)].count(1) == 2
    assert (out / "cell-0000" / "row.json").read_bytes() == first_row
    assert (out / "superseded" / "attempt-1" / "cell-0001").is_dir()

    report = replay(str(out))
    assert report.exit_code == 0, report.lines
    assert "superseded/attempt-1/cell-0001/native-serial/cell.json" in report.identical
    assert "cell-0001/row.json" in report.identical and MATRIX_FILENAME in report.identical
    matrix = json.loads((out / MATRIX_FILENAME).read_bytes())
    assert [r["result"]["status"] for r in matrix["rows"]] == ["completed", "completed"]
    assert len(json.loads((out / PRODUCTION_JSON).read_bytes())) == 2

    # A finished run is not resumed again.
    again = subprocess.run(
        [str(CLI), "run", "--resume", str(out)], env=env, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert again.returncode == 2 and "run.resume.finished" in again.stderr
    assert os.path.getsize(out / "journal.jsonl") == len((out / "journal.jsonl").read_bytes())


# --- a run stopped by SIGINT (sealed with its terminal refusal), then resumed ----------------


async def test_resume_after_sigint_continues_the_sealed_interrupted_run(tmp_path: Path) -> None:
    """The cancelled segment is sealed with ``cancelled``; resume may continue it: the row is
    re-run afresh (the old cancellation no longer applies), the old matrix and report files
    move aside, and replay checks both segments and both seals."""
    from run_harness import make_prepared
    from signal_harness import Fifo, behave, logs_dir, start_run

    prepared = make_prepared(tmp_path / "p")
    fifo = Fifo(tmp_path / "notify")
    behave(prepared, stream_delay=3600, notify_fifo=str(fifo.path))
    out = tmp_path / "out"
    process = await start_run(prepared, out, logs_dir(tmp_path))
    try:
        assert (await fifo.next_line()).startswith("stream ")
        process.send_signal(signal.SIGINT)
        assert await wait_exit(process) == 130
    finally:
        fifo.close()
        if process.returncode is None:
            process.kill()
    [seal] = records(out, JournalSealed)
    assert seal.terminal_refusal == "cancelled" and seal.matrix_status == "incomplete"
    old_matrix = (out / MATRIX_FILENAME).read_bytes()

    behave(prepared)  # the host answers at once this time
    resumed = await trio.to_thread.run_sync(
        lambda: subprocess.run(
            [str(CLI), "run", "--resume", str(out)],
            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
            capture_output=True, text=True, timeout=600, check=False,
        )
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    [resume] = records(out, RunResumed)
    # Row 0 is re-run; the others were journaled with their model missing, nothing to run.
    assert resume.rerun_rows == (0,) and 0 not in resume.kept_rows
    assert set(resume.moved) == {"cell-0000", MATRIX_FILENAME, PRODUCTION_JSON, PRODUCTION_MD}
    assert (out / resume.superseded_dir / MATRIX_FILENAME).read_bytes() == old_matrix
    matrix = json.loads((out / MATRIX_FILENAME).read_bytes())
    assert matrix["status"] == "completed" and matrix["terminal_refusal"] is None
    assert len(records(out, JournalSealed)) == 2
    report = replay(str(out))
    assert report.exit_code == 0, report.lines
    assert f"{resume.superseded_dir}/{MATRIX_FILENAME}" in report.identical


def test_replay_regenerates_the_run_report_written_into_the_run(tmp_path: Path) -> None:
    from cache_family.cli import main as cli_main

    build_run(tmp_path)
    assert cli_main(["report-run", str(tmp_path)]) == 0
    report = replay(str(tmp_path))
    assert report.exit_code == 0 and "report.md" in report.identical
    assert "report.html" in report.identical
    page = tmp_path / "report.md"
    page.write_bytes(page.read_bytes().replace(b"Run `", b"Run  `", 1))
    edited = replay(str(tmp_path))
    assert edited.exit_code == 1 and edited.mismatched == ["report.md"]


def test_the_run_command_takes_either_resume_or_input_and_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cache_family.cli import main as cli_main

    build_run(tmp_path)
    with pytest.raises(SystemExit) as both:
        cli_main(["run", "--resume", str(tmp_path), "--output", str(tmp_path / "x")])
    assert both.value.code == 2
    assert "refused: cli.usage at --resume: --resume continues a run" in capsys.readouterr().err
    with pytest.raises(SystemExit) as neither:
        cli_main(["run"])
    assert neither.value.code == 2
    assert "give --input and --output (or --resume RUN_DIR)" in capsys.readouterr().err
    # A finished run: refused through the command line too, nothing appended.
    before = (tmp_path / "journal.jsonl").read_bytes()
    assert cli_main(["run", "--resume", str(tmp_path)]) == 2
    assert "refused: run.resume.finished" in capsys.readouterr().err
    assert (tmp_path / "journal.jsonl").read_bytes() == before


def crashed_after_row_0(tmp_path: Path) -> Path:
    """A run of two rows (FAKE hosts) whose journal is cut right after row 0 finished, as a
    runner killed then leaves it; the dead runner is journaled without an identity."""
    from run_harness import FakeHostScript, make_prepared, run

    from cache_family.schemas.journal import ReceiptPublished, Transition

    prepared = make_prepared(tmp_path / "p", keys=("qwen3_dense", "llama"))
    out = tmp_path / "out"
    trio.run(run, prepared, out, FakeHostScript())
    lines = [decode_line(line) for line in journal_lines(out)]
    published = next(
        i
        for i, line in enumerate(lines)
        if isinstance(line.record, ReceiptPublished) and line.record.row_index == 0
    )
    done = lines[published + 1].record
    assert isinstance(done, Transition) and done.to_state == "done"
    chain = JournalChain()
    data = b""
    for line in lines[: published + 2]:
        record = line.record
        if isinstance(record, RunStarted):
            record = msgspec.structs.replace(record, runner_pid=None, runner_create_time=None)
        data += chain.line(record, mono_ns=line.mono_ns, wall_ns=line.wall_ns)[1]
    (out / "journal.jsonl").write_bytes(data)
    for name in (MATRIX_FILENAME, PRODUCTION_JSON, PRODUCTION_MD):
        (out / name).unlink()
    return out


def test_resume_keeps_a_completed_row_only_while_its_pins_verify(tmp_path: Path) -> None:
    out = crashed_after_row_0(tmp_path)
    _, resumption, notes = plan_resumption(str(out))
    assert resumption.record.kept_rows == (0,) and resumption.record.rerun_rows[0] == 1
    assert resumption.moves[0] == ("cell-0001", "superseded/attempt-1/cell-0001")
    assert any(note.startswith("resume: keeping rows [0]") for note in notes)
    # The server binary of the kept row's host profile changed since: the row is re-run.
    server = tmp_path / "p" / "tools" / "fake-llama-server"
    server.write_bytes(server.read_bytes() + b"\n# changed after the run\n")
    _, drifted, _ = plan_resumption(str(out))
    assert 0 in drifted.record.rerun_rows and 0 not in drifted.record.kept_rows
    assert drifted.record.detail == "pins changed for rows [0]; re-run"
    # Nothing was moved or appended while deciding.
    assert (out / "cell-0001").is_dir() and not (out / "superseded").exists()


# The run directory's one writer: a process that holds its lock until its stdin closes.
LOCK_HOLDER = (
    "import sys\n"
    "from cache_family.system.run_lock import run_lock\n"
    "with run_lock(sys.argv[1], what='test'):\n"
    "    print('held', flush=True)\n"
    "    sys.stdin.read()\n"
)


def test_a_second_writer_of_a_run_directory_is_refused_naming_the_holder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two resumes of one run must not both write it: while one process holds the run
    directory's lock, ``run --resume`` and ``replay --reap`` are refused with the holder's pid
    and change nothing; a holder killed with SIGKILL leaves no stale lock behind."""
    from cache_family.cli import main as cli_main
    from cache_family.system.run_lock import run_lock

    out = crashed_after_row_0(tmp_path)
    before = (out / "journal.jsonl").read_bytes()
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        assert cli_main(["run", "--resume", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"refused: run.locked at $.run_dir: {out} is in use by pid {holder.pid}" in err
        assert "run --resume: failed: the run cannot be resumed" in err
        with pytest.raises(Refused) as reaping:
            replay(str(out), reap=True, reap_grace_s=1)
        assert reaping.value.codes == ["run.locked"]
        assert (out / "journal.jsonl").read_bytes() == before
        assert not (out / "superseded").exists()
    finally:
        holder.kill()
        holder.wait()
    assert holder.returncode == -signal.SIGKILL
    with run_lock(str(out), what="test"):  # the killed holder's lock went with it
        assert (out / "run.lock").read_text() == f"{os.getpid()}\n"
