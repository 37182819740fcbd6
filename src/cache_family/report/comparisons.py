"""Two named ladders of a row compared rung by rung: median(other) - median(base) of each
request's TTFT and end-to-end latency, with a bootstrap interval. Which two arms, and how the
section names them, is one ``LadderComparison`` each (``LADDER_COMPARISONS``): the old and new
stage servers, and a declared OpenAI-compatible server against the native baseline its ladder
is planned to match."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from cache_family.report.ladders import (
    NOT_OBSERVABLE,
    folded,
    ladder_rungs,
    median_effect,
    row_title,
    rung_tokens,
    table_row,
    unobserved,
)
from cache_family.report.render import cell, effect_cells
from cache_family.report.run import ArmView, RowView, RunReceipts
from cache_family.report.stats import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, CONFIDENCE
from cache_family.schemas.arms import NATIVE_CONCURRENT, OPENAI_CONCURRENT, SKIPPY_NEW, SKIPPY_OLD

#: The per-request timings compared (names in ``ROW_VALUES``).
METRICS: Final = ("TTFT", "latency")
PAIRED_NOT_RUN: Final = "paired serving not run"
DECLARED_NOT_RUN: Final = "the declared server's ladder or the native baseline's not run"


@dataclass(frozen=True, slots=True)
class LadderComparison:
    heading: str
    base: str  # the arm the effect is measured from
    other: str
    # How the table's columns name each side ("old" / "new").
    base_word: str
    other_word: str
    # What faster means, said in the lead's last sentence.
    faster: str
    # Why a row shows no comparison (its arms are not both there).
    not_run: str
    # A sentence the lead ends with ("" for none).
    note: str = ""


OLD_VERSUS_NEW: Final = LadderComparison(
    heading="## Old versus new",
    base=SKIPPY_OLD.name,
    other=SKIPPY_NEW.name,
    base_word="old",
    other_word="new",
    faster="the new server",
    not_run=PAIRED_NOT_RUN,
)
NATIVE_VERSUS_DECLARED: Final = LadderComparison(
    heading="## Native baseline versus the declared server",
    base=NATIVE_CONCURRENT.name,
    other=OPENAI_CONCURRENT.name,
    base_word="native",
    other_word="declared",
    faster="the declared OpenAI-compatible server",
    not_run=DECLARED_NOT_RUN,
    note="The declared server's ladder is planned as the native baseline's (same rungs, prompt "
    "and output tokens), on the same model file.",
)
LADDER_COMPARISONS: Final = (OLD_VERSUS_NEW, NATIVE_VERSUS_DECLARED)


def _rows(view: RowView, base: ArmView, other: ArmView) -> list[str]:
    """One line per rung both arms ran (matched by concurrency) and metric."""
    base_by_c = {r.concurrency: r for r in ladder_rungs(base)}
    lines: list[str] = []
    for rung in ladder_rungs(other):
        before = base_by_c.get(rung.concurrency)
        if before is None:
            continue
        tokens = {rung_tokens(before), rung_tokens(rung)}
        shown = "/".join("n/a" if t is None else str(t) for t in sorted(tokens, key=str))
        for metric in METRICS:
            base_values, other_values = before.values.get(metric, ()), rung.values.get(metric, ())
            effect = median_effect(before, rung, metric)
            head = [row_title(view), shown, str(rung.concurrency), metric]
            counts = [str(len(base_values)), str(len(other_values))]
            cells = effect_cells(effect)
            if (
                effect is None
                and metric == "TTFT"
                and (unobserved(before.summary) or unobserved(rung.summary))
            ):
                cells[-1] = NOT_OBSERVABLE
            lines.append(table_row([*head, *counts, *cells]))
    return lines


def compared(receipts: RunReceipts, comparison: LadderComparison) -> bool:
    """Whether some row has both arms' cells (the section is shown only then)."""
    for view in receipts.rows:
        cells = {arm.arm for arm in view.arms if arm.cell is not None}
        if comparison.base in cells and comparison.other in cells:
            return True
    return False


def comparison_section(receipts: RunReceipts, comparison: LadderComparison) -> list[str]:
    base_word, other_word = comparison.base_word, comparison.other_word
    lines = [
        comparison.heading,
        "",
        f"Per rung, the effect is median({other_word}) - median({base_word}) of per-request "
        "TTFT and end-to-end",
        f"latency (completed requests, warmups excluded), with a {CONFIDENCE:.0%} percentile",
        f"bootstrap interval: {BOOTSTRAP_RESAMPLES} resamples of each arm with replacement,",
        f"seed {BOOTSTRAP_SEED}. An interval that excludes 0 is a difference the samples",
        f"support; negative means {comparison.faster} is faster.",
        *([comparison.note] if comparison.note else []),
        "",
    ]
    table: list[str] = []
    missing: list[str] = []
    for view in receipts.rows:
        by_arm = {arm.arm: arm for arm in view.arms}
        base, other = by_arm.get(comparison.base), by_arm.get(comparison.other)
        if base is None or other is None or base.cell is None or other.cell is None:
            reasons = sorted(
                {
                    a.observation.reason
                    for a in (base, other)
                    if a is not None and a.observation.reason
                }
            )
            missing.append(
                f"- {row_title(view)}: {comparison.not_run}"
                + (f" ({cell('; '.join(reasons))})" if reasons else "")
            )
            continue
        table += _rows(view, base, other)
    if table:
        base_title, other_title = base_word.capitalize(), other_word.capitalize()
        lines += [
            *folded(
                "Per-rung effects",
                [
                    f"| Row | Output tok/req | Concurrency | Metric | n {base_word} "
                    f"| n {other_word} | {base_title} median ms | {other_title} median ms "
                    f"| {other_title} - {base_word} ms | {CONFIDENCE:.0%} CI ms | Relative "
                    "| Verdict |",
                    "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
                    "| --- |",
                    *table,
                ],
            ),
        ]
        if missing:
            lines += ["", *missing]
    else:
        lines.append(
            f"No row has both `{comparison.base}` and `{comparison.other}` cells: "
            f"{comparison.not_run}."
        )
    return lines
