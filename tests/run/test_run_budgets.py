"""The run's budgets and downgrades, on trio's autojump clock with in-process FAKE hosts.

The supervisor, row and cell actors, the journal writer and the folds are all real; only the
host (an in-process fake llama HTTP endpoint standing in for custody's child process) and the
pin hasher (instant answers) are fakes, so a 15-minute cell budget costs no real time. Every
test checks what the journal and the published receipts say, never internal flags.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import signal
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from fake_hosts.fake_correctness_tool import FAKE_PROMPT
from fake_hosts.fake_custody import FakeHostScript, fake_child_runner, fake_opener, hasher
from fake_hosts.fake_llama_http import Reply
from run_harness import (  # noqa: F401
    CONCURRENT,
    FAKE_CORRECTNESS,
    FAKE_SERVER,
    HERE,
    SERIAL,
    _SilentEvents,
    autojump_clock,
    cell,
    fake_server_launcher,
    journal,
    make_prepared,
    matrix,
    records,
    row,
    run,
    synthetic_catalog,
)

from cache_family.actors.audit.replay import replay
from cache_family.actors.journal.writer import JournalWriter
from cache_family.actors.run import custody
from cache_family.actors.run.context import HostSettings, RunStop, hash_pins
from cache_family.actors.run.matrix import (
    RUN_INPUT_MAX_BYTES,
    MatrixOutcome,
    admit_run,
    check_interrupt_finish,
    final_line,
    is_interrupt,
    make_fresh_dir,
    supervise,
)
from cache_family.console.progress import (
    JsonRunProgress,
    RichRunProgress,
    RunProgress,
    choose_mode,
    run_progress_for,
)
from cache_family.errors import Refused
from cache_family.schemas import request_rows
from cache_family.schemas.bounded import MIB
from cache_family.schemas.catalog import packaged_catalog
from cache_family.schemas.journal import (
    Cancellation,
    CellOpened,
    ChildSpawned,
    CleanupOutcome,
    DeadlineExpired,
    Fault,
    InterruptFinishFailed,
    JournalChain,
    RowOpened,
    RungCompleted,
    RungRows,
    RunStarted,
    Transition,
    WarmupExclusion,
    read_journal,
)
from cache_family.schemas.matrix import (
    MATRIX_FILENAME,
    MATRIX_SCOPE,
    MATRIX_SCOPE_SYNTHETIC,
    MatrixCatalog,
)
from cache_family.schemas.measurement import RequestRow
from cache_family.schemas.prepared import (
    PREPARED_INPUT_MAX_BYTES,
)
from cache_family.schemas.receipts import (
    REAL_EVIDENCE_PREFIX,
    SYNTHETIC_EVIDENCE_CLASS,
    decode_row_receipt,
)
from cache_family.states.budgets import Budgets
from cache_family.states.fold import JournalIndex
from cache_family.states.handoff import RUNTIME_SLICE_TOPOLOGIES
from cache_family.states.matrix import fold_matrix
from cache_family.states.plans import PinTarget
from cache_family.system.pins import Budget, pin_tree

# --- a prepared input with one present row (qwen3_dense, first in catalog order) ---------


# --- fakes ------------------------------------------------------------------------------------


def rows_file(out: Path, name: str) -> list[RequestRow]:
    """The rows a cell's load runs wrote to its rows file, in the order they ended."""
    data = (out / "cell-0000" / name / request_rows.REQUESTS_FILENAME).read_bytes()
    return [line.row for line in request_rows.DECODER.decode_lines(data)]


def transitions(out: Path, cell_id: str) -> list[tuple[str, str, str]]:
    return [
        (t.from_state, t.event, t.to_state)
        for t in records(out, Transition)
        if t.machine == "cell" and t.cell_id == cell_id
    ]


# --- budgets ------------------------------------------------------------------------------------


async def test_pins_are_rehashed_together_and_each_result_names_its_own_problem(
    tmp_path: Path,
) -> None:
    """The real hasher: files through pins' one pool, trees after; one unreadable target
    gets its own problem while the others are still observed, in the targets' order."""
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "a").write_bytes(b"a")
    (tmp_path / "model").write_bytes(b"weights")
    model_sha = hashlib.sha256(b"weights").hexdigest()
    tree_sha = pin_tree(str(tmp_path / "tree"), Budget.seconds(10)).sha256
    targets = [
        PinTarget("model", str(tmp_path / "model"), model_sha, "file"),
        PinTarget("native_build", str(tmp_path / "tree"), tree_sha, "tree"),
        PinTarget("binary", str(tmp_path / "gone"), "0" * 64, "file"),
        PinTarget("shard:2", str(tmp_path / "model"), "1" * 64, "file"),
    ]
    results = await hash_pins(targets, 10.0)
    assert [r.target.name for r in results] == ["model", "native_build", "binary", "shard:2"]
    assert [r.matches for r in results] == [True, True, False, False]
    assert results[2].observed_sha256 is None and "gone" in results[2].problem
    assert results[3].observed_sha256 == model_sha  # read, and differs from its pin
    everything_readable = await hash_pins([targets[0], targets[1], targets[3]], 10.0)
    assert [r.observed_sha256 for r in everything_readable] == [model_sha, tree_sha, model_sha]


def test_budgets_only_shrink() -> None:
    budgets = Budgets(run_deadline=100.0, cell_seconds=30.0, request_timeout_ms=5000)
    assert budgets.cell_deadline(now=10.0) == 40.0
    assert budgets.cell_deadline(now=90.0) == 100.0  # never past the run's deadline
    assert Budgets.request_deadline(40.0, started=20.0, request_timeout_ms=5000) == 25.0
    assert Budgets.request_deadline(40.0, started=38.0, request_timeout_ms=5000) == 40.0
    assert Budgets.startup_seconds(40.0, now=35.0, profile_startup=886) == 5.0
    assert Budgets.startup_seconds(40.0, now=10.0, profile_startup=12) == 12
    stop = RunStop(run_deadline=100.0)
    assert stop.classify(cell_deadline=40.0, now=41.0) == "cell"
    assert stop.classify(cell_deadline=100.0, now=100.0) == "execution"
    stop.signal_name = "SIGTERM"
    assert stop.classify(cell_deadline=40.0, now=41.0) == "cancelled"


async def test_the_warmup_state_sends_the_excluded_request_and_the_ladder_the_measured_ones(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    out = tmp_path / "out"
    await run(make_prepared(tmp_path / "p"), out, FakeHostScript())
    order: list[str] = []
    for line in journal(out):
        record = line.record
        if isinstance(record, WarmupExclusion) and record.cell_id == SERIAL:
            order.append("warmup rule")
        elif isinstance(record, RungRows) and record.cell_id == SERIAL:
            order.append(f"rows {record.first_line}+{record.count}")
        elif isinstance(record, Transition) and record.cell_id == SERIAL:
            order.append(f"{record.from_state} -> {record.to_state}")
    start = order.index("launch -> warmup")
    assert order[start : start + 6] == [
        "launch -> warmup",
        "warmup rule",
        "rows 0+1",  # request 0, journaled by the warmup state
        "warmup -> ladder",
        "rows 1+2",
        "ladder -> post-verify",
    ]
    rows = [(r.request_id, r.excluded_warmup) for r in rows_file(out, "native-serial")]
    assert rows == [(0, True), (1, False), (2, False)]
    serial = cell(out, "native-serial").measurement.rungs[0]
    assert [r.request_id for r in serial.rows] == [0, 1, 2]
    assert serial.warmup_excluded_ids == (0,) and serial.serial_summary.excluded_runs == 1


async def test_a_complete_run_measures_both_arms_and_replays(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    script = FakeHostScript()
    outcome = await run(make_prepared(tmp_path / "p", llama_parallel=2), tmp_path / "out", script)
    out = tmp_path / "out"
    assert outcome.status == "completed" and not outcome.interrupted
    assert script.launched == ["native-serial", "sweep-native-concurrent"]  # one host per arm
    serial, concurrent = cell(out, "native-serial"), cell(out, "sweep-native-concurrent")
    assert (serial.status, concurrent.status) == ("completed", "completed")
    assert serial.measurement.rungs[0].warmup_excluded_ids == (0,)
    assert [r.concurrency for r in concurrent.measurement.rungs] == [1, 2]
    assert all(r.host_retained for r in concurrent.measurement.rungs)
    assert row(out).status == "completed"
    # The correctness arm ran first, one FAKE tool child per planned topology, all passed.
    checked = row(out).correctness
    assert checked.status == "completed" and checked.reason is None
    assert checked.planned_topologies == RUNTIME_SLICE_TOPOLOGIES
    assert [(t.topology, t.status) for t in checked.topologies] == [
        (name, "pass") for name in RUNTIME_SLICE_TOPOLOGIES
    ]
    assert checked.topologies[0].evidence_dir == "cell-0000/correctness/topology-00"
    assert checked.topologies[0].cache_hit_total_ms == 0.75 and checked.suffix_prefill_matches
    prompt_sha = hashlib.sha256(FAKE_PROMPT.encode()).hexdigest()
    assert checked.prompt_sha256 == prompt_sha
    evidence = out / "cell-0000" / "correctness" / "topology-03"
    assert {p.name for p in evidence.iterdir()} == {
        "state-handoff.json",
        "process.json",
        "child.stdout.log",
        "child.stderr.log",
    }
    # The accepted text drives every request of the row, and never appears in a receipt.
    assert {w.prompt_sha256 for w in records(out, WarmupExclusion)} == {prompt_sha}
    for receipt_path in out.rglob("*.json"):
        if receipt_path.name not in ("state-handoff.json",):
            assert FAKE_PROMPT not in receipt_path.read_text(), receipt_path
    assert FAKE_PROMPT not in (out / "journal.jsonl").read_text()
    argv = script.argv[0]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and "--no-webui" in argv
    assert argv[argv.index("-t") + 1] == "2"  # the operator's OMP_NUM_THREADS
    # Two slots, each with the row's whole context (llama-server divides --ctx-size by slots).
    assert argv[argv.index("--parallel") + 1] == "2"
    assert argv[argv.index("--ctx-size") + 1] == str(2 * 512)
    assert script.env[0]["HOME"].startswith(str(out / "cell-0000" / "native-serial"))
    assert "LLAMA_STAGE_BUILD_DIR" in script.env[0]
    # What the actors journal is typed by the reader (no field dropped); each child's
    # effective environment is recorded, device ids redacted.
    spawned = [s for s in records(out, ChildSpawned) if s.role == "host"]
    assert [list(s.host_argv) for s in spawned] == script.argv
    assert [s.host_env_names for s in spawned] == [tuple(sorted(env)) for env in script.env]
    assert [s.effective_environment for s in spawned] == [
        custody.recorded_environment(env) for env in script.env
    ]
    assert {s.host_threads for s in spawned} == {"2"}
    tools = [s for s in records(out, ChildSpawned) if s.role == "correctness"]
    assert len(tools) == 4 and {s.cell_id for s in tools} == {"cell-0000/correctness"}
    assert all("LLAMA_STAGE_BUILD_DIR" in (s.effective_environment or {}) for s in tools)
    assert script.env[0]["LLAMA_STAGE_BACKEND"] == "cpu"
    warmups = records(out, WarmupExclusion)
    assert {w.prompt_source for w in warmups} == {"correctness-benchmark-prompt"}
    assert len({w.prompt_sha256 for w in warmups}) == 1 and warmups[0].prompt_tokens
    opened = records(out, RowOpened)
    assert (opened[0].model_status, opened[0].correctness_status) == ("present", "not-run")
    assert opened[0].correctness_reason == "correctness_not_started"
    assert {r.correctness_reason for r in opened[1:]} == {"missing-model"}
    [started] = records(out, RunStarted)
    budgets = (started.execution_seconds, started.cell_seconds, started.request_timeout_ms)
    assert budgets == (7200, 900, 120_000)  # hub_fixture's operator budgets
    assert started.operator_threads == "2"
    assert started.input_path == str(tmp_path / "p" / "cache-family-input.json")
    assert [(p.index, p.case) for p in started.planned_rows] == [
        (r.row_index, r.case_key) for r in opened
    ]
    # The packaged catalog: recorded as such, nothing is labelled synthetic, and every
    # receipt names what its figures are: the model, the host's CPU, threads and load.
    assert (started.catalog_packaged, started.catalog_synthetic) == (True, False)
    assert started.catalog_sha256 == packaged_catalog().sha256
    assert started.host is not None and started.load_average is not None
    for receipt in (serial, concurrent, row(out)):
        assert not receipt.synthetic and receipt.evidence_class is not None
        assert receipt.evidence_class.startswith(REAL_EVIDENCE_PREFIX)
        assert ", 2 threads, 1-min load average " in receipt.evidence_class
    assert matrix(out).scope == MATRIX_SCOPE
    assert matrix(out).catalog == MatrixCatalog(
        path=started.catalog_path,
        sha256=packaged_catalog().sha256,
        synthetic=False,
        packaged=True,
    )
    entries = matrix(out).rows
    assert not any(e.synthetic for e in entries)
    assert entries[0].result.status == "completed"
    assert entries[0].result.evidence == "cell-0000/row.json"
    assert {e.result.status for e in entries[1:]} == {"missing-model"}
    assert not (out / "cell-0001").exists()  # missing models get no directory
    verdict = replay(str(out))
    assert verdict.exit_code == 0 and MATRIX_FILENAME in verdict.identical
    # The matrix is re-folded from the journal: an edited copy no longer replays.
    published = (out / MATRIX_FILENAME).read_bytes()
    (out / MATRIX_FILENAME).write_bytes(published.replace(b'"completed"', b'"incomplete"', 1))
    edited = replay(str(out))
    assert edited.exit_code == 1 and edited.mismatched == [MATRIX_FILENAME]


async def test_a_published_row_leaves_the_writers_index_and_the_matrix_still_folds_it(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a row's row.json is published its lines leave the live index (memory stays bounded
    over a long run); the matrix is folded from the journal file, so it still sees every row."""
    writers: list[JournalWriter] = []
    monkeypatch.setattr(
        "cache_family.actors.run.matrix.JournalWriter",
        lambda path, **options: writers.append(JournalWriter(path, **options)) or writers[-1],
    )
    out = tmp_path / "out"
    prepared = make_prepared(tmp_path / "p", keys=("qwen3_dense", "llama"))
    outcome = await run(prepared, out, FakeHostScript())
    assert outcome.status == "completed"
    measured = [r for r in matrix(out).rows if r.result.status == "completed"]
    assert [r.case for r in measured] == ["qwen3_dense", "llama"]
    [writer] = writers
    index = writer.index
    assert index.cell_ids() == []  # every cell's lines were dropped with its row
    assert not {r.index for r in measured} & set(index.row_indices())
    read = read_journal((out / "journal.jsonl").read_bytes())
    assert index.last_seq == read.last_seq  # the index did see every line
    # Two rows, each with two arms and its correctness arm's scope (tool children, pins).
    assert len(JournalIndex(read.lines).cell_ids()) == 6
    assert replay(str(out)).exit_code == 0


async def test_a_hanging_request_is_cut_at_the_cell_deadline(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """request timeout (600 s) > cell budget (15 s): the cell deadline ends the request."""

    def hang_in_ladder(index: int, body: dict[str, Any]) -> Reply:
        return Reply(behaviour="hang") if body.get("stream") else Reply(first_token_delay=0.01)

    script = FakeHostScript(reply=hang_in_ladder)
    prepared = make_prepared(
        tmp_path / "p", top={"cell_seconds": 15, "request_timeout_ms": 600_000}
    )
    out = tmp_path / "out"
    started = trio.current_time()
    outcome = await run(prepared, out, script)
    concurrent = cell(out, "sweep-native-concurrent")
    assert concurrent.status == "incomplete" and concurrent.terminal_refusal == "deadline_expired"
    expiry = [r for r in records(out, DeadlineExpired) if r.cell_id == CONCURRENT]
    assert [r.budget for r in expiry] == ["cell"]
    cut = rows_file(out, "sweep-native-concurrent")
    assert [r.status for r in cut] == ["incomplete", "not-launched"]  # concurrency 1
    assert cut[0].elapsed_ms is not None and 12_000 <= cut[0].elapsed_ms <= 15_000
    assert "the cell budget" in (cut[0].error or "")
    # Serial arm finished first and keeps its verdict; the run itself was not out of time.
    assert cell(out, "native-serial").status == "completed"
    assert trio.current_time() - started < 60
    assert outcome.status == "incomplete" and matrix(out).terminal_refusal is None
    assert ("ladder", "deadline-expired", "cleanup") in transitions(out, CONCURRENT)
    assert cell(out, "sweep-native-concurrent").cleanup.clean  # cleanup still ran
    assert replay(str(out)).exit_code == 0


async def test_a_request_timeout_shorter_than_the_cell_faults_only_that_cell(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    script = FakeHostScript(
        reply=lambda i, b: Reply(behaviour="hang") if b.get("stream") else Reply(0.01)
    )
    prepared = make_prepared(tmp_path / "p", top={"cell_seconds": 900, "request_timeout_ms": 1500})
    out = tmp_path / "out"
    outcome = await run(prepared, out, script)
    concurrent = cell(out, "sweep-native-concurrent")
    assert concurrent.status == "incomplete" and concurrent.terminal_refusal is None
    assert [f.kind for f in concurrent.faults][:1] == ["request_timeout"]
    cut = rows_file(out, "sweep-native-concurrent")
    assert {r.status for r in cut} <= {"incomplete", "not-launched"}
    assert all(
        r.elapsed_ms is None or 1500 <= r.elapsed_ms < 1600
        for r in cut
        if r.status != "not-launched"
    )
    assert "its own timeout" in (cut[0].error or "")
    assert records(out, DeadlineExpired) == []
    assert outcome.status == "incomplete"


async def test_the_execution_deadline_downgrades_every_level_and_stops_later_rows(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    script = FakeHostScript(reply=lambda i, b: Reply(behaviour="hang"))
    prepared = make_prepared(
        tmp_path / "p",
        keys=("qwen3_dense", "llama"),
        top={"execution_seconds": 30, "cell_seconds": 900, "request_timeout_ms": 600_000},
    )
    out = tmp_path / "out"
    started = trio.current_time()
    outcome = await run(prepared, out, script)
    assert 30 <= trio.current_time() - started < 45  # cleanup is bounded
    run_wide = [r for r in records(out, DeadlineExpired) if r.cell_id is None]
    assert [r.budget for r in run_wide] == ["execution"]
    serial = cell(out, "native-serial")
    assert serial.status == "incomplete" and serial.terminal_refusal == "deadline_expired"
    assert serial.cleanup is not None and serial.cleanup.clean
    receipt = matrix(out)
    assert receipt.status == "incomplete" and receipt.terminal_refusal == "deadline_expired"
    assert row(out).status == "incomplete" and row(out).terminal_refusal == "deadline_expired"
    second = receipt.rows[1]  # llama: never reached, kept without launch
    assert (second.case, second.result.status) == ("llama", "not-launched")
    assert second.result.reason == "cancellation_or_deadline"
    assert not (out / "cell-0001").exists()
    assert script.launched == ["native-serial"]
    assert outcome.status == "incomplete" and not outcome.interrupted
    assert replay(str(out)).exit_code == 0


async def test_a_signal_cancels_the_run_and_downgrades_every_receipt(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    arrived = trio.Event()

    def hang_and_tell(index: int, body: dict[str, Any]) -> Reply:
        if body.get("stream"):
            arrived.set()
            return Reply(behaviour="hang")
        return Reply(first_token_delay=0.01)

    script = FakeHostScript(reply=hang_and_tell)
    prepared = make_prepared(tmp_path / "p")
    out = tmp_path / "out"

    async def signal_when_hanging() -> None:
        await arrived.wait()
        os.kill(os.getpid(), signal.SIGTERM)  # caught by the run's signal receiver

    async with trio.open_nursery() as nursery:
        nursery.start_soon(signal_when_hanging)
        outcome = await run(prepared, out, script)
    assert outcome.interrupted and outcome.status == "incomplete"
    run_wide = [r for r in records(out, Cancellation) if r.cell_id is None]
    assert [r.signal for r in run_wide] == ["SIGTERM"]
    concurrent = cell(out, "sweep-native-concurrent")
    assert concurrent.status == "incomplete" and concurrent.terminal_refusal == "cancelled"
    assert concurrent.cleanup is not None and concurrent.cleanup.clean
    # The rung's roster survives the cancellation: every planned id, none lost.
    rung = concurrent.measurement.rungs[0]
    assert [r.request_id for r in rung.rows] == [0, 1] and rung.status == "incomplete"
    # Nothing already written is erased or raised: the serial cell stays completed.
    assert cell(out, "native-serial").status == "completed"
    assert row(out).status == "incomplete" and row(out).terminal_refusal == "cancelled"
    assert matrix(out).terminal_refusal == "cancelled"
    assert script.cleaned == script.launched
    assert replay(str(out)).exit_code == 0


async def test_a_host_that_exits_on_the_signal_mid_ladder_is_not_a_changed_identity(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The FAKE host exits (as on the operator's SIGINT) before the signal reaches the run, so
    the rung's identity re-check always runs after the exit: an exit, not a swap."""
    script = FakeHostScript()
    arrived = trio.Event()

    def exit_and_tell(index: int, body: dict[str, Any]) -> Reply:
        if body.get("stream"):
            script.exited = True
            arrived.set()
            return Reply(behaviour="hang")
        return Reply(first_token_delay=0.01)

    script.reply = exit_and_tell
    out = tmp_path / "out"

    async def signal_when_exited() -> None:
        await arrived.wait()
        os.kill(os.getpid(), signal.SIGINT)  # caught by the run's signal receiver

    async with trio.open_nursery() as nursery:
        nursery.start_soon(signal_when_exited)
        outcome = await run(make_prepared(tmp_path / "p"), out, script)
    assert outcome.interrupted
    concurrent = cell(out, "sweep-native-concurrent")
    assert concurrent.terminal_refusal == "cancelled"
    assert "host_identity_changed" not in [f.kind for f in concurrent.faults]
    [rung] = [r for r in records(out, RungCompleted) if r.cell_id == CONCURRENT]
    assert rung.host_create_time is not None and rung.status == "incomplete"
    assert replay(str(out)).exit_code == 0


async def test_a_host_gone_before_the_next_rung_is_an_exit_not_a_changed_identity(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    script = FakeHostScript()

    def exit_after_answering(index: int, body: dict[str, Any]) -> Reply:
        if body.get("stream"):
            script.exited = True  # the FAKE host exits once it answered the ladder's request
        return Reply(first_token_delay=0.01)

    script.reply = exit_after_answering
    out = tmp_path / "out"
    await run(make_prepared(tmp_path / "p"), out, script)
    concurrent = cell(out, "sweep-native-concurrent")
    assert [f.kind for f in concurrent.faults] == ["child_exited"]
    assert concurrent.status != "completed"
    assert replay(str(out)).exit_code == 0


async def test_a_cells_transition_is_on_disk_before_its_host_is_started_or_ended(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Transitions into warmup, finalize and done share the next fsync (the cell table's
    ``fsync`` column); the ones a process start or end follows never wait for one."""
    script = FakeHostScript()
    out = tmp_path / "out"
    inner = fake_opener(script)
    seen: list[tuple[str, str, str]] = []

    def last_state_on_disk(cell_id: str) -> str:
        lines = read_journal((out / "journal.jsonl").read_bytes()).lines
        states = [
            line.record.to_state
            for line in lines
            if isinstance(line.record, Transition) and line.record.cell_id == cell_id
        ]
        return states[-1] if states else "(none)"

    @contextlib.asynccontextmanager
    async def opener(config: custody.HostConfig, observe: Any) -> Any:
        cell_id = config.process_tag.split("/", 1)[1]
        async with inner(config, observe) as host:
            launch, cleanup = host.launch, host.cleanup

            async def launch_seen(argv: Sequence[str], env: Any) -> Any:
                seen.append((cell_id, "launch", last_state_on_disk(cell_id)))
                return await launch(argv, env)

            async def cleanup_seen() -> Any:
                seen.append((cell_id, "cleanup", last_state_on_disk(cell_id)))
                return await cleanup()

            host.launch, host.cleanup = launch_seen, cleanup_seen
            yield host

    await run(make_prepared(tmp_path / "p"), out, script, host_opener=opener)
    assert seen == [
        (SERIAL, "launch", "launch"),
        (SERIAL, "cleanup", "cleanup"),
        (CONCURRENT, "launch", "launch"),
        (CONCURRENT, "cleanup", "cleanup"),
    ]
    assert cell(out, "sweep-native-concurrent").status == "completed"
    assert replay(str(out)).exit_code == 0


# --- custody faults keep observations -------------------------------------------------------------


async def test_pin_drift_before_launch_launches_nothing(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    script = FakeHostScript()
    out = tmp_path / "out"
    # Call 0: the correctness arm's pins; call 1: the serial cell's pins before launch;
    # call 2: the concurrent cell's.
    pins = hasher({1: "model", 2: "native_build"})
    await run(make_prepared(tmp_path / "p"), out, script, pins=pins)
    serial = cell(out, "native-serial")
    assert serial.status == "failed" and serial.host is None
    assert serial.lifecycle == ("pin-verify", "not-launched", "finalize")
    assert [p.name for p in serial.before_identity if not p.matches] == ["model"]
    concurrent = cell(out, "sweep-native-concurrent")
    assert [p.name for p in concurrent.before_identity if not p.matches] == ["native_build"]
    assert script.launched == [] and script.cleaned == []  # nothing launched, nothing ended
    assert records(out, RungRows) == []
    assert not list(out.glob("cell-0000/*/requests.jsonl"))
    # Nothing was ended, so the receipts claim no cleanup at all.
    assert serial.cleanup is None and concurrent.cleanup is None
    assert records(out, CleanupOutcome) == []


async def test_post_run_drift_and_forced_kill_keep_measurements_but_mark_incomplete(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    script = FakeHostScript(forced_cleanup=True)
    out = tmp_path / "out"
    # Call 0 is the correctness arm's, call 2 the serial cell's post-verify.
    await run(make_prepared(tmp_path / "p"), out, script, pins=hasher({2: "binary"}))
    serial = cell(out, "native-serial")
    assert serial.status == "incomplete" and serial.pins_drifted
    assert not serial.accepted_for_parity
    assert serial.measurement.rungs[0].serial_summary is not None  # measurements kept
    assert {f.kind for f in serial.faults} >= {"pin_drift", "cleanup_forced"}
    assert serial.terminal_refusal is None
    assert row(out).status == "incomplete"


@pytest.mark.parametrize(
    ("findings", "kind"),
    [
        ({"capture_truncated": True, "oversized_lines": 1}, "capture_truncated"),
        ({"escaped_descendants": (40999,)}, "cleanup_unclean"),
    ],
)
async def test_custody_findings_at_cleanup_mark_the_cell_incomplete_and_refuse_parity(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
    findings: dict[str, Any],
    kind: str,
) -> None:
    script = FakeHostScript(cleanup_findings=findings)
    out = tmp_path / "out"
    outcome = await run(make_prepared(tmp_path / "p"), out, script)
    outcomes = {r.cell_id: r for r in records(out, CleanupOutcome)}
    for cell_id, name in ((SERIAL, "native-serial"), (CONCURRENT, "sweep-native-concurrent")):
        journaled = outcomes[cell_id]
        for field_name, value in findings.items():
            assert getattr(journaled.cleanup, field_name) == value  # the journal holds it
        receipt = cell(out, name)
        assert receipt.status == "incomplete" and not receipt.accepted_for_parity
        assert [f.kind for f in receipt.faults] == [kind]  # once, from the cleanup record
        assert receipt.cleanup is not None and not receipt.cleanup.clean
        assert receipt.measurement.complete  # observations kept
    assert records(out, Fault) == []  # the fold, not the actor, judges the cleanup
    assert row(out).status == "incomplete" and outcome.status == "incomplete"
    assert replay(str(out)).exit_code == 0


async def test_a_host_that_changes_between_rungs_is_a_fault(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # Each host answers "same" twice: before rung 0 and when rung 0 is journaled; the
    # concurrent ladder's check before rung 1 then sees a different process.
    script = FakeHostScript(identity_lasts=2)
    out = tmp_path / "out"
    await run(make_prepared(tmp_path / "p"), out, script)
    concurrent = cell(out, "sweep-native-concurrent")
    assert concurrent.status == "incomplete"
    assert [f.kind for f in concurrent.faults] == ["host_identity_changed"]
    completed = records(out, RungCompleted)
    assert [(r.cell_id, r.rung_index) for r in completed] == [(SERIAL, 0), (CONCURRENT, 0)]
    assert cell(out, "native-serial").status == "completed"


async def test_a_busy_port_refuses_before_anything_is_launched(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    port = blocker.getsockname()[1]
    out = tmp_path / "out"
    try:
        # Real host custody: its reservation is refused, so the fake binary never runs.
        await run(
            make_prepared(tmp_path / "p"),
            out,
            FakeHostScript(),
            # The seam pins the port that custody reserves to the one held busy here.
            host_opener=lambda config, observe: custody.host_custody(
                dataclasses.replace(config, port=port), observe
            ),
        )
    finally:
        blocker.close()
    serial = cell(out, "native-serial")
    assert serial.status == "failed" and serial.host is None
    assert [f.kind for f in serial.faults] == ["port_busy"]
    assert records(out, Fault)[0].kind == "port_busy"
    # Nothing was launched, so nothing was ended: no cleanup is claimed.
    assert serial.lifecycle == ("pin-verify", "not-launched", "finalize")
    assert serial.cleanup is None
    assert [r for r in records(out, CleanupOutcome) if r.cell_id == SERIAL] == []
    assert not list((out / "cell-0000" / "native-serial").glob("*-state-*"))


async def test_readiness_failure_is_failed_and_bounded_by_the_cell(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    script = FakeHostScript(never_ready=True)
    prepared = make_prepared(tmp_path / "p", top={"cell_seconds": 20})
    out = tmp_path / "out"
    started = trio.current_time()
    await run(prepared, out, script)
    serial = cell(out, "native-serial")
    assert serial.status == "failed" and not serial.readiness.ready
    assert [f.kind for f in serial.faults] == ["readiness_failed"]
    assert trio.current_time() - started <= 2 * 20 + 1  # two cells, each within its budget


async def test_without_a_native_profile_the_planned_arms_fail_without_launching(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    script = FakeHostScript()
    out = tmp_path / "out"
    outcome = await run(make_prepared(tmp_path / "p", top={"native_server": None}), out, script)
    assert script.launched == []
    for name in ("native-serial", "sweep-native-concurrent"):
        receipt = cell(out, name)
        assert receipt.status == "failed" and [f.kind for f in receipt.faults] == [
            "profile_refused"
        ]
    assert row(out).status == "failed" and outcome.status == "failed"


async def test_a_failed_interrupt_finish_downgrades_the_matrix(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    out = tmp_path / "out"
    await run(make_prepared(tmp_path / "p"), out, FakeHostScript())
    read = read_journal((out / "journal.jsonl").read_bytes())
    assert fold_matrix(JournalIndex(read.lines), through_seq=read.last_seq).status == "completed"
    chain = JournalChain(next_seq=read.last_seq + 1, prev=read.line_sha256s[-1])
    extra, _ = chain.line(InterruptFinishFailed(detail="handlers"), mono_ns=0, wall_ns=0)
    receipt = fold_matrix(JournalIndex((*read.lines, extra)), through_seq=extra.seq)
    assert receipt.status == "incomplete"
    assert receipt.terminal_refusal == "interrupt_finish_failed"
    assert receipt.rows[0].result.status == "completed"  # the row's own receipt is kept


async def supervise_fake(admitted: Any, script: FakeHostScript) -> MatrixOutcome:
    hosts = HostSettings(
        host_opener=fake_opener(script),
        pin_hasher=hasher(),
        row_pins=None,
        child_runner=fake_child_runner(),
    )
    return await supervise(admitted, hosts, RunProgress(io.StringIO(), len(admitted.prepared.rows)))


async def test_the_interrupt_finish_check_runs_before_the_fold_and_downgrades_the_matrix(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    admitted = admit_run(str(make_prepared(tmp_path / "p")), str(tmp_path / "out"))
    os.mkdir(admitted.output)
    seen: list[dict[int, Any]] = []
    real_verdicts: list[str | None] = []

    def handlers_cannot_be_restored(originals: Any) -> str:
        seen.append(dict(originals))
        # While the run holds the signals the real check finds nothing wrong.
        real_verdicts.append(check_interrupt_finish(originals))
        return "SIGTERM's previous handler cannot be put back"

    monkeypatch.setattr(
        "cache_family.actors.run.matrix.check_interrupt_finish", handlers_cannot_be_restored
    )
    outcome = await supervise_fake(admitted, FakeHostScript())
    out = Path(admitted.output)
    assert [sorted(s) for s in seen] == [sorted((signal.SIGINT, signal.SIGTERM))]
    assert real_verdicts == [None]
    failed = records(out, InterruptFinishFailed)
    assert [f.detail for f in failed] == ["SIGTERM's previous handler cannot be put back"]
    received = matrix(out)
    assert (
        received.status == "incomplete" and received.terminal_refusal == "interrupt_finish_failed"
    )
    assert received.rows[0].result.status == "completed"  # the row's own receipt is kept
    assert outcome.status == "incomplete" and not outcome.interrupted
    finished_at = next(
        line.seq for line in journal(out) if isinstance(line.record, InterruptFinishFailed)
    )
    assert received.journal_through_seq >= finished_at
    assert replay(str(out)).exit_code == 0
    # Handlers are back after the run.
    assert signal.getsignal(signal.SIGTERM) == seen[0][signal.SIGTERM]


def test_the_interrupt_finish_check_outside_the_runs_receiver_fails() -> None:
    originals = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    # Nothing turns the signals into cancellation here: the run's handlers are gone.
    problem = check_interrupt_finish(originals)
    assert problem is not None and "SIGINT is no longer turned into cancellation" in problem
    assert "SIGTERM is no longer turned into cancellation" in problem
    unrestorable = check_interrupt_finish({signal.SIGTERM: None})
    assert unrestorable is not None and "not set from Python" in unrestorable


async def test_a_fold_that_fails_still_publishes_the_failed_matrix(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    admitted = admit_run(str(make_prepared(tmp_path / "p")), str(tmp_path / "out"))
    os.mkdir(admitted.output)

    def fold_interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt  # what Python's default SIGINT handler would raise

    monkeypatch.setattr("cache_family.actors.run.matrix.fold_matrix", fold_interrupted)
    with pytest.raises(BaseException) as raised:
        await supervise_fake(admitted, FakeHostScript())
    assert is_interrupt(raised.value)  # re-raised, after the fallback was written
    failed = msgspec.json.decode((Path(admitted.output) / MATRIX_FILENAME).read_bytes())
    assert failed["status"] == "failed"
    assert failed["request_sha256"] == admitted.request_sha256
    assert "KeyboardInterrupt" in failed["detail"]


async def test_package_only_and_skipped_baselines_are_recorded_not_launched(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    script = FakeHostScript()
    out = tmp_path / "out"
    await run(make_prepared(tmp_path / "p", keys=("deepseek3",)), out, script)
    package = decode_row_receipt((out / "cell-0003" / "row.json").read_bytes())
    assert [(o.arm, o.status) for o in package.observations] == [
        ("native-serial", "unavailable"),
        ("native-concurrent", "unavailable"),
    ]
    assert package.status == "unmeasured" and script.launched == []
    assert not list((out / "cell-0003").glob("*/cell.json"))

    skipped_out = tmp_path / "skipped"
    prepared = make_prepared(tmp_path / "q", skip_llama_server=True)
    await run(prepared, skipped_out, script)
    skipped = row(skipped_out)
    assert {(o.status, o.reason) for o in skipped.observations} == {
        ("skipped", "skip_llama_server is set in the plan")
    }
    assert script.launched == [] and matrix(skipped_out).status == "completed"


# --- synthetic evidence and the input cap ---------------------------------------------------------


async def test_a_synthetic_catalog_is_labelled_from_the_journal_to_the_last_line(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    pinned = synthetic_catalog(tmp_path / "catalog")
    prepared = make_prepared(tmp_path / "p", catalog=pinned)
    stream = io.StringIO()
    out = tmp_path / "out"
    outcome = await run(prepared, out, FakeHostScript(), progress_stream=stream)
    assert outcome.status == "completed"  # the label never changes a verdict

    [started] = records(out, RunStarted)
    assert (started.catalog_path, started.catalog_sha256) == (pinned["path"], pinned["sha256"])
    assert (started.catalog_synthetic, started.catalog_packaged) == (True, False)
    assert {p.synthetic for p in started.planned_rows} == {True}
    assert {r.synthetic for r in records(out, RowOpened)} == {True}
    assert {c.synthetic for c in records(out, CellOpened)} == {True}

    cell_paths = sorted(out.glob("cell-*/*/cell.json"))
    row_paths = sorted(out.glob("cell-*/row.json"))
    assert len(cell_paths) == 2 and row_paths
    for path in (*cell_paths, *row_paths):
        published = json.loads(path.read_bytes())
        assert published["synthetic"] is True, path
        assert published["evidence_class"] == SYNTHETIC_EVIDENCE_CLASS, path
    published_matrix = json.loads((out / MATRIX_FILENAME).read_bytes())
    assert published_matrix["catalog"] == {
        "path": pinned["path"],
        "sha256": pinned["sha256"],
        "synthetic": True,
        "packaged": False,
    }
    assert published_matrix["scope"] == MATRIX_SCOPE_SYNTHETIC
    assert SYNTHETIC_EVIDENCE_CLASS in published_matrix["scope"]
    # Every row, the missing-model ones included, is synthetic evidence.
    assert len(published_matrix["rows"]) > 1
    assert {r["synthetic"] for r in published_matrix["rows"]} == {True}

    progress = stream.getvalue().splitlines()
    assert progress[0].startswith("run: ") and progress[0].endswith(" (synthetic)")
    row_lines = [line for line in progress if line.startswith("row ")]
    assert row_lines and all("(synthetic)" in line for line in row_lines)
    admitted = admit_run(str(prepared), str(tmp_path / "unused"))
    assert final_line(admitted, outcome) == (
        f"completed: {tmp_path / 'unused' / MATRIX_FILENAME} (synthetic)"
    )
    verdict = replay(str(out))
    assert verdict.exit_code == 0 and MATRIX_FILENAME in verdict.identical


async def test_progress_and_the_final_line_carry_no_mark_for_a_real_catalog(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    prepared = make_prepared(tmp_path / "p")
    stream = io.StringIO()
    outcome = await run(prepared, tmp_path / "out", FakeHostScript(), progress_stream=stream)
    assert stream.getvalue().count("row ") >= 2 and "synthetic" not in stream.getvalue()
    admitted = admit_run(str(prepared), str(tmp_path / "unused"))
    assert final_line(admitted, outcome) == f"completed: {tmp_path / 'unused' / MATRIX_FILENAME}"


def test_the_run_reads_every_size_preparation_may_publish(tmp_path: Path) -> None:
    """A large use-case sweep's prepared input passes 1 MiB: the run admits up to the prepared
    cap (the same constant preparation refuses beyond) and refuses a byte more."""
    assert RUN_INPUT_MAX_BYTES == PREPARED_INPUT_MAX_BYTES > 1 * MIB
    document = make_prepared(tmp_path / "p").read_bytes()
    # Trailing JSON whitespace stands in for more rows: the document is the same, its size is
    # what admission reads and bounds.
    for size in (1 * MIB + 64 * 1024, PREPARED_INPUT_MAX_BYTES):
        large = tmp_path / f"input-{size}.json"
        large.write_bytes(document + b" " * (size - len(document)))
        assert large.stat().st_size == size
        admitted = admit_run(str(large), str(tmp_path / f"out-{size}"))
        assert admitted.prepared.rows and admitted.request_sha256
    too_large = tmp_path / "too-large.json"
    too_large.write_bytes(document)
    os.truncate(too_large, PREPARED_INPUT_MAX_BYTES + 1)
    with pytest.raises(Refused) as refused:
        admit_run(str(too_large), str(tmp_path / "out-too-large"))
    assert refused.value.codes == ["file.too_large"]


def test_admission_reports_every_refusal_it_finds_in_order(tmp_path: Path) -> None:
    prepared = make_prepared(tmp_path / "p")
    with pytest.raises(Refused) as relative:
        admit_run("in.json", "out")
    # Relative paths are refused before anything is looked at.
    assert relative.value.codes == ["run.not_absolute", "run.not_absolute"]
    assert [r.path for r in relative.value.refusals] == ["$.input", "$.output"]
    taken = tmp_path / "taken"
    taken.mkdir()
    with pytest.raises(Refused) as both:
        admit_run(str(tmp_path / "absent.json"), str(taken))
    assert both.value.codes[0] == "run.output_exists" and len(both.value.codes) == 2
    with pytest.raises(Refused) as parent:
        admit_run(str(prepared), str(tmp_path / "absent" / "out"))
    assert parent.value.codes == ["run.output_parent"]
    with pytest.raises(Refused) as exists:
        admit_run(str(prepared), str(taken))
    assert exists.value.codes == ["run.output_exists"]
    # The same refusal when the output appears between admission and creating it.
    with pytest.raises(Refused) as raced:
        make_fresh_dir(str(taken))
    assert raced.value.refusals == exists.value.refusals
    assert str(raced.value) == (
        f"run.output_exists at $.output: {taken} already exists "
        "(hint: a run writes into a fresh directory; choose a new --output)"
    )


def test_both_progress_displays_open_with_the_same_start_line() -> None:
    plain = io.StringIO()
    RunProgress(plain, 3, synthetic=True).start("/runs/x")
    assert plain.getvalue() == "run: 3 planned row(s) -> /runs/x (synthetic)\n"
    live = io.StringIO()
    bar = RichRunProgress(live, 3, synthetic=True)
    bar.start("/runs/x")
    bar.close()
    assert "run: 3 planned row(s) -> /runs/x (synthetic)\n" in live.getvalue()


# --- progress: one line per row and arm, read from the journal --------------------------------


def arm_states(out: Path) -> dict[tuple[int, str], list[str]]:
    """Each arm's states in journal order (the correctness machine's and each cell's)."""
    arms = {c.cell_id: (c.row_index, c.arm) for c in records(out, CellOpened)}
    states: dict[tuple[int, str], list[str]] = {}
    for record in records(out, Transition):
        if record.machine == "cell":
            key = arms[record.cell_id]
        elif record.machine == "correctness":
            key = (record.row_index, "correctness")
        else:
            continue
        steps = states.setdefault(key, [])
        if not steps or steps[-1] != record.to_state:  # a self-step shows as one state
            steps.append(record.to_state)
    return states


async def test_json_events_follow_the_journal_with_row_arm_state_rung_elapsed_and_budget(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    events = io.StringIO()
    stderr = io.StringIO()
    prepared = make_prepared(tmp_path / "p", llama_parallel=2)
    rows = len(admit_run(str(prepared), str(tmp_path / "unused")).prepared.rows)
    progress = JsonRunProgress(stderr, rows, events=events)
    out = tmp_path / "out"
    outcome = await run(prepared, out, FakeHostScript(), progress=progress)
    assert outcome.status == "completed"
    parsed = [json.loads(line) for line in events.getvalue().splitlines()]
    assert parsed[0] == {"event": "run_started", "run_dir": str(out), "rows": rows,
                         "synthetic": False}  # fmt: skip
    arm_events = [e for e in parsed if e["event"] == "arm"]
    fields = {"event", "row", "row_number", "rows", "arm", "state", "rung", "rungs",
              "elapsed_s", "budget_left_s"}  # fmt: skip
    assert arm_events and all(set(e) == fields for e in arm_events)
    # Every state an arm's machine stepped into, in journal order, and nothing else.
    shown: dict[tuple[int, str], list[str]] = {}
    for e in arm_events:
        states = shown.setdefault((e["row_number"] - 1, e["arm"]), [])
        if not states or states[-1] != e["state"]:
            states.append(e["state"])
    journaled = arm_states(out)
    assert {k: [s for s in v if s != "opened"] for k, v in shown.items()} == journaled
    # Correctness counts its topologies as it begins each; a ladder's rungs climb k of n to n.
    topologies = [e["rung"] for e in arm_events if e["arm"] == "correctness"]
    assert sorted(set(topologies)) == list(range(1, len(RUNTIME_SLICE_TOPOLOGIES) + 1))
    concurrent = [e for e in arm_events if e["arm"] == "native-concurrent"]
    assert {e["rungs"] for e in concurrent} == {2}
    assert next(e["rung"] for e in concurrent if e["state"] == "ladder") == 1
    assert concurrent[-1]["state"] == "done" and concurrent[-1]["rung"] == 2
    cell_seconds = admit_run(str(prepared), str(tmp_path / "u2")).prepared.cell_seconds
    for e in arm_events:
        assert e["elapsed_s"] >= 0 and 0 <= e["budget_left_s"] <= cell_seconds
        assert e["elapsed_s"] + e["budget_left_s"] <= cell_seconds + 1e-6
    finished = [e for e in parsed if e["event"] == "row_finished"]
    assert len(finished) == rows and finished[0]["status"] == row(out).status == "completed"
    assert stderr.getvalue() == ""  # JSON mode writes nothing on stderr unless told to


async def test_plain_progress_has_one_line_per_arm_state_with_rung_elapsed_and_budget(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    stream = io.StringIO()  # not a terminal: plain lines
    await run(make_prepared(tmp_path / "p", llama_parallel=2), tmp_path / "out", FakeHostScript(),
              progress_stream=stream)  # fmt: skip
    lines = stream.getvalue().splitlines()
    arm_lines = [line for line in lines if line.startswith("  ")]
    pattern = re.compile(
        r"^  (\S+) (correctness|native-serial|native-concurrent): ([a-z-]+), "
        r"(rung \d+/\d+|topology \d+), \d+\.\ds elapsed, \d+\.\ds budget left$"
    )
    assert arm_lines and all(pattern.match(line) for line in arm_lines), arm_lines
    assert any(" native-concurrent: ladder, rung 1/2," in line for line in arm_lines)
    assert any(" native-concurrent: done, rung 2/2," in line for line in arm_lines)
    assert lines[-1].startswith("row ")  # the row's own line closes its arms' lines


async def test_quiet_progress_prints_nothing_while_the_run_works(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    stream = io.StringIO()
    prepared = make_prepared(tmp_path / "p")
    progress = run_progress_for("quiet", stream, 1)
    outcome = await run(prepared, tmp_path / "out", FakeHostScript(), progress=progress)
    assert outcome.status == "completed"
    assert stream.getvalue() == ""
    progress.note("SIGINT: cancelling")  # what the operator must see still prints
    assert stream.getvalue() == "SIGINT: cancelling\n"


def test_the_mode_is_json_then_quiet_then_rich_on_a_terminal_else_plain() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert choose_mode(io.StringIO()) == "plain"
    assert choose_mode(Terminal()) == "rich"
    assert choose_mode(Terminal(), quiet=True) == "quiet"
    assert choose_mode(io.StringIO(), quiet=True, json_events=True) == "json"
    assert isinstance(run_progress_for("rich", Terminal(), 1), RichRunProgress)


async def test_the_live_display_draws_each_arm_and_closes_with_the_row_line(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    progress = run_progress_for("rich", terminal, 1)
    outcome = await run(make_prepared(tmp_path / "p"), tmp_path / "out", FakeHostScript(),
                        progress=progress)  # fmt: skip
    assert outcome.status == "completed"
    drawn = terminal.getvalue()
    assert "native-concurrent: ladder" in drawn and "s left" in drawn
    assert "row 1/1 " in drawn and "completed" in drawn
