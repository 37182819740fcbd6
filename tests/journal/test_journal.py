"""The journal: hash chain (edits, truncation, torn tail, reorder), tolerant typed decoding,
and the single writer task (seq order, fsync at state changes, batching, cancellation)."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from pathlib import Path

import msgspec
import pytest
import trio
from cell_journal_builder import CellScript, run_started
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_family.actors.journal.writer import JournalWriter, journal_path, publish_cell_receipt
from cache_family.errors import Refused
from cache_family.schemas.journal import (
    GENESIS_PREV,
    KNOWN_TAGS,
    RECORD_TYPES,
    Cancellation,
    CellOpened,
    ChildSpawned,
    CleanupOutcome,
    Fault,
    JournalChain,
    PinObserved,
    PlannedRowBrief,
    PortReserved,
    Ready,
    ReceiptPublished,
    Record,
    RowOpened,
    RunStarted,
    Transition,
    WarmupExclusion,
    encode_journal,
    read_journal,
)
from cache_family.schemas.measurement import HostCleanup
from cache_family.schemas.receipts import decode_cell_receipt, encode_receipt
from cache_family.schemas.workload_records import OverlapPointMeasured
from cache_family.states.cell import CellEvent
from cache_family.states.fold import fold_cell


def sample_records(n_cells: int = 1) -> list[Record]:
    records: list[Record] = [run_started()]
    for i in range(n_cells):
        records += (
            CellScript(cell_id=f"cell-{i:04d}/native-concurrent", row_index=i).happy().records
        )
    return records


def lines_of(data: bytes) -> list[bytes]:
    return data.split(b"\n")[:-1]


def join(lines: list[bytes]) -> bytes:
    return b"".join(line + b"\n" for line in lines)


# --- the chain ------------------------------------------------------------------------------


def test_round_trip_and_chain_layout() -> None:
    records = sample_records()
    data = encode_journal(records)
    read = read_journal(data)
    assert read.chain_break is None and not read.torn_tail and not read.unknown_types
    assert [line.record for line in read.lines] == records
    assert [line.seq for line in read.lines] == list(range(1, len(records) + 1))
    raw = lines_of(data)
    assert json.loads(raw[0])["prev"] == GENESIS_PREV == "0" * 64
    for previous, line in itertools.pairwise(raw):
        assert json.loads(line)["prev"] == hashlib.sha256(previous).hexdigest()
    assert json.loads(raw[0])["record"]["type"] == "run_started"


def test_every_record_type_has_a_unique_tag() -> None:
    assert len(KNOWN_TAGS) == len(RECORD_TYPES)
    assert "rung_rows" in KNOWN_TAGS and "request_outcome" not in KNOWN_TAGS


def test_edit_in_a_record_reports_that_line() -> None:
    data = encode_journal(sample_records())
    raw = lines_of(data)
    k = 5  # a pin_observed line: change one hex digit of its path-free content
    assert b"pin_observed" in raw[k - 1] or b"port_reserved" in raw[k - 1] or raw[k - 1]
    raw[k - 1] = raw[k - 1].replace(b'"wall_ns":4', b'"wall_ns":9', 1)
    read = read_journal(join(raw))
    assert read.first_bad_seq == k
    assert read.chain_break is not None and read.chain_break.code == "journal.chain.broken"
    assert read.last_seq == k - 1  # nothing from the edited line on is trusted


def test_edit_of_the_prev_field_reports_that_line() -> None:
    raw = lines_of(encode_journal(sample_records()))
    k = 7
    line = json.loads(raw[k - 1])
    raw[k - 1] = raw[k - 1].replace(line["prev"].encode(), b"e" * 64)
    assert read_journal(join(raw)).first_bad_seq == k


def test_undecodable_line() -> None:
    raw = lines_of(encode_journal(sample_records()))
    raw[3] = raw[3][:-1] + b"#"
    read = read_journal(join(raw))
    assert read.first_bad_seq == 4
    assert read.chain_break is not None and read.chain_break.code == "journal.line.undecodable"


def test_removed_line_and_reorder_report_the_position() -> None:
    raw = lines_of(encode_journal(sample_records()))
    removed = raw[:9] + raw[10:]
    read = read_journal(join(removed))
    assert read.first_bad_seq == 10
    assert read.chain_break is not None and read.chain_break.code == "journal.seq.out_of_order"
    swapped = list(raw)
    swapped[11], swapped[12] = swapped[12], swapped[11]
    assert read_journal(join(swapped)).first_bad_seq == 12


def test_torn_last_line_is_reported_and_never_used() -> None:
    data = encode_journal(sample_records())
    count = len(lines_of(data))
    torn = data[:-20]
    read = read_journal(torn)
    assert read.torn_tail
    assert read.first_bad_seq == count
    assert read.chain_break is not None and read.chain_break.code == "journal.line.torn"
    assert read.last_seq == count - 1
    # A tail that happens to be valid JSON but lacks its newline is still torn.
    assert read_journal(data[:-1]).first_bad_seq == count


def test_truncation_at_a_line_boundary_is_a_shorter_valid_journal() -> None:
    # The chain alone cannot see a clean truncation; replay catches it through receipts.
    raw = lines_of(encode_journal(sample_records()))
    read = read_journal(join(raw[:10]))
    assert read.chain_break is None and read.last_seq == 10


def test_unknown_record_type_is_a_typed_refusal_not_a_crash() -> None:
    chain = JournalChain()
    first, data1 = chain.line(run_started(), mono_ns=0, wall_ns=0)
    # A newer writer's record, chained correctly: the reader cannot type it.
    future = {
        "seq": 2,
        "mono_ns": 1,
        "wall_ns": 1,
        "prev": chain.prev,
        "record": {"type": "gpu_sampled", "watts": 300},
    }
    line2 = msgspec.json.encode(future)
    chain.prev = hashlib.sha256(line2).hexdigest()
    chain.next_seq = 3
    _, data3 = chain.line(Fault(cell_id=None, kind="internal"), mono_ns=2, wall_ns=2)
    read = read_journal(data1 + line2 + b"\n" + data3)
    assert read.chain_break is None
    assert [r.code for r in read.unknown_types] == ["journal.record.unknown_type"]
    assert "gpu_sampled" in read.unknown_types[0].message
    assert [line.seq for line in read.lines] == [1, 3]
    del first


def test_missing_new_fields_default_and_unknown_fields_are_refused() -> None:
    # An older writer did not know `detail`: it defaults. A field this reader does not know
    # (a newer writer's, or one added by hand to a re-chained journal) is refused, typed, and
    # the chain around it is still verified.
    known = {"type": "cancellation", "cell_id": None, "signal": "SIGINT"}
    line1 = _raw_line(1, GENESIS_PREV, known)
    line2 = _raw_line(2, hashlib.sha256(line1).hexdigest(), {**known, "extra": [1, 2]})
    line3 = _raw_line(3, hashlib.sha256(line2).hexdigest(), known)
    read = read_journal(line1 + b"\n" + line2 + b"\n" + line3 + b"\n")
    assert read.chain_break is None
    assert read.lines[0].record == Cancellation(cell_id=None, signal="SIGINT", detail="")
    assert [line.seq for line in read.lines] == [1, 3]
    [refusal] = read.unknown_types
    assert (refusal.code, refusal.path) == ("journal.record.unknown_field", "$.journal[1]")
    assert "field `extra` at `$.record`" in refusal.message


def _raw_line(seq: int, prev: str, record: dict[str, object]) -> bytes:
    return msgspec.json.encode(
        {"seq": seq, "mono_ns": seq, "wall_ns": seq, "prev": prev, "record": record}
    )


def test_fields_added_to_records_are_typed_not_dropped() -> None:
    """The argv, prompt, correctness, plan and synthetic-catalog fields are the records' own: a
    reader decodes them with their types, and a line from before them gets the defaults."""
    spawned = ChildSpawned(
        cell_id="cell-0000/native-serial",
        pid=7,
        create_time=1.5,
        argv_sha256="3" * 64,
        host_argv=("/bin/llama-server", "-t", "2"),
        host_env_names=("HOME", "OMP_NUM_THREADS"),
        host_threads="2",
    )
    warmup = WarmupExclusion(
        cell_id="cell-0000/native-serial",
        rung_index=0,
        request_ids=(0,),
        reason="serial",
        prompt_source="use-case",
        prompt_entry="tool_calling",
        prompt_corpus_path="/corpus.json",
        prompt_corpus_sha256="4" * 64,
        prompt_tokens=129,
        prompt_sha256="5" * 64,
    )
    opened = RowOpened(
        row_index=0,
        row_key="llama-p128",
        case_key="llama",
        correctness_status="not-run",
        correctness_reason="correctness arm not built yet",
        synthetic=True,
    )
    cell = CellOpened(
        cell_id="cell-0000/native-serial",
        row_index=0,
        row_key="llama-p128",
        arm="native-serial",
        cohort="native",
        cell_dir="cell-0000/native-serial",
        synthetic=True,
    )
    started = RunStarted(
        run_id="r",
        request_sha256="1" * 64,
        catalog_sha256="2" * 64,
        input_path="/in/cache-family-input.json",
        execution_seconds=1800,
        cell_seconds=300,
        request_timeout_ms=60000,
        operator_threads="2",
        planned_rows=(
            PlannedRowBrief(
                index=0,
                case="llama",
                prefix_tokens=128,
                use_case=None,
                model_status="present",
                output_relative="llama-p128",
                synthetic=True,
            ),
        ),
        catalog_path="/zoo/catalog.json",
        catalog_synthetic=True,
        catalog_packaged=False,
    )
    records: list[Record] = [started, opened, cell, spawned, warmup]
    read = read_journal(encode_journal(records))
    assert read.chain_break is None
    assert [line.record for line in read.lines] == records
    assert [type(line.record) for line in read.lines] == [type(r) for r in records]

    # The same records as a writer from before these fields wrote them.
    older = [
        {"type": "run_started", "run_id": "r", "request_sha256": "1", "catalog_sha256": "2"},
        {"type": "row_opened", "row_index": 0, "row_key": "k", "case_key": "c"},
        {"type": "cell_opened", "cell_id": "c", "row_index": 0, "row_key": "k",
         "arm": "native-serial", "cohort": "native", "cell_dir": "c"},
        {"type": "child_spawned", "cell_id": None, "pid": 7, "create_time": 1.5,
         "argv_sha256": "3"},
        {"type": "warmup_exclusion", "cell_id": "c", "rung_index": 0, "request_ids": [],
         "reason": "r"},
    ]  # fmt: skip
    data = b""
    prev = GENESIS_PREV
    for seq, record in enumerate(older, start=1):
        line = _raw_line(seq, prev, record)
        prev = hashlib.sha256(line).hexdigest()
        data += line + b"\n"
    read = read_journal(data)
    assert read.chain_break is None and len(read.lines) == len(older)
    run, row, opened_cell, child, warm = (line.record for line in read.lines)
    assert isinstance(run, RunStarted) and run.planned_rows == () and run.input_path == ""
    assert run.execution_seconds is None and run.operator_threads is None
    assert (run.catalog_path, run.catalog_synthetic, run.catalog_packaged) == ("", False, False)
    assert isinstance(row, RowOpened)
    assert (row.correctness_status, row.correctness_reason) == ("not-run", None)
    assert row.synthetic is False
    assert isinstance(opened_cell, CellOpened) and opened_cell.synthetic is False
    assert isinstance(child, ChildSpawned) and child.host_argv == () and child.host_threads is None
    assert isinstance(warm, WarmupExclusion) and warm.prompt_tokens is None
    assert warm.prompt_source == warm.prompt_sha256 == ""


def test_cleanup_outcome_carries_every_custody_finding() -> None:
    found = HostCleanup(
        pid=7,
        graceful=True,
        forced=False,
        escaped_descendants=(8,),
        capture_truncated=True,
        oversized_lines=3,
        grace_shortened=True,
        bounded_out=True,
        state_dir_error="Directory not empty",
    )
    record = CleanupOutcome(cell_id="cell-0000/native-serial", cleanup=found)
    [line] = read_journal(encode_journal([record])).lines
    assert line.record == record
    brief = {"pid": None, "graceful": True, "forced": False}
    older = {"type": "cleanup_outcome", "cell_id": "c", "cleanup": brief}
    [line] = read_journal(_raw_line(1, GENESIS_PREV, older) + b"\n").lines
    assert isinstance(line.record, CleanupOutcome)
    clean = line.record.cleanup
    assert clean.escaped_descendants == () and not clean.capture_truncated
    assert clean.oversized_lines == 0 and not clean.bounded_out and not clean.grace_shortened
    assert clean.state_dir_error is None
    # Defaults confirm nothing: a brief record is not clean custody.
    assert [kind for kind, _ in clean.problems()] == ["cleanup_unclean"]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_single_byte_edit_before_the_last_line_is_found_at_its_line(
    data: st.DataObject,
) -> None:
    raw = lines_of(encode_journal(sample_records()))
    k = data.draw(st.integers(1, len(raw) - 1), label="line")
    line = raw[k - 1]
    pos = data.draw(st.integers(0, len(line) - 1), label="offset")
    new = data.draw(st.integers(0x20, 0x7E).filter(lambda b: b != line[pos]), label="byte")
    raw[k - 1] = line[:pos] + bytes([new]) + line[pos + 1 :]
    read = read_journal(join(raw))
    assert read.first_bad_seq == k, (k, pos, chr(new), read.chain_break)


# --- the writer -----------------------------------------------------------------------------


class CountingFsync:
    """Fake fsync that records which file descriptors were synced and when (by seq)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, fd: int) -> None:
        self.calls += 1
        os.fsync(fd)


def wall_counter() -> object:
    state = {"now": 1_700_000_000_000_000_000}

    def wall_ns() -> int:
        state["now"] += 1000
        return state["now"]

    return wall_ns


def make_writer(tmp_path: Path, **kwargs: object) -> tuple[JournalWriter, CountingFsync]:
    fsync = CountingFsync()
    writer = JournalWriter(
        journal_path(str(tmp_path)),
        fsync=fsync,
        wall_ns=wall_counter(),
        **kwargs,  # type: ignore[arg-type]
    )
    return writer, fsync


async def test_a_workload_point_is_durable_as_soon_as_it_is_journaled(
    tmp_path: Path, autojump_clock: object
) -> None:
    """Nothing follows a point inside the workload state, so no later state change would
    fsync it: a run killed outright keeps every point journaled before the kill."""
    writer, fsync = make_writer(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        await writer.append(run_started())
        point = OverlapPointMeasured(
            cell_id="cell-0000",
            hit_ratio_pct=90,
            prompt_tokens=1024,
            rule="exact_prefix",
            requested_prefix_tokens=921,
            shared_prefix_tokens=921,
            reusable_tokens=921,
            groups=2,
            seed=7,
        )
        seq = await writer.append(point)
        assert writer.durable_seq == seq == 2 and fsync.calls == 2
        await writer.aclose()
    lines = Path(journal_path(str(tmp_path))).read_bytes().splitlines()
    assert b'"type":"overlap_point"' in lines[-1]


async def test_fsync_only_at_state_changes_and_batches(
    tmp_path: Path, autojump_clock: object
) -> None:
    writer, fsync = make_writer(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        assert await writer.append(run_started()) == 1  # durable: waits for fsync
        assert fsync.calls == 1 and writer.durable_seq == 1
        cell = CellScript()
        seqs = [
            writer.append_nowait(PortReserved(cell_id=cell.cell_id, port=8000 + i))
            for i in range(20)
        ]
        assert seqs == list(range(2, 22))
        for i in range(20):
            await writer.append(Ready(cell_id=cell.cell_id, url=f"u{i}", attempts=1))
        await writer.wait_written(41)
        assert fsync.calls == 1, "observations alone never fsync"
        assert writer.written_seq == 41 and writer.durable_seq == 1
        seq = await writer.append(
            Transition(
                machine="cell",
                cell_id=cell.cell_id,
                from_state="pin-verify",
                event="pins-verified",
                to_state="launch",
            )
        )
        assert seq == 42 and fsync.calls == 2 and writer.durable_seq == 42
        assert "pending=0" in repr(writer) and "state=running" in repr(writer)
        await writer.aclose()
    assert writer.state == "closed"
    read = read_journal(Path(writer.path).read_bytes())
    assert read.chain_break is None and read.last_seq == 42


async def test_many_tasks_get_consecutive_seqs_in_file_order(
    tmp_path: Path, autojump_clock: object
) -> None:
    writer, _ = make_writer(tmp_path, batch_max=7)
    got: list[tuple[int, str]] = []

    async def appender(name: str) -> None:
        for i in range(15):
            seq = await writer.append(
                Fault(cell_id=name, kind="internal", detail=str(i)), durable=(i % 4 == 0)
            )
            got.append((seq, f"{name}:{i}"))
            await trio.sleep(0.001 * (i % 3))  # virtual time: autojump_clock interleaves tasks

    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        async with trio.open_nursery() as inner:
            for name in "abcd":
                inner.start_soon(appender, name)
        await writer.aclose()
    read = read_journal(Path(writer.path).read_bytes())
    assert read.chain_break is None
    by_seq = {line.seq: f"{line.record.cell_id}:{line.record.detail}" for line in read.lines}  # type: ignore[union-attr]
    assert sorted(by_seq) == list(range(1, 61))
    assert all(by_seq[seq] == label for seq, label in got)


async def test_monotonic_stamps_come_from_the_trio_clock(
    tmp_path: Path, autojump_clock: object
) -> None:
    writer, _ = make_writer(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        await writer.append(run_started())
        await trio.sleep(5)
        await writer.append(Fault(cell_id=None, kind="internal"))
        await writer.aclose()
    first, second = read_journal(Path(writer.path).read_bytes()).lines
    assert second.mono_ns - first.mono_ns == 5_000_000_000
    assert second.wall_ns > first.wall_ns


async def test_cancelled_writer_still_writes_what_was_queued(
    tmp_path: Path, autojump_clock: object
) -> None:
    writer, fsync = make_writer(tmp_path)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            for i in range(5):
                writer.append_nowait(PortReserved(cell_id="c", port=9000 + i))
            scope.cancel()
    assert writer.state == "closed"
    read = read_journal(Path(writer.path).read_bytes())
    assert read.chain_break is None and read.last_seq == 5
    assert fsync.calls >= 1  # the final flush is durable
    with pytest.raises(Refused) as refused:
        writer.append_nowait(Fault(cell_id=None, kind="internal"))
    assert refused.value.codes == ["journal.closed"]


async def test_failed_fsync_is_a_typed_refusal_for_the_waiter(
    tmp_path: Path, autojump_clock: object
) -> None:
    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    writer = JournalWriter(journal_path(str(tmp_path)), fsync=broken_fsync)
    with pytest.raises(ExceptionGroup) as group:
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            with pytest.raises(Refused) as refused:
                await writer.append(run_started())
            assert refused.value.codes == ["journal.write.failed"]
            assert "No space left" in str(refused.value)
    assert group.value.subgroup(OSError) is not None
    assert writer.state == "failed"
    with pytest.raises(Refused):
        writer.append_nowait(Fault(cell_id=None, kind="internal"))


async def test_a_run_directory_gets_one_fresh_journal(tmp_path: Path) -> None:
    Path(journal_path(str(tmp_path))).write_bytes(b"")
    writer = JournalWriter(journal_path(str(tmp_path)))
    async with trio.open_nursery() as nursery:
        with pytest.raises(Refused) as refused:
            await nursery.start(writer.run)
    assert refused.value.codes == ["journal.exists"]
    await writer.aclose()  # closing a writer that never started is harmless


async def test_resume_continues_the_chain_and_refuses_a_torn_journal(
    tmp_path: Path, autojump_clock: object
) -> None:
    path = journal_path(str(tmp_path))
    first = JournalWriter(path)
    async with trio.open_nursery() as nursery:
        await nursery.start(first.run)
        await first.append(run_started())
        await first.append(Fault(cell_id=None, kind="internal"))
        await first.aclose()
    second = JournalWriter(path, resume=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(second.run)
        assert await second.append(Cancellation(cell_id=None, signal="SIGTERM")) == 3
        await second.aclose()
    read = read_journal(Path(path).read_bytes())
    assert read.chain_break is None and read.last_seq == 3
    with open(path, "ab") as handle:
        handle.write(b'{"seq":4')
    third = JournalWriter(path, resume=True)
    async with trio.open_nursery() as nursery:
        with pytest.raises(Refused) as refused:
            await nursery.start(third.run)
    assert refused.value.codes == ["journal.line.torn"]


async def test_published_cell_receipt_is_the_fold_of_the_file(
    tmp_path: Path, autojump_clock: object
) -> None:
    writer, fsync = make_writer(tmp_path)
    script = CellScript(cell_id="cell-0000/native-concurrent")
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        await writer.append(run_started())
        for record in script.happy().records:
            await writer.append(record)
        (tmp_path / "cell-0000" / "native-concurrent").mkdir(parents=True)
        script.write_rows(str(tmp_path / "cell-0000" / "native-concurrent"))
        syncs_before = fsync.calls
        publication = await publish_cell_receipt(
            writer, str(tmp_path), script.cell_id, "cell-0000/native-concurrent/cell.json"
        )
        published = publication.record
        assert fsync.calls > syncs_before
        script.fire(CellEvent.RECEIPT_PUBLISHED)
        await writer.append(script.records[-1])
        await writer.aclose()
    read = read_journal(Path(writer.path).read_bytes())
    published_lines = [line for line in read.lines if isinstance(line.record, ReceiptPublished)]
    assert [line.record for line in published_lines] == [published]
    assert published.through_seq == published_lines[0].seq - 1
    on_disk = (tmp_path / published.path).read_bytes()
    assert hashlib.sha256(on_disk).hexdigest() == published.sha256
    refolded = fold_cell(
        read.lines, script.cell_id, through_seq=published.through_seq, rows=script.rows_source
    )
    assert encode_receipt(refolded) == on_disk
    # What the caller gets back is the receipt as published, without reading the file again.
    assert publication.receipt == refolded == decode_cell_receipt(on_disk)
    assert refolded.status == "completed" and refolded.final_state == "finalize"
    assert isinstance(read.lines[1].record, CellOpened)
    assert isinstance(read.lines[2].record, PinObserved)
    assert isinstance(read.lines[0].record, RunStarted)


# The field order of every record as first published. The evolution rule lets a record grow
# only at the end, with defaults; renaming, retyping or reordering breaks old journals.
PUBLISHED_FIELDS: dict[str, tuple[str, ...]] = {
    "run_started": ("run_id", "request_sha256", "catalog_sha256", "tool_version"),
    "cancellation": ("cell_id", "signal", "detail"),
    "deadline_expired": ("cell_id", "budget", "detail"),
    "interrupt_finish_failed": ("detail",),
    "row_opened": (
        "row_index",
        "row_key",
        "case_key",
        "prefix_tokens",
        "use_case",
        "row_dir",
        "model_status",
        "arms",
    ),
    "cell_opened": (
        "cell_id",
        "row_index",
        "row_key",
        "arm",
        "cohort",
        "cell_dir",
        "measurement_kind",
        "rungs",
        "ttft_slo_ms",
        "tpot_slo_ms",
    ),
    "transition": ("machine", "cell_id", "row_index", "from_state", "event", "to_state"),
    "pin_observed": ("cell_id", "phase", "name", "path", "expected_sha256", "observed_sha256"),
    "pin_drift": ("cell_id", "phase", "name", "path", "expected_sha256", "observed_sha256"),
    "port_reserved": ("cell_id", "port"),
    "child_spawned": ("cell_id", "role", "pid", "create_time", "pgid", "argv_sha256", "executable"),
    "listening_marker_seen": ("cell_id", "pid", "port", "marker"),
    "ready": ("cell_id", "url", "attempts", "elapsed_ms"),
    "warmup_exclusion": ("cell_id", "rung_index", "request_ids", "reason"),
    "rung_rows": (
        "cell_id",
        "rung_index",
        "concurrency",
        "path",
        "first_line",
        "count",
        "completed",
        "sha256",
    ),
    "rung_completed": (
        "cell_id",
        "rung_index",
        "concurrency",
        "requested_requests",
        "status",
        "makespan_seconds",
        "prompt_sha256",
        "output_tokens",
        "host_pid",
        "host_create_time",
        "stop_reason",
    ),
    "fault": ("cell_id", "kind", "detail", "pid"),
    # Re-published by issue 8 as custody's one cleanup record (journals before it do not replay).
    "cleanup_outcome": ("cell_id", "cleanup"),
    "receipt_published": ("scope", "cell_id", "row_index", "path", "sha256", "through_seq"),
    # Issue 10: resume and the seal.
    "run_resumed": ("resumed_after_seq",),
    "report_failed": ("path",),
    "journal_sealed": ("through_seq", "head_sha256"),
    # Published by issue 10 (the correctness arm).
    "correctness_topology": ("row_index", "topology_index", "topology", "status"),
    "correctness_verdict": ("row_index", "status"),
    "cli_admission": ("cell_id", "binary", "binary_sha256", "dialect"),
    # Issue 13: the run's own client overhead, before the first ladder.
    "client_calibrated": (),
    # Issue 22: every file of the run directory, bound before the matrix.
    "run_files": (),
    "rows_selected": (
        "prepared_sha256",
        "how",
        "row_keys",
        "shard_index",
        "shard_count",
        "unselected_rows",
        "host",
    ),
    # Issue 20: the workload cells' measurements.
    "workload_opened": (
        "cell_id",
        "kind",
        "spec_json",
        "workloads_sha256",
        "architecture",
        "rule",
        "vocabulary_size",
    ),
    "overlap_point": (
        "cell_id",
        "hit_ratio_pct",
        "prompt_tokens",
        "rule",
        "requested_prefix_tokens",
        "shared_prefix_tokens",
        "reusable_tokens",
        "groups",
        "seed",
        "requests",
    ),
    "sessions_measured": ("cell_id", "users", "turns", "seed", "think_time_ms", "requests"),
    "open_loop_stage": (
        "cell_id",
        "stage",
        "pattern",
        "burstiness",
        "seed",
        "target_rate_per_s",
        "measured_rate_per_s",
        "scheduled",
        "launched",
        "completed",
        "achieved_rate_per_s",
        "lateness_p50_ms",
        "lateness_p99_ms",
        "lateness_max_ms",
        "fit_statistic",
        "fit_value",
        "fit_p_value",
        "completed_per_s",
        "stop_reason",
        "stop_detail",
        "skipped_because",
    ),
    "workload_stopped": ("cell_id", "kind", "reason", "point_index", "sent", "detail"),
    "chat_template": ("cell_id", "pieces", "piece_count", "template_source"),
    "reuse_probed": ("cell_id", "header_rule", "sliding_window", "n_ubatch", "steps", "rule"),
    "trace_request": ("cell_id", "index", "line", "scheduled_s"),
    "trace_replayed": (
        "cell_id",
        "path",
        "sha256",
        "format",
        "block_tokens",
        "tokens_per_block",
        "time_scale",
        "output_tokens_cap",
        "window_json",
        "requests",
        "distinct_ids",
    ),
    "server_metrics": (
        "cell_id",
        "scope",
        "index",
        "status",
        "reason",
        "refusal_code",
        "path",
        "before_bytes",
        "after_bytes",
        "counters",
        "client",
    ),
}


@pytest.mark.parametrize("record_type", RECORD_TYPES, ids=lambda t: t.__name__)
def test_records_only_grow_at_the_end_with_defaults(record_type: type) -> None:
    tag = record_type.__struct_config__.tag
    fields = tuple(record_type.__struct_fields__)
    published = PUBLISHED_FIELDS[tag]
    assert fields[: len(published)] == published
    added = fields[len(published) :]
    defaults = (
        dict(
            zip(
                fields[-len(record_type.__struct_defaults__) :],
                record_type.__struct_defaults__,
                strict=True,
            )
        )
        if added
        else {}
    )
    assert all(name in defaults for name in added), f"{tag}: new fields need defaults"
    assert record_type.__struct_config__.frozen
