"""One self-contained HTML cost report per job: inline SVG charts, no script or font from the network.

Sections: cost by tenant and by tier, a savings waterfall from the no-dedup/no-cache/largest-tier
baseline down to what was paid, engine throughput per tier, reuse by kind, and the slowest
partitions. Figures come from the job's ledger (DuckDB) and manifest.
"""

from __future__ import annotations

import html
import json
from decimal import Decimal

import duckdb

from pipeline.output.ledger import MONEY
from pipeline.stores import storage

WIDTH, BAR_H, GAP, LABEL_W = 640, 22, 8, 170
COLORS = {"bar": "#3b6ea5", "save": "#3a9a5b", "total": "#555", "paid": "#c0533a"}


def _fmt_usd(v: float) -> str:
    return f"${v:,.6f}" if abs(v) < 1 else f"${v:,.2f}"


def bar_chart(chart_id: str, title: str, rows: list[tuple[str, float]], fmt=_fmt_usd) -> str:
    """Horizontal bars, one per (label, value)."""
    if not rows:
        return f'<section><h2>{html.escape(title)}</h2><p class="empty">no data</p></section>'
    top = max(v for _, v in rows) or 1.0
    height = len(rows) * (BAR_H + GAP) + GAP
    bars = []
    for i, (label, value) in enumerate(rows):
        y = GAP + i * (BAR_H + GAP)
        w = max(1.0, (WIDTH - LABEL_W - 110) * value / top)
        bars.append(
            f'<text x="{LABEL_W - 6}" y="{y + BAR_H * 0.7}" text-anchor="end">{html.escape(str(label))}</text>'
            f'<rect class="bar" x="{LABEL_W}" y="{y}" width="{w:.1f}" height="{BAR_H}" fill="{COLORS["bar"]}"/>'
            f'<text x="{LABEL_W + w + 6:.1f}" y="{y + BAR_H * 0.7}">{html.escape(fmt(value))}</text>')
    return (f'<section><h2>{html.escape(title)}</h2><svg class="chart" id="{chart_id}" width="{WIDTH}" '
            f'height="{height}" role="img" aria-label="{html.escape(title)}">{"".join(bars)}</svg></section>')


def waterfall(chart_id: str, title: str, baseline: float, steps: list[tuple[str, float]], paid: float) -> str:
    """Baseline, then each saving as a drop, then what was paid."""
    top = baseline or 1.0
    scale = (WIDTH - LABEL_W - 110) / top
    rows = [("baseline", 0.0, baseline, COLORS["total"])]
    level = baseline
    for label, saved in steps:
        rows.append((f"− {label}", level - saved, saved, COLORS["save"]))
        level -= saved
    rows.append(("paid", 0.0, paid, COLORS["paid"]))
    height = len(rows) * (BAR_H + GAP) + GAP
    parts = []
    for i, (label, start, value, color) in enumerate(rows):
        y = GAP + i * (BAR_H + GAP)
        w = max(1.0, value * scale)
        parts.append(
            f'<text x="{LABEL_W - 6}" y="{y + BAR_H * 0.7}" text-anchor="end">{html.escape(label)}</text>'
            f'<rect class="bar" x="{LABEL_W + start * scale:.1f}" y="{y}" width="{w:.1f}" height="{BAR_H}" fill="{color}"/>'
            f'<text x="{LABEL_W + (start + value) * scale + 6:.1f}" y="{y + BAR_H * 0.7}">{_fmt_usd(value)}</text>')
    return (f'<section><h2>{html.escape(title)}</h2><svg class="chart" id="{chart_id}" width="{WIDTH}" '
            f'height="{height}" role="img" aria-label="{html.escape(title)}">{"".join(parts)}</svg></section>')


def _efficiency_line(eff: dict) -> str:
    if eff.get("mfu") is None:
        return f"hardware efficiency not computed ({eff.get('note', 'no data')})"
    return (f"MFU {eff['mfu']:.1%}, memory-bandwidth use {eff['mbu']:.1%} of a {eff['gpu_model']} "
            f"({eff['note']}; estimates, see docs/analyst.md)")


def _rows(con: duckdb.DuckDBPyConnection, sql: str, params: list) -> list[tuple]:
    return [tuple(float(v) if isinstance(v, Decimal) else v for v in r) for r in con.execute(sql, params).fetchall()]


def savings_steps(con: duckdb.DuckDBPyConnection, job_id: str, largest_tier: str | None) -> list[tuple[str, float]]:
    """What each lever saved against the baseline.

    Reused rows save their whole baseline (grouped by how they were reused). Generated rows save
    baseline − cost: on the largest tier that is the prefix cache and batching; on a smaller tier it
    is routing (and that tier's prefix cache).
    """
    baseline, cost = MONEY.format(col="baseline_cost_usd"), MONEY.format(col="cost_usd")
    steps = _rows(con, f"SELECT source, sum({baseline}) FROM ledger WHERE job_id = ? "
                       "AND source <> 'generated' GROUP BY 1 ORDER BY 1", [job_id])
    generated = _rows(con, f"SELECT tier = ?, sum({baseline} - {cost}) "
                           "FROM ledger WHERE job_id = ? AND source = 'generated' GROUP BY 1", [largest_tier, job_id])
    out = [(f"reuse: {source.replace('_', ' ')}", saved) for source, saved in steps]
    for on_largest, saved in generated:
        out.append(("prefix cache and batching" if on_largest else "routing to smaller tiers", saved))
    return out


def _false_reuse_line(v: dict) -> str:
    """The false-reuse rate measured by shadow verification (manifest `reuse.verification`)."""
    if not v.get("checked"):
        return ("False-reuse rate: no near or semantic reuse was shadow-verified in this job "
                "(dedup.shadow_rate; the manifest's reuse.verification).")
    low, high = v["ci95"]
    return (f"False-reuse rate (shadow verification, token F1 below {v.get('min_f1')}): {v['false_hit_rate']:.1%} "
            f"of {v['checked']} verified reuses (95% CI {low:.1%}-{high:.1%}); per kind and samples in the "
            "manifest's reuse.verification.")


def build_report(output_uri: str, job_id: str, storage_config=None) -> str:
    from pipeline.output.ledger import connect

    root = storage.resolve(output_uri, storage_config)
    try:
        manifest = json.loads(storage.read_bytes(root, root.join("jobs", job_id, "manifest.json")))
    except storage.StorageError as e:
        raise storage.StorageError(f"no manifest for job {job_id}: {e}") from None
    con = connect(output_uri, storage_config)
    by = "SELECT {k}, sum(" + MONEY.format(col="cost_usd") + ") AS c FROM ledger WHERE job_id = ? GROUP BY 1 ORDER BY c DESC"
    tenants = _rows(con, by.format(k="tenant"), [job_id])
    tiers = _rows(con, by.format(k="tier"), [job_id])
    cost, baseline = manifest["cost"]["cost_usd"], manifest["cost"]["baseline_cost_usd"]
    engines = manifest.get("engines", {})
    counts = manifest["counts"]
    reuse = [(k, v / counts["outputs"]) for k, v in counts["by_source"].items() if k != "generated" and counts["outputs"]]
    slow = sorted(((f'{p} ({v["file"]})', v["seconds"]) for p, v in manifest["partitions"].items() if v.get("seconds")),
                  key=lambda r: -r[1])[:10]
    sections = [
        bar_chart("cost-by-tenant", "Cost by tenant", tenants),
        bar_chart("cost-by-tier", "Cost by tier", tiers),
        waterfall("savings", "Savings: from baseline to paid", baseline,
                  savings_steps(con, job_id, manifest["largest_tier"]), cost),
        bar_chart("tokens-per-second", "Output tokens per second, per tier",
                  [(t, e["output_tokens_per_second"] or 0.0) for t, e in engines.items()], fmt=lambda v: f"{v:,.0f} tok/s")
        + "".join(f'<p class="note">{html.escape(t)}: {html.escape(_efficiency_line(e.get("efficiency") or {}))}</p>'
                  for t, e in engines.items()),
        bar_chart("reuse", "Reuse rate by kind (share of output rows)", reuse, fmt=lambda v: f"{v:.1%}")
        + f'<p class="note">{html.escape(_false_reuse_line(manifest.get("reuse", {}).get("verification") or {}))}</p>',
        bar_chart("slowest-partitions", "Slowest partitions (wall seconds)", slow, fmt=lambda v: f"{v:.2f} s"),
    ]
    quarantined = ", ".join(f"{k} {v}" for k, v in counts["by_reason"].items()) or "none"
    head = (f"<h1>tokenmill cost report: job {html.escape(job_id)}</h1>"
            f'<p class="facts">{counts["records"]} records · {counts["outputs"]} outputs · '
            f'{counts["quarantined"]} quarantined ({html.escape(quarantined)}) · paid {_fmt_usd(cost)} · '
            f'baseline {_fmt_usd(baseline)} · saved {_fmt_usd(baseline - cost)}</p>')
    # The one script marks each chart with how many bars it drew, so a headless browser can check.
    check = ("<script>document.querySelectorAll('svg.chart').forEach(s=>{const b=[...s.querySelectorAll('rect.bar')]"
             ".filter(r=>r.getBBox().width>0&&r.getBBox().height>0);s.setAttribute('data-drawn',b.length)});</script>")
    style = ("body{font:14px system-ui,sans-serif;margin:2em;color:#222}svg text{font-size:12px;fill:#222}"
             "section{margin:1.5em 0}h2{font-size:16px}.note,.facts,.empty{color:#555}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>tokenmill report {html.escape(job_id)}</title>"
            f"<style>{style}</style></head><body>{head}{''.join(sections)}{check}</body></html>")
