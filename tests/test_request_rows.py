"""A cell's rows in their own streamed file: written in chunks with a running SHA-256, read
back never more than a chunk at a time with the digest checked at the end, and summarised
row by row into exactly the summary the whole roster gives."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest

from cache_family.actors import request_rows
from cache_family.actors.request_rows import RowFileWriter, stream_rows
from cache_family.errors import Refused
from cache_family.schemas.measurement import RequestRow
from cache_family.schemas.request_rows import RequestRowLine, RowsFileDigest
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
