"""A small SVG line-chart writer for the run report's concurrency curves.

Deterministic by construction: coordinates are printed with one decimal, nothing depends on
time, locale or dict order, so the same figures give the same bytes. Each point carries a
``<title>`` with its exact formatted value (a tooltip, and text a test can read back).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape
from typing import Final

PANEL_WIDTH: Final = 360
PANEL_HEIGHT: Final = 220
GAP: Final = 20
MARGIN_LEFT: Final = 56
MARGIN_RIGHT: Final = 14
MARGIN_TOP: Final = 26
MARGIN_BOTTOM: Final = 38
COLUMNS: Final = 2
#: More x positions than this are labelled every k-th (a trace's requests run to thousands).
MAX_X_LABELS: Final = 24
FONT: Final = 'font-family="sans-serif"'


@dataclass(frozen=True, slots=True)
class Series:
    label: str
    color: str
    dashed: bool
    #: One value per x position (None: not measured there).
    values: tuple[float | None, ...]


@dataclass(frozen=True, slots=True)
class XAxis:
    """What the shared x axis holds: ``name`` (and ``unit``) under the axis, and in each
    point's tooltip "at NAME X UNIT"."""

    name: str
    unit: str = ""

    @property
    def label(self) -> str:
        return f"{self.name} ({self.unit})" if self.unit else self.name

    def at(self, x: str) -> str:
        return f"{self.name} {x} {self.unit}" if self.unit else f"{self.name} {x}"


CONCURRENCY: Final = XAxis("concurrency")


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    unit: str
    series: tuple[Series, ...]
    #: How a value is printed in its tooltip.
    fmt: Callable[[float], str]
    #: A line inside the plot (what it cannot show, e.g. figures that were not observable).
    note: str = ""


def _n(value: float) -> str:
    text = f"{value:.1f}"
    return "0.0" if text == "-0.0" else text


def nice_top(largest: float) -> tuple[float, float]:
    """(axis top, tick step): four or five ticks of 1, 2 or 5 times a power of ten."""
    if not largest > 0 or not math.isfinite(largest):
        return 1.0, 0.25
    rough = largest / 4.0
    power = 10.0 ** math.floor(math.log10(rough))
    step = next(m * power for m in (1.0, 2.0, 5.0, 10.0) if m * power >= rough)
    return math.ceil(largest / step - 1e-9) * step, step


def _tick(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    return f"{value:.{decimals}f}"


def _panel(panel: Panel, xs: Sequence[str], axis: XAxis, left: float, top: float) -> list[str]:
    plot_w = PANEL_WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = PANEL_HEIGHT - MARGIN_TOP - MARGIN_BOTTOM
    x0, y0 = left + MARGIN_LEFT, top + MARGIN_TOP
    values = [v for s in panel.series for v in s.values if v is not None]
    axis_top, step = nice_top(max(values, default=0.0))

    def px(i: int) -> float:
        return x0 + (plot_w * (i + 0.5) / len(xs) if xs else 0.0)

    def py(v: float) -> float:
        return y0 + plot_h - plot_h * (v / axis_top)

    out = [
        f'<g class="panel"><text x="{_n(left + PANEL_WIDTH / 2)}" y="{_n(top + 16)}" '
        f'text-anchor="middle" font-size="13" {FONT}>{escape(panel.title)} '
        f"({escape(panel.unit)})</text>",
        f'<rect x="{_n(x0)}" y="{_n(y0)}" width="{_n(plot_w)}" height="{_n(plot_h)}" '
        'fill="none" stroke="#999"/>',
    ]
    if panel.note:
        out.append(
            f'<text x="{_n(x0 + 6)}" y="{_n(y0 + 14)}" font-size="10" fill="#9a3412" '
            f"{FONT}>{escape(panel.note)}</text>"
        )
    ticks = round(axis_top / step)
    for k in range(ticks + 1):
        value = step * k
        y = py(value)
        out.append(
            f'<line x1="{_n(x0 - 4)}" y1="{_n(y)}" x2="{_n(x0 + plot_w)}" y2="{_n(y)}" '
            'stroke="#e4e4e4"/>'
            f'<text x="{_n(x0 - 6)}" y="{_n(y + 4)}" text-anchor="end" font-size="10" '
            f"{FONT}>{_tick(value, step)}</text>"
        )
    stride = max(1, math.ceil(len(xs) / MAX_X_LABELS))
    for i, label in enumerate(xs):
        if i % stride:
            continue
        out.append(
            f'<text x="{_n(px(i))}" y="{_n(y0 + plot_h + 14)}" text-anchor="middle" '
            f'font-size="10" {FONT}>{escape(label)}</text>'
        )
    out.append(
        f'<text x="{_n(x0 + plot_w / 2)}" y="{_n(y0 + plot_h + 30)}" text-anchor="middle" '
        f'font-size="10" {FONT}>{escape(axis.label)}</text>'
    )
    for series in panel.series:
        points = [(px(i), py(v), i, v) for i, v in enumerate(series.values) if v is not None]
        dash = ' stroke-dasharray="5 3"' if series.dashed else ""
        if len(points) > 1:
            path = " ".join(f"{_n(x)},{_n(y)}" for x, y, _, _ in points)
            out.append(
                f'<polyline points="{path}" fill="none" stroke="{series.color}" '
                f'stroke-width="2"{dash}/>'
            )
        for x, y, i, v in points:
            out.append(
                f'<circle cx="{_n(x)}" cy="{_n(y)}" r="3" fill="{series.color}">'
                f"<title>{escape(series.label)} at {escape(axis.at(xs[i]))}: "
                f"{panel.fmt(v)} {escape(panel.unit)}</title></circle>"
            )
    out.append("</g>")
    return out


def line_panels(title: str, xs: Sequence[str], panels: Sequence[Panel], *, axis: XAxis) -> str:
    """An SVG document: ``panels`` in a grid sharing the categorical x axis ``xs`` (what it
    holds: ``axis``), a legend of every distinct series label, and ``title`` on top."""
    rows = max(1, math.ceil(len(panels) / COLUMNS))
    width = COLUMNS * PANEL_WIDTH + (COLUMNS - 1) * GAP
    legend: dict[str, Series] = {}
    for panel in panels:
        for series in panel.series:
            legend.setdefault(series.label, series)
    legend_top = 34 + rows * (PANEL_HEIGHT + GAP)
    height = legend_top + 18 * max(1, math.ceil(len(legend) / 2)) + 10
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img">',
        f"<title>{escape(title)}</title>",
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{width // 2}" y="20" text-anchor="middle" font-size="15" '
        f'font-weight="bold" {FONT}>{escape(title)}</text>',
    ]
    for k, panel in enumerate(panels):
        left = (k % COLUMNS) * (PANEL_WIDTH + GAP)
        top = 30 + (k // COLUMNS) * (PANEL_HEIGHT + GAP)
        out.extend(_panel(panel, xs, axis, left, top))
    for k, series in enumerate(legend.values()):
        x = 20 + (k % 2) * (width // 2)
        y = legend_top + 18 * (k // 2)
        dash = ' stroke-dasharray="5 3"' if series.dashed else ""
        out.append(
            f'<line x1="{x}" y1="{y}" x2="{x + 28}" y2="{y}" stroke="{series.color}" '
            f'stroke-width="2"{dash}/><text x="{x + 34}" y="{y + 4}" font-size="11" '
            f"{FONT}>{escape(series.label)}</text>"
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"
