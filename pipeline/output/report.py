"""One self-contained HTML cost report per job: inline SVG charts, no script or font from the network.

Sections: cost by tenant and by tier, a savings waterfall from the no-dedup/no-cache/largest-tier
baseline down to what was paid, engine throughput per tier, reuse by kind, the slowest partitions,
and quality: outputs flagged unfaithful per tier, escalations by reason, shadow verification's
false-reuse rate and, when given, the headline of the latest `tokenmill eval`. Figures come from
the job's ledger (DuckDB), its manifest and the eval's eval.json (read as plain JSON: the evals
layer sits above this one).
"""

from __future__ import annotations

import html
import json
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path

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


def _table(table_id: str, head: list[str], rows: list[list[str]]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="quality" id="{table_id}"><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table>'


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def _note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def job_quality(con: duckdb.DuckDBPyConnection, job_id: str) -> tuple[list[list[str]], list[list[str]]]:
    """Per tier: served outputs, those flagged unfaithful, those escalated; and escalations by reason.

    Ledger files written before the faithfulness columns existed read as NULL there (the views carry
    today's schema): their rows count as "not recorded", never as faithful or unexplained.
    """
    tiers = _rows(con, "SELECT tier, count(*), count(unfaithful), count(*) FILTER (WHERE unfaithful), "
                       "count(*) FILTER (WHERE escalated) FROM ledger WHERE job_id = ? GROUP BY 1 ORDER BY 1", [job_id])
    by_tier = [[tier, n, f"{flagged} ({flagged / recorded:.1%})" if recorded else "not recorded", escalated]
               for tier, n, recorded, flagged, escalated in tiers]
    reasons = _rows(con, "SELECT coalesce(escalation_reason, 'not recorded'), count(*) AS n FROM ledger "
                         "WHERE job_id = ? AND escalated GROUP BY 1 ORDER BY n DESC, 1", [job_id])
    return by_tier, [[reason, n] for reason, n in reasons]


def load_eval(path: Path) -> dict:
    """A `tokenmill eval` result (its eval.json), with where it came from and when it was written."""
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
        written = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"eval result {path}: {e}") from None
    if not isinstance(result, dict) or not isinstance(result.get("tiers"), dict):
        raise ValueError(f"eval result {path}: not a `tokenmill eval` eval.json (no `tiers`)")
    return {**result, "eval_file": str(path), "eval_written": written.strftime("%Y-%m-%d %H:%M UTC")}


def _policy_line(routing: dict, baseline_tier: str) -> str:
    chosen, target = routing.get("chosen"), routing.get("target_quality")
    if not chosen:
        return f"Chosen policy: none keeps {_pct(target)} of all-{baseline_tier} quality (the config was left as it was)."
    if chosen.get("all_large"):
        return (f"Chosen policy (target {_pct(target)}): everything on {baseline_tier}, ${chosen['cost_per_1k_usd']:.5f} "
                "per 1k documents: no cheaper mix of tiers kept the target quality.")
    settings = [f"router below {chosen['router_threshold']:.2f} to the large tier" if chosen.get("router_threshold") is not None
                else "no router",
                "mean log-probability signal off" if chosen.get("min_mean_logprob") is None
                else f"escalate below mean log-probability {chosen['min_mean_logprob']:.3f}",
                f"truncation {'on' if chosen.get('on_truncation') else 'off'}",
                f"unfaithful {'on' if chosen.get('on_unfaithful') else 'off'}"]
    all_large = (routing.get("all_large") or {}).get("cost_per_1k_usd")
    against = f" (all-{baseline_tier} ${all_large:.5f})" if all_large is not None else ""
    return (f"Chosen policy (target {_pct(target)}, scored on {routing.get('test_documents', '?')} test documents): "
            f"quality kept {_pct(chosen['quality_kept'])}, {_pct(chosen['small_share'])} kept on the small tier, "
            f"{_pct(chosen.get('escalated_share'))} escalated, ${chosen['cost_per_1k_usd']:.5f} per 1k documents{against}; "
            + ", ".join(settings) + ".")


def eval_headline(result: dict, job_models: dict[str, str | None]) -> str:
    """The latest eval's tiers table, chosen policy and reuse false hits; a note when it measured other models."""
    base = result.get("baseline_tier", "?")
    models = result.get("models", {})
    rows = [[tier, models.get(tier, "-"), "-" if s.get("rouge_l_vs_baseline") is None else f"{s['rouge_l_vs_baseline']:.3f}",
             f"{_pct(s.get('unfaithful_rate'))} ({' - '.join(_pct(v) for v in s.get('unfaithful_ci95') or [None, None])})",
             "-" if s.get("cost_per_1k_usd") is None else f"${s['cost_per_1k_usd']:.5f}"]
            for tier, s in result["tiers"].items()]
    holdout = result.get("holdout", {})
    parts = [f"<h3>Latest eval: {html.escape(result['eval_file'])} (written {result['eval_written']}, "
             f"{holdout.get('documents', '?')} hold-out documents)</h3>",
             _table("eval-tiers", ["tier", "model", f"ROUGE-L vs {base}", "unfaithful (95% CI)", "$/1k docs"], rows),
             _note(_policy_line(result.get("routing") or {}, base))]
    total = (result.get("reuse") or {}).get("total") or {}
    if total.get("reused"):
        low, high = total["ci95"]
        parts.append(_note(f"Near and semantic reuse on the hold-out set: {total['false_hits']} false hits in "
                           f"{total['reused']} reuses ({_pct(total['false_hit_rate'])}, 95% CI {low:.1%}-{high:.1%})."))
    stale = sorted(t for t, m in models.items() if t in job_models and job_models[t] not in (None, m))
    if stale:
        parts.append(_note(f"This job ran other models than the eval measured on {', '.join(stale)}: "
                           "run `tokenmill eval` again before trusting these figures."))
    return "".join(parts)


def quality_section(con: duckdb.DuckDBPyConnection, job_id: str, manifest: dict, eval_result: dict | None) -> str:
    by_tier, reasons = job_quality(con, job_id)
    parts = ["<h2>Quality</h2>",
             _table("unfaithful-by-tier", ["tier", "served outputs", "flagged unfaithful", "escalated to this tier"], by_tier),
             _note("Flagged unfaithful: the served output states numbers, dates or capitalised names its document "
                   "does not contain (ledger column `unfaithful`; on the escalation tier it is flagged, not escalated)."),
             _table("escalations", ["escalation reason", "outputs"], reasons) if reasons
             else _note("No output was escalated in this job."),
             _note(_false_reuse_line(manifest.get("reuse", {}).get("verification") or {}))]
    if eval_result is not None:
        models = {t: e.get("model") for t, e in manifest.get("engines", {}).items()}
        parts.append(eval_headline(eval_result, models))
    else:
        parts.append(_note("No eval result: run `tokenmill eval` (docs/data-engineer.md) and pass its eval.json "
                           "with --eval."))
    return f'<section id="quality">{"".join(parts)}</section>'


def build_report(output_uri: str, job_id: str, storage_config=None, eval_result: dict | None = None) -> str:
    """The report page; `eval_result` is a `load_eval` result to show in the quality section (None: none)."""
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
        quality_section(con, job_id, manifest, eval_result),
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
             "section{margin:1.5em 0}h2{font-size:16px}h3{font-size:14px}.note,.facts,.empty{color:#555}"
             "table.quality{border-collapse:collapse;margin:.5em 0}table.quality td,table.quality th"
             "{border-bottom:1px solid #ddd;padding:3px 10px;text-align:right}table.quality td:first-child"
             "{text-align:left}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>tokenmill report {html.escape(job_id)}</title>"
            f"<style>{style}</style></head><body>{head}{''.join(sections)}{check}</body></html>")
