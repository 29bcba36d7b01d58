"""One self-contained HTML cost report per job: inline SVG charts, no script or font from the network.

Sections: cost by tenant and by tier, a waterfall from the no-dedup/no-cache/largest-tier baseline
to what was paid (savings going down, engine start-up and idle, escalation and failed work going up),
engine utilisation per tier (starts, start-up, busy and idle seconds, busy ÷ held) and the levers
each tier ran with (quantisation, KV-cache dtype, speculative acceptance, prefix-cache hits), engine
throughput, reuse by kind, the slowest partitions (labels drawn whole: the label column widens), and
quality: the output checks per tier (degenerate, copied, off topic, unfaithful, acceptable, cost per
acceptable document), escalations by reason, shadow verification's
false-reuse rate and, when given, the headline of the latest `tokenmill eval`. Figures come from
the job's ledger (DuckDB), its manifest and the eval's eval.json (read as plain JSON: the evals
layer sits above this one, and a crafted file may hold anything: its numbers are formatted only when
they are numbers).

Every fragment of the page is markupsafe's Markup, built with `Markup(template).format(...)` or
joined with `Markup("").join`: a value from the data, the manifest or eval.json is escaped by
construction, never call by call.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path

import duckdb
from markupsafe import Markup

from pipeline.generate.quality import CHECKS
from pipeline.output.charts import bar_chart, fmt_usd, waterfall
from pipeline.output.ledger import DOCUMENTS, MONEY, summary
from pipeline.output.manifest import EngineFigures, Manifest, read_manifest
from pipeline.output.telemetry import device_name
from pipeline.stores import storage


def _efficiency_line(eff: dict) -> str:
    if eff.get("mfu") is None:
        return f"hardware efficiency not computed ({eff.get('note', 'no data')})"
    return (
        f"MFU {eff['mfu']:.1%}, memory-bandwidth use {eff['mbu']:.1%} of {device_name(eff)} "
        f"({eff['note']}; estimates, see docs/analyst.md)"
    )


def _rows(con: duckdb.DuckDBPyConnection, sql: str, params: list) -> list[tuple]:
    return [tuple(float(v) if isinstance(v, Decimal) else v for v in r) for r in con.execute(sql, params).fetchall()]


CHARGES = ("failed_attempt", "lost", "unfinished")


def _tier_prices(con: duckdb.DuckDBPyConnection, job_id: str) -> dict[str, float | None]:
    """Each tier's price per GPU-hour in this job, from its rows that ran on that tier alone (an escalated
    row's price blends the tiers its attempts ran on); None where the rows disagree."""
    rows = _rows(
        con,
        "SELECT tier, min(price_per_gpu_hour), max(price_per_gpu_hour) FROM ledger WHERE job_id = ? "
        "AND NOT coalesce(escalated, false) AND price_per_gpu_hour > 0 GROUP BY 1",
        [job_id],
    )
    return {tier: low if low == high else None for tier, low, high in rows}


def savings_steps(
    con: duckdb.DuckDBPyConnection, job_id: str, largest_tier: str | None
) -> tuple[list[tuple[str, float]], list[str]]:
    """The waterfall's steps from the baseline to what was paid, signed (below zero: saved; above: added),
    and notes on how they were derived. From the ledger alone; the steps add up to paid − baseline.

    Every ledger row's cost is its busy GPU time plus its share of its engines' start-up and idle time
    (`overhead_gpu_seconds`), at its `price_per_gpu_hour`. The savings compare the baseline (largest tier,
    no dedup, no cache, start-up and idle shared in) with the busy part: reused rows save their whole
    baseline (per kind of reuse); generated rows save baseline − busy cost, on the largest tier through
    the prefix cache and batching, on a smaller one through routing. Then the costs no baseline row has
    are added: start-up and idle of every row, the attempts escalated documents paid before their
    escalation, and failed attempts and work lost with dead workers (ledger rows of `kind` failed_attempt
    and lost). Ledger files written before these columns read busy = gpu_seconds, no overhead.
    """
    money = "CAST({} AS DECIMAL(38, 18))"
    rows = _rows(
        con,
        f"""
        SELECT CASE WHEN coalesce(kind, 'output') IN {CHARGES} THEN 'charge' WHEN kind = 'judge' THEN 'judge'
                    WHEN source = 'generated' THEN 'generated'
                    WHEN source IS NULL THEN 'other' ELSE 'reuse' END AS grp,
               source, tier, coalesce(escalated, false) AS escalated,
               sum({money.format("coalesce(baseline_cost_usd, 0)")}), sum({money.format("coalesce(cost_usd, 0)")}),
               sum({money.format("coalesce(overhead_gpu_seconds, 0) * coalesce(price_per_gpu_hour, 0) / 3600")}),
               sum(coalesce(busy_gpu_seconds, gpu_seconds, 0))
        FROM ledger WHERE job_id = ? GROUP BY ALL ORDER BY ALL""",
        [job_id],
    )
    prices = _tier_prices(con, job_id)
    reuse: dict[str, float] = {}
    routing = prefix = overhead = escalation = other = 0.0
    extra = {"charge": 0.0, "judge": 0.0}
    notes, unsplit = [], []
    for grp, source, tier, escalated, baseline, cost, over, busy_gpu in rows:
        busy = cost - over  # cost = (busy + overhead) GPU-seconds × price / 3600
        overhead += over
        if grp == "reuse":
            reuse[source] = reuse.get(source, 0.0) + baseline - busy
            continue
        if grp in ("charge", "judge"):  # rows no baseline has: added, never saved
            extra[grp] += busy - baseline
            continue
        if grp == "other":
            other += busy - baseline
            continue
        if escalated:  # the attempts before the escalation: what the blended price says the other tier got
            p2, others = prices.get(tier), {v for t, v in prices.items() if t != tier}
            p1 = next(iter(others)) if len(others) == 1 else None
            if p1 is None or p2 is None or p1 == p2:
                unsplit.append(tier)
                escalation += busy - baseline
                continue
            first = min(max(p1 / (p2 - p1) * (p2 * busy_gpu / 3600 - busy), 0.0), busy)
            escalation += first
            busy -= first
        if tier == largest_tier:
            prefix += baseline - busy
        else:
            routing += baseline - busy
    steps = [(f"reuse: {source.replace('_', ' ')}", -saved) for source, saved in sorted(reuse.items())]
    steps += [
        (label, -saved)
        for label, saved in (("routing to smaller tiers", routing), ("prefix cache and batching", prefix))
        if saved
    ]
    steps += [
        (label, added)
        for label, added in (
            ("engine start-up and idle", overhead),
            ("escalation: attempts before it", escalation),
            ("failed attempts and lost work", extra["charge"]),
            ("LLM judge (checks.judge)", extra["judge"]),
            ("other rows", other),
        )
        if added
    ]
    return steps, notes + savings_notes(escalation, unsplit)


def savings_notes(escalation: float, unsplit: list[str]) -> list[str]:
    """How the waterfall's steps were derived; `unsplit`: tiers whose escalated rows could not be split."""
    notes = [
        "Savings compare the baseline (every document generated on the largest tier, no dedup, no cache, "
        "with its share of engine start-up and idle) with the busy GPU time actually paid; engine start-up "
        "and idle (ledger overhead_gpu_seconds × price) and the other costs are then added as paid."
    ]
    if escalation and not unsplit:
        notes.append(
            "Escalation: what escalated documents paid on the tier they were escalated from (their first "
            "attempts and retries), derived from each row's blended price; their final attempt counts "
            "with the savings of its tier."
        )
    elif unsplit:
        notes.append(
            f"Escalation on {', '.join(sorted(set(unsplit)))}: the first attempts' share cannot be told from "
            "the ledger (tier prices equal, unknown, or more than one tier they came from), so the bar "
            "shows what escalated documents paid above their baseline."
        )
    return notes


def _false_reuse_line(v: dict) -> str:
    """The false-reuse rate measured by shadow verification (manifest `reuse.verification`)."""
    if not v.get("checked"):
        return (
            "False-reuse rate: no near or semantic reuse was shadow-verified in this job "
            "(dedup.shadow_rate; the manifest's reuse.verification)."
        )
    low, high = _pair(v.get("ci95"))
    return (
        f"False-reuse rate (shadow verification, token F1 below {v.get('min_f1')}): {_pct(v.get('false_hit_rate'))} "
        f"of {v['checked']} verified reuses (95% CI {_pct(low)}-{_pct(high)}); per kind and samples in the "
        "manifest's reuse.verification."
    )


def _table(table_id: str, head: list[str], rows: list[list[str]]) -> Markup:
    cells = Markup("").join(Markup("<th>{}</th>").format(h) for h in head)
    body = Markup("").join(
        Markup("<tr>{}</tr>").format(Markup("").join(Markup("<td>{}</td>").format(c) for c in r)) for r in rows
    )
    return Markup('<table class="quality" id="{}"><thead><tr>{}</tr></thead><tbody>{}</tbody></table>').format(
        table_id, cells, body
    )


def _num(v, spec: str = ",.1f") -> str:
    """`v` formatted as `spec` when it is a number; "-" when absent, "?" when it is anything else (a
    crafted or damaged eval.json)."""
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else "?"


def _pct(v) -> str:
    return _num(v, ".1%")


def _pair(v) -> tuple:
    return tuple(v) if isinstance(v, list) and len(v) == 2 else (None, None)


def _dict(v) -> dict:
    return v if isinstance(v, dict) else {}


def _note(text: str) -> Markup:
    return Markup('<p class="note">{}</p>').format(text)


FLAGS = (*CHECKS, "unfaithful", "acceptable")  # ledger columns, per tier


def job_quality(con: duckdb.DuckDBPyConnection, job_id: str) -> tuple[list[list[str]], list[list[str]]]:
    """Per tier: documents (outputs served or quarantined after they were paid), those failing each output check,
    those acceptable (no check failed), the tier's whole cost (failed attempts and lost work included, as
    `ledger summary` counts it) per document and per acceptable document, those escalated; and escalations by
    reason.

    Ledger files written before a check's column existed read as NULL there (the views carry today's schema):
    their rows count as "not recorded", never as passing or unexplained.
    """
    flags = ", ".join(f"count({f}), count(*) FILTER (WHERE {f})" for f in FLAGS)  # charge rows: null in each
    tiers = _rows(
        con,
        f"SELECT tier, {DOCUMENTS}, {flags}, count(*) FILTER (WHERE escalated) FROM ledger "
        "WHERE job_id = ? GROUP BY 1 ORDER BY 1",
        [job_id],
    )
    costs = {r["tier"]: r for r in summary(con, ["tier"], job_id).to_pylist()}  # as `ledger summary` says them

    def usd(v) -> str:
        return "-" if v is None else fmt_usd(float(v))

    by_tier = []
    for tier, n, *counts, escalated in tiers:
        cells = [
            f"{flagged} ({flagged / recorded:.1%})" if recorded else "not recorded"
            for recorded, flagged in zip(counts[::2], counts[1::2])
        ]
        by_tier.append(
            [
                tier,
                n,
                *cells,
                usd(costs[tier]["cost_per_document_usd"]),
                usd(costs[tier]["cost_per_acceptable_usd"]),
                escalated,
            ]
        )
    reasons = _rows(
        con,
        "SELECT coalesce(escalation_reason, 'not recorded'), count(*) AS n FROM ledger "
        "WHERE job_id = ? AND escalated GROUP BY 1 ORDER BY n DESC, 1",
        [job_id],
    )
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
    chosen, target = _dict(routing.get("chosen")), routing.get("target_quality")
    if not chosen:
        return (
            f"Chosen policy: none keeps {_pct(target)} of all-{baseline_tier} quality (the config was left as it was)."
        )
    if chosen.get("all_large"):
        return (
            f"Chosen policy (target {_pct(target)}): everything on {baseline_tier}, "
            f"${_num(chosen.get('cost_per_1k_usd'), '.5f')} per 1k documents: no cheaper mix of tiers kept the "
            "target quality."
        )
    settings = [
        f"router below {_num(chosen['router_threshold'], '.2f')} to the large tier"
        if chosen.get("router_threshold") is not None
        else "no router",
        "mean log-probability signal off"
        if chosen.get("min_mean_logprob") is None
        else f"escalate below mean log-probability {_num(chosen['min_mean_logprob'], '.3f')}",
        f"truncation {'on' if chosen.get('on_truncation') else 'off'}",
        f"unfaithful {'on' if chosen.get('on_unfaithful') else 'off'}",
    ]
    all_large = _dict(routing.get("all_large")).get("cost_per_1k_usd")
    against = f" (all-{baseline_tier} ${_num(all_large, '.5f')})" if all_large is not None else ""
    return (
        f"Chosen policy (target {_pct(target)}, scored on {routing.get('test_documents', '?')} test documents): "
        f"quality kept {_pct(chosen.get('quality_kept'))}, {_pct(chosen.get('small_share'))} kept on the small tier, "
        f"{_pct(chosen.get('escalated_share'))} escalated, ${_num(chosen.get('cost_per_1k_usd'), '.5f')} per 1k "
        f"documents{against}; " + ", ".join(settings) + "."
    )


def eval_headline(result: dict, job_models: dict[str, str | None]) -> Markup:
    """The latest eval's tiers table, chosen policy and reuse false hits; a note when it measured other models."""
    base = str(result.get("baseline_tier", "?"))
    models = _dict(result.get("models"))
    rows = [
        [
            tier,
            models.get(tier, "-"),
            _num(s.get("rouge_l_vs_baseline"), ".3f"),
            f"{_pct(s.get('unfaithful_rate'))} ({' - '.join(_pct(v) for v in _pair(s.get('unfaithful_ci95')))})",
            "-" if s.get("cost_per_1k_usd") is None else f"${_num(s['cost_per_1k_usd'], '.5f')}",
        ]
        for tier, s in ((t, _dict(v)) for t, v in result["tiers"].items())
    ]
    holdout = _dict(result.get("holdout"))
    parts = [
        Markup("<h3>Latest eval: {} (written {}, {} hold-out documents)</h3>").format(
            result["eval_file"], result["eval_written"], holdout.get("documents", "?")
        ),
        _table("eval-tiers", ["tier", "model", f"ROUGE-L vs {base}", "unfaithful (95% CI)", "$/1k docs"], rows),
        _note(_policy_line(_dict(result.get("routing")), base)),
    ]
    total = _dict(_dict(result.get("reuse")).get("total"))
    if total.get("reused"):
        low, high = _pair(total.get("ci95"))
        parts.append(
            _note(
                f"Near and semantic reuse on the hold-out set: {total.get('false_hits')} false hits in "
                f"{total['reused']} reuses ({_pct(total.get('false_hit_rate'))}, 95% CI "
                f"{_pct(low)}-{_pct(high)})."
            )
        )
    stale = sorted(str(t) for t, m in models.items() if t in job_models and job_models[t] not in (None, m))
    if stale:
        parts.append(
            _note(
                f"This job ran other models than the eval measured on {', '.join(stale)}: "
                "run `tokenmill eval` again before trusting these figures."
            )
        )
    return Markup("").join(parts)


def quality_section(
    con: duckdb.DuckDBPyConnection, job_id: str, manifest: Manifest, eval_result: dict | None
) -> Markup:
    by_tier, reasons = job_quality(con, job_id)
    parts = [
        Markup("<h2>Quality</h2>"),
        _table(
            "checks-by-tier",
            [
                "tier",
                "outputs",
                "degenerate",
                "copied",
                "off topic",
                "unfaithful",
                "acceptable",
                "$ per document",
                "$ per acceptable",
                "escalated to this tier",
            ],
            by_tier,
        ),
        _note(
            "Output checks (docs/data-engineer.md#output-checks), per served output: degenerate (a repetition "
            "loop), copied (its document given back), off topic (about something else), unfaithful (numbers, "
            "dates or capitalised names its document does not contain). Acceptable: no check failed and not "
            "cut off by max_tokens; what a buyer of summaries pays for. Outputs quarantined by `checks.quarantine` "
            "count here, as paid and not acceptable."
        ),
        _table("escalations", ["escalation reason", "outputs"], reasons)
        if reasons
        else _note("No output was escalated in this job."),
        _note(_false_reuse_line(manifest.reuse.verification)),
    ]
    if eval_result is not None:
        models = {t: e.model for t, e in manifest.engines.items()}
        parts.append(eval_headline(eval_result, models))
    else:
        parts.append(
            _note("No eval result: run `tokenmill eval` (docs/data-engineer.md) and pass its eval.json with --eval.")
        )
    return Markup('<section id="quality">{}</section>').format(Markup("").join(parts))


def _model_name(model: str | None) -> str:
    """A model as the table shows it: a local checkpoint by its folder's name (the manifest has the path)."""
    if not model:
        return "-"
    if model.startswith("fake-engine:"):  # TierConfig.generator: fake-engine:<model>:<its settings>
        return f"fake engine ({_model_name(model.removeprefix('fake-engine:').split(':{')[0])})"
    return Path(model).name if model.startswith(("/", ".", "~")) else model


def _levers_table(engines: dict[str, EngineFigures]) -> Markup:
    """Per tier: the levers it ran with and what vLLM's own counters say they did."""

    def spec(lv: dict) -> str:
        sp = lv.get("speculative")
        return f"{sp.get('method')} ×{sp.get('num_speculative_tokens') or '?'}" if sp else "off"

    rows = [
        [
            tier,
            (lv := e.levers).get("quantization") or "-",
            lv.get("dtype") or "-",
            lv.get("kv_cache_dtype") or "-",
            spec(lv),
            _pct(e.spec_acceptance),
            "off" if lv.get("prefix_caching") is False else _pct(e.prefix_cache_hit_rate),
        ]
        for tier, e in engines.items()
    ]
    return _table(
        "engine-levers",
        ["tier", "quantisation", "dtype", "KV cache dtype", "speculative", "drafts accepted", "prefix-cache hits"],
        rows,
    )


def engine_section(manifest: Manifest) -> Markup:
    """Per tier, from the manifest's `engines`: engine starts, start-up, busy and idle seconds, held time
    and utilisation (busy ÷ held), next to throughput; then the job's GPU-seconds by what they bought."""
    engines = manifest.engines
    rows = [
        [
            tier,
            _model_name(e.model),
            _num(e.workers, ""),
            _num(e.starts, ""),
            _num(e.startup_seconds),
            _num(e.busy_seconds),
            _num(e.idle_seconds),
            _num(e.held_seconds),
            _num(e.held_gpu_seconds),
            _pct(e.utilisation),
            _num(e.output_tokens_per_second, ",.0f"),
            _num(e.failed_attempts, ""),
        ]
        for tier, e in engines.items()
    ]
    parts = [
        Markup("<h2>Engine utilisation, per tier</h2>"),
        _table(
            "engine-utilisation",
            [
                "tier",
                "model",
                "workers",
                "engine starts",
                "start-up s",
                "busy s",
                "idle s",
                "held s",
                "held GPU-s",
                "utilisation",
                "output tok/s",
                "failed attempts",
            ],
            rows,
        )
        if rows
        else _note("No engine ran for this job (every output reused, or nothing to generate)."),
    ]
    if rows:
        parts.append(_levers_table(engines))
    c = manifest.cost
    if c.gpu_seconds:
        kinds = ", ".join(f"{k.replace('_', ' ')} {v:,.1f}" for k, v in c.gpu_seconds_by_kind.items())
        parts.append(
            _note(
                f"Utilisation = busy ÷ held seconds (held = start-up + busy + idle). The ledger carries "
                f"{c.gpu_seconds:,.1f} GPU-seconds, all its engines were held × their GPUs; "
                f"{c.overhead_gpu_seconds:,.1f} of them start-up and idle shared into its rows"
                + (f"; by what they bought: {kinds}." if kinds else ".")
            )
        )
    return Markup('<section id="engines">{}</section>').format(Markup("").join(parts))


def build_report(output_uri: str, job_id: str, storage_config=None, eval_result: dict | None = None) -> str:
    """The report page; `eval_result` is a `load_eval` result to show in the quality section (None: none)."""
    from pipeline.output.ledger import connect

    root = storage.resolve(output_uri, storage_config)
    try:
        manifest = read_manifest(root, job_id)
    except storage.StorageError as e:
        raise storage.StorageError(f"no manifest for job {job_id}: {e}") from None
    con = connect(output_uri, storage_config)
    by = (
        "SELECT {k}, sum("
        + MONEY.format(col="cost_usd")
        + ") AS c FROM ledger WHERE job_id = ? GROUP BY 1 ORDER BY c DESC"
    )
    tenants = _rows(con, by.format(k="tenant"), [job_id])
    tiers = _rows(con, by.format(k="tier"), [job_id])
    cost, baseline = manifest.cost.cost_usd, manifest.cost.baseline_cost_usd
    engines = manifest.engines
    counts = manifest.counts
    reuse = [(k, v / counts.outputs) for k, v in counts.by_source.items() if k != "generated" and counts.outputs]
    slow = sorted(
        ((f"{p} ({v.file})", v.seconds) for p, v in manifest.partitions.items() if v.seconds),
        key=lambda r: -r[1],
    )[:10]
    steps, notes = savings_steps(con, job_id, manifest.largest_tier)
    sections = [
        bar_chart("cost-by-tenant", "Cost by tenant", tenants),
        bar_chart("cost-by-tier", "Cost by tier", tiers),
        waterfall("savings", "From baseline to paid: savings down, costs added up", baseline, steps, cost)
        + Markup("").join(_note(n) for n in notes),
        engine_section(manifest),
        bar_chart(
            "tokens-per-second",
            "Output tokens per second, per tier",
            [(t, e.output_tokens_per_second or 0.0) for t, e in engines.items()],
            fmt=lambda v: f"{v:,.0f} tok/s",
        )
        + Markup("").join(_note(f"{t}: {_efficiency_line(e.efficiency)}") for t, e in engines.items()),
        bar_chart("reuse", "Reuse rate by kind (share of output rows)", reuse, fmt=lambda v: f"{v:.1%}")
        + _note(_false_reuse_line(manifest.reuse.verification)),
        bar_chart("slowest-partitions", "Slowest partitions (wall seconds)", slow, fmt=lambda v: f"{v:.2f} s"),
        quality_section(con, job_id, manifest, eval_result),
    ]
    quarantined = ", ".join(f"{k} {v}" for k, v in counts.by_reason.items()) or "none"
    head = Markup('<h1>tokenmill cost report: job {}</h1><p class="facts">{}</p>').format(
        job_id,
        f"{counts.records} records · {counts.outputs} outputs · {counts.quarantined} quarantined "
        f"({quarantined}) · paid {fmt_usd(cost)} · baseline {fmt_usd(baseline)} · saved {fmt_usd(baseline - cost)}",
    )
    # The one script marks each chart with how many bars it drew, so a headless browser can check.
    check = Markup(
        "<script>document.querySelectorAll('svg.chart').forEach(s=>{const b=[...s.querySelectorAll('rect.bar')]"
        ".filter(r=>r.getBBox().width>0&&r.getBBox().height>0);s.setAttribute('data-drawn',b.length)});</script>"
    )
    style = Markup(
        "body{font:14px system-ui,sans-serif;margin:2em;color:#222}svg text{font-size:12px;fill:#222}"
        "section{margin:1.5em 0}h2{font-size:16px}h3{font-size:14px}.note,.facts,.empty{color:#555}"
        "table.quality{border-collapse:collapse;margin:.5em 0}table.quality td,table.quality th"
        "{border-bottom:1px solid #ddd;padding:3px 10px;text-align:right}"
        "table.quality td{white-space:nowrap}table.quality td:first-child"
        "{text-align:left}"
    )
    page = Markup(
        "<!doctype html><html><head><meta charset='utf-8'><title>tokenmill report {}</title>"
        "<style>{}</style></head><body>{}{}{}</body></html>"
    ).format(job_id, style, head, Markup("").join(sections), check)
    return str(page)
