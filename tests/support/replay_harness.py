"""Helpers several test modules share (they were in test_replay.py)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
from cell_journal_builder import CellScript, RowScript, row_records, run_started, serial_cell

from cache_family.actors.journal.writer import (
    JournalWriter,
    journal_path,
    publish_cell_receipt,
    publish_row_receipt,
)
from cache_family.actors.run.matrix import finish_run
from cache_family.schemas.journal import (
    GENESIS_PREV,
    ArmPlan,
    JournalChain,
    JournalSealed,
    decode_line,
)
from cache_family.states.cell import CellEvent, RowEvent


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


def rechain(lines: list[bytes], edit: Any = None) -> list[bytes]:
    """Every line re-chained after ``edit(index, object)`` changed the decoded objects, and
    the final seal recomputed over the result: what anyone with write access can do."""
    out: list[bytes] = []
    prev = GENESIS_PREV
    before = hashlib.sha256()
    for index, raw in enumerate(lines[:-1]):
        obj = msgspec.json.decode(raw)
        if edit is not None:
            edit(index, obj)
        obj["prev"] = prev
        data = msgspec.json.encode(obj)
        out.append(data)
        prev = hashlib.sha256(data).hexdigest()
        before.update(data + b"\n")
    last = decode_line(lines[-1])
    seal = last.record
    assert isinstance(seal, JournalSealed)
    chain = JournalChain(next_seq=last.seq, prev=prev)
    record = msgspec.structs.replace(seal, head_sha256=prev, through_seq=last.seq - 1)
    _, data = chain.seal(record, before, mono_ns=last.mono_ns, wall_ns=last.wall_ns)
    return [*out, data[:-1]]
