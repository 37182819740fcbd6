"""The run's report files as the journal folds them: ``production-cache-bench.json`` and ``.md``.

The run publishes these bytes (``actors/run/report_files.py``) and replay refolds them to
compare; both read the same functions.
"""

from __future__ import annotations

from cache_family.report.producer import render_producer_report
from cache_family.schemas.journal import PlannedRowBrief, ReceiptPublished, RunStarted
from cache_family.schemas.production import encode_production
from cache_family.states.fold import JournalIndex
from cache_family.states.matrix import fold_production


def _briefs(index: JournalIndex, through_seq: int) -> tuple[PlannedRowBrief, ...]:
    for line in index.lines_for_cell(""):
        if line.seq <= through_seq and isinstance(line.record, RunStarted):
            return line.record.planned_rows
    return ()


def production_json(index: JournalIndex, through_seq: int) -> bytes:
    return encode_production(fold_production(index, through_seq=through_seq))


def production_md(index: JournalIndex, through_seq: int) -> bytes:
    return render_producer_report(production_json(index, through_seq), _briefs(index, through_seq))


def refold_production_md(index: JournalIndex, published: ReceiptPublished) -> bytes:
    return production_md(index, published.through_seq)
