"""Inline SVG charts for the HTML report: horizontal bars, a waterfall and log-scale lines, labels drawn whole.

No script and no font from the network: the report is one self-contained file. Every fragment is
markupsafe's Markup, built with `Markup(template).format(...)`: a label from the data is escaped by
construction, whatever it holds.
"""

from __future__ import annotations

import math
import re

from markupsafe import Markup

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


def _label(x: float, top: float, h: float, label: str, lines: list[str]) -> Markup:
    if len(lines) == 1:
        return Markup('<text x="{:.1f}" y="{:.1f}" text-anchor="end">{}</text>').format(
            x, top + (h - BAR_H) / 2 + BAR_H * 0.7, label
        )
    first = top + h / 2 + 4 - (len(lines) - 1) * LINE_H / 2
    spans = Markup("").join(
        Markup('<tspan x="{:.1f}" dy="{}">{}</tspan>').format(x, 0 if i == 0 else LINE_H, line)
        for i, line in enumerate(lines)
    )
    return Markup('<text x="{:.1f}" y="{:.1f}" text-anchor="end"><title>{}</title>{}</text>').format(
        x, first, label, spans
    )


def _svg(chart_id: str, title: str, width: float, height: float, parts: list[Markup]) -> Markup:
    return Markup(
        '<section><h2>{}</h2><svg class="chart" id="{}" width="{:.0f}" height="{:.0f}" role="img" '
        'aria-label="{}">{}</svg></section>'
    ).format(title, chart_id, width, height, title, Markup("").join(parts))


def bar_chart(chart_id: str, title: str, rows: list[tuple[str, float]], fmt=fmt_usd) -> Markup:
    """Horizontal bars, one per (label, value); labels whole, on more lines when long."""
    if not rows:
        return Markup('<section><h2>{}</h2><p class="empty">no data</p></section>').format(title)
    top = max(v for _, v in rows) or 1.0
    label_w, layout, height = _layout([str(label) for label, _ in rows])
    bars = []
    for (label, value), (y, h, lines) in zip(rows, layout):
        w = max(1.0, (PLOT_W - 110) * value / top)
        bar_y = y + (h - BAR_H) / 2
        bars.append(
            _label(label_w - 6, y, h, str(label), lines)
            + Markup(
                '<rect class="bar" x="{:.1f}" y="{:.1f}" width="{:.1f}" height="{}" fill="{}"/>'
                '<text x="{:.1f}" y="{:.1f}">{}</text>'
            ).format(label_w, bar_y, w, BAR_H, COLORS["bar"], label_w + w + 6, bar_y + BAR_H * 0.7, fmt(value))
        )
    return _svg(chart_id, title, label_w + PLOT_W, height, bars)


def waterfall(chart_id: str, title: str, baseline: float, steps: list[tuple[str, float]], paid: float) -> Markup:
    """Baseline, then each step as a change of level, then what was paid.

    A step's value is signed: below zero a saving (a bar going down, "− label"), above zero a cost
    added (a bar going up, "+ label"). No bar has a negative width, whatever the signs."""
    rows = [("baseline", 0.0, baseline, COLORS["total"], fmt_usd(baseline), baseline)]
    level = top = baseline
    for label, delta in steps:
        low, high = sorted((level, level + delta))
        sign = "−" if delta < 0 else "+"
        rows.append(
            (
                f"{sign} {label}",
                low,
                high - low,
                COLORS["save"] if delta < 0 else COLORS["cost"],
                f"{sign}{fmt_usd(abs(delta))}",
                delta,
            )
        )
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
            + Markup(
                '<rect class="bar" x="{:.1f}" y="{:.1f}" width="{:.1f}" height="{}" fill="{}" data-value="{:.9f}"/>'
                '<text x="{:.1f}" y="{:.1f}">{}</text>'
            ).format(
                label_w + start * scale,
                bar_y,
                w,
                BAR_H,
                color,
                signed,
                label_w + start * scale + w + 6,
                bar_y + BAR_H * 0.7,
                text,
            )
        )
    return _svg(chart_id, title, label_w + PLOT_W, height, parts)


LINE_COLORS = ("#3b6ea5", "#c0533a", "#3a9a5b", "#d08a2c", "#7a4fa0", "#555")


def line_chart(chart_id: str, title: str, xs: list[float], lines: dict[str, list[float]], x_name: str) -> Markup:
    """One polyline per named series over `xs`, both axes logarithmic (volumes and $/document span decades);
    a legend of the names, the axes' ends labelled."""
    values = [v for ys in lines.values() for v in ys if v > 0]
    if len(xs) < 2 or not values:
        return Markup('<section><h2>{}</h2><p class="empty">no data</p></section>').format(title)
    left, top, plot_w, plot_h = 90, 10, WIDTH - 110, 260
    x0, x1 = math.log10(min(xs)), math.log10(max(xs))
    y0, y1 = math.log10(min(values)), math.log10(max(values))
    y0, y1 = (y0 - 0.5, y1 + 0.5) if y1 - y0 < 1e-9 else (y0, y1)

    def at(x: float, y: float) -> str:
        px = left + plot_w * (math.log10(x) - x0) / ((x1 - x0) or 1)
        py = top + plot_h * (1 - (math.log10(max(y, 10**y0)) - y0) / (y1 - y0))
        return f"{px:.1f},{py:.1f}"

    parts = [
        Markup('<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="#bbb"/>').format(
            left, top, plot_w, plot_h
        ),
        Markup('<text x="{}" y="{}" text-anchor="end">{}</text>').format(left - 4, top + 10, fmt_usd(10**y1)),
        Markup('<text x="{}" y="{}" text-anchor="end">{}</text>').format(left - 4, top + plot_h, fmt_usd(10**y0)),
        Markup('<text x="{}" y="{}">{:,.0f}</text>').format(left, top + plot_h + 16, 10**x0),
        Markup('<text x="{}" y="{}" text-anchor="end">{:,.0f} {}</text>').format(
            left + plot_w, top + plot_h + 16, 10**x1, x_name
        ),
    ]
    for i, (name, ys) in enumerate(lines.items()):
        color, y = LINE_COLORS[i % len(LINE_COLORS)], top + plot_h + 36 + i * LINE_H
        points = " ".join(at(x, v) for x, v in zip(xs, ys))
        parts.append(
            Markup(
                '<polyline class="line" points="{}" fill="none" stroke="{}" stroke-width="2"/>'
                '<rect x="{}" y="{}" width="12" height="3" fill="{}"/><text x="{}" y="{}">{}</text>'
            ).format(points, color, left, y - 4, color, left + 18, y, name)
        )
    return _svg(chart_id, title, WIDTH, top + plot_h + 44 + len(lines) * LINE_H, parts)
