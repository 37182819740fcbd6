"""The run's report files: ``production-cache-bench.json`` and ``production-cache-bench.md``.

Both are folded from the durable journal file, published fresh and journaled as receipts, so
replay regenerates and compares them; a file that cannot be written is journaled as
``report_failed`` and the matrix names the error.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from cache_family.actors.audit.production import production_json, production_md
from cache_family.actors.journal.writer import (
    JOURNAL_READ_LIMIT,
    JournalWriter,
    journal_path,
    publish_receipt,
)
from cache_family.errors import Refused
from cache_family.schemas.bounded import read_bounded
from cache_family.schemas.journal import (
    ReportFailed,
    read_journal,
)
from cache_family.schemas.production import (
    PRODUCTION_JSON,
    PRODUCTION_MAX_BYTES,
    PRODUCTION_MD,
)
from cache_family.states.fold import JournalIndex
from cache_family.states.matrix import (
    SCOPE_PRODUCTION_JSON,
    SCOPE_PRODUCTION_MD,
)


async def publish_report_files(writer: JournalWriter, run_dir: str) -> None:
    """Fold, publish and journal both files; a failure is journaled, never raised (the
    matrix and the seal still follow)."""
    through = await writer.sync()
    path = journal_path(run_dir)

    def fold() -> tuple[JournalIndex, bytes]:
        read = read_journal(read_bounded(path, JOURNAL_READ_LIMIT, what="journal").data)
        if read.chain_break is not None:
            raise Refused((read.chain_break.refusal(),))
        index = JournalIndex(read.lines)
        return index, production_json(index, through)

    try:
        index, data = await trio.to_thread.run_sync(fold)
    except Refused as refused:
        for name in (PRODUCTION_JSON, PRODUCTION_MD):
            await writer.append(ReportFailed(path=name, detail=str(refused)[:2000]))
        return
    if len(data) > PRODUCTION_MAX_BYTES:
        detail = f"{len(data)} bytes, more than the {PRODUCTION_MAX_BYTES} a report file may hold"
        for name in (PRODUCTION_JSON, PRODUCTION_MD):
            await writer.append(ReportFailed(path=name, detail=detail))
        return
    files: tuple[tuple[str, str, Callable[[], bytes]], ...] = (
        (PRODUCTION_JSON, SCOPE_PRODUCTION_JSON, lambda: data),
        (PRODUCTION_MD, SCOPE_PRODUCTION_MD, lambda: production_md(index, through)),
    )
    for name, scope, render in files:
        try:
            content = render()
            await publish_receipt(writer, run_dir, name, content, scope=scope, through=through)
        except (Refused, OSError) as exc:
            await writer.append(ReportFailed(path=name, detail=str(exc)[:2000]))
