"""The run report's trace replay section, from a trace cell's ``workload.json``: designed
against achieved reuse per request, reuse and server prompt time over the replay, efficiency
by prefix depth and the sender's lateness, each figure titled with the scaling it ran at."""

from __future__ import annotations

import json
from collections.abc import Sequence
from itertools import pairwise
from typing import Final

from cache_family.report.render import cell, format_ms
from cache_family.report.stats import median
from cache_family.report.svg import Panel, Series, XAxis, line_panels
from cache_family.schemas.workload_records import (
    TraceEfficiencyBin,
    TraceReceipt,
    TraceRequestReceipt,
)

_DESIGNED, _LRU, _ACHIEVED, _TIME = "#1f77b4", "#9467bd", "#d62728", "#2ca02c"
REQUEST_AXIS: Final = XAxis("request")
TIME_AXIS: Final = XAxis("replay time", "s")
DEPTH_AXIS: Final = XAxis("designed prefix depth", "blocks")
#: Prefix depths grouped by powers of two: 0, 1, 2-3, 4-7, ...
_DEPTH_EDGES: Final = (0, 1, 2, 4, 8, 16, 32, 64, 128)
#: Losses listed by name in the table (the rest are counted).
LOSSES_LISTED: Final = 10


def scaling_text(receipt: TraceReceipt) -> str:
    """The scaling a replay ran at, as shown next to each of its figures."""
    r = receipt.replay
    window = {k: v for k, v in json.loads(r.window_json).items() if v is not None}
    where = ", ".join(f"{k} {v:g}" for k, v in sorted(window.items())) or "the whole trace"
    return (
        f"{r.format} trace `{cell(r.path)}` (SHA-256 `{r.sha256[:12]}…`), window {where}: "
        f"{r.requests} requests, {r.distinct_ids} distinct block ids; each {r.block_tokens}-token "
        f"block replayed as {r.tokens_per_block} tokens (lengths × {r.tokens_per_block}/"
        f"{r.block_tokens}), replay time = trace time × {r.time_scale:g}, answers capped at "
        f"{r.output_tokens_cap} tokens"
    )


def _short(receipt: TraceReceipt) -> str:
    r = receipt.replay
    return f"B={r.tokens_per_block} of {r.block_tokens}, time ×{r.time_scale:g}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f} %"


def _depth_label(low: int, high: int | None) -> str:
    if high is None:
        return f"{low}+"
    return str(low) if high == low + 1 else f"{low}-{high - 1}"


def efficiency_by_depth(
    rows: Sequence[TraceRequestReceipt], tokens_per_block: int
) -> list[tuple[str, int, float | None]]:
    """(depth label, measured requests, achieved / designed) per designed prefix depth."""
    out: list[tuple[str, int, float | None]] = []
    edges = (*_DEPTH_EDGES, None)
    for low, high in pairwise(edges):
        assert low is not None
        inside = [
            r
            for r in rows
            if r.achieved_tokens is not None
            and -(-r.designed_infinite_tokens // tokens_per_block) >= low
            and (high is None or -(-r.designed_infinite_tokens // tokens_per_block) < high)
        ]
        if not inside:
            continue
        designed = sum(r.designed_infinite_tokens for r in inside)
        achieved = sum(r.achieved_tokens or 0 for r in inside)
        out.append(
            (_depth_label(low, high), len(inside), achieved / designed if designed else None)
        )
    return out


def _tokens(value: float) -> str:
    return f"{value:.0f}"


def _slice_medians(
    rows: Sequence[TraceRequestReceipt], bins: Sequence[TraceEfficiencyBin]
) -> tuple[float | None, ...]:
    """The median server prompt time of the requests scheduled in each time slice."""
    out: list[float | None] = []
    for at, b in enumerate(bins):
        last = at == len(bins) - 1
        times = [
            r.prompt_ms
            for r in rows
            if r.prompt_ms is not None
            and b.from_s <= r.scheduled_s
            and (r.scheduled_s < b.until_s or (last and r.scheduled_s <= b.until_s))
        ]
        out.append(median(times) if times else None)
    return tuple(out)


def trace_figures(receipt: TraceReceipt) -> tuple[tuple[str, str], ...]:
    """(file suffix, SVG) of three figures: per request (reuse designed and achieved, server
    prompt time, lateness), efficiency over the replay's time, and by prefix depth."""
    rows = receipt.requests
    xs = tuple(str(r.index) for r in rows)
    lru = tuple(
        None if r.designed_lru_tokens is None else float(r.designed_lru_tokens) for r in rows
    )
    per_request = line_panels(
        f"Trace replay ({_short(receipt)}): designed against achieved reuse per request",
        xs,
        (
            Panel(
                "Reused tokens",
                "tokens",
                (
                    Series(
                        "designed (infinite cache)",
                        _DESIGNED,
                        True,
                        tuple(float(r.designed_infinite_tokens) for r in rows),
                    ),
                    Series("designed (LRU)", _LRU, True, lru),
                    Series(
                        "achieved",
                        _ACHIEVED,
                        False,
                        tuple(
                            None if r.achieved_tokens is None else float(r.achieved_tokens)
                            for r in rows
                        ),
                    ),
                ),
                _tokens,
            ),
            Panel(
                "Server prompt time",
                "ms",
                (Series("prompt", _TIME, False, tuple(r.prompt_ms for r in rows)),),
                format_ms,
            ),
            Panel(
                "Send lateness",
                "ms",
                (Series("lateness", _ACHIEVED, False, tuple(r.lateness_ms for r in rows)),),
                format_ms,
            ),
        ),
        axis=REQUEST_AXIS,
    )
    bins = receipt.efficiency_over_time
    depths = efficiency_by_depth(rows, receipt.replay.tokens_per_block)
    over_time = line_panels(
        f"Trace replay ({_short(receipt)}): reuse and server prompt time over the replay",
        tuple(f"{b.from_s:.1f}" for b in bins),
        (
            Panel(
                "Reused tokens per slice",
                "tokens",
                (
                    Series(
                        "designed", _DESIGNED, True, tuple(float(b.designed_tokens) for b in bins)
                    ),
                    Series(
                        "achieved", _ACHIEVED, False, tuple(float(b.achieved_tokens) for b in bins)
                    ),
                ),
                _tokens,
            ),
            Panel(
                "Server prompt time, median per slice",
                "ms",
                (Series("prompt", _TIME, False, _slice_medians(rows, bins)),),
                format_ms,
            ),
            Panel(
                "Efficiency (achieved / designed)",
                "%",
                (
                    Series(
                        "efficiency",
                        _ACHIEVED,
                        False,
                        tuple(None if b.efficiency is None else 100 * b.efficiency for b in bins),
                    ),
                ),
                lambda v: f"{v:.1f}",
            ),
        ),
        axis=TIME_AXIS,
    )
    by_depth = line_panels(
        f"Trace replay ({_short(receipt)}): efficiency by designed prefix depth",
        tuple(label for label, _, _ in depths),
        (
            Panel(
                "Efficiency (achieved / designed)",
                "%",
                (
                    Series(
                        "efficiency",
                        _ACHIEVED,
                        False,
                        tuple(None if e is None else 100 * e for _, _, e in depths),
                    ),
                ),
                lambda v: f"{v:.1f}",
            ),
        ),
        axis=DEPTH_AXIS,
    )
    return (("", per_request), ("-over-time", over_time), ("-by-depth", by_depth))


def trace_table(receipt: TraceReceipt) -> list[str]:
    r = receipt.replay
    late = (
        "-"
        if r.lateness_p50_ms is None
        else f"{format_ms(r.lateness_p50_ms)} / {format_ms(r.lateness_p99_ms)} / "
        f"{format_ms(r.lateness_max_ms)}"
    )
    lru = "-" if receipt.designed_lru_tokens is None else str(receipt.designed_lru_tokens)
    lines = [
        f"Designed reuse: the longest run of leading block ids sent earlier in the replay "
        f"(infinite cache), and under an LRU cache of {r.lru_capacity_tokens or '-'} tokens; "
        f"achieved: the server's own count; a request reusing more than designed + "
        f"{r.granularity_tokens} token(s) is flagged `trace.reuse.over_claimed`.",
        "",
        "| sent | completed | measured | failed | prompt tokens | designed (infinite) "
        "| designed (LRU) | achieved | efficiency | lateness p50 / p99 / max (ms) | stop |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| {r.launched} of {r.requests} | {r.completed} | {receipt.measured_requests} | "
        f"{receipt.failed_requests} | {receipt.prompt_tokens} | "
        f"{receipt.designed_infinite_tokens} | {lru} | {receipt.achieved_tokens} | "
        f"{_pct(receipt.efficiency)} | {late} | "
        f"{cell(r.stop_detail or r.stop_reason or '-')} |",
        "",
    ]
    depths = efficiency_by_depth(receipt.requests, r.tokens_per_block)
    if depths:
        lines += [
            "| designed depth (blocks) | requests | efficiency |",
            "|---:|---:|---:|",
            *(f"| {label} | {n} | {_pct(e)} |" for label, n, e in depths),
            "",
        ]
    if receipt.losses:
        named = ", ".join(
            f"{loss.index} ({loss.achieved_tokens} of {loss.designed_tokens}, last sent by "
            f"{'-' if loss.last_sender is None else loss.last_sender})"
            for loss in receipt.losses[:LOSSES_LISTED]
        )
        more = len(receipt.losses) - LOSSES_LISTED
        lines += [
            f"Reuse lost at {len(receipt.losses)} requests: {named}"
            + (f", and {more} more" if more > 0 else "")
            + ".",
            "",
        ]
    if receipt.over_claimed:
        lines += [
            f"Over-claimed (`trace.reuse.over_claimed`) at requests "
            f"{', '.join(str(i) for i in receipt.over_claimed)}.",
            "",
        ]
    if receipt.token_count_mismatches:
        lines += [
            "Counted otherwise than designed (`workload.prompt.token_count_mismatch`) at "
            f"requests {', '.join(str(i) for i in receipt.token_count_mismatches)}.",
            "",
        ]
    return lines


def trace_prompt_ms(receipt: TraceReceipt) -> tuple[float, ...]:
    """The measured requests' server prompt times, in window order (old against new)."""
    return tuple(
        r.prompt_ms
        for r in receipt.requests
        if r.prompt_ms is not None and r.achieved_tokens is not None
    )
