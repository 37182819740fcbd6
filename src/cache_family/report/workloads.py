"""The run report's workload sections, from each workload cell's ``workload.json``.

Each plot's x axis names what it holds (``svg.XAxis``). A closed-loop stage reads "closed loop",
never "0/0"; an open-loop rate that sent fewer than ``sends_to_judge`` requests reads "too few
requests to judge" with the number needed. Synthetic cells are labelled as plumbing evidence.
Pure once the receipts are read.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import msgspec

from cache_family.errors import Refused
from cache_family.report.render import cell, effect_cells, format_ms
from cache_family.report.server_metrics import SERVER_METRICS_NOTE, server_metrics_table
from cache_family.report.stats import (
    BOOTSTRAP_RESAMPLES,
    BOOTSTRAP_SEED,
    CONFIDENCE,
    bootstrap_median_difference,
)
from cache_family.report.svg import Panel, Series, XAxis, line_panels
from cache_family.report.trace import (
    scaling_text,
    trace_figures,
    trace_prompt_ms,
    trace_table,
)
from cache_family.schemas.arms import ARM_BY_NAME, ARMS, PAIRED_WORKLOAD_ARMS
from cache_family.schemas.bounded import MIB, read_bounded
from cache_family.schemas.host_kinds import host_kind_facts
from cache_family.schemas.workload_records import (
    WORKLOAD_RECEIPT_NAME,
    ChatTemplateMeasured,
    OpenLoopStageMeasured,
    OverlapPointReceipt,
    SessionsReceipt,
    TraceReceipt,
    WorkloadReceipt,
    decode_workload_receipt,
)

# Every host kind's workload arms (a declared server's too).
WORKLOAD_ARM_NAMES: Final = frozenset(arm.name for arm in ARMS if arm.workload)
_DESIGNED, _ACHIEVED, _TIME = "#1f77b4", "#d62728", "#2ca02c"
OVERLAP_AXIS: Final = XAxis("designed overlap", "%")
TURN_AXIS: Final = XAxis("turn")
OFFERED_AXIS: Final = XAxis("offered rate", "requests/s")
#: An open-loop rate's send figures are judged from this many sends up: below 100 the p99
#: lateness is the largest one, not a percentile.
PERCENTILE_SENDS: Final = 100
#: The share a drawn schedule's achieved rate may stray from its target, at 95 %: a Poisson
#: schedule of n sends reaches its target within about 1.96 / sqrt(n - 1) (a gamma one of
#: burstiness k within 1.96 / sqrt(k (n - 1))); 20 % needs 98 Poisson sends.
RATE_TOLERANCE: Final = 0.20
_Z95: Final = 1.96
TOO_FEW: Final = "too few requests to judge"
#: The fit statistics as the open-loop table names them (said in full above the table).
FIT_NAMES: Final = {"kolmogorov-smirnov": "KS", "max-relative-gap-error": "max gap error"}


@dataclass(frozen=True, slots=True)
class WorkloadView:
    #: ``workload.json`` relative to the run directory.
    path: str
    receipt: WorkloadReceipt


def read_workloads(root: str, cells: Iterable[tuple[str, str | None]]) -> tuple[WorkloadView, ...]:
    """The ``workload.json`` beside each (arm, ``cell.json`` path) of a workload arm; a cell
    that published none (it failed before its workload) has no section."""
    views: list[WorkloadView] = []
    for arm, cell_path in cells:
        if arm not in WORKLOAD_ARM_NAMES or cell_path is None:
            continue
        relative = os.path.join(os.path.dirname(cell_path), WORKLOAD_RECEIPT_NAME)
        path = os.path.join(root, relative)
        if not os.path.lexists(path):
            continue
        data = read_bounded(path, 16 * MIB, what="workload receipt").data
        try:
            views.append(WorkloadView(relative, decode_workload_receipt(data)))
        except msgspec.DecodeError as exc:
            raise Refused.one(
                "report.receipt",
                f"$.{relative}",
                f"{relative} is not a workload receipt: {exc}",
                "report a run directory the run wrote (replay checks it)",
            ) from None
    return tuple(views)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} %"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _plot_name(receipt: WorkloadReceipt) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", receipt.cell_id).strip("_")
    return f"plots/workload-{slug}.svg"


def _overlap(points: Sequence[OverlapPointReceipt]) -> tuple[list[str], str]:
    lines = [
        "| hit ratio | designed | achieved | band | verdict | prompt tokens | shared prefix "
        "| server prompt time p50 (ms) |",
        "|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for p in points:
        verdict = "accepted" if p.accepted else f"refused: `{cell(p.refusal or '')}`"
        band = "-" if p.band_pp is None else f"± {p.band_pp:.2f} pp"
        lines.append(
            f"| {p.hit_ratio_pct} % | {_pct(p.designed_ratio_pct)} | "
            f"{_pct(p.achieved_ratio_pct)} | {band} | {verdict} | {p.prompt_tokens} | "
            f"{p.shared_prefix_tokens} | {format_ms(p.prompt_ms_p50)} |"
        )
    xs = tuple(str(p.hit_ratio_pct) for p in points)
    designed = tuple(p.designed_ratio_pct for p in points)
    achieved = tuple(p.achieved_ratio_pct for p in points)
    svg = line_panels(
        "Prefix overlap: designed against achieved reuse",
        xs,
        (
            Panel(
                "Reuse",
                "%",
                (
                    Series("designed", _DESIGNED, True, designed),
                    Series("achieved", _ACHIEVED, False, achieved),
                ),
                _pct,
            ),
            Panel(
                "Server prompt time p50",
                "ms",
                (Series("prompt", _TIME, False, tuple(p.prompt_ms_p50 for p in points)),),
                format_ms,
            ),
        ),
        axis=OVERLAP_AXIS,
    )
    return lines, svg


def _sessions(sessions: SessionsReceipt) -> tuple[list[str], str]:
    shortfall = sessions.shortfall_turn
    lines = [
        f"{sessions.users} users × {sessions.turns} turns (seed {sessions.seed}); eviction: "
        + (
            f"reuse stops at turn {sessions.eviction_turn}"
            if sessions.eviction_turn is not None
            else "none (every turn reused the session so far)"
            if not isinstance(shortfall, int)
            else "none (the cache was never full)"
        )
        + (
            f"; reuse fell short of the rule at turn {shortfall} with nothing evicted "
            f"(refused: `{cell(str(sessions.refusal))}`)"
            if isinstance(shortfall, int)
            else ""
        )
        + f"; failed requests: {sessions.failed_requests}.",
        "",
        "| turn | requests | prompt tokens | expected reused | achieved reused "
        "| server prompt time p50 (ms) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for t in sessions.by_turn:
        lines.append(
            f"| {t.turn} | {t.requests} | {t.prompt_tokens} | {t.expected_reused_tokens} | "
            f"{t.achieved_reused_tokens} | {format_ms(t.prompt_ms_p50)} |"
        )
    xs = tuple(str(t.turn) for t in sessions.by_turn)
    svg = line_panels(
        "Sessions: reuse and prompt time by turn",
        xs,
        (
            Panel(
                "Reused tokens",
                "tokens",
                (
                    Series(
                        "expected",
                        _DESIGNED,
                        True,
                        tuple(float(t.expected_reused_tokens) for t in sessions.by_turn),
                    ),
                    Series(
                        "achieved",
                        _ACHIEVED,
                        False,
                        tuple(float(t.achieved_reused_tokens) for t in sessions.by_turn),
                    ),
                ),
                lambda v: f"{v:.0f}",
            ),
            Panel(
                "Server prompt time p50",
                "ms",
                (Series("prompt", _TIME, False, tuple(t.prompt_ms_p50 for t in sessions.by_turn)),),
                format_ms,
            ),
        ),
        axis=TURN_AXIS,
    )
    return lines, svg


def sends_to_judge(pattern: str, burstiness: float | None) -> int:
    """How many sends an open-loop rate needs before its figures mean something: enough for
    a p99 (:data:`PERCENTILE_SENDS`), and for a drawn schedule enough that its achieved rate
    is within :data:`RATE_TOLERANCE` of the target at 95 % (a constant one is exact)."""
    if pattern == "constant":
        return PERCENTILE_SENDS
    # The squared coefficient of variation of the gaps: 1 for Poisson, 1 / k for gamma.
    spread = 1.0 / burstiness if pattern == "gamma" and burstiness else 1.0
    return max(PERCENTILE_SENDS, 1 + math.ceil(spread * (_Z95 / RATE_TOLERANCE) ** 2))


def rate_labels(rates: Sequence[float]) -> tuple[str, ...]:
    """Rates as they read on an axis: three significant digits (300.141 reads 300), more
    only where two rates would otherwise read the same."""
    for extra in range(4):

        def label(rate: float, extra: int = extra) -> str:
            if not rate > 0 or not math.isfinite(rate):
                return f"{rate:g}"
            decimals = max(0, 2 + extra - math.floor(math.log10(rate)))
            text = f"{rate:.{decimals}f}"
            return text.rstrip("0").rstrip(".") if "." in text else text

        labels = tuple(label(rate) for rate in rates)
        if len(set(labels)) == len(labels):
            return labels
    return tuple(f"{rate:g}" for rate in rates)


def _sent(s: OpenLoopStageMeasured) -> str:
    if s.stage != "rate":
        return "closed loop"
    if s.skipped_because is not None:
        return "not sent"
    return f"{s.launched} of {s.scheduled}"


def _note(s: OpenLoopStageMeasured) -> str:
    """Why the stage stopped or was skipped, and whether it sent enough to be judged."""
    parts: list[str] = []
    stop = s.skipped_because or s.stop_reason
    if stop:
        parts.append(f"{stop}: {s.stop_detail}" if s.stop_detail else stop)
    need = sends_to_judge(s.pattern, s.burstiness)
    if s.stage == "rate" and s.skipped_because is None and s.launched < need:
        parts.append(f"{TOO_FEW}: {s.launched} sent, {need} needed")
    return "; ".join(parts) or "-"


def _open_loop(stages: Sequence[OpenLoopStageMeasured]) -> tuple[list[str], str | None]:
    lines = [
        "| stage | offered (/s) | achieved (/s) | goodput (/s) | sent | completed "
        "| lateness p50 / p99 (ms) | fit | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in stages:
        fit = "-"
        if s.fit_statistic is not None:
            fit = f"{cell(FIT_NAMES.get(s.fit_statistic, s.fit_statistic))} {_num(s.fit_value, 3)}"
            if s.fit_p_value is not None:
                fit += f" (p {_num(s.fit_p_value, 3)})"
        offered = s.target_rate_per_s if s.target_rate_per_s is not None else None
        achieved = s.achieved_rate_per_s if s.stage == "rate" else s.measured_rate_per_s
        late = (
            "-"
            if s.lateness_p50_ms is None and s.lateness_p99_ms is None
            else f"{_num(s.lateness_p50_ms, 3)} / {_num(s.lateness_p99_ms, 3)}"
        )
        lines.append(
            f"| {cell(s.stage)} | {_num(offered)} | {_num(achieved)} | {_num(s.completed_per_s)} "
            f"| {_sent(s)} | {s.completed} | {late} | {fit} | {cell(_note(s))} |"
        )
    rates = [s for s in stages if s.stage == "rate" and s.target_rate_per_s is not None]
    if not rates:
        return lines, None
    xs = rate_labels([s.target_rate_per_s for s in rates if s.target_rate_per_s is not None])
    sent_rates = tuple(s.achieved_rate_per_s for s in rates)
    short = [
        x
        for x, s in zip(xs, rates, strict=True)
        if s.skipped_because is None and s.launched < sends_to_judge(s.pattern, s.burstiness)
    ]
    note = f"{TOO_FEW} at {', '.join(short)}/s" if short else ""
    svg = line_panels(
        "Open loop: achieved and goodput against offered rate",
        xs,
        (
            Panel(
                "Rate",
                "requests/s",
                (
                    Series("offered", _DESIGNED, True, tuple(s.target_rate_per_s for s in rates)),
                    Series("achieved", _ACHIEVED, False, sent_rates),
                    Series("goodput", _TIME, False, tuple(s.completed_per_s for s in rates)),
                ),
                lambda v: f"{v:.2f}/s",
                note,
            ),
            Panel(
                "Send lateness p99",
                "ms",
                (Series("p99", _ACHIEVED, False, tuple(s.lateness_p99_ms for s in rates)),),
                format_ms,
                note,
            ),
        ),
        axis=OFFERED_AXIS,
    )
    return lines, svg


def _row_of(receipt: WorkloadReceipt) -> str:
    return receipt.cell_id.rpartition("/")[0]


def _samples(values: tuple[float, ...] | msgspec.UnsetType) -> tuple[float, ...]:
    return values if isinstance(values, tuple) else ()


def _compared(
    row: str,
    point: str,
    reuse: tuple[float | None, float | None],
    times: tuple[tuple[float, ...], tuple[float, ...]],
) -> str:
    """One line: the reuse of each arm, then median(new) - median(old) of the prompt times."""
    effect = bootstrap_median_difference(*times)
    return (
        f"| {cell(row)} | {point} | {_pct(reuse[0])} | {_pct(reuse[1])} | "
        f"{len(times[0])} | {len(times[1])} | " + " | ".join(effect_cells(effect)) + " |"
    )


def _share(reused: int, prompt: int) -> float | None:
    return 100.0 * reused / prompt if prompt else None


def _against(old: WorkloadReceipt, new: WorkloadReceipt) -> list[str]:
    """One line per overlap point, or per session turn, that both arms measured."""
    row = _row_of(new)
    lines: list[str] = []
    points = {p.hit_ratio_pct: p for p in old.overlap}
    for point in new.overlap:
        earlier = points.get(point.hit_ratio_pct)
        if earlier is not None:
            lines.append(
                _compared(
                    row,
                    f"overlap {point.hit_ratio_pct} %",
                    (earlier.achieved_ratio_pct, point.achieved_ratio_pct),
                    (_samples(earlier.prompt_ms), _samples(point.prompt_ms)),
                )
            )
    if isinstance(old.trace, TraceReceipt) and isinstance(new.trace, TraceReceipt):
        lines.append(
            _compared(
                row,
                "trace replay (efficiency)",
                (
                    None if old.trace.efficiency is None else 100 * old.trace.efficiency,
                    None if new.trace.efficiency is None else 100 * new.trace.efficiency,
                ),
                (trace_prompt_ms(old.trace), trace_prompt_ms(new.trace)),
            )
        )
    if old.sessions is not None and new.sessions is not None:
        turns = {t.turn: t for t in old.sessions.by_turn}
        for turn in new.sessions.by_turn:
            earlier_turn = turns.get(turn.turn)
            if earlier_turn is not None:
                lines.append(
                    _compared(
                        row,
                        f"sessions turn {turn.turn}",
                        (
                            _share(earlier_turn.achieved_reused_tokens, earlier_turn.prompt_tokens),
                            _share(turn.achieved_reused_tokens, turn.prompt_tokens),
                        ),
                        (_samples(earlier_turn.prompt_ms), _samples(turn.prompt_ms)),
                    )
                )
    return lines


def _old_against_new(views: Sequence[WorkloadView]) -> list[str]:
    """``### Old against new``: each paired workload of a row where both stage servers ran
    it (nothing when none did)."""
    by_arm = {
        (_row_of(v.receipt), v.receipt.arm): v.receipt for v in views if v.receipt.arm is not None
    }
    table: list[str] = []
    for (row, arm), new in sorted(by_arm.items()):
        for old_arm, new_arm in PAIRED_WORKLOAD_ARMS.values():
            old = by_arm.get((row, old_arm.name))
            if arm == new_arm.name and old is not None:
                table += _against(old, new)
    if not table:
        return []
    return [
        "",
        "### Old against new",
        "",
        "Per overlap point and session turn both stage servers measured: the achieved reuse",
        "of each (of the prompt tokens), and median(new) - median(old) of the measured",
        f"requests' server prompt time (ms), with a {CONFIDENCE:.0%} percentile bootstrap",
        f"interval ({BOOTSTRAP_RESAMPLES} resamples, seed {BOOTSTRAP_SEED}); negative means the",
        "new server is faster.",
        "",
        "| row | point | old reuse | new reuse | old n | new n | old p50 (ms) "
        "| new p50 (ms) | difference (ms) | interval | relative | verdict |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *table,
    ]


def _dialect(receipt: WorkloadReceipt) -> str:
    """How a chat host's workload was sent and judged ("" for a host sent token ids)."""
    arm = ARM_BY_NAME.get(receipt.arm or "")
    if arm is None or arm.host_kind is None:
        return ""
    facts = host_kind_facts(arm.host_kind)
    if facts.request_dialect != "chat":
        return ""
    if receipt.open_loop:
        return f"; {facts.label}, OpenAI chat: the row's prompt as one streamed message per send"
    how = (
        "each turn expects the turn before as the server counted it (prompt and answer, the "
        "answer held to the design's pieces)"
        if receipt.sessions is not None
        else "judged less the chat template's tokens (measured by the cell's calibration)"
    )
    return (
        f"; {facts.label}, OpenAI chat: text messages, reuse from "
        f"`usage.prompt_tokens_details.cached_tokens`, {how}"
    )


_TEMPLATE_SOURCES: Final = {
    "model": "the model's own (the GGUF's `tokenizer.chat_template`)",
    "server-fallback": "the server's fallback (the GGUF carries none: llama-server applies ChatML)",
}


def _code(text: str) -> str:
    """A rendered template text as one code span, line breaks and quotes escaped."""
    return "`" + json.dumps(text, ensure_ascii=False).replace("`", "'") + "`"


def _template(template: ChatTemplateMeasured | msgspec.UnsetType) -> list[str]:
    """What a chat dialect's cell wrote its messages in and wrapped them with."""
    if not isinstance(template, ChatTemplateMeasured):
        return []
    source = _TEMPLATE_SOURCES.get(template.template_source, "unknown (no model file read)")
    pieces = (
        "one character per token (a byte vocabulary)"
        if template.pieces == "byte-alphabet"
        else f"the model's own word tokens ({template.piece_count} that tokenize back joined)"
    )
    text = f"Chat template: {source}; messages written in {pieces}"
    if template.template_tokens is not None:
        text += (
            f"; {template.template_tokens} prompt tokens around each message by the server's "
            f"counts ({template.template_reused_tokens} reused between messages sharing nothing)"
        )
    if template.rendered_head is not None and template.rendered_tail is not None:
        text += (
            f"; rendered {_code(template.rendered_head)} + message + "
            f"{_code(template.rendered_tail)} ({template.head_tokens} + {template.tail_tokens} "
            "tokens), the message's tokens checked inside it by the server's `/tokenize`."
        )
    else:
        text += (
            f"; the wrapper was not rendered ({template.unrendered_reason or 'no reason given'}):"
            " the text is checked by the server's prompt counts only."
        )
    first, later = template.session_first_turn_tokens, template.session_later_turn_tokens
    if first is not None and later is not None:
        text += (
            f" Sessions: the template adds {first} tokens to a first turn and {later} to each "
            "later one (beyond the answer before it), so every turn is designed to a count."
        )
    return [text, ""]


def _probed(receipt: WorkloadReceipt) -> str:
    """How the rule was found: the model header's, checked by the cell's probe (empty for a
    receipt from before probes)."""
    probe = receipt.reuse_probe
    if isinstance(probe, msgspec.UnsetType):
        return ""
    window = f", sliding window {probe.sliding_window}" if probe.sliding_window else ""
    seen = ", ".join(
        f"{s.cached_tokens if s.cached_tokens is not None else 'failed'}/{s.prompt_tokens}"
        for s in probe.steps
    )
    verdict = (
        "agreed"
        if probe.rule == probe.header_rule
        else f"found {cell(probe.rule or 'no known rule')}"
    )
    return (
        f" (header: {cell(probe.header_rule or '-')}{window}; the server's probe reused "
        f"{seen} tokens: {verdict})"
    )


def workload_sections(views: Sequence[WorkloadView], svgs: dict[str, str]) -> list[str]:
    """The ``## Workloads`` section (nothing when the run measured no workload)."""
    if not views:
        return []
    lines = [
        "## Workloads",
        "",
        "Each workload of the run's workload file, measured on its own host (`workload.json`",
        "beside the cell): reuse is the server's own count per request (`timings.cache_n` of",
        "`tokens_evaluated`), judged against the design within max(0.5 pp, 100 × page / mean",
        "prompt tokens); the 0 % point is the control and must reuse nothing.",
    ]
    if any(view.receipt.open_loop for view in views):
        lines += [
            "An open-loop rate's fit says how the sent gaps follow the drawn distribution: the",
            "Kolmogorov-Smirnov distance (KS, with its p-value), or for constant arrivals the",
            "largest gap error relative to the target gap. A rate that sent fewer requests than",
            f"its figures need ({PERCENTILE_SENDS} for a p99; a drawn schedule, enough for its",
            f"rate to be within {RATE_TOLERANCE:.0%} of the target at 95 %) is marked "
            f'"{TOO_FEW}", with the number needed.',
        ]
    for view in views:
        receipt = view.receipt
        label = " (synthetic: plumbing evidence)" if receipt.synthetic else ""
        lines += [
            "",
            f"### {cell(receipt.cell_id)}: {cell(receipt.kind or 'unknown')}{label}",
            "",
            f"Status **{cell(receipt.status)}**; architecture {cell(receipt.architecture or '-')}"
            f", reuse rule {cell(receipt.rule or '-')}{_dialect(receipt)}{_probed(receipt)}; "
            f"receipt `{cell(view.path)}`.",
            "",
            *_template(receipt.chat_template),
        ]
        table: list[str] = []
        svg: str | None = None
        if receipt.overlap:
            table, svg = _overlap(receipt.overlap)
        elif receipt.sessions is not None:
            table, svg = _sessions(receipt.sessions)
        elif receipt.open_loop:
            table, svg = _open_loop(receipt.open_loop)
            if receipt.over_saturated_at_per_s is not None:
                table = [
                    f"Over-saturated at {rate_labels([receipt.over_saturated_at_per_s])[0]}/s: "
                    "the rates below it are the ones the server sustained.",
                    "",
                    *table,
                ]
        elif isinstance(receipt.trace, TraceReceipt):
            table = trace_table(receipt.trace)
            # The scaling stands above the figures it scales.
            lines += [f"Scaling: {scaling_text(receipt.trace)}.", ""]
            base = _plot_name(receipt).removesuffix(".svg")
            for suffix, figure in trace_figures(receipt.trace):
                svgs[f"{base}{suffix}.svg"] = figure
                lines += [
                    f"![trace replay of {cell(receipt.cell_id)}]({base}{suffix}.svg)",
                    "",
                ]
        else:
            table = ["Nothing was measured."]
        if svg is not None:
            name = _plot_name(receipt)
            svgs[name] = svg
            lines += [
                f"![{cell(receipt.kind or 'workload')} of {cell(receipt.cell_id)}]({name})",
                "",
            ]
        lines += table
        if not isinstance(receipt.server_metrics, msgspec.UnsetType):
            points = [(receipt.arm or "-", str(p.index), p.metrics) for p in receipt.server_metrics]
            lines += ["", SERVER_METRICS_NOTE, "", *server_metrics_table(points, "Point")]
    return lines + _old_against_new(views)
