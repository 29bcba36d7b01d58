"""Inline SVG charts for the HTML report: horizontal bars and a waterfall, labels drawn whole.

No script and no font from the network: the report is one self-contained file.
"""

from __future__ import annotations

import html
import re

WIDTH, BAR_H, GAP, LABEL_W = 640, 22, 8, 170
PLOT_W = WIDTH - LABEL_W  # bars and their value labels; the label column widens to fit its longest label
CHAR_W = 7.2  # a generous average glyph width of 12px system-ui text, so that no label is cut off
WRAP, LINE_H = 56, 14  # a longer label goes on more lines (each kept whole), LINE_H apart
COLORS = {"bar": "#3b6ea5", "save": "#3a9a5b", "cost": "#d08a2c", "total": "#555", "paid": "#c0533a"}


def fmt_usd(v: float) -> str:
    return f"${v:,.6f}" if abs(v) < 1 else f"${v:,.2f}"


def _lines(label) -> list[str]:
    """A label in lines of at most WRAP characters, broken only after a '/' or a space: nothing is cut,
    and a longer word (a partition id, a file name) keeps a line of its own."""
    lines, line = [], ""
    for token in re.split(r"(?<=[/ ])", str(label)):
        if line and len((line + token).rstrip()) > WRAP:
            lines.append(line.rstrip())
            line = ""
        line += token
    lines.append(line.rstrip())
    return [text for text in lines if text] or [""]


def _layout(labels: list[str]) -> tuple[float, list[tuple[float, float, list[str]]], float]:
    """(label column width, per row (top, height, label lines), chart height): the column is as wide as
    the longest line, and a row as tall as its lines."""
    rows, y = [], GAP
    for label in labels:
        lines = _lines(label)
        h = max(BAR_H, len(lines) * LINE_H + 4)
        rows.append((y, h, lines))
        y += h + GAP
    width = max([LABEL_W] + [len(line) * CHAR_W + 12 for _, _, lines in rows for line in lines])
    return width, rows, y


def _label(x: float, top: float, h: float, label: str, lines: list[str]) -> str:
    if len(lines) == 1:
        return f'<text x="{x:.1f}" y="{top + (h - BAR_H) / 2 + BAR_H * 0.7:.1f}" text-anchor="end">{html.escape(label)}</text>'
    first = top + h / 2 + 4 - (len(lines) - 1) * LINE_H / 2
    spans = "".join(f'<tspan x="{x:.1f}" dy="{0 if i == 0 else LINE_H}">{html.escape(line)}</tspan>'
                    for i, line in enumerate(lines))
    return f'<text x="{x:.1f}" y="{first:.1f}" text-anchor="end"><title>{html.escape(label)}</title>{spans}</text>'


def _svg(chart_id: str, title: str, width: float, height: float, parts: list[str]) -> str:
    return (f'<section><h2>{html.escape(title)}</h2><svg class="chart" id="{chart_id}" width="{width:.0f}" '
            f'height="{height:.0f}" role="img" aria-label="{html.escape(title)}">{"".join(parts)}</svg></section>')


def bar_chart(chart_id: str, title: str, rows: list[tuple[str, float]], fmt=fmt_usd) -> str:
    """Horizontal bars, one per (label, value); labels whole, on more lines when long."""
    if not rows:
        return f'<section><h2>{html.escape(title)}</h2><p class="empty">no data</p></section>'
    top = max(v for _, v in rows) or 1.0
    label_w, layout, height = _layout([str(label) for label, _ in rows])
    bars = []
    for (label, value), (y, h, lines) in zip(rows, layout):
        w = max(1.0, (PLOT_W - 110) * value / top)
        bar_y = y + (h - BAR_H) / 2
        bars.append(
            _label(label_w - 6, y, h, str(label), lines)
            + f'<rect class="bar" x="{label_w:.1f}" y="{bar_y:.1f}" width="{w:.1f}" height="{BAR_H}" fill="{COLORS["bar"]}"/>'
            f'<text x="{label_w + w + 6:.1f}" y="{bar_y + BAR_H * 0.7:.1f}">{html.escape(fmt(value))}</text>')
    return _svg(chart_id, title, label_w + PLOT_W, height, bars)


def waterfall(chart_id: str, title: str, baseline: float, steps: list[tuple[str, float]], paid: float) -> str:
    """Baseline, then each step as a change of level, then what was paid.

    A step's value is signed: below zero a saving (a bar going down, "− label"), above zero a cost
    added (a bar going up, "+ label"). No bar has a negative width, whatever the signs."""
    rows = [("baseline", 0.0, baseline, COLORS["total"], fmt_usd(baseline), baseline)]
    level = top = baseline
    for label, delta in steps:
        low, high = sorted((level, level + delta))
        sign = "−" if delta < 0 else "+"
        rows.append((f"{sign} {label}", low, high - low, COLORS["save"] if delta < 0 else COLORS["cost"],
                     f"{sign}{fmt_usd(abs(delta))}", delta))
        level += delta
        top = max(top, level)
    rows.append(("paid", 0.0, paid, COLORS["paid"], fmt_usd(paid), paid))
    scale = (PLOT_W - 110) / (max(top, paid) or 1.0)
    label_w, layout, height = _layout([r[0] for r in rows])
    parts = []
    for (label, start, value, color, text, signed), (y, h, lines) in zip(rows, layout):
        w = max(1.0, value * scale)
        bar_y = y + (h - BAR_H) / 2
        parts.append(
            _label(label_w - 6, y, h, label, lines)
            + f'<rect class="bar" x="{label_w + start * scale:.1f}" y="{bar_y:.1f}" width="{w:.1f}" height="{BAR_H}" '
            f'fill="{color}" data-value="{signed:.9f}"/>'
            f'<text x="{label_w + start * scale + w + 6:.1f}" y="{bar_y + BAR_H * 0.7:.1f}">{html.escape(text)}</text>')
    return _svg(chart_id, title, label_w + PLOT_W, height, parts)
