"""``cache-family replay``: a run directory written by the real writer replays identically;
edits, truncation, torn tails and consistent forgeries are caught; ``--reap`` ends real
children that still match the journal and leaves reused pids alone."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import psutil
import pytest
import trio
from cell_journal_builder import row_records, run_started
from replay_harness import build_run, journal_lines, run_dir, write_lines  # noqa: F401

from cache_family.actors.audit.replay import REFOLDERS, HeadCheck, replay
from cache_family.actors.journal.rows_file import cell_rows
from cache_family.actors.journal.writer import (
    JournalWriter,
    journal_path,
)
from cache_family.actors.run.matrix import finish_run
from cache_family.cli import main as cli_main
from cache_family.console.commands import replay_command
from cache_family.schemas.journal import (
    ArmPlan,
    ChildSpawned,
    JournalChain,
    ReceiptPublished,
    Record,
    RungCompleted,
    decode_line,
    encode_journal,
    read_journal,
)
from cache_family.schemas.matrix import MATRIX_FILENAME, MATRIX_SCOPE_SYNTHETIC, decode_matrix
from cache_family.schemas.production import PRODUCTION_JSON, PRODUCTION_MD
from cache_family.schemas.receipts import SYNTHETIC_EVIDENCE_CLASS, encode_receipt
from cache_family.states.fold import JournalIndex, fold_cell
from cache_family.states.matrix import SCOPE_PRODUCTION_JSON, SCOPE_PRODUCTION_MD
from cache_family.states.workload_fold import SCOPE_WORKLOAD
from cache_family.system.process_group import PROCESS_TAG_NAME


def test_untouched_run_replays_identically(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert replay_command(str(run_dir), reap=False) == 0
    out = capsys.readouterr().out
    assert "hash chain intact" in out
    assert out.count("identical cell-0000/") == 3
    assert f"identical {MATRIX_FILENAME}" in out
    assert f"identical {PRODUCTION_JSON}" in out and f"identical {PRODUCTION_MD}" in out
    assert "replay: identical (6 identical, 0 differing)" in out
    row = json.loads((run_dir / "cell-0000/row.json").read_text())
    assert row["status"] == "completed" and row["receipt"] == "row"
    cell = json.loads((run_dir / "cell-0000/native-serial/cell.json").read_text())
    assert cell["status"] == "completed" and cell["final_state"] == "finalize"
    matrix = decode_matrix((run_dir / MATRIX_FILENAME).read_bytes())
    assert matrix.status == "completed"
    assert [(r.index, r.result.status, r.result.evidence) for r in matrix.rows] == [
        (0, "completed", "cell-0000/row.json")
    ]


def test_the_run_report_is_compared_in_its_layout_and_an_earlier_one_is_named(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["report-run", str(run_dir)]) == 0
    capsys.readouterr()
    assert replay_command(str(run_dir), reap=False) == 0
    out = capsys.readouterr().out
    assert "identical report.md (run report)" in out
    assert "identical report.html (run report)" in out
    # A report written by an earlier layout (no format line) is named, not compared: the
    # receipts it was made from are what replay verifies.
    markdown = run_dir / "report.md"
    markdown.write_bytes(markdown.read_bytes().split(b"\n", 1)[1])
    assert replay_command(str(run_dir), reap=False) == 0
    out = capsys.readouterr().out
    assert "report.md was written in an earlier layout, not compared" in out
    assert "(run report)" not in out


def test_cli_is_wired(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["replay", str(run_dir)]) == 0
    assert "replay: identical" in capsys.readouterr().out


def test_drifted_run_still_replays_identically(tmp_path: Path) -> None:
    build_run(tmp_path)
    report = replay(str(tmp_path))
    assert report.exit_code == 0
    build_drift = tmp_path / "drift"
    build_drift.mkdir()
    build_run(build_drift, drift=True)
    assert replay(str(build_drift)).exit_code == 0
    cell = json.loads((build_drift / "cell-0000/native-concurrent/cell.json").read_text())
    assert cell["status"] == "incomplete" and not cell["accepted_for_parity"]
    row = json.loads((build_drift / "cell-0000/row.json").read_text())
    assert row["status"] == "incomplete"


def test_synthetic_run_replays_identically_and_an_erased_label_differs(tmp_path: Path) -> None:
    build_run(tmp_path, synthetic=True)
    verdict = replay(str(tmp_path))
    assert verdict.exit_code == 0 and len(verdict.identical) == 6
    published = [
        tmp_path / "cell-0000/native-serial/cell.json",
        tmp_path / "cell-0000/native-concurrent/cell.json",
        tmp_path / "cell-0000/row.json",
    ]
    for path in published:
        receipt = json.loads(path.read_text())
        assert receipt["synthetic"] is True
        assert receipt["evidence_class"] == SYNTHETIC_EVIDENCE_CLASS
    matrix = decode_matrix((tmp_path / MATRIX_FILENAME).read_bytes())
    assert matrix.catalog is not None and matrix.catalog.synthetic
    assert matrix.scope == MATRIX_SCOPE_SYNTHETIC and [r.synthetic for r in matrix.rows] == [True]
    # A receipt whose label was removed no longer matches the journal's fold.
    row = published[2]
    row.write_bytes(row.read_bytes().replace(b'"synthetic": true', b'"synthetic": false'))
    edited = replay(str(tmp_path))
    assert edited.exit_code == 1 and edited.mismatched == ["cell-0000/row.json"]


def test_edited_receipt_differs(run_dir: Path) -> None:
    path = run_dir / "cell-0000/native-concurrent/cell.json"
    path.write_bytes(path.read_bytes().replace(b'"status": "completed"', b'"status": "complete"'))
    report = replay(str(run_dir))
    assert report.exit_code == 1
    assert report.mismatched == ["cell-0000/native-concurrent/cell.json"]
    text = "\n".join(report.lines)
    assert "changed after it was published" in text and "at byte" in text


def test_edited_matrix_receipt_differs(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The matrix is re-folded like every other receipt, so an edit to it is caught."""
    path = run_dir / MATRIX_FILENAME
    original = path.read_bytes()
    edited = original.replace(b'"planned_cells": 1', b'"planned_cells": 2')
    assert edited != original
    path.write_bytes(edited)
    assert replay_command(str(run_dir), reap=False) == 1
    out = capsys.readouterr().out
    assert f"DIFFERS {MATRIX_FILENAME}" in out
    assert "changed after it was published" in out and "re-folded bytes differ" in out
    assert "planned_cells" in out
    report = replay(str(run_dir))
    assert report.mismatched == [MATRIX_FILENAME]
    assert len(report.identical) == 5  # the cell, row and report files are untouched


def test_matrix_published_with_a_matching_sha_but_a_different_fold_differs(
    run_dir: Path,
) -> None:
    """A matrix whose bytes match the journaled SHA-256 but not the fold (a consistent forgery
    of the file and its publication record) is caught by re-folding alone."""
    lines = [decode_line(line) for line in journal_lines(run_dir)]
    forged_matrix = (
        (run_dir / MATRIX_FILENAME)
        .read_bytes()
        .replace(b'"status": "completed"', b'"status": "incomplete"', 1)
    )
    chain = JournalChain()
    data = b""
    for line in lines:
        record = line.record
        if isinstance(record, ReceiptPublished) and record.scope == "matrix":
            record = ReceiptPublished(
                scope="matrix",
                path=record.path,
                sha256=hashlib.sha256(forged_matrix).hexdigest(),
                through_seq=record.through_seq,
            )
        _, chunk = chain.line(record, mono_ns=line.mono_ns, wall_ns=line.wall_ns)
        data += chunk
    (run_dir / "journal.jsonl").write_bytes(data)
    (run_dir / MATRIX_FILENAME).write_bytes(forged_matrix)
    report = replay(str(run_dir))
    assert report.exit_code == 1 and report.mismatched == [MATRIX_FILENAME]
    assert any(
        f"DIFFERS {MATRIX_FILENAME}" in line
        and "re-folded bytes differ" in line
        and "changed after it was published" not in line
        for line in report.lines
    )


def test_unjournaled_matrix_is_not_accounted_for(run_dir: Path) -> None:
    lines = journal_lines(run_dir)
    assert b'"scope":"matrix"' in lines[-2] and b'"journal_sealed"' in lines[-1]
    write_lines(run_dir, lines[:-2])  # the matrix's publication record and the seal are lost
    report = replay(str(run_dir))
    assert report.exit_code == 1 and report.mismatched == [MATRIX_FILENAME]
    assert len(report.identical) == 5
    # The matrix was folded through the line before its own publication, which is still
    # trusted: nothing says a line is missing, only that no record accounts for the file.
    assert report.first_bad_seq is None
    assert f"DIFFERS {MATRIX_FILENAME}: no receipt_published record in the trusted journal" in (
        report.lines
    )


def test_edited_journal_line_reports_first_bad_seq(run_dir: Path) -> None:
    lines = journal_lines(run_dir)
    k = 12
    lines[k - 1] = lines[k - 1].replace(b'"wall_ns":1', b'"wall_ns":2', 1)
    write_lines(run_dir, lines)
    report = replay(str(run_dir))
    assert report.exit_code == 1 and report.first_bad_seq == k
    assert f"first bad seq {k}" in report.lines[0]


def test_reordered_journal(run_dir: Path) -> None:
    lines = journal_lines(run_dir)
    lines[20], lines[21] = lines[21], lines[20]
    write_lines(run_dir, lines)
    report = replay(str(run_dir))
    assert report.exit_code == 1 and report.first_bad_seq == 21


def test_torn_tail(run_dir: Path) -> None:
    data = (run_dir / "journal.jsonl").read_bytes()
    count = data.count(b"\n")
    (run_dir / "journal.jsonl").write_bytes(data[:-15])
    report = replay(str(run_dir))
    assert report.exit_code == 1 and report.first_bad_seq == count
    assert "journal.line.torn" in report.lines[0]


def test_truncated_journal_leaves_receipts_unaccounted(run_dir: Path) -> None:
    lines = journal_lines(run_dir)
    published = [i for i, line in enumerate(lines) if b'"receipt_published"' in line]
    cut = published[1]  # keep the first cell receipt's publication, lose the rest
    write_lines(run_dir, lines[:cut])
    report = replay(str(run_dir))
    assert report.exit_code == 1
    assert report.identical == ["cell-0000/native-serial/cell.json"]
    text = "\n".join(report.lines)
    assert "cell-0000/row.json" in text
    assert f"first missing seq {cut + 1}" in text
    assert report.first_bad_seq == cut + 1


def test_consistent_forgery_is_caught_by_refolding(run_dir: Path) -> None:
    """Rewrite the journal with a valid chain but one observation changed: the chain checks out,
    the re-folded receipt does not match the published bytes."""
    records: list[Record] = [decode_line(line).record for line in journal_lines(run_dir)]
    for i, record in enumerate(records):
        if type(record).__name__ == "Ready" and record.cell_id == "cell-0000/native-concurrent":  # type: ignore[union-attr]
            records[i] = type(record)(cell_id=record.cell_id, url=record.url, attempts=9)  # type: ignore[call-arg, union-attr]
    original = [decode_line(line) for line in journal_lines(run_dir)]
    chain = JournalChain()
    forged = b""
    for old, record in zip(original, records, strict=True):
        _, data = chain.line(record, mono_ns=old.mono_ns, wall_ns=old.wall_ns)
        forged += data
    (run_dir / "journal.jsonl").write_bytes(forged)
    report = replay(str(run_dir))
    assert report.exit_code == 1
    assert "hash chain intact" in report.lines[0]
    assert "cell-0000/native-concurrent/cell.json" in report.mismatched
    assert "cell-0000/row.json" not in report.mismatched  # the row brief has no readiness
    assert MATRIX_FILENAME not in report.mismatched  # nor has the matrix
    assert any("re-folded bytes differ" in line and "attempts" in line for line in report.lines)


def test_missing_receipt_file_differs(run_dir: Path) -> None:
    (run_dir / "cell-0000/row.json").unlink()
    report = replay(str(run_dir))
    assert report.exit_code == 1 and "cell-0000/row.json" in report.mismatched


def test_planted_receipt_is_not_accounted_for(run_dir: Path) -> None:
    (run_dir / "cell-0001").mkdir()
    (run_dir / "cell-0001/row.json").write_text('{"journal_through_seq": 3}\n')
    report = replay(str(run_dir))
    assert report.exit_code == 1
    assert any("no receipt_published record" in line for line in report.lines)


def test_a_run_killed_mid_ladder_did_not_finish(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What SIGKILL leaves: the journal stops inside the concurrent cell; no later receipt."""
    lines = journal_lines(run_dir)
    opened = next(i for i, line in enumerate(lines) if b'"cell-0000/native-concurrent"' in line)
    assert b'"cell_opened"' in lines[opened]
    write_lines(run_dir, lines[: opened + 3])  # the cell got a little further, then nothing
    for later in ("cell-0000/native-concurrent/cell.json", "cell-0000/row.json", MATRIX_FILENAME):
        (run_dir / later).unlink()
    assert replay_command(str(run_dir), reap=False) == 1
    out = capsys.readouterr().out.splitlines()
    assert "identical cell-0000/native-serial/cell.json" in out[1]  # what exists still compares
    assert out[-2] == (
        f"replay: run did not finish: cell cell-0000/native-concurrent opened at seq {opened + 1}"
        " never published its receipt; row 0 opened at seq 2 never published its receipt; no "
        f"{MATRIX_FILENAME} was published; the journal is not sealed (the trusted journal ends "
        f"at seq {opened + 3})"
    )
    assert out[-1] == "replay: UNFINISHED (1 identical, 0 differing)"


def test_a_row_that_never_published_is_unfinished_even_with_a_matrix(tmp_path: Path) -> None:
    async def main() -> None:
        writer = JournalWriter(journal_path(str(tmp_path)))
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            await writer.append(run_started())
            await writer.append(row_records(0, [ArmPlan(arm="native-serial")]))
            await finish_run(writer, str(tmp_path))
            await writer.aclose()

    trio.run(main)
    report = replay(str(tmp_path))
    assert report.identical == [PRODUCTION_JSON, PRODUCTION_MD, MATRIX_FILENAME]
    assert not report.differs and report.exit_code == 1
    assert report.unfinished == (
        "row 0 opened at seq 2 never published its receipt (the trusted journal ends at seq 7)"
    )
    # A finished run with the same shape replays identically (no false alarm).
    finished = tmp_path / "finished"
    finished.mkdir()
    build_run(finished)
    assert replay(str(finished)).unfinished is None


def test_unreadable_journals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert replay_command(str(tmp_path), reap=False) == 2
    assert "file.missing" in capsys.readouterr().out
    (tmp_path / "journal.jsonl").write_bytes(b"")
    assert replay(str(tmp_path)).exit_code == 2
    chain = JournalChain()
    _, first = chain.line(run_started(), mono_ns=0, wall_ns=0)
    newer = json.dumps(
        {
            "seq": 2,
            "mono_ns": 1,
            "wall_ns": 1,
            "prev": chain.prev,
            "record": {"type": "power_sample", "watts": 250},
        },
        separators=(",", ":"),
    ).encode()
    (tmp_path / "journal.jsonl").write_bytes(first + newer + b"\n")
    report = replay(str(tmp_path))
    assert report.exit_code == 2
    assert "journal.record.unknown_type" in report.lines[0]


# --- reaping real processes -----------------------------------------------------------------

CHILD_WAITS_ON_STDIN = "import sys; print('ready', flush=True); sys.stdin.read()"
FAULT_CHILD_IGNORES_SIGTERM = (
    "import signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); sys.stdin.read()"
)


# The environment tag a run's host carries (``CACHE_FAMILY_CELL=<run tag>/<cell id>``): its run
# part names the journal's run (run-test) and a runner that is gone (this pid, created at 1.0).
HOST_TAG = f"cf-test0123456789:run-test:{os.getpid()}:1.0/cell-0000/native-serial"


def spawn_child(code: str, *, tag: str | None = HOST_TAG) -> subprocess.Popen[bytes]:
    """A child as a run's host is: carrying the run's tag (``tag=None``: a process that is no
    run's, such as a victim a forged journal names)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    if tag is not None:
        env[PROCESS_TAG_NAME] = tag
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    return child


def child_spawned(pid: int, create_time: float, tag: str = HOST_TAG) -> ChildSpawned:
    return ChildSpawned(
        cell_id="cell-0000/native-serial",
        pid=pid,
        create_time=create_time,
        argv_sha256=hashlib.sha256(b"argv").hexdigest(),
        effective_environment={PROCESS_TAG_NAME: tag},
    )


def journal_children(run_dir: Path, children: list[tuple[int, float]]) -> None:
    records: list[Record] = [run_started()]
    records += [child_spawned(pid, create_time) for pid, create_time in children]
    (run_dir / "journal.jsonl").write_bytes(encode_journal(records))


def test_reap_ends_a_journaled_child(tmp_path: Path) -> None:
    child = spawn_child(CHILD_WAITS_ON_STDIN)
    try:
        journal_children(tmp_path, [(child.pid, psutil.Process(child.pid).create_time())])
        report = replay(str(tmp_path), reap=True, reap_grace_s=10)
        # replay reaped its exit status (it is our child here), so only its absence is visible.
        assert not psutil.pid_exists(child.pid)
        assert f"reap: ended with SIGTERM: [{child.pid}]" in report.lines
        assert not any("SIGKILL" in line for line in report.lines)
        # A journal that stops after spawning a host is a crashed run: reaped, still unfinished.
        assert report.exit_code == 1 and not report.differs and not report.mismatched
        assert report.lines[-2].startswith("replay: run did not finish: ")
        assert report.lines[-1] == "replay: UNFINISHED (0 identical, 0 differing)"
    finally:
        child.kill()
        child.wait()


def test_reap_kills_a_child_that_ignores_sigterm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    child = spawn_child(FAULT_CHILD_IGNORES_SIGTERM)
    try:
        journal_children(tmp_path, [(child.pid, psutil.Process(child.pid).create_time())])
        assert replay_command(str(tmp_path), reap=True, reap_grace_s=0.3) == 1
        assert not psutil.pid_exists(child.pid)
        out = capsys.readouterr().out
        assert f"killed with SIGKILL after 0.3 s: [{child.pid}]" in out
        assert "replay: run did not finish: " in out
    finally:
        child.kill()
        child.wait()


def test_reap_never_ends_a_process_a_forged_record_names(tmp_path: Path) -> None:
    """A ``child_spawned`` record appended for an unrelated process (its pid and create time
    copied from the process table, the journal re-chained): the process carries no run tag, so
    neither it nor its descendant is ended, while the run's own tagged host is."""
    victim = spawn_child(
        "import subprocess, sys; grandchild = subprocess.Popen([sys.executable, '-c', "
        "'import sys; sys.stdin.read()'], stdin=subprocess.PIPE); "
        "print('ready', flush=True); print(grandchild.pid, flush=True); sys.stdin.read()",
        tag=None,
    )
    host = spawn_child(CHILD_WAITS_ON_STDIN)
    try:
        assert victim.stdout is not None
        grandchild = psutil.Process(int(victim.stdout.readline()))
    except BaseException:
        victim.kill()
        host.kill()
        raise
    try:
        created = psutil.Process(victim.pid).create_time()
        # The forger copies the host's record (tag included) for the victim, and re-chains.
        records: list[Record] = [
            run_started(),
            child_spawned(host.pid, psutil.Process(host.pid).create_time()),
            child_spawned(victim.pid, created),
        ]
        (tmp_path / "journal.jsonl").write_bytes(encode_journal(records))
        report = replay(str(tmp_path), reap=True, reap_grace_s=10)
        assert psutil.Process(victim.pid).status() != psutil.STATUS_ZOMBIE
        assert grandchild.is_running() and grandchild.status() != psutil.STATUS_ZOMBIE
        assert f"reap: ended with SIGTERM: [{host.pid}]" in report.lines
        assert any(
            line.startswith(f"reap: pid {victim.pid} ") and "does not carry" in line
            for line in report.lines
        )
    finally:
        grandchild.kill()
        for child in (victim, host):
            child.kill()
            child.wait()


def test_reap_refuses_a_journal_whose_head_is_not_the_expected_one(tmp_path: Path) -> None:
    """Even the run's own tagged host is not ended on the word of a journal that does not
    verify: a head other than --expect-head, or a broken chain."""
    host = spawn_child(CHILD_WAITS_ON_STDIN)
    try:
        journal_children(tmp_path, [(host.pid, psutil.Process(host.pid).create_time())])
        expected = HeadCheck(expect_head="0" * 64)
        report = replay(str(tmp_path), reap=True, reap_grace_s=10, head=expected)
        assert host.poll() is None
        assert any(
            line.startswith("reap: refused: replay.reap.unverified") for line in report.lines
        )
        assert report.exit_code == 1
        journal = tmp_path / "journal.jsonl"
        edited = journal.read_bytes().replace(b'"run_id":"run-test"', b'"run_id":"run-edit"', 1)
        journal.write_bytes(edited)
        broken = replay(str(tmp_path), reap=True, reap_grace_s=10)
        assert host.poll() is None
        assert any("replay.reap.unverified" in line for line in broken.lines)
    finally:
        host.kill()
        host.wait()


def test_reap_leaves_a_reused_pid_alone(tmp_path: Path) -> None:
    me = psutil.Process(os.getpid())
    gone = spawn_child(CHILD_WAITS_ON_STDIN)
    gone_create = psutil.Process(gone.pid).create_time()
    gone.kill()
    gone.wait()
    # Our own pid with another create time stands for a pid the kernel handed to someone else.
    journal_children(tmp_path, [(me.pid, me.create_time() - 1000.0), (gone.pid, gone_create)])
    report = replay(str(tmp_path), reap=True, reap_grace_s=0.1)
    assert me.is_running()
    text = "\n".join(report.lines)
    assert (
        f"pid {me.pid} (host, cell cell-0000/native-serial) now belongs to another process" in text
    )
    assert f"pid {gone.pid} (host, cell cell-0000/native-serial) is not running" in text


def test_receipt_scopes_come_from_replays_one_refold_mapping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scope = "scope-without-a-refolder"
    receipt = b'{"receipt": "unregistered", "status": "completed"}\n'
    (tmp_path / "unregistered.json").write_bytes(receipt)
    published = ReceiptPublished(
        scope=scope,
        path="unregistered.json",
        sha256=hashlib.sha256(receipt).hexdigest(),
        through_seq=1,
    )
    (tmp_path / "journal.jsonl").write_bytes(encode_journal([run_started(), published]))
    report = replay(str(tmp_path))
    assert scope not in REFOLDERS
    assert report.exit_code == 2
    assert any("fold.scope.unsupported" in line and scope in line for line in report.lines)

    seen: list[int] = []

    def refold_unregistered(index: JournalIndex, record: ReceiptPublished) -> bytes:
        seen.append(index.last_seq)
        return receipt if record.through_seq == 1 else b""

    monkeypatch.setitem(REFOLDERS, scope, refold_unregistered)
    registered = replay(str(tmp_path))
    assert registered.identical == ["unregistered.json"] and not registered.differs
    # The receipt matches; only the missing matrix says this journal is not a finished run.
    assert registered.exit_code == 1
    assert registered.unfinished is not None and MATRIX_FILENAME in registered.unfinished
    assert seen == [2]
    # Every scope a run publishes is named in the one mapping; no import fills it.
    assert set(REFOLDERS) - {scope} == {
        "cell",
        "row",
        "matrix",
        SCOPE_PRODUCTION_JSON,
        SCOPE_PRODUCTION_MD,
        SCOPE_WORKLOAD,
    }


@pytest.mark.parametrize(
    ("damage", "code"),
    [
        ("edit", "rows.digest_mismatch"),
        ("truncate", "rows.digest_mismatch"),
        ("remove", "file.missing"),
    ],
)
def test_a_small_cells_damaged_rows_file_makes_replay_differ(
    run_dir: Path, damage: str, code: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A small cell lists its rows inline, but the journal holds only their rung_rows
    records: replay re-reads them from the rows file, which must hold every record's digest."""
    path = run_dir / "cell-0000/native-serial/requests.jsonl"
    data = path.read_bytes()
    path.chmod(0o644)
    if damage == "edit":
        path.write_bytes(data.replace(b'"elapsed_ms":2', b'"elapsed_ms":3', 1))
    elif damage == "truncate":
        path.write_bytes(data[: data.rindex(b"\n", 0, len(data) - 1) + 1])
    else:
        path.unlink()
    assert replay_command(str(run_dir), reap=False) == 1
    out = capsys.readouterr().out
    assert "DIFFERS cell-0000/native-serial/cell.json" in out and code in out
    assert "identical cell-0000/native-concurrent/cell.json" in out


def test_a_rung_summary_its_rows_do_not_give_is_caught_by_re_tallying(run_dir: Path) -> None:
    """A consistent forgery of the journal and the cell receipt (a rung's p50 latency changed
    in its ``rung_completed`` facts, the receipt re-folded from them and its publication
    record re-hashed): the chain and the receipt check out, the rows file does not re-tally."""
    cell_id, cell_json = (
        "cell-0000/native-concurrent",
        run_dir / "cell-0000/native-concurrent/cell.json",
    )

    def forged(records: list[Record]) -> bytes:
        chain, data = JournalChain(), b""
        for old, record in zip(original, records, strict=True):
            data += chain.line(record, mono_ns=old.mono_ns, wall_ns=old.wall_ns)[1]
        return data

    original = [decode_line(line) for line in journal_lines(run_dir)]
    records: list[Record] = [line.record for line in original]
    for i, record in enumerate(records):
        if isinstance(record, RungCompleted) and record.cell_id == cell_id:
            assert record.tally is not None and record.tally.rung_summary is not None
            summary = msgspec.structs.replace(record.tally.rung_summary, latency_p50_ms=999.0)
            tally = msgspec.structs.replace(record.tally, rung_summary=summary)
            records[i] = msgspec.structs.replace(record, tally=tally)
    lines = read_journal(forged(records)).lines
    at, published = next(
        (i, r)
        for i, r in enumerate(records)
        if isinstance(r, ReceiptPublished) and r.cell_id == cell_id
    )
    receipt = encode_receipt(
        fold_cell(
            lines, cell_id, through_seq=published.through_seq, rows=cell_rows(str(cell_json.parent))
        )
    )
    records[at] = msgspec.structs.replace(published, sha256=hashlib.sha256(receipt).hexdigest())
    (run_dir / "journal.jsonl").write_bytes(forged(records))
    cell_json.chmod(0o644)
    cell_json.write_bytes(receipt)
    report = replay(str(run_dir))
    assert report.exit_code == 1 and "hash chain intact" in report.lines[0]
    assert any(
        line.startswith(f"DIFFERS {cell_id}/cell.json")
        and "rung 0: its rows re-tally to other facts" in line
        and "re-folded bytes differ" not in line
        for line in report.lines
    ), report.lines


# --- every file of the run directory is bound (issue 22, item 6) ----------------------------

EVIDENCE = {
    "cell-0000/correctness/state-handoff.json": b'{"verdict": "pass"}\n',
    "cell-0000/skippy-new/stage.json": b'{"stage": 0}\n',
    "cell-0000/native-serial/host.stderr.log": b"listening on 127.0.0.1\n",
}


def sealed_run_with_evidence(run_dir: Path) -> None:
    """A finished run whose directory holds evidence files no receipt names."""
    for relative, data in EVIDENCE.items():
        (run_dir / relative).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / relative).write_bytes(data)

    async def main() -> None:
        writer = JournalWriter(journal_path(str(run_dir)))
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            await writer.append(run_started())
            await finish_run(writer, str(run_dir))
            await writer.aclose()

    trio.run(main)


@pytest.mark.parametrize(
    ("damage", "code"),
    [
        ("edit", "replay.file.changed"),
        ("remove", "replay.file.missing"),
        ("plant", "replay.file.unbound"),
        ("link", "replay.file.changed"),
    ],
)
def test_an_evidence_file_no_receipt_names_is_bound_by_the_journal(
    tmp_path: Path, damage: str, code: str
) -> None:
    """``state-handoff.json``, ``stage.json`` and host logs are outside every receipt: the
    run binds them all by SHA-256 before the matrix, so an edit, a removal, a planted file or
    a file swapped for a link differs with a typed code."""
    sealed_run_with_evidence(tmp_path)
    clean = replay(str(tmp_path))
    assert clean.exit_code == 0, clean.lines
    assert f"run files: {len(EVIDENCE) + 2} bound, every one as bound and no other" in clean.lines
    target = tmp_path / "cell-0000/correctness/state-handoff.json"
    if damage == "edit":
        target.write_bytes(b'{"verdict": "fail"}\n')
    elif damage == "remove":
        target.unlink()
    elif damage == "plant":
        target = tmp_path / "cell-0000/skippy-new/extra.json"
        target.write_bytes(b"{}\n")
    else:
        target.unlink()
        target.symlink_to(tmp_path / "cell-0000/skippy-new/stage.json")
    report = replay(str(tmp_path))
    relative = str(target.relative_to(tmp_path))
    assert report.exit_code == 1 and report.mismatched == [relative]
    assert any(line.startswith(f"DIFFERS {relative}: {code}: ") for line in report.lines)


def test_a_journal_from_before_bound_files_still_replays_and_says_so(tmp_path: Path) -> None:
    """Old runs stay replayable: a journal without ``run_files`` binds no file list, which
    replay says; its receipts are checked as before, and no file is called unbound."""
    (tmp_path / "planted.txt").write_bytes(b"not bound by anyone\n")
    (tmp_path / "journal.jsonl").write_bytes(encode_journal([run_started()]))
    report = replay(str(tmp_path))
    assert any(
        line.startswith("run files: the journal binds no file list") for line in report.lines
    )
    assert not report.differs and report.mismatched == []


def test_report_run_files_are_all_compared_even_without_report_md(tmp_path: Path) -> None:
    """Replay compared the report files only while ``report.md`` was there: deleting it let an
    edited ``report.html`` or plot pass. Now any one of report-run's files (or its manifest
    ``report-files.json``) makes replay regenerate and compare them all."""
    build_run(tmp_path, synthetic=True)
    assert cli_main(["report-run", str(tmp_path)]) == 0
    clean = replay(str(tmp_path))
    assert clean.exit_code == 0
    (tmp_path / "report.md").unlink()
    page = tmp_path / "report.html"
    page.write_bytes(page.read_bytes().replace(b"synthetic", b"measured", 1))
    report = replay(str(tmp_path))
    assert report.exit_code == 1
    assert {"report.md", "report.html"} <= set(report.mismatched)
    assert any(line.startswith("DIFFERS report.md (run report): ") for line in report.lines)
    # report-run bound what it wrote: the manifest names each file's SHA-256.
    manifest = json.loads((tmp_path / "report-files.json").read_text())
    assert set(manifest["report_files"]) >= {"report.md", "report.html"}
    assert "report-files.json" in clean.identical


def test_a_plot_report_run_never_wrote_differs(tmp_path: Path) -> None:
    build_run(tmp_path)
    assert cli_main(["report-run", str(tmp_path)]) == 0
    (tmp_path / "report.md").unlink()
    (tmp_path / "report.html").unlink()
    (tmp_path / "report-files.json").unlink(missing_ok=True)
    planted = tmp_path / "plots" / "row-9999-planted.svg"
    planted.parent.mkdir(exist_ok=True)
    planted.write_bytes(b"<svg/>\n")
    report = replay(str(tmp_path))
    assert report.exit_code == 1
    assert "plots/row-9999-planted.svg" in report.mismatched
    assert any("replay.report.unlisted" in line for line in report.lines)
    assert {"report.md", "report.html"} <= set(report.mismatched)
