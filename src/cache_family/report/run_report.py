"""The run report: ``report.md``, ``report.html`` and ``plots/*.svg`` from a run's receipts.

``render_run_report`` is pure and deterministic, so replay regenerates and compares the files
byte for byte. Arms come from the receipts, not a fixed list; a section appears only when the
run measured what it reports.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Final
from urllib.parse import quote

import msgspec
from msgspec import UnsetType

from cache_family.report.comparisons import (
    LADDER_COMPARISONS,
    OLD_VERSUS_NEW,
    PAIRED_NOT_RUN,
    compared,
    comparison_section,
)
from cache_family.report.decode import Refusals
from cache_family.report.html import anchor, markdown_to_html
from cache_family.report.ladders import (
    NOT_OBSERVABLE,
    LadderRung,
    folded,
    ladder_rungs,
    median_effect,
    row_name,
    row_title,
    rung_tokens,
    table_row,
    unobserved,
)
from cache_family.report.render import (
    FULL_SECTION,
    PACKAGE_SECTION,
    USE_CASE_SECTION,
    baseline,
    cell,
    format_ms,
    hit_ms,
    reference_sections,
    speedup,
)
from cache_family.report.rows import BaselineFigures, ReportRow, SkippyFigures
from cache_family.report.run import ArmView, RowView, RunReceipts
from cache_family.report.server_metrics import SERVER_METRICS_NOTE, server_metrics_table
from cache_family.report.stats import (
    CONFIDENCE,
    MIN_SAMPLES,
    MedianDifference,
    median,
)
from cache_family.report.svg import CONCURRENCY, Panel, Series, line_panels
from cache_family.report.workloads import workload_sections
from cache_family.schemas.arms import NATIVE_CONCURRENT, SKIPPY_NEW, SKIPPY_OLD
from cache_family.schemas.matrix import MATRIX_FILENAME
from cache_family.schemas.measurement import RungSummary
from cache_family.schemas.production import Figure, ProducerRow
from cache_family.schemas.receipts import CacheVerdict

MARKDOWN_NAME: Final = "report.md"
#: The first line of ``report.md``: which layout wrote it. Replay regenerates and compares the
#: files of a report of this layout only (a run reported by an earlier layout says so instead).
FORMAT_LINE: Final = "<!-- cache-family run report, format 3 -->"
HTML_NAME: Final = "report.html"
PLOTS_DIR: Final = "plots"
JOURNAL_NAME: Final = "journal.jsonl"
NATIVE_ARM: Final = NATIVE_CONCURRENT.name
OLD_ARM: Final = SKIPPY_OLD.name
NEW_ARM: Final = SKIPPY_NEW.name
SYNTHETIC_BANNER: Final = "synthetic: plumbing evidence, not a performance claim"
#: How the report names what a run did not measure, in the line that says so.
NOT_RUN_NAMES: Final = {
    FULL_SECTION: "full-GGUF rows",
    USE_CASE_SECTION: "use-case rows",
    PACKAGE_SECTION: "package-only rows",
}
NO_LADDERS: Final = "concurrency ladders"
NO_WORKLOADS: Final = "workloads"
#: How output tokens per request are named in every legend and table.
TOKENS_UNIT: Final = "output tok/req"
ARM_COLORS: Final = {
    NATIVE_ARM: "#1f77b4",
    OLD_ARM: "#d62728",
    NEW_ARM: "#2ca02c",
}
OTHER_COLORS: Final = ("#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def _arm_tokens(arm: ArmView) -> str:
    """The arm's output tokens per request as a label: one number, or each one it used."""
    counts = sorted({t for t in (rung_tokens(r) for r in ladder_rungs(arm)) if t is not None})
    return "/".join(str(c) for c in counts) if counts else "n/a"


def _series_name(arm: ArmView) -> str:
    return f"{arm.arm}, {_arm_tokens(arm)} {TOKENS_UNIT}"


def _ttft_cell(summary: RungSummary | None, value: float | None) -> str:
    if unobserved(summary):
        return NOT_OBSERVABLE
    text = format_ms(value)
    if summary is not None and summary.ttft_unobserved_count and value is not None:
        text += f" ({summary.ttft_unobserved_count} not observable)"
    return text


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


def _plot_name(view: RowView) -> str:
    """``plots/row-NNNN-<slug>.svg``: unique by row index, safe as a file name and a link."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", row_name(view)).strip("_")
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


def _real_evidence(receipts: RunReceipts) -> list[str]:
    """What the run's real-model rows are (model, CPU, threads, load, GPUs), each text once."""
    found = (
        view.receipt.evidence_class
        for view in receipts.rows
        if view.receipt is not None and not view.receipt.synthetic
    )
    return list(dict.fromkeys(text for text in found if text))


def _plot(view: RowView, arms: Sequence[ArmView]) -> str:
    xs = sorted({r.concurrency for arm in arms for r in ladder_rungs(arm)})
    labels = tuple(str(x) for x in xs)

    def values(
        arm: ArmView, pick: Callable[[RungSummary], float | None]
    ) -> tuple[float | None, ...]:
        by_c = {r.concurrency: r.summary for r in ladder_rungs(arm)}
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
            name = _series_name(arm)
            out.append(Series(f"{name}, p50", color, False, values(arm, low)))
            out.append(Series(f"{name}, p99", color, True, values(arm, high)))
        return tuple(out)

    def plain(pick: Callable[[RungSummary], float | None]) -> tuple[Series, ...]:
        return tuple(
            Series(_series_name(arm), _color(arm.arm, k), False, values(arm, pick))
            for k, arm in enumerate(arms)
        )

    hidden = [arm.arm for arm in arms if any(unobserved(r.summary) for r in ladder_rungs(arm))]
    note = f"{NOT_OBSERVABLE}: {', '.join(hidden)}" if hidden else ""
    panels = (
        Panel(
            "TTFT p50 and p99",
            "ms",
            percentiles(lambda s: s.ttft_p50_ms, lambda s: s.ttft_p99_ms),
            format_ms,
            note,
        ),
        Panel(
            "TPOT p50 and p99",
            "ms",
            percentiles(lambda s: s.tpot_p50_ms, lambda s: s.tpot_p99_ms),
            format_ms,
            note,
        ),
        Panel("Throughput", "requests/s", plain(lambda s: s.throughput_requests_per_sec), _rate),
        Panel("Output tokens", "tokens/s", plain(lambda s: s.output_tokens_per_sec), _rate),
        Panel("Goodput", "requests/s", plain(lambda s: s.goodput_requests_per_sec), _rate),
    )
    return line_panels(f"Concurrency curves: {row_name(view)}", labels, panels, axis=CONCURRENCY)


def _verdict_text(verdict: CacheVerdict | None, rules: dict[str, int]) -> tuple[str, ...]:
    """Expected hits, observed hits and the verdict; the verdict's rule (a sentence, the same
    for every rung of an arm) as a numbered note, its number in ``rules``."""
    if verdict is None:
        return ("n/a", "n/a", "n/a")
    short = verdict.shortfall
    if short is None and verdict.expected_hits is not None and verdict.observed_hits is not None:
        short = verdict.observed_hits < verdict.expected_hits
    text = "n/a" if short is None else ("**short**" if short else "ok")
    if verdict.rule:
        text += f" [{rules.setdefault(cell(verdict.rule), len(rules) + 1)}]"
    expected = _count(verdict.expected_hits)
    observed = _count(verdict.observed_hits)
    if verdict.expected_cached_tokens is not None or verdict.observed_cached_tokens_min is not None:
        expected += f" / {_count(verdict.expected_cached_tokens)} tok"
        observed += f" / {_count(verdict.observed_cached_tokens_min)} tok"
    return (expected, observed, text)


def _curve_tables(arms: Sequence[ArmView], with_verdicts: bool) -> list[str]:
    """Two tables per row, so each fits a desktop window: the latencies of each arm's rungs,
    then their rates and cache figures."""
    latency = [
        "| Arm | Output tok/req | Concurrency | Status | Measured/requested | TTFT p50 ms "
        "| TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    rates = [
        "| Arm | Concurrency | Throughput req/s | Output tok/s | Goodput req/s "
        "| Served from cache |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    if with_verdicts:
        rates[0] += " Expected hits | Observed hits | Cache verdict |"
        rates[1] += " ---: | ---: | --- |"
    rules: dict[str, int] = {}
    for arm in arms:
        for rung in ladder_rungs(arm):
            s = rung.summary
            cached = rung.values.get("cache_n", ())
            served = f"{sum(1 for c in cached if c > 0)}/{len(cached)}" if cached else "n/a"
            tokens = rung_tokens(rung)
            not_observed = unobserved(s)
            latency.append(
                table_row(
                    [
                        cell(arm.arm),
                        "n/a" if tokens is None else str(tokens),
                        str(rung.concurrency),
                        cell(rung.status),
                        "n/a" if s is None else f"{s.measured_requests}/{s.requested_requests}",
                        _ttft_cell(s, None if s is None else s.ttft_p50_ms),
                        _ttft_cell(s, None if s is None else s.ttft_p99_ms),
                        NOT_OBSERVABLE
                        if not_observed
                        else format_ms(None if s is None else s.tpot_p50_ms),
                        NOT_OBSERVABLE
                        if not_observed
                        else format_ms(None if s is None else s.tpot_p99_ms),
                    ]
                )
            )
            fields = [
                cell(arm.arm),
                str(rung.concurrency),
                _rate(None if s is None else s.throughput_requests_per_sec),
                _rate(None if s is None else s.output_tokens_per_sec),
                _rate(None if s is None else s.goodput_requests_per_sec),
                served,
            ]
            if with_verdicts:
                fields.extend(_verdict_text(rung.verdict, rules))
            rates.append(table_row(fields))
    notes = [f"- [{n}] {rule}" for rule, n in rules.items()]
    chat = _chat_prompt_notes(arms)
    return [
        *latency,
        "",
        *rates,
        *(["", "Cache verdict rules:", "", *notes] if notes else []),
        *(["", "Prompt as a chat message:", "", *chat] if chat else []),
    ]


def _chat_prompt_notes(arms: Sequence[ArmView]) -> list[str]:
    """What each chat host counted for the row's prompt, and whether the message's tokens
    stayed intact inside its template (else the arm was not sent the other arms' tokens)."""
    notes = []
    for arm in arms:
        counted = arm.cell.chat_prompt if arm.cell is not None else msgspec.UNSET
        if isinstance(counted, msgspec.UnsetType):
            continue
        intact = (
            "its message tokens intact"
            if counted.merged_tokens == 0
            else f"{counted.merged_tokens} message token(s) merged into the template where "
            "they meet it: not exactly the tokens a host sent token ids evaluated"
        )
        notes.append(
            f"- {cell(arm.arm)}: {counted.prompt_tokens} prompt tokens by the host's own count "
            f"({counted.message_tokens} of the message), every request held to it; {intact}"
        )
    return notes


def _server_figure(value: float | UnsetType) -> str:
    return "n/a" if isinstance(value, UnsetType) else format_ms(value)


def _server_table(arms: Sequence[ArmView]) -> list[str]:
    """The server's own TTFT and TPOT of each rung whose server timed every event, beside
    the client's p50 and how many requests' client figures were not observable; no table
    when no rung has them."""
    rungs = [
        (arm, rung)
        for arm in arms
        for rung in ladder_rungs(arm)
        if rung.summary is not None and not isinstance(rung.summary.server_ttft_p50_ms, UnsetType)
    ]
    if not rungs:
        return []
    lines = [
        "| Arm | Concurrency | Server's TTFT p50 ms | Server's TTFT p99 ms "
        "| Server's TPOT p50 ms | Server's TPOT p99 ms | Client TTFT p50 ms "
        "| Client TPOT p50 ms | Client not observable |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for arm, rung in rungs:
        s = rung.summary
        assert s is not None
        lines.append(
            "| "
            + " | ".join(
                [
                    cell(arm.arm),
                    str(rung.concurrency),
                    _server_figure(s.server_ttft_p50_ms),
                    _server_figure(s.server_ttft_p99_ms),
                    _server_figure(s.server_tpot_p50_ms),
                    _server_figure(s.server_tpot_p99_ms),
                    NOT_OBSERVABLE if unobserved(s) else format_ms(s.ttft_p50_ms),
                    NOT_OBSERVABLE if unobserved(s) else format_ms(s.tpot_p50_ms),
                    f"{s.ttft_unobserved_count}/{s.measured_requests}",
                ]
            )
            + " |"
        )
    return lines


def _server_metrics(view: RowView) -> list[str]:
    """Every arm's rungs whose host's metrics were read (``RungReceipt.server_metrics``)."""
    intervals = [
        (arm.arm, str(r.concurrency), r.server_metrics)
        for arm in view.arms
        for r in arm.rungs
        if not isinstance(r.server_metrics, UnsetType)
    ]
    return server_metrics_table(intervals, "Concurrency")


def _curves(receipts: RunReceipts, svgs: dict[str, str]) -> list[str]:
    with_verdicts = any(arm.verdicts for view in receipts.rows for arm in view.arms)
    lines = [
        "## Concurrency curves",
        "",
        "Per row and concurrent arm, from each rung's summary in its `cell.json`: the output",
        "tokens each request asked for (arms that generate different lengths do different",
        "work per request: compare them per token), TTFT and TPOT at p50 and p99 (ms),",
        "throughput and goodput (requests/s; goodput counts requests meeting both the TTFT and",
        "the TPOT objective), output tokens/s, and how many measured requests the server",
        "answered partly from its prompt cache (`cache_n` > 0). TTFT is the first event that",
        "carries a generated token; when that only came with the final event it is",
        f'"{NOT_OBSERVABLE}" (and so is TPOT), never the whole response. Where the server',
        "timed every event (llama-server's per-event `timings`), a first token the client",
        "read later than those timings allow (by more than the client's measured lag), or a",
        "TPOT below the server's own, is not observable either (a stalled client), and the",
        "server's own TTFT (from starting the prompt, its queue not included) and TPOT are",
        "shown beside the client's, labelled as the server's.",
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
                f"- {row_title(view)}: {cell(status)}" + (f" ({cell(reason)})" if reason else "")
            )
            continue
        name = _plot_name(view)
        svgs[name] = _plot(view, arms)
        alt = row_title(view).replace("[", "(").replace("]", ")")
        lines += [
            "",
            f"### {row_title(view)}",
            "",
            # Brackets would end the image's alt text early.
            f"![Concurrency curves of {alt}]({name})",
            "",
            *folded(f"Per-rung figures of {row_title(view)}", _curve_tables(arms, with_verdicts)),
        ]
        server = _server_table(arms)
        if server:
            lines += ["", *folded(f"The server's own timings of {row_title(view)}", server)]
        counted = _server_metrics(view)
        if counted:
            title = f"The server's own token counters of {row_title(view)}"
            lines += ["", SERVER_METRICS_NOTE, "", *folded(title, counted)]
    if without:
        lines += ["", "Rows without a concurrent arm:", "", *without]
    return lines


def _first_shared(a: ArmView, b: ArmView) -> tuple[LadderRung, LadderRung] | None:
    """The two arms' rungs at the lowest concurrency both ran."""
    by_c = {r.concurrency: r for r in ladder_rungs(a)}
    for rung in sorted(ladder_rungs(b), key=lambda r: r.concurrency):
        if rung.concurrency in by_c:
            return by_c[rung.concurrency], rung
    return None


def _effect_text(effect: MedianDifference) -> str:
    return f"{effect.difference:+.1f} ms [{effect.low:+.1f}, {effect.high:+.1f}], {effect.verdict}"


def _versus(base: ArmView | None, new: ArmView | None) -> str:
    """new against ``base`` at their lowest shared concurrency: TTFT when both observed it,
    else end-to-end latency when both asked for the same output tokens."""
    if base is None or new is None or base.cell is None or new.cell is None:
        return "n/a (not both run)"
    pair = _first_shared(base, new)
    if pair is None:
        return "n/a (no shared concurrency)"
    before, after = pair
    where = f"c={after.concurrency}"
    effect = median_effect(before, after, "TTFT")
    if effect is not None:
        return f"TTFT {where}: {_effect_text(effect)}"
    why = (
        f"TTFT {NOT_OBSERVABLE}"
        if unobserved(before.summary) or unobserved(after.summary)
        else "TTFT n/a"
    )
    tokens = (rung_tokens(before), rung_tokens(after))
    if tokens[0] != tokens[1]:
        shown = "/".join("n/a" if t is None else str(t) for t in tokens)
        return f"n/a ({why}; latency compares different work: {shown} {TOKENS_UNIT})"
    effect = median_effect(before, after, "latency")
    if effect is None:
        return f"n/a ({why}; fewer than {MIN_SAMPLES} requests)"
    return f"latency {where}: {_effect_text(effect)} ({why})"


def _downgraded(view: RowView, href: str) -> str:
    """Planned arms that did not complete, each linked to its cell receipt."""
    out = []
    for arm in view.arms:
        if arm.observation.planned != "planned" or arm.observation.status == "completed":
            continue
        text = f"{arm.arm}: {arm.observation.status}"
        if arm.observation.reason:
            text += f" ({arm.observation.reason})"
        out.append(_link(href, text, arm.cell_path) if arm.cell is not None else cell(text))
    return "; ".join(out) if out else "none"


def _summary(receipts: RunReceipts, curves: set[int]) -> list[str]:
    staged = _staged(receipts)
    if staged:
        lines = [
            "## Summary",
            "",
            f"Per row: `{NEW_ARM}` against `{OLD_ARM}` and against `{NATIVE_ARM}`, the effect",
            "median(new) - median(old) per request with its "
            f"{CONFIDENCE:.0%} bootstrap interval at the lowest concurrency",
            "both ran (negative: the new server is faster); the row's correctness; and every",
            "planned arm that did not complete, linked to its cell receipt.",
            "",
            "| Row | Output tok/req (new, old, native) | Correctness | New vs old "
            "| New vs native | Not completed |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
    else:
        lines = [
            "## Summary",
            "",
            "Per row: the output tokens per request of its native ladder, the row's",
            "correctness, and every planned arm that did not complete, linked to its cell",
            "receipt.",
            "",
            "| Row | Output tok/req | Correctness | Not completed |",
            "| --- | --- | --- | --- |",
        ]
    for view in receipts.rows:
        by_arm = {arm.arm: arm for arm in view.arms}
        new = by_arm.get(NEW_ARM)
        name = row_title(view)
        if view.entry.index in curves:
            name = f"[{name}](#{anchor(row_name(view))})"
        correctness = view.receipt.correctness.status if view.receipt is not None else "n/a"
        shown = (NEW_ARM, OLD_ARM, NATIVE_ARM) if staged else (NATIVE_ARM,)
        tokens = ", ".join(
            "n/a" if by_arm.get(arm) is None else _arm_tokens(by_arm[arm]) for arm in shown
        )
        versus = (
            [cell(_versus(by_arm.get(OLD_ARM), new)), cell(_versus(by_arm.get(NATIVE_ARM), new))]
            if staged
            else []
        )
        lines.append(
            table_row(
                [name, tokens, cell(correctness), *versus, _downgraded(view, receipts.run_href)]
            )
        )
    return lines


def _staged(receipts: RunReceipts) -> bool:
    """Whether any row ran a stage server (an old or new arm with a cell)."""
    return any(
        arm.arm in (OLD_ARM, NEW_ARM) and arm.cell is not None
        for view in receipts.rows
        for arm in view.arms
    )


def _paired(receipts: RunReceipts) -> bool:
    """Whether any row has both an old and a new cell: something to set side by side."""
    for view in receipts.rows:
        cells = {arm.arm for arm in view.arms if arm.cell is not None}
        if OLD_ARM in cells and NEW_ARM in cells:
            return True
    return False


def _reference(receipts: RunReceipts) -> tuple[list[str], list[str]]:
    """The reference tables the run has rows for, and the names of those it has none for
    (nothing either way when the run has no production rows)."""
    reference = receipts.reference
    if reference is None:
        return [], []
    refusals = Refusals()
    sections = reference_sections(
        reference.rows, reference.sources, reference.corpus_shown, refusals
    )
    refusals.raise_any()
    shown = [line for section in sections if section.rows for line in section.lines]
    missing = [NOT_RUN_NAMES[section.key] for section in sections if not section.rows]
    if not shown:
        return [], missing
    return ["## Reference tables", "", *_footnoted("\n".join(shown).rstrip("\n")), ""], missing


def _figure(value: Figure) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _series(value: Figure) -> tuple[float | None, ...] | None:
    return tuple(float(v) for v in value) if isinstance(value, tuple) else None


def _warm_row(producer: ProducerRow) -> ReportRow:
    """The row's production entry as the reference tables read it."""
    skippy, llama = producer.skippy, producer.llama_server
    status = skippy.get("status")
    llama_status = llama.get("status")
    return ReportRow(
        file="row.json",
        index=0,
        skippy=SkippyFigures(
            status=status if isinstance(status, str) else None,
            cache_hit_import_ms=_series(skippy.get("cache_hit_import_ms")),
            cache_hit_decode_ms=_series(skippy.get("cache_hit_decode_ms")),
            cache_hit_total_ms=_figure(skippy.get("cache_hit_total_ms")),
        ),
        llama_server=BaselineFigures(
            status=llama_status if isinstance(llama_status, str) else None,
            warm_median_ms=_figure(llama.get("warm_median_ms")),
            warm_mean_ms=_figure(llama.get("warm_mean_ms")),
        ),
    )


def _warm_win(receipts: RunReceipts) -> list[str]:
    """The reference's win beside the same warm request timed inside the server."""
    table: list[str] = []
    for view in receipts.rows:
        producer = view.receipt.producer_report_row if view.receipt is not None else None
        serial = next((a for a in view.arms if not a.concurrent and a.cell is not None), None)
        if producer is None or serial is None:
            continue
        row = _warm_row(producer)
        hit = hit_ms(row)
        base = baseline(row, package=False)
        inside = [v for r in ladder_rungs(serial) for v in r.values.get("server", ())]
        server = median(inside) if inside else None
        reference = speedup(row, package=False)
        own: float | None = None
        if reference is not None and server is not None and hit is not None:
            own = server / hit
        client = None if base is None or server is None else base.value - server
        table.append(
            table_row(
                [
                    row_title(view),
                    _arm_tokens(serial),
                    cell(row.skippy.status or "missing"),
                    format_ms(hit),
                    format_ms(None if base is None else base.value),
                    "n/a" if reference is None else f"{reference:.2f}x",
                    format_ms(server),
                    "n/a" if own is None else f"{own:.2f}x",
                    format_ms(client),
                ]
            )
        )
    if not table:
        return []
    return [
        "## Warm request: the reference's win and the server's own time",
        "",
        '"Skippy win" is the reference\'s: the llama-server warm request timed end to end by',
        "the client over HTTP (the serial baseline's warm median) divided by the correctness",
        "tool's in-process cache hit (import + decode). Beside it, the same warm requests timed",
        "inside the server (`timings.prompt_ms + predicted_ms`, median of the serial rows) and",
        "the win against that: the rest of the end-to-end time is HTTP and client.",
        "",
        "| Row | Output tok/req | Correctness | Skippy hit median ms "
        "| llama-server warm median ms (client) | Skippy win (reference) "
        "| Same requests inside the server ms | Skippy win against the server's time "
        "| HTTP and client ms |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        *table,
        "",
    ]


def _footnoted(tables: str) -> list[str]:
    """The reference tables with each distinct note (the parts of a Notes cell split at
    "; ") said once, as a numbered footnote under them, and its number in the cells."""
    notes: dict[str, int] = {}
    out: list[str] = []
    in_notes_table = False
    for line in tables.split("\n"):
        if not line.startswith("|"):
            in_notes_table = False
            out.append(line)
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not in_notes_table:
            in_notes_table = cells[-1] == "Notes"
            out.append(line)
            continue
        if set(cells[-1]) <= {"-", ":"}:
            out.append(line)
            continue
        parts = [part.strip() for part in cells[-1].split("; ") if part.strip()]
        marks = [f"[{notes.setdefault(part, len(notes) + 1)}]" for part in parts]
        out.append(table_row([*cells[:-1], "".join(marks)]))
    if notes:
        out += ["", "Notes:", ""] + [f"- [{n}] {text}" for text, n in notes.items()]
    return out


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
            lines.append(f"| {row_title(view)} | {cell(status)} | {row_link} | n/a | n/a | n/a |")
        for arm in view.arms:
            cell_link = (
                _link(href, "cell.json", arm.cell_path)
                if arm.cell is not None
                else ("absent" if arm.cell_path else "n/a")
            )
            lines.append(
                f"| {row_title(view)} | {cell(status)} | {row_link} | {cell(arm.arm)} "
                f"| {cell(arm.observation.status)} | {cell_link} |"
            )
    return lines


def written_in_this_format(markdown: bytes) -> bool:
    """Whether a ``report.md`` was written in the layout :func:`render_run_report` writes."""
    return markdown.split(b"\n", 1)[0] == FORMAT_LINE.encode()


def render_run_report(receipts: RunReceipts) -> dict[str, bytes]:
    """The report files (relative path -> bytes): ``report.md``, ``report.html`` and one
    ``plots/row-NNNN-<row>.svg`` per row with a concurrent arm. Raises ``Refused`` only when
    the reference tables refuse (a metadata-derived size that overflows 64 bits)."""
    matrix = receipts.matrix
    run_id = next((v.receipt.run_id for v in receipts.rows if v.receipt is not None), None)
    lines = [FORMAT_LINE, "# Cache-family run report", ""]
    if _synthetic(receipts):
        lines += [f"> {SYNTHETIC_BANNER}", ""]
    for evidence in _real_evidence(receipts):
        lines += [f"> {cell(evidence)}", ""]
    lines += [
        f"Run `{cell(run_id or 'unknown')}`: status **{cell(matrix.status)}**, "
        f"{len(matrix.rows)} planned rows, {matrix.planned_cells} planned cells.",
        "",
        f"Scope: {cell(matrix.scope)}.",
        "",
    ]
    svgs: dict[str, str] = {}
    plotted = {v.entry.index for v in receipts.rows if any(a.concurrent for a in v.arms)}
    reference, not_run = _reference(receipts)
    if not plotted:
        not_run.append(NO_LADDERS)
    paired = _paired(receipts)
    if not paired:
        not_run.append(f"old and new stage servers side by side ({PAIRED_NOT_RUN})")
    if not receipts.workloads:
        not_run.append(NO_WORKLOADS)
    if not_run:
        lines += [f"Not in this run, so not reported: {', '.join(not_run)}.", ""]
    lines += [*_summary(receipts, plotted), ""]
    lines += reference
    lines += _warm_win(receipts)
    lines += [*_curves(receipts, svgs), ""] if plotted else []
    for comparison in LADDER_COMPARISONS:
        # Old against new whenever paired serving ran (saying why a row lacks it); any other
        # pair only where a row has both.
        if paired if comparison is OLD_VERSUS_NEW else compared(receipts, comparison):
            lines += [*comparison_section(receipts, comparison), ""]
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
