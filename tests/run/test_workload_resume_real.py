"""A real run of the zoo's llama with a sessions workload, stopped by SIGINT once its
sessions cell has journaled its workload's opening (the users think 3 s between turns, so the
signal lands among the turns), then resumed: the stopped cell journals the turns it sent and
names the stop, its ``workload.json`` is incomplete and replay identical; the resumed run
measures every turn once and replays identical, the stopped attempt's receipt included. Tiny
random-weight models: plumbing evidence, not performance claims."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import trio
from real_run_harness import CLI, cli, operator_for
from signal_harness import logs_dir, poll_journal_until, start_run, wait_exit

from cache_family.oracles.native_parts import Parts
from cache_family.schemas.journal import JournalSealed, RunResumed, read_journal
from cache_family.schemas.workload_records import (
    ReuseProbed,
    SessionsMeasured,
    WorkloadStopped,
    decode_workload_receipt,
)

pytestmark = pytest.mark.native

WORKLOADS = {
    "schema_version": 1,
    "multi_turn": {
        "users": 2,
        "turns": 2,
        "system_prompt_tokens": 16,
        "user_context_tokens": 8,
        "question_tokens": 4,
        "answer_tokens": 2,
        "think_time_ms": 3000,
        "seed": 3,
    },
}
SESSIONS = "cell-0000/workload-native-sessions/workload.json"


def records(out: Path, kind: type) -> list[object]:
    read = read_journal((out / "journal.jsonl").read_bytes())
    assert read.chain_break is None
    return [line.record for line in read.lines if isinstance(line.record, kind)]


async def test_a_sigint_mid_sessions_then_resume_measures_every_turn_once(
    native_parts: Parts, oracle_tools: Path, tmp_path: Path
) -> None:
    operator = operator_for(native_parts, oracle_tools, tmp_path, ["llama"])
    workloads = tmp_path / "workloads.json"
    workloads.write_text(json.dumps(WORKLOADS))
    prepared_dir = tmp_path / "prepared"
    prepare = await trio.to_thread.run_sync(
        lambda: cli("prepare-full", "--input", str(operator), "--output", str(prepared_dir),
                    "--workloads", str(workloads), cwd=tmp_path)
    )  # fmt: skip
    assert prepare.returncode == 0, prepare.stderr
    out = tmp_path / "run"
    process = await start_run(prepared_dir / "cache-family-input.json", out, logs_dir(tmp_path))
    try:
        # The workload's opening records (its plan, then its reuse probe) are durable at
        # once; the runner's next await after the probe is in its turns (the users think 3 s
        # between them), so the signal lands there. A signal before it is journaled too
        # (nothing sent), but then no turn record exists.
        await poll_journal_until(out, process, lambda r: isinstance(r, ReuseProbed))
        process.send_signal(signal.SIGINT)
        assert await wait_exit(process) == 130
    finally:
        if process.returncode is None:
            process.kill()
    [stopped] = records(out, WorkloadStopped)
    assert isinstance(stopped, WorkloadStopped) and stopped.reason == "cancelled"
    [measured] = records(out, SessionsMeasured)
    assert isinstance(measured, SessionsMeasured)
    assert len(measured.requests) == stopped.sent < 4
    receipt = decode_workload_receipt((out / SESSIONS).read_bytes())
    assert receipt.status == "incomplete"
    [seal] = records(out, JournalSealed)
    assert isinstance(seal, JournalSealed) and seal.terminal_refusal == "cancelled"
    first = await trio.to_thread.run_sync(lambda: cli("replay", str(out), cwd=tmp_path))
    assert first.returncode == 0, first.stdout

    resumed = await trio.to_thread.run_sync(
        lambda: subprocess.run(
            [str(CLI), "run", "--resume", str(out)],
            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
            capture_output=True, text=True, timeout=600, check=False,
        )
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    [resume] = records(out, RunResumed)
    assert isinstance(resume, RunResumed) and resume.rerun_rows == (0,)
    receipt = decode_workload_receipt((out / SESSIONS).read_bytes())
    assert receipt.status == "accepted" and receipt.sessions is not None
    assert [t.requests for t in receipt.sessions.by_turn] == [2, 2]
    for turn in receipt.sessions.by_turn[1:]:
        assert turn.achieved_reused_tokens == turn.expected_reused_tokens > 0, turn
    old = out / resume.superseded_dir / SESSIONS
    assert decode_workload_receipt(old.read_bytes()).status == "incomplete"
    replayed = await trio.to_thread.run_sync(lambda: cli("replay", str(out), cwd=tmp_path))
    assert replayed.returncode == 0, replayed.stdout
    assert SESSIONS in replayed.stdout
    assert f"{resume.superseded_dir}/{SESSIONS}" in replayed.stdout
