"""A cell's rows in their own streamed file: written in chunks with a running SHA-256, read
back never more than a chunk at a time with the digest checked at the end, and summarised
row by row into exactly the summary the whole roster gives."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import msgspec
import pytest
import run_harness as budgets
import trio
import trio.testing
from replay_harness import build_run

from cache_family.actors.audit import replay as replay_module
from cache_family.actors.journal import rows_file as request_rows
from cache_family.actors.journal.rows_file import RowFileWriter
from cache_family.console.commands import replay_command
from cache_family.errors import Refused
from cache_family.report.run import read_run
from cache_family.report.run_report import MARKDOWN_NAME, render_run_report
from cache_family.schemas import request_rows as schemas_request_rows
from cache_family.schemas.journal import RungRows
from cache_family.schemas.measurement import RequestRow
from cache_family.schemas.receipts import decode_cell_receipt
from cache_family.schemas.request_rows import (
    REQUESTS_FILENAME,
    RequestRowLine,
    RowsFileDigest,
    rows_digest,
    stream_rows,
)
from cache_family.states.metrics import RungAccumulator, roster_refusals, rung_summary


def roster(n: int, seed: int = 7) -> list[RequestRow]:
    """Rows as replay decodes them (floats from JSON), some failed, one warmup excluded."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        elapsed = round(rng.uniform(5, 500), 3)
        ttft = round(elapsed * rng.uniform(0.05, 0.9), 3)
        status = "failed" if rng.random() < 0.02 else "completed"
        rows.append(
            RequestRow(
                request_id=i,
                status=status,
                excluded_warmup=i == 0,
                elapsed_ms=elapsed,
                ttft_ms=ttft if rng.random() < 0.97 else None,
                tpot_ms=round((elapsed - ttft) / 15, 4),
                tokens_predicted=16,
            )
        )
    rng.shuffle(rows)  # the order requests ended in
    return msgspec.json.decode(msgspec.json.encode(rows), type=list[RequestRow])


def accumulated(rows: list[RequestRow]) -> RungAccumulator:
    rung = RungAccumulator(len(rows), compact=True, ttft_slo_ms=80.0, tpot_slo_ms=20.0)
    for row in rows:
        rung.add(row, row.request_id)
    return rung


@pytest.mark.parametrize("n", [1, 2, 99, 1000])
def test_the_streamed_summary_is_the_whole_rosters_summary(n: int) -> None:
    rows = roster(n)
    whole = rung_summary(
        sorted(rows, key=lambda row: row.request_id),
        concurrency=8,
        requested_requests=n,
        makespan_seconds=12.5,
        ttft_slo_ms=80.0,
        tpot_slo_ms=20.0,
    )
    streamed = accumulated(rows).summary(concurrency=8, makespan_seconds=12.5)
    assert msgspec.json.encode(streamed) == msgspec.json.encode(whole)


def test_a_broken_roster_is_refused_with_the_same_reasons() -> None:
    rows = roster(50)
    broken = [*rows[:10], rows[3], *rows[12:]]  # ids of two rows missing, one duplicated
    broken.append(msgspec.structs.replace(rows[20], request_id=77, elapsed_ms=-1.0))
    ordered = sorted(broken, key=lambda row: row.request_id)
    rung = RungAccumulator(50)
    for row in ordered:
        rung.add(row)
    with pytest.raises(Refused) as refused:
        rung.summary(concurrency=1, makespan_seconds=1.0)
    assert list(refused.value.refusals) == roster_refusals(ordered, 50)
    assert "duplicated [" in refused.value.refusals[0].message


def write_rows(path: Path, rows: list[RequestRow], **kwargs: int) -> RowsFileDigest:
    writer = RowFileWriter(str(path), "cell-0000/native-serial/requests.jsonl", **kwargs)
    for row in rows:
        writer.add(RequestRowLine(rung_index=0, concurrency=8, row=row))
    return writer.close()


def test_twenty_thousand_rows_stream_through_a_small_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = roster(20_000)
    path = tmp_path / "requests.jsonl"
    digest = write_rows(path, rows, flush_bytes=256 * 1024)
    cap = 64 * 1024
    assert digest.count == 20_000 and path.stat().st_size > 40 * cap
    reads: list[int] = []
    real_read = request_rows.os.read

    def counted(fd: int, size: int) -> bytes:
        reads.append(size)
        return real_read(fd, size)

    monkeypatch.setattr(request_rows.os, "read", counted)
    rung = RungAccumulator(20_000, compact=True, ttft_slo_ms=80.0, tpot_slo_ms=20.0)
    for line in stream_rows(str(path), digest, chunk_bytes=cap):
        rung.add(line.row, line.row.request_id)
    assert max(reads) == cap and len(reads) > 40  # never the whole file at once
    assert rung.summary(concurrency=8, makespan_seconds=30.0) == accumulated(rows).summary(
        concurrency=8, makespan_seconds=30.0
    )


def test_an_edited_truncated_or_torn_rows_file_is_refused(tmp_path: Path) -> None:
    rows = roster(300)
    path = tmp_path / "requests.jsonl"
    digest = write_rows(path, rows)
    data = path.read_bytes()
    edits = {
        "edited": data.replace(b'"request_id":1,', b'"request_id":9,', 1),
        "truncated": data[: data.index(b"\n", len(data) // 2) + 1],
        "torn": data[:-5],
        "undecodable": data.replace(b'"status"', b'"stat"us"', 1),
    }
    for name, edited in edits.items():
        path.write_bytes(edited)
        with pytest.raises(Refused) as refused:
            list(stream_rows(str(path), digest, chunk_bytes=4096))
        assert refused.value.codes[0].startswith("rows."), name
    path.write_bytes(data)
    assert [line.row for line in stream_rows(str(path), digest)] == rows


# --- a large cell through the real fold, publisher and replay ---------------------------------

LARGE_RUNGS = ((8, 12_000), (16, 12_000))  # 24k rows: past INLINE_ROWS_MAX, so in the file
CONCURRENT = "cell-0000/native-concurrent"


@pytest.fixture(scope="module")
def built_large_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("large") / "run"
    out.mkdir()
    build_run(out, concurrent_rungs=LARGE_RUNGS)
    return out


@pytest.fixture
def large_run(built_large_run: Path, tmp_path: Path) -> Path:
    """A private copy: the tests below damage it."""
    return Path(shutil.copytree(built_large_run, tmp_path / "run"))


def test_a_large_cell_keeps_its_rows_in_the_rows_file(large_run: Path) -> None:
    cell_json = large_run / CONCURRENT / "cell.json"
    receipt = decode_cell_receipt(cell_json.read_bytes())
    rows_file = receipt.measurement.rows_file
    assert rows_file is not None and rows_file.path == REQUESTS_FILENAME
    assert rows_file.count == 24_000
    assert all(rung.rows == () for rung in receipt.measurement.rungs)
    # Inline, these rows would make a cell.json of many MB; without them it stays small.
    assert cell_json.stat().st_size < 64 * 1024
    lines = list(stream_rows(str(large_run / CONCURRENT / REQUESTS_FILENAME), rows_file))
    assert [(line.rung_index, line.row.request_id) for line in lines] == [
        (rung, request_id) for rung, (_, n) in enumerate(LARGE_RUNGS) for request_id in range(n)
    ]
    # The summaries are the ones the inline receipt gives: same fold, rows elsewhere.
    for rung in receipt.measurement.rungs:
        rows = [line.row for line in lines if line.rung_index == rung.rung_index]
        assert rung.rung_summary == rung_summary(
            rows,
            concurrency=rung.concurrency,
            requested_requests=rung.requested_requests,
            makespan_seconds=rung.makespan_seconds or 0.0,
            ttft_slo_ms=2000.0,
            tpot_slo_ms=100.0,
        )
    # The small serial cell of the same run lists its rows inline and names no file (its
    # rows file stays beside it: the journal's rung_rows records name it).
    serial = decode_cell_receipt((large_run / "cell-0000/native-serial/cell.json").read_bytes())
    assert serial.measurement.rows_file is None and serial.measurement.rungs[0].rows
    assert (large_run / "cell-0000/native-serial" / REQUESTS_FILENAME).exists()


def test_a_large_cell_replays_identically_under_a_small_read_cap(
    large_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(replay_module, "RECEIPT_READ_LIMIT", 256 * 1024)
    assert replay_command(str(large_run), reap=False) == 0
    assert "replay: identical" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["edit", "truncate", "remove"])
def test_a_damaged_rows_file_makes_replay_differ(
    large_run: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = large_run / CONCURRENT / REQUESTS_FILENAME
    data = path.read_bytes()
    path.chmod(0o644)
    if damage == "edit":
        at = data.index(b'"elapsed_ms":') + len(b'"elapsed_ms":')
        digit = b"1" if data[at : at + 1] != b"1" else b"2"
        path.write_bytes(data[:at] + digit + data[at + 1 :])  # still a valid row
    elif damage == "truncate":
        path.write_bytes(data[: data.rindex(b"\n", 0, len(data) - 1) + 1])
    else:
        path.unlink()
    assert replay_command(str(large_run), reap=False) != 0
    out = capsys.readouterr().out
    assert f"DIFFERS {CONCURRENT}/cell.json" in out
    assert "rows file does not hold" in out
    code = "file.missing" if damage == "remove" else "rows.digest_mismatch"
    assert code in out


def test_each_checkpoint_names_its_prefix_and_the_reader_checks_every_one(
    tmp_path: Path,
) -> None:
    """The writer's checkpoints (one per ``rung_rows`` record) give the count and SHA-256 of
    every line so far, as ``rows_digest`` computes them; the reader checks each such mark
    where it falls inside a chunk, and refuses at the first that does not hold, before it
    gives a line past it."""
    lines = [
        RequestRowLine(rung_index=i % 3, concurrency=4, row=row)
        for i, row in enumerate(roster(5_000))
    ]
    path = str(tmp_path / REQUESTS_FILENAME)
    writer = RowFileWriter(path, REQUESTS_FILENAME, flush_bytes=4096)
    marks, first = [], 0
    for cut in (1, 1234, 5_000):
        writer.add_many(lines[first:cut])
        written = writer.checkpoint()
        assert (written.count, written.sha256) == rows_digest(lines[:cut], batch=7)
        marks.append((written.count, written.sha256))
        first = cut
    whole = writer.close()
    assert list(stream_rows(path, whole, marks=marks[:-1], chunk_bytes=4096)) == lines
    given: list[RequestRowLine] = []
    with pytest.raises(Refused) as refused:
        given.extend(stream_rows(path, whole, marks=[(1234, "0" * 64)], chunk_bytes=4096))
    assert refused.value.codes == ["rows.digest_mismatch"]
    assert len(given) < 1234  # no line of the chunk that holds the bad mark, or later
    with pytest.raises(Refused) as refused:
        list(stream_rows(path, whole, marks=[(5_001, whole.sha256)]))
    assert refused.value.codes == ["rows.digest_mismatch"]  # a mark past the file's end


def test_the_run_report_of_a_large_cell_is_the_one_its_inline_rows_give(
    large_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    streamed = render_run_report(read_run(str(large_run)))
    inline_run = tmp_path / "inline" / "run"
    inline_run.mkdir(parents=True)
    with monkeypatch.context() as patched:
        patched.setattr(schemas_request_rows, "INLINE_ROWS_MAX", 10**9)
        build_run(inline_run, concurrent_rungs=LARGE_RUNGS)
    inline = decode_cell_receipt((inline_run / CONCURRENT / "cell.json").read_bytes())
    assert inline.measurement.rows_file is None and inline.measurement.rungs[0].rows
    assert render_run_report(read_run(str(inline_run))) == streamed
    markdown = streamed[MARKDOWN_NAME].decode()
    assert "12000/12000" in markdown  # served from cache, counted from the rows file


def test_the_run_report_refuses_a_damaged_rows_file(large_run: Path) -> None:
    path = large_run / CONCURRENT / REQUESTS_FILENAME
    path.chmod(0o644)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(Refused) as refused:
        read_run(str(large_run))
    assert "rows.digest_mismatch" in refused.value.codes


# --- through the real run path, with the inline limit lowered ------------------------------

autojump_clock = budgets.autojump_clock  # the run tests' clock fixture, as is


async def test_a_cell_past_the_inline_limit_runs_publishes_its_rows_file_and_replays(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole run path (matrix, row, cell and load actors against a FAKE in-process host):
    the concurrent cell's rows (past a limit lowered to 3) land in its requests.jsonl, the
    serial cell's 3 stay inline, replay holds, and a damaged rows file makes it differ."""
    monkeypatch.setattr(schemas_request_rows, "INLINE_ROWS_MAX", 3)
    out = tmp_path / "out"
    script = budgets.FakeHostScript()
    prepared = budgets.make_prepared(tmp_path / "p", llama_parallel=2)
    assert (await budgets.run(prepared, out, script)).status == "completed"
    serial = budgets.cell(out, "native-serial")
    concurrent = budgets.cell(out, "sweep-native-concurrent")
    assert serial.measurement.rows_file is None and len(serial.measurement.rungs[0].rows) == 3
    rows_file = concurrent.measurement.rows_file
    assert rows_file is not None
    assert rows_file.count == sum(r.requested_requests for r in concurrent.measurement.rungs)
    assert all(r.rows == () and r.rung_summary for r in concurrent.measurement.rungs)
    path = out / "cell-0000" / "sweep-native-concurrent" / REQUESTS_FILENAME
    streamed = list(stream_rows(str(path), rows_file))
    assert {line.row.status for line in streamed} == {"completed"}
    # The journal holds no row: one rung_rows record per rung (the serial rung 0 has two,
    # its warmup request's and the rest), naming consecutive lines and their digests.
    journal = (out / "journal.jsonl").read_bytes()
    assert b'"request_outcome"' not in journal and b'"row":' not in journal
    segments = budgets.records(out, RungRows)
    by_cell = {
        cell_id: [(s.rung_index, s.first_line, s.count) for s in segments if s.cell_id == cell_id]
        for cell_id in (budgets.SERIAL, budgets.CONCURRENT)
    }
    assert by_cell[budgets.SERIAL] == [(0, 0, 1), (0, 1, 2)]
    assert [(r, c) for r, _, c in by_cell[budgets.CONCURRENT]] == [
        (r.rung_index, r.requested_requests) for r in concurrent.measurement.rungs
    ]
    last = [s for s in segments if s.cell_id == budgets.CONCURRENT][-1]
    assert (last.first_line + last.count, last.sha256) == (rows_file.count, rows_file.sha256)
    verdict = replay_module.replay(str(out))
    assert verdict.exit_code == 0, verdict.lines
    assert "cell-0000/sweep-native-concurrent/cell.json" in verdict.identical
    path.chmod(0o644)
    path.write_bytes(path.read_bytes().replace(b'"completed"', b'"failed"   ', 1))
    damaged = replay_module.replay(str(out))
    assert damaged.exit_code == 1
    assert damaged.mismatched == ["cell-0000/sweep-native-concurrent/cell.json"]
