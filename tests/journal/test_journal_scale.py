"""The journal's hot paths keep its contract: the fast encoder writes exactly the canonical
bytes, the one-pass reader agrees with the line-by-line one, observations are buffered until a
state change (or a sync, a wait, the close, a full buffer), and the writer's lazily filed and
decoded index folds exactly what the file holds."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import trio
from cell_journal_builder import CellScript, run_started

from cache_family.actors.journal.writer import JournalWriter, journal_path
from cache_family.schemas.journal import (
    JournalChain,
    JournalLine,
    JournalSealed,
    PortReserved,
    Record,
    Transition,
    _read_checked,
    _read_intact,
    encode_journal,
    encode_line,
    read_journal,
)
from cache_family.schemas.receipts import encode_receipt
from cache_family.states.fold import JournalIndex, fold_cell


def sample_records() -> list[Record]:
    records: list[Record] = [run_started()]
    for i in range(3):
        records += CellScript(cell_id=f"cell-{i:04d}/native-serial", row_index=i).happy().records
    return records


def test_fast_encoders_write_the_canonical_line_bytes() -> None:
    records = [
        *sample_records(),
        JournalSealed(through_seq=7, head_sha256="a" * 64, matrix_status=None, digest="b" * 64),
    ]
    one, many, reference = JournalChain(), JournalChain(), JournalChain()
    items = [
        (record, -5 + i * 1_000_003, 1_700_000_000_000_000_000 + i)
        for i, record in enumerate(records)
    ]
    batched = many.encode_many(items)
    for (record, mono_ns, wall_ns), from_many in zip(items, batched, strict=True):
        expected = JournalLine(
            seq=reference.next_seq,
            mono_ns=mono_ns,
            wall_ns=wall_ns,
            prev=reference.prev,
            record=record,
        )
        _, from_line = reference.line(record, mono_ns=mono_ns, wall_ns=wall_ns)
        assert from_line == encode_line(expected) + b"\n"
        assert one.encode(record, mono_ns=mono_ns, wall_ns=wall_ns) == from_line == from_many
    assert one.prev == many.prev == reference.prev and one.next_seq == many.next_seq


def test_one_pass_reader_agrees_with_the_line_by_line_reader() -> None:
    data = encode_journal(sample_records())
    intact = _read_intact(data)
    assert intact is not None and intact == _read_checked(data) == read_journal(data)
    lines = data.split(b"\n")
    edited = b"\n".join([*lines[:3], lines[3].replace(b'"seq":4', b'"seq":5'), *lines[4:]])
    torn = data[:-1]
    for bad in (edited, torn, data + b"{}\n"):
        # At the first doubt the one-pass reader gives up and the checked one names the break.
        assert _read_intact(bad) is None
        assert read_journal(bad) == _read_checked(bad) and read_journal(bad).chain_break


async def test_observations_wait_in_the_buffer_until_a_state_change(
    tmp_path: Path, autojump_clock: object
) -> None:
    writer = JournalWriter(journal_path(str(tmp_path)))
    size = lambda: os.path.getsize(writer.path)  # noqa: E731
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        await writer.append(run_started())
        on_disk = size()
        for i in range(50):
            await writer.append(PortReserved(cell_id="c", port=9000 + i))
        await trio.sleep(1)
        assert size() == on_disk and writer.written_seq == 1 and writer.pending == 50
        fsyncs = writer.fsync_count
        await writer.append(
            Transition(machine="cell", cell_id="c", from_state="a", event="b", to_state="c")
        )
        # Everything before the state change went out with it: one write, one fsync.
        assert writer.fsync_count == fsyncs + 1 and writer.durable_seq == writer.written_seq == 52
        writer.append_nowait(PortReserved(cell_id="c", port=1))
        await writer.wait_written(53)  # a waiter gets the buffer written, not fsynced
        assert writer.written_seq == 53 and writer.durable_seq == 52
        assert writer.fsync_count == fsyncs + 1
        await writer.aclose()
    read = read_journal(Path(writer.path).read_bytes())
    assert read.chain_break is None and read.last_seq == 53


async def test_a_full_buffer_is_written_without_a_state_change(
    tmp_path: Path, autojump_clock: object
) -> None:
    writer = JournalWriter(journal_path(str(tmp_path)), flush_bytes=4096)
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        for i in range(200):
            await writer.append(PortReserved(cell_id="c", port=i))
        await trio.sleep(1)
        assert writer.written_seq > 150 and writer.durable_seq == 0 and writer.fsync_count == 0
        await writer.aclose()
    assert read_journal(Path(writer.path).read_bytes()).last_seq == 200


async def test_the_writers_index_folds_exactly_what_the_file_holds(
    tmp_path: Path, autojump_clock: object
) -> None:
    records = sample_records()
    writer = JournalWriter(journal_path(str(tmp_path)), batch_max=5)
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        for record in records:
            writer.append_nowait(record)
            await trio.lowlevel.checkpoint()
        through = await writer.sync()
        live = writer.index
        assert live.last_seq == through == len(records)
        from_file = JournalIndex(read_journal(Path(writer.path).read_bytes()).lines)
        assert live.cell_ids() == from_file.cell_ids()
        for cell_id in live.cell_ids():
            lines = live.lines_for_cell(cell_id)
            assert lines == from_file.lines_for_cell(cell_id)
            assert all(type(line) is JournalLine for line in lines)
            assert encode_receipt(fold_cell(lines, cell_id, through_seq=through)) == encode_receipt(
                fold_cell(from_file.lines_for_cell(cell_id), cell_id, through_seq=through)
            )
        assert live.lines_for_row(1) == from_file.lines_for_row(1)
        await writer.aclose()
    assert msgspec.json.decode(Path(writer.path).read_bytes().split(b"\n")[0])["seq"] == 1


async def test_a_backlog_longer_than_a_batch_keeps_call_order_and_durable_waits(
    tmp_path: Path, autojump_clock: object
) -> None:
    """The writer takes a long backlog a few records at a time; seqs stay call order and a
    state change queued behind the backlog returns only once it and all before it are
    fsynced."""
    writer = JournalWriter(journal_path(str(tmp_path)), batch_max=4)
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        # No checkpoint until the state change is queued: it waits behind 23 records, six
        # batches' worth.
        seqs = [writer.append_nowait(PortReserved(cell_id="c", port=i)) for i in range(23)]
        seq = await writer.append(
            Transition(machine="cell", cell_id="c", from_state="a", event="b", to_state="c")
        )
        assert seq == 24 and writer.durable_seq >= 24
        seqs += [writer.append_nowait(PortReserved(cell_id="c", port=100 + i)) for i in range(9)]
        assert await writer.sync() == 33 and writer.durable_seq == 33
        await writer.aclose()
    read = read_journal(Path(writer.path).read_bytes())
    assert read.chain_break is None
    assert [line.seq for line in read.lines] == list(range(1, 34))
    assert seqs == [*range(1, 24), *range(25, 34)]
    ports = [line.record.port for line in read.lines if isinstance(line.record, PortReserved)]
    assert ports == [*range(23), *range(100, 109)]
    assert isinstance(read.lines[23].record, Transition)


async def test_the_default_clock_stamps_trios_own_time(tmp_path: Path) -> None:
    """With trio's system clock the writer reads ``perf_counter_ns`` plus the clock's offset:
    the stamp must still be trio's time (what deadlines and budgets are computed in)."""
    writer = JournalWriter(journal_path(str(tmp_path)))
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        before = round(trio.current_time() * 1e9)
        writer.append_nowait(PortReserved(cell_id="c", port=1))
        after = round(trio.current_time() * 1e9)
        await writer.aclose()
    [line] = read_journal(Path(writer.path).read_bytes()).lines
    # Within a nanosecond of rounding on either side.
    assert before - 1 <= line.mono_ns <= after + 1
