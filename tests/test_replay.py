"""``cache-family replay``: a run directory written by the real writer replays identically;
edits, truncation, torn tails and consistent forgeries are caught; ``--reap`` ends real
children that still match the journal and leaves reused pids alone."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec
import psutil
import pytest
import trio

from cache_family.actors.audit.replay import replay, replay_command
from cache_family.actors.journal.rows_file import cell_rows
from cache_family.actors.journal.writer import (
    JournalWriter,
    journal_path,
    publish_cell_receipt,
    publish_row_receipt,
)
from cache_family.actors.run.matrix import finish_run
from cache_family.cli import main as cli_main
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
from cache_family.states.cell import CellEvent, RowEvent
from cache_family.states.fold import REFOLDERS, JournalIndex, fold_cell, register_refolder
from cell_journal_builder import CellScript, RowScript, row_records, run_started, serial_cell


def build_run(
    run_dir: Path,
    *,
    drift: bool = False,
    synthetic: bool = False,
    concurrent_rungs: Sequence[tuple[int, int]] = ((1, 2), (2, 4)),
) -> None:
    """One row, a serial and a concurrent cell, every receipt published through the writer,
    then the matrix receipt folded from the journal file, as ``cache-family run`` ends;
    ``synthetic``: planned by a synthetic catalog, as the zoo's runs are;
    ``concurrent_rungs``: the concurrent cell's (concurrency, requests) ladder."""

    async def main() -> None:
        writer = JournalWriter(journal_path(str(run_dir)))
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            row = RowScript(0)
            await writer.append(run_started(synthetic=synthetic))
            await writer.append(
                row_records(
                    0,
                    [ArmPlan(arm="native-serial"), ArmPlan(arm="native-concurrent")],
                    synthetic=synthetic,
                )
            )
            row.pass_correctness()
            for record in row.records:
                await writer.append(record)
            cells = [
                serial_cell(synthetic=synthetic),
                CellScript(
                    cell_id="cell-0000/native-concurrent",
                    synthetic=synthetic,
                    rungs=concurrent_rungs,
                ),
            ]
            for script in cells:
                script.happy(drift=drift and script.kind == "concurrent")
                for record in script.records:
                    await writer.append(record)
                (run_dir / script.cell_id).mkdir(parents=True)
                script.write_rows(str(run_dir / script.cell_id))
                await publish_cell_receipt(
                    writer, str(run_dir), script.cell_id, f"{script.cell_id}/cell.json"
                )
                script.fire(CellEvent.RECEIPT_PUBLISHED)
                await writer.append(script.records[-1])
                row.fire(RowEvent.ARM_FINISHED)
                await writer.append(row.records[-1])
            row.fire(RowEvent.ARMS_EXHAUSTED)
            await writer.append(row.records[-1])
            await publish_row_receipt(writer, str(run_dir), 0, "cell-0000/row.json")
            row.fire(RowEvent.RECEIPT_PUBLISHED)
            await writer.append(row.records[-1])
            await finish_run(writer, str(run_dir))
            await writer.aclose()

    trio.run(main)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    out = tmp_path / "run"
    out.mkdir()
    build_run(out)
    return out


def journal_lines(run_dir: Path) -> list[bytes]:
    return (run_dir / "journal.jsonl").read_bytes().split(b"\n")[:-1]


def write_lines(run_dir: Path, lines: list[bytes]) -> None:
    (run_dir / "journal.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))


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
        "row 0 opened at seq 2 never published its receipt (the trusted journal ends at seq 6)"
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


def spawn_child(code: str) -> subprocess.Popen[bytes]:
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
    )
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    return child


def journal_children(run_dir: Path, children: list[tuple[int, float]]) -> None:
    records: list[Record] = [run_started()]
    for pid, create_time in children:
        records.append(
            ChildSpawned(
                cell_id="cell-0000/native-serial",
                pid=pid,
                create_time=create_time,
                argv_sha256=hashlib.sha256(b"argv").hexdigest(),
            )
        )
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


def test_receipt_scopes_come_from_the_refolder_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scope = "scope-no-module-registers"
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
    # Replay loaded states/matrix.py, which registered the matrix refolder once and for all.
    assert "matrix" in REFOLDERS
    with pytest.raises(ValueError, match="already registered"):
        register_refolder("matrix", lambda index, record: b"")


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
