"""The run report: ``report.md``, ``report.html`` and ``plots/*.svg`` from a run's receipts.

``render_run_report`` is pure (receipts in, files out) and deterministic, so a replay can
regenerate the files and compare them byte for byte. Arms are taken from the receipts, not
from a fixed list: every concurrent arm a row observed gets curves, and the old-versus-new
comparison pairs the arms named ``skippy-old`` and ``skippy-new`` when both have cells.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final
from urllib.parse import quote

from cache_family.report.decode import Refusals
from cache_family.report.html import markdown_to_html
from cache_family.report.render import cell, format_ms, render_report
from cache_family.report.run import ArmView, RowView, RunReceipts, measured_values
from cache_family.report.stats import (
    BOOTSTRAP_RESAMPLES,
    BOOTSTRAP_SEED,
    CONFIDENCE,
    MIN_SAMPLES,
    MedianDifference,
    bootstrap_median_difference,
)
from cache_family.report.svg import Panel, Series, line_panels
from cache_family.report.workloads import workload_sections
from cache_family.schemas.arms import NATIVE_CONCURRENT, SKIPPY_NEW, SKIPPY_OLD
from cache_family.schemas.matrix import MATRIX_FILENAME
from cache_family.schemas.measurement import RungSummary
from cache_family.schemas.receipts import CacheVerdict

MARKDOWN_NAME: Final = "report.md"
HTML_NAME: Final = "report.html"
PLOTS_DIR: Final = "plots"
JOURNAL_NAME: Final = "journal.jsonl"
OLD_ARM: Final = SKIPPY_OLD.name
NEW_ARM: Final = SKIPPY_NEW.name
SYNTHETIC_BANNER: Final = "synthetic: plumbing evidence, not a performance claim"
PAIRED_NOT_RUN: Final = "paired serving not run"
ARM_COLORS: Final = {
    NATIVE_CONCURRENT.name: "#1f77b4",
    OLD_ARM: "#d62728",
    NEW_ARM: "#2ca02c",
}
OTHER_COLORS: Final = ("#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


@dataclass(frozen=True, slots=True)
class _Rung:
    concurrency: int
    status: str
    summary: RungSummary | None
    #: ``measured_values`` of the rung's requests (inline rows, or streamed from the rows file).
    values: Mapping[str, Sequence[float]]
    verdict: CacheVerdict | None


def _rungs(arm: ArmView) -> list[_Rung]:
    if arm.cell is not None:
        streamed = arm.file_values or {}
        return [
            _Rung(
                r.concurrency,
                r.status,
                r.rung_summary,
                streamed.get(r.rung_index, {})
                if arm.file_values is not None
                else measured_values(r.rows),
                arm.verdicts.get(r.rung_index),
            )
            for r in arm.rungs
        ]
    return [_Rung(b.concurrency, b.status, b.rung_summary, {}, None) for b in arm.observation.rungs]


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _count(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def _url(path: str) -> str:
    """A relative POSIX path as a link target: percent-encoded, no scheme possible."""
    return quote(path, safe="/._~-")


def _href(run_href: str, relative: str) -> str:
    return _url(f"{run_href}/{relative}" if run_href else relative)


def _link(run_href: str, text: str, relative: str | None) -> str:
    if relative is None:
        return "n/a"
    return f"[{cell(text)}]({_href(run_href, relative)})"


def _row_name(view: RowView) -> str:
    entry = view.entry
    key = view.receipt.row_key if view.receipt and view.receipt.row_key else None
    name = key or f"{entry.case}-p{entry.prefix_tokens}"
    if entry.use_case:
        name += f" ({entry.use_case})"
    return name


def _title(view: RowView) -> str:
    """The row's name as table, heading and link text."""
    return cell(_row_name(view))


def _plot_name(view: RowView) -> str:
    """``plots/row-NNNN-<slug>.svg``: unique by row index, safe as a file name and a link."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", _row_name(view)).strip("_")
    return f"{PLOTS_DIR}/row-{view.entry.index:04d}-{slug}.svg"


def _color(arm: str, order: int) -> str:
    return ARM_COLORS.get(arm, OTHER_COLORS[order % len(OTHER_COLORS)])


def _synthetic(receipts: RunReceipts) -> bool:
    matrix = receipts.matrix
    if matrix.catalog is not None and matrix.catalog.synthetic:
        return True
    if any(row.synthetic for row in matrix.rows):
        return True
    for view in receipts.rows:
        if view.receipt is not None and view.receipt.synthetic:
            return True
        if any(arm.cell is not None and arm.cell.synthetic for arm in view.arms):
            return True
    reference = receipts.reference
    return reference is not None and any(row.plumbing for row in reference.rows)


def _plot(view: RowView, arms: Sequence[ArmView]) -> str:
    xs = sorted({r.concurrency for arm in arms for r in _rungs(arm)})
    labels = tuple(str(x) for x in xs)

    def values(
        arm: ArmView, pick: Callable[[RungSummary], float | None]
    ) -> tuple[float | None, ...]:
        by_c = {r.concurrency: r.summary for r in _rungs(arm)}
        out: list[float | None] = []
        for x in xs:
            summary = by_c.get(x)
            out.append(None if summary is None else pick(summary))
        return tuple(out)

    def percentiles(
        low: Callable[[RungSummary], float | None], high: Callable[[RungSummary], float | None]
    ) -> tuple[Series, ...]:
        out: list[Series] = []
        for k, arm in enumerate(arms):
            color = _color(arm.arm, k)
            out.append(Series(f"{arm.arm} p50", color, False, values(arm, low)))
            out.append(Series(f"{arm.arm} p99", color, True, values(arm, high)))
        return tuple(out)

    def plain(pick: Callable[[RungSummary], float | None]) -> tuple[Series, ...]:
        return tuple(
            Series(arm.arm, _color(arm.arm, k), False, values(arm, pick))
            for k, arm in enumerate(arms)
        )

    panels = (
        Panel(
            "TTFT p50 and p99",
            "ms",
            percentiles(lambda s: s.ttft_p50_ms, lambda s: s.ttft_p99_ms),
            format_ms,
        ),
        Panel(
            "TPOT p50 and p99",
            "ms",
            percentiles(lambda s: s.tpot_p50_ms, lambda s: s.tpot_p99_ms),
            format_ms,
        ),
        Panel("Throughput", "requests/s", plain(lambda s: s.throughput_requests_per_sec), _rate),
        Panel("Goodput", "requests/s", plain(lambda s: s.goodput_requests_per_sec), _rate),
    )
    return line_panels(f"Concurrency curves: {_row_name(view)}", labels, panels)


def _verdict_text(verdict: CacheVerdict | None) -> tuple[str, ...]:
    if verdict is None:
        return ("n/a", "n/a", "n/a")
    short = verdict.shortfall
    if short is None and verdict.expected_hits is not None and verdict.observed_hits is not None:
        short = verdict.observed_hits < verdict.expected_hits
    text = "n/a" if short is None else ("**short**" if short else "ok")
    if verdict.rule:
        text += f" ({cell(verdict.rule)})"
    expected = _count(verdict.expected_hits)
    observed = _count(verdict.observed_hits)
    if verdict.expected_cached_tokens is not None or verdict.observed_cached_tokens_min is not None:
        expected += f" / {_count(verdict.expected_cached_tokens)} tok"
        observed += f" / {_count(verdict.observed_cached_tokens_min)} tok"
    return (expected, observed, text)


def _curve_table(arms: Sequence[ArmView], with_verdicts: bool) -> list[str]:
    head = (
        "| Arm | Concurrency | Status | Measured/requested | TTFT p50 ms | TTFT p99 ms "
        "| TPOT p50 ms | TPOT p99 ms | Throughput req/s | Goodput req/s | Served from cache |"
    )
    align = "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    if with_verdicts:
        head += " Expected hits | Observed hits | Cache verdict |"
        align += " ---: | ---: | --- |"
    lines = [head, align]
    for arm in arms:
        for rung in _rungs(arm):
            s = rung.summary
            cached = rung.values.get("cache_n", ())
            served = f"{sum(1 for c in cached if c > 0)}/{len(cached)}" if cached else "n/a"
            fields = [
                cell(arm.arm),
                str(rung.concurrency),
                cell(rung.status),
                "n/a" if s is None else f"{s.measured_requests}/{s.requested_requests}",
                format_ms(None if s is None else s.ttft_p50_ms),
                format_ms(None if s is None else s.ttft_p99_ms),
                format_ms(None if s is None else s.tpot_p50_ms),
                format_ms(None if s is None else s.tpot_p99_ms),
                _rate(None if s is None else s.throughput_requests_per_sec),
                _rate(None if s is None else s.goodput_requests_per_sec),
                served,
            ]
            if with_verdicts:
                fields.extend(_verdict_text(rung.verdict))
            lines.append("| " + " | ".join(fields) + " |")
    return lines


def _curves(receipts: RunReceipts, svgs: dict[str, str]) -> list[str]:
    with_verdicts = any(arm.verdicts for view in receipts.rows for arm in view.arms)
    lines = [
        "## Concurrency curves",
        "",
        "Per row and concurrent arm, from each rung's summary in its `cell.json`: TTFT and",
        "TPOT at p50 and p99 (ms), throughput and goodput (requests/s; goodput counts requests",
        "meeting both the TTFT and the TPOT objective), and how many measured requests the",
        "server answered partly from its prompt cache (`cache_n` > 0).",
    ]
    if with_verdicts:
        lines.append(
            "Cache verdicts compare the hits the row's architecture should get with those observed."
        )
    without: list[str] = []
    for view in receipts.rows:
        arms = [arm for arm in view.arms if arm.concurrent]
        if not arms:
            reason = view.receipt.reason if view.receipt else view.entry.result.reason
            status = view.receipt.status if view.receipt else view.entry.result.status
            without.append(
                f"- {_title(view)}: {cell(status)}" + (f" ({cell(reason)})" if reason else "")
            )
            continue
        name = _plot_name(view)
        svgs[name] = _plot(view, arms)
        lines += [
            "",
            f"### {_title(view)}",
            "",
            # Brackets would end the image's alt text early.
            f"![Concurrency curves of {_title(view).replace('[', '(').replace(']', ')')}]({name})",
            "",
            *_curve_table(arms, with_verdicts),
        ]
    if without:
        lines += ["", "Rows without a concurrent arm:", "", *without]
    return lines


#: The per-request timings compared between old and new (names in ``ROW_VALUES``).
METRICS: Final = ("TTFT", "latency")


def _table_row(fields: Sequence[str]) -> str:
    return "| " + " | ".join(fields) + " |"


def _effect_cells(effect: MedianDifference | None) -> list[str]:
    """Old median, new median, difference, interval, relative difference, verdict."""
    if effect is None:
        return ["n/a"] * 5 + [f"fewer than {MIN_SAMPLES} requests"]
    relative = effect.relative
    return [
        format_ms(effect.median_old),
        format_ms(effect.median_new),
        f"{effect.difference:+.1f}",
        f"[{effect.low:+.1f}, {effect.high:+.1f}]",
        "n/a" if relative is None else f"{relative:+.1%}",
        effect.verdict,
    ]


def _comparison_rows(view: RowView, old: ArmView, new: ArmView) -> list[str]:
    """One line per rung both arms ran (matched by concurrency) and metric."""
    old_by_c = {r.concurrency: r for r in _rungs(old)}
    lines: list[str] = []
    for rung in _rungs(new):
        before = old_by_c.get(rung.concurrency)
        if before is None:
            continue
        for metric in METRICS:
            old_values, new_values = before.values.get(metric, ()), rung.values.get(metric, ())
            effect = bootstrap_median_difference(old_values, new_values)
            head = [_title(view), str(rung.concurrency), metric]
            counts = [str(len(old_values)), str(len(new_values))]
            lines.append(_table_row([*head, *counts, *_effect_cells(effect)]))
    return lines


def _comparison(receipts: RunReceipts) -> list[str]:
    lines = [
        "## Old versus new",
        "",
        "Per rung, the effect is median(new) - median(old) of per-request TTFT and end-to-end",
        f"latency (completed requests, warmups excluded), with a {CONFIDENCE:.0%} percentile",
        f"bootstrap interval: {BOOTSTRAP_RESAMPLES} resamples of each arm with replacement,",
        f"seed {BOOTSTRAP_SEED}. An interval that excludes 0 is a difference the samples",
        "support; negative means the new server is faster.",
        "",
    ]
    table: list[str] = []
    missing: list[str] = []
    for view in receipts.rows:
        by_arm = {arm.arm: arm for arm in view.arms}
        old, new = by_arm.get(OLD_ARM), by_arm.get(NEW_ARM)
        if old is None or new is None or old.cell is None or new.cell is None:
            reasons = sorted(
                {a.observation.reason for a in (old, new) if a is not None and a.observation.reason}
            )
            missing.append(
                f"- {_title(view)}: {PAIRED_NOT_RUN}"
                + (f" ({cell('; '.join(reasons))})" if reasons else "")
            )
            continue
        table += _comparison_rows(view, old, new)
    if table:
        lines += [
            "| Row | Concurrency | Metric | n old | n new | Old median ms | New median ms "
            f"| New - old ms | {CONFIDENCE:.0%} CI ms | Relative | Verdict |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |",
            *table,
        ]
        if missing:
            lines += ["", *missing]
    else:
        lines.append(f"No row has both `{OLD_ARM}` and `{NEW_ARM}` cells: {PAIRED_NOT_RUN}.")
    return lines


def _receipts_table(receipts: RunReceipts) -> list[str]:
    href = receipts.run_href
    lines = [
        "## Receipts",
        "",
        f"Run: {_link(href, MATRIX_FILENAME, MATRIX_FILENAME)}, "
        f"{_link(href, JOURNAL_NAME, JOURNAL_NAME)}"
        + (
            f", [production-cache-bench.json]({_url(receipts.reference.href)})"
            if receipts.reference is not None
            else ""
        )
        + ".",
        "",
        "| Row | Row status | Row receipt | Arm | Arm status | Cell receipt |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for view in receipts.rows:
        status = view.receipt.status if view.receipt else view.entry.result.status
        row_link = (
            _link(href, "row.json", view.row_path)
            if view.receipt
            else "absent"
            if view.row_path
            else "n/a"
        )
        if not view.arms:
            lines.append(f"| {_title(view)} | {cell(status)} | {row_link} | n/a | n/a | n/a |")
        for arm in view.arms:
            cell_link = (
                _link(href, "cell.json", arm.cell_path)
                if arm.cell is not None
                else ("absent" if arm.cell_path else "n/a")
            )
            lines.append(
                f"| {_title(view)} | {cell(status)} | {row_link} | {cell(arm.arm)} "
                f"| {cell(arm.observation.status)} | {cell_link} |"
            )
    return lines


def render_run_report(receipts: RunReceipts) -> dict[str, bytes]:
    """The report files (relative path -> bytes): ``report.md``, ``report.html`` and one
    ``plots/row-NNNN-<row>.svg`` per row with a concurrent arm. Raises ``Refused`` only when
    the reference tables refuse (a metadata-derived size that overflows 64 bits)."""
    matrix = receipts.matrix
    run_id = next((v.receipt.run_id for v in receipts.rows if v.receipt is not None), None)
    lines = ["# Cache-family run report", ""]
    if _synthetic(receipts):
        lines += [f"> {SYNTHETIC_BANNER}", ""]
    lines += [
        f"Run `{cell(run_id or 'unknown')}`: status **{cell(matrix.status)}**, "
        f"{len(matrix.rows)} planned rows, {matrix.planned_cells} planned cells.",
        "",
        f"Scope: {cell(matrix.scope)}.",
        "",
    ]
    reference = receipts.reference
    if reference is not None:
        refusals = Refusals()
        tables = render_report(reference.rows, reference.sources, reference.corpus_shown, refusals)
        refusals.raise_any()
        lines += ["## Reference tables", "", tables.rstrip("\n"), ""]
    svgs: dict[str, str] = {}
    lines += _curves(receipts, svgs)
    lines += [""]
    lines += _comparison(receipts)
    lines += [""]
    lines += [*workload_sections(receipts.workloads, svgs), ""] if receipts.workloads else []
    lines += _receipts_table(receipts)
    markdown = "\n".join(lines) + "\n"
    page = markdown_to_html(
        markdown,
        f"Cache-family run report {run_id or ''}".strip(),
        svgs,
    )
    files = {MARKDOWN_NAME: markdown.encode("utf-8"), HTML_NAME: page.encode("utf-8")}
    files.update((name, text.encode("utf-8")) for name, text in svgs.items())
    return dict(sorted(files.items()))
