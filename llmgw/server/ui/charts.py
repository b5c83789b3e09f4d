"""Bar charts drawn on the server as SVG: no script, no library, a few kilobytes.

Each chart also carries its numbers as text (a ``<title>`` per bar, and the table the page
puts beside it), so a screen reader or a copy-paste gets them too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

WIDTH, HEIGHT = 720, 200
LEFT, BOTTOM, TOP = 52, 22, 8
COLOURS = 6  # .bar-0 … .bar-5 in llmgw.css; more series reuse them


@dataclass(frozen=True, slots=True)
class Column:
    """One bar: its label on the axis (may be empty) and its value per series."""

    label: str
    values: Sequence[float]
    title: str = ""  # what hovering (or a screen reader) says; the label by default


def _nice(peak: float) -> float:
    """A round axis top at or above ``peak``."""
    if peak <= 0:
        return 1.0
    step = 10 ** (len(str(int(peak))) - 1)
    for m in (1, 2, 2.5, 5, 10):
        if m * step >= peak:
            return m * step
    return 10 * step


def _short(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


def stacked_bars(columns: Sequence[Column], series: Sequence[str], what: str) -> Markup:
    """An SVG of one stacked bar per column, a series per colour. ``what`` names the chart
    for assistive technology ("tokens per day, by model")."""
    peak = max((sum(c.values) for c in columns), default=0)
    top = _nice(peak)
    plot_w, plot_h = WIDTH - LEFT - 4, HEIGHT - BOTTOM - TOP
    slot = plot_w / max(1, len(columns))
    bar_w = max(1.0, slot * 0.8)
    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
             f'aria-label="{escape(what)}" xmlns="http://www.w3.org/2000/svg">']
    for frac in (0, 0.5, 1):
        y = TOP + plot_h * (1 - frac)
        parts.append(f'<line class="axis" x1="{LEFT}" x2="{WIDTH - 4}" y1="{y:.1f}" '
                     f'y2="{y:.1f}"/><text x="{LEFT - 6}" y="{y + 4:.1f}" '
                     f'text-anchor="end">{_short(top * frac)}</text>')
    for i, column in enumerate(columns):
        x = LEFT + i * slot + (slot - bar_w) / 2
        y = TOP + plot_h
        for s, value in enumerate(column.values):
            if value <= 0:
                continue
            h = plot_h * value / top
            y -= h
            name = series[s] if s < len(series) else ""
            parts.append(f'<rect class="bar-{s % COLOURS}" x="{x:.1f}" y="{y:.1f}" '
                         f'width="{bar_w:.1f}" height="{h:.1f}"><title>'
                         f'{escape(column.title or column.label)}: {escape(name)} '
                         f'{value:,.0f}</title></rect>')
        if column.label:
            parts.append(f'<text x="{x + bar_w / 2:.1f}" y="{HEIGHT - 6}" '
                         f'text-anchor="middle">{escape(column.label)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
