"""``production-cache-bench.md``: the in-run producer variant of the combined report.

The run's ``production-cache-bench.json`` is read as ``cache-family report`` reads it and
rendered by the same renderer in its producer wording.
"""

from __future__ import annotations

from collections.abc import Iterable

from cache_family.report.decode import Refusals
from cache_family.report.render import render_report
from cache_family.report.rows import rows_from_bytes
from cache_family.report.sources import SourceEntry
from cache_family.schemas.journal import PlannedRowBrief
from cache_family.schemas.production import PRODUCTION_JSON


def producer_sources(briefs: Iterable[PlannedRowBrief]) -> tuple[SourceEntry, ...]:
    """The planned use cases, deduplicated by key, missing source fields as empty text."""
    seen: dict[str, SourceEntry] = {}
    for brief in briefs:
        if not brief.use_case or brief.use_case in seen:
            continue
        source = brief.use_case_source
        seen[brief.use_case] = SourceEntry(
            key=brief.use_case,
            label=brief.use_case_label,
            dataset=(source.dataset if source else None) or "",
            config=(source.config if source else None) or "",
            split=(source.split if source else None) or "",
            row_idx=source.row_idx if source else None,
        )
    return tuple(seen.values())


def render_producer_report(production: bytes, briefs: Iterable[PlannedRowBrief]) -> bytes:
    """The ``.md`` for the run's ``production-cache-bench.json`` bytes. Raises ``Refused``
    with what the reader or the renderer refused (the run journals it as a report error)."""
    refusals = Refusals()
    rows = rows_from_bytes(PRODUCTION_JSON, production, refusals)
    refusals.raise_any()
    text = render_report(rows, producer_sources(briefs), "", refusals, producer=True)
    refusals.raise_any()
    return text.encode("utf-8")
