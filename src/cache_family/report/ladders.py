"""A run's concurrency ladders as the report's sections read them: each rung of an arm with its
summary, per-request values and cache verdict, the row's name, and the table helpers those
sections share (``run_report.py``, ``comparisons.py``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Final

from cache_family.report.render import cell
from cache_family.report.run import ArmView, RowView, measured_values
from cache_family.report.stats import MedianDifference, bootstrap_median_difference
from cache_family.schemas.measurement import RungSummary
from cache_family.schemas.receipts import CacheVerdict

NOT_OBSERVABLE: Final = "not observable"
#: A per-rung table with more lines than this starts folded in the page (``<details>``).
FOLD_ABOVE_LINES: Final = 8


@dataclass(frozen=True, slots=True)
class LadderRung:
    concurrency: int
    status: str
    summary: RungSummary | None
    #: ``measured_values`` of the rung's requests (inline rows, or streamed from the rows file).
    values: Mapping[str, Sequence[float]]
    verdict: CacheVerdict | None
    #: Output tokens each request asked for (the rung's load request), when the cell says.
    output_tokens: int | None = None


def ladder_rungs(arm: ArmView) -> list[LadderRung]:
    if arm.cell is not None:
        streamed = arm.file_values or {}
        return [
            LadderRung(
                r.concurrency,
                r.status,
                r.rung_summary,
                streamed.get(r.rung_index, {})
                if arm.file_values is not None
                else measured_values(r.rows),
                arm.verdicts.get(r.rung_index),
                r.output_tokens,
            )
            for r in arm.rungs
        ]
    return [
        LadderRung(b.concurrency, b.status, b.rung_summary, {}, None) for b in arm.observation.rungs
    ]


def rung_tokens(rung: LadderRung) -> int | None:
    """Output tokens per request: as asked, else as observed when every request gave the
    same count (a rung from an observation only)."""
    if rung.output_tokens is not None:
        return rung.output_tokens
    s = rung.summary
    if s is None or s.measured_requests <= 0:
        return None
    per, rest = divmod(s.observed_completion_tokens, s.measured_requests)
    return per if rest == 0 else None


def unobserved(summary: RungSummary | None) -> bool:
    """Every measured request of the rung lacks a first-token time (it only came with the
    final event): TTFT and TPOT are not observable, never the elapsed time."""
    return summary is not None and summary.ttft_unobserved_count > 0 and summary.ttft_p50_ms is None


def median_effect(before: LadderRung, rung: LadderRung, metric: str) -> MedianDifference | None:
    """median(``rung``) - median(``before``) of one per-request metric, with its interval."""
    return bootstrap_median_difference(before.values.get(metric, ()), rung.values.get(metric, ()))


def row_name(view: RowView) -> str:
    entry = view.entry
    key = view.receipt.row_key if view.receipt and view.receipt.row_key else None
    name = key or f"{entry.case}-p{entry.prefix_tokens}"
    if entry.use_case:
        name += f" ({entry.use_case})"
    return name


def row_title(view: RowView) -> str:
    """The row's name as table, heading and link text."""
    return cell(row_name(view))


def table_row(fields: Sequence[str]) -> str:
    return "| " + " | ".join(fields) + " |"


def is_table_line(line: str) -> bool:
    return line.startswith("|")


def folded(summary: str, lines: list[str]) -> list[str]:
    """``lines`` (tables, an empty line between two) inside ``<details>`` when one of them
    is long: the page opens short, the figures stay one click away (and plain in the
    Markdown)."""
    tables = [len(list(rows)) for table, rows in groupby(lines, is_table_line) if table]
    if max(tables, default=0) <= FOLD_ABOVE_LINES:
        return lines
    return ["<details>", f"<summary>{summary}</summary>", "", *lines, "", "</details>"]
