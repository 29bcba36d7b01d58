"""What a job will cost before it runs, and whether it may: the pre-flight estimate and the budget.

The requests a job would send (per item: tier, prompt tokens, tenant) are priced (`price_demand`) with what
earlier ledgers under the output root measured for the same tier and model (`tier_rates`): busy GPU-seconds
per weighted token, the prefix-cache share of prompt tokens, output tokens per item, the share of items
escalated, and the engine's start-up and idle per job, each with its spread; with no history, configured
defaults and a wide range that says so. Low / mid / high USD per tier, per tenant and for the job.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import TokenmillConfig
from pipeline.stores.storage import StorageError

log = logging.getLogger(__name__)

Z, RECENT_JOBS = 1.96, 20  # 95% predictive intervals; history: the latest 20 jobs with generated rows
MIN_JOBS = 3                # fewer measured jobs: the floors below (declared, not measured: one or two jobs cannot
THIN_RATE_SPREAD = 0.25     # show how runs differ with the machine's load; engine start-up varies more, 20-45 s
THIN_OVERHEAD_SPREAD = 0.5  # on 2 shared cores for one model)
DEFAULT_RATE_FACTOR = 4.0   # no history: the configured throughput may be off by this factor either way, and
DEFAULT_OVERHEAD = 60.0     # an engine's start-up and idle 0-60 s (× GPUs); unmeasured: the middle of the range
NOTE = ("est_usd is the midpoint, est_usd_low-est_usd_high the range. Counted: each item at its tier's throughput, "
        "prefix-cache share, output length and escalation rate measured in earlier ledgers (else configured "
        "defaults), escalations on the escalation tier, each engine's start-up and idle, documents too long for the "
        "context as the run cuts them (a request per chunk, a reduce each). Not counted: reuse from earlier jobs' "
        "cache (inputs it holds cost less), shadow verification (dedup.shadow_rate of near/semantic reuses), schema "
        "retries, failed attempts.")


@dataclass(frozen=True)
class Range:
    low: float
    mid: float
    high: float

    def __add__(self, other: Range) -> Range:
        return Range(self.low + other.low, self.mid + other.mid, self.high + other.high)

    def times(self, k: Range | float) -> Range:
        k = k if isinstance(k, Range) else Range(k, k, k)
        return Range(self.low * k.low, self.mid * k.mid, self.high * k.high)

    def widened(self, spread: float) -> Range:  # at least ±spread of the midpoint
        return Range(min(self.low, self.mid * (1 - spread)), self.mid, max(self.high, self.mid * (1 + spread)))


ZERO = Range(0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Measured:
    """A per-item quantity measured on `n` items of history, output tokens (a mean, `sd` given) or the share
    escalated (`sd` None), with each job's own value. `predict(items)`: its range over `items` new items, the 95%
    predictive interval for the history's error and the new items' own spread (mean ± Z·sd·√(1/n + 1/items);
    for a share, Wilson's at n_eff = 1/(1/n + 1/items)), widened to every job's value (corpora differ), within
    `bounds`. `default`: nothing measured, this range stands."""

    value: float
    n: int = 0
    sd: float | None = None
    jobs: tuple[float, ...] = ()
    bounds: tuple[float, float] = (0.0, math.inf)
    default: Range | None = None

    def predict(self, items: float) -> Range:
        if self.default is not None:
            return self.default
        m, p = 1 / (1 / self.n + 1 / max(items, 1.0)), self.value
        if self.sd is not None:
            low, high = p - Z * self.sd / math.sqrt(m), p + Z * self.sd / math.sqrt(m)
        else:
            d, half = 1 + Z * Z / m, Z * math.sqrt(p * (1 - p) / m + Z * Z / (4 * m * m))
            low, high = (p + Z * Z / (2 * m) - half) / d, (p + Z * Z / (2 * m) + half) / d
        return Range(max(self.bounds[0], min(low, *self.jobs)), p, min(self.bounds[1], max(high, *self.jobs)))


@dataclass(frozen=True)
class TierRate:
    """What one tier's model did in earlier jobs, with spreads. seconds_range: busy GPU-seconds per weighted token
    (`cost` weights), pooled over partitions; the range: that ratio's 95% predictive interval (from the partitions'
    spread about it, for the history's error and a new job's) and each job's own ratio.
    cached_share: prompt tokens the prefix cache served (each job's as the range). output, escalation (share of
    the tier's items escalated; None: none from it): see Measured. overhead: engine start-up and idle GPU-seconds
    per job. From generated rows on one tier (not escalated, one attempt); an escalated row counts for the tier it
    came from (route reason), its start-up and idle split between both tiers by its blended price (as the report
    does); a tier that only ran escalations is measured from them (tokens halved)."""

    seconds_per_weight: float      # midpoints, as before
    output_tokens_per_item: float
    method: str                    # how it was obtained, for humans
    seconds_range: Range
    cached_share: Range
    output: Measured
    escalation: Measured | None
    overhead: Range
    items: int = 0
    jobs: int = 0


def _weight(config, prompt, cached, output):
    c = config.cost  # cached prompt tokens at their own weight
    return c.prefill_token_weight * (prompt - cached) + c.cached_token_weight * cached + c.decode_token_weight * output


GENERATED = "source = 'generated' AND coalesce(kind, 'output') IN ('output', 'invalid_output')"


def _ledger_history(config: TokenmillConfig, output_uri: str) -> tuple[list, list]:
    """(one-tier rows per job, partition, tier; multi-attempt rows per job, tier, route) of the latest jobs."""
    from pipeline.output.ledger import connect

    con = connect(output_uri, config.storage)
    jobs = [r[0] for r in con.execute(f"SELECT job_id FROM ledger WHERE {GENERATED} GROUP BY 1 ORDER BY max(created_at) "
                                      "DESC LIMIT ?", [RECENT_JOBS]).fetchall()]
    common = ("count(*), sum(coalesce(busy_gpu_seconds, gpu_seconds)), sum(coalesce(overhead_gpu_seconds, 0)), "
              "sum(prompt_tokens), sum(cached_prompt_tokens), sum(output_tokens)")
    plain = "FILTER (WHERE coalesce(chunks, 0) = 0)"
    pure = con.execute(
        f"SELECT job_id, partition, tier, model, {common}, count(*) {plain}, sum(output_tokens) {plain}, "
        f"sum(output_tokens * output_tokens) {plain}, min(price_per_gpu_hour), max(price_per_gpu_hour) FROM ledger "
        f"WHERE {GENERATED} AND list_contains(?, job_id) AND NOT coalesce(escalated, false) "
        "AND coalesce(attempts, 1) <= 1 GROUP BY ALL", [jobs]).fetchall()
    multi = con.execute(
        f"SELECT job_id, tier, model, coalesce(route_reason, ''), coalesce(escalated, false), {common}, "
        f"sum(gpu_seconds), sum(cost_usd) FROM ledger WHERE {GENERATED} AND list_contains(?, job_id) "
        "AND (coalesce(escalated, false) OR coalesce(attempts, 1) > 1) GROUP BY ALL", [jobs]).fetchall()
    return pure, multi


def _origin(config: TokenmillConfig, route_reason: str, to: str) -> str | None:
    """The tier an escalated row's first attempt ran on: the one other tier, else its route reason's."""
    others = [t for t in config.tiers if t != to]
    rules = {f"rule:{r.name}": r.tier for r in config.route.rules} | {"default": config.route.default_tier}
    tier = others[0] if len(others) == 1 else rules.get(route_reason)
    return tier if tier in others else None


def _measure(config: TokenmillConfig, pure: list, multi: list) -> dict[str, dict]:
    """Per tier: one-tier batches (its escalations' share of escalated rows), per job start-up and idle, escalations."""
    models = {name: t.model for name, t in config.tiers.items()}
    out = {t: {"batches": [], "derived": [], "overhead": {}, "escalated": {}, "routed": {}} for t in config.tiers}
    prices: dict[tuple[str, str], float] = {}

    def add(tier, key, job, value):
        out[tier][key][job] = out[tier][key].get(job, 0) + value
    for job, _, tier, model, n, busy, over, prompt, cached, output, plain, p_out, p_out2, lo, hi in pure:
        if tier not in out or model != models[tier]:
            continue
        out[tier]["batches"].append((job, n, busy, _weight(config, prompt, cached, output), prompt, cached,
                                     plain, p_out or 0, p_out2 or 0))
        add(tier, "routed", job, plain)
        add(tier, "overhead", job, over)
        if lo is not None and lo == hi:
            prices[(job, tier)] = lo
    for job, tier, model, reason, escalated, n, busy, over, prompt, cached, output, gpu, cost in multi:
        if tier not in out or model != models[tier]:
            continue
        first = _origin(config, reason, tier) if escalated else None
        share = 0.0  # of the row's GPU-seconds that ran on `first`
        if first is not None:
            p1 = prices.get((job, first), config.tiers[first].price_per_gpu_hour)
            p2 = prices.get((job, tier), config.tiers[tier].price_per_gpu_hour)
            share = min(max((p2 * gpu - 3600 * cost) / (p2 - p1) / gpu, 0.0), 1.0) if p1 != p2 and gpu else 0.5
            add(first, "escalated", job, n)
            add(first, "routed", job, n)
            add(first, "overhead", job, over * share)
            half = (prompt / 2, cached / 2, output / 2)  # the escalation's tokens: assumed half the row's
            out[tier]["derived"].append((job, n, busy * (1 - share), _weight(config, *half), *half[:2], n, half[2],
                                         half[2] ** 2 / n))
        elif not escalated:
            add(tier, "routed", job, n)
        add(tier, "overhead", job, over * (1 - share))
    return out


def _configured(config: TokenmillConfig, name: str) -> TierRate:
    mid, k = 1.0 / config.tiers[name].default_tokens_per_gpu_second, float(config.sampling.max_tokens)
    escalates = config.escalation_tier not in (None, name)
    return TierRate(mid, k, f"configured default (no ledger of this tier's model yet): throughput ×{1 / DEFAULT_RATE_FACTOR:g}"
                    f"-×{DEFAULT_RATE_FACTOR:g} of default_tokens_per_gpu_second, output up to max_tokens"
                    + (", escalations 0-100%" if escalates else "") + f", engine start-up and idle 0-{DEFAULT_OVERHEAD:g} s",
                    Range(mid / DEFAULT_RATE_FACTOR, mid, mid * DEFAULT_RATE_FACTOR), ZERO,
                    Measured(k, default=Range(1.0, k, k)), Measured(0.5, default=Range(0.0, 0.5, 1.0)) if escalates else None,
                    Range(0.0, 0.5, 1.0).times(DEFAULT_OVERHEAD * config.tiers[name].gpus))


def _rate(config: TokenmillConfig, name: str, m: dict) -> TierRate:
    derived = not m["batches"] and bool(m["derived"])  # only escalations ran on this tier
    batches = m["batches"] or m["derived"]
    jobs = sorted({x[0] for x in batches})
    if not jobs:
        return _configured(config, name)
    b = np.array([x[1:] for x in batches], dtype=float)  # items, busy, weight, prompt, cached, plain, out, out²
    per_job = [np.array([x[1:] for x in batches if x[0] == j], dtype=float).sum(axis=0) for j in jobs]
    mid, k = float(b[:, 1].sum() / max(b[:, 2].sum(), 1e-12)), len(b)
    # a pooled ratio's variance from its batches' residuals, the history's and a new job's alike: ×2
    half = Z * math.sqrt(2 * ((b[:, 1] - mid * b[:, 2]) ** 2).sum() * k / (k - 1)) / max(b[:, 2].sum(), 1e-12) if k > 1 else 0.0
    job_rates = [s[1] / s[2] for s in per_job if s[2] > 0] or [mid]
    seconds = Range(max(min(mid - half, *job_rates), 0.0), mid, max(mid + half, *job_rates))
    shares = [s[4] / s[3] for s in per_job if s[3] > 0]
    cached = Range(min(shares), b[:, 4].sum() / b[:, 3].sum(), max(shares)) if shares else ZERO
    n, top = int(b[:, 5].sum()), float(config.sampling.max_tokens)
    mean = float(b[:, 6].sum() / n) if n else top
    sd = math.sqrt(max(b[:, 7].sum() / n - mean * mean, 0.0) * n / (n - 1)) if n > 1 else 0.0
    output = Measured(mean, max(n, 1), sd, tuple(s[6] / s[5] for s in per_job if s[5] > 0), (0.0, top),
                      Range(mean, mean, mean).widened(THIN_RATE_SPREAD) if derived else None)
    escalation, routed = None, sum(m["routed"].values())
    if config.escalation_tier not in (None, name):
        escalation = Measured(sum(m["escalated"].values()) / routed, routed, None, tuple(
            m["escalated"].get(j, 0) / r for j, r in m["routed"].items() if r), (0.0, 1.0)) if routed else \
            _configured(config, name).escalation
    over = list(m["overhead"].values())
    overhead = Range(min(over), sum(over) / len(over), max(over)) if over else ZERO
    if len(jobs) < MIN_JOBS:
        seconds, overhead = seconds.widened(THIN_RATE_SPREAD), overhead.widened(THIN_OVERHEAD_SPREAD)
    items = int(b[:, 0].sum())
    method = (f"measured: {items} {'escalated' if derived else 'generated'} item{'s' * (items != 1)} in {len(jobs)} earlier "
              f"job{'s' * (len(jobs) != 1)}{' (second attempts: half the tokens, GPU time split by price)' * derived}"
              + (f"; fewer than {MIN_JOBS} jobs: ranges at least ±{THIN_RATE_SPREAD:.0%} for throughput, "
                 f"±{THIN_OVERHEAD_SPREAD:.0%} for start-up and idle" if len(jobs) < MIN_JOBS else ""))
    return TierRate(mid, mean, method, seconds, cached, output, escalation, overhead, items, len(jobs))


def tier_rates(config: TokenmillConfig, output_uri: str | None = None) -> dict[str, TierRate]:
    """Per tier, what earlier ledgers under `output_uri` measured of its model, else configured defaults."""
    pure, multi = [], []
    if output_uri:
        try:
            pure, multi = _ledger_history(config, output_uri)
        except (StorageError, duckdb.Error, OSError) as e:  # no readable history: configured defaults
            log.warning("no throughput history under %s (%s); using configured defaults", output_uri, e)
    measured = _measure(config, pure, multi)
    return {name: _rate(config, name, measured[name]) for name in config.tiers}


class Demand:
    """Items and prompt tokens to generate per (tier, tenant): add each partition's requests, then price_demand."""

    def __init__(self) -> None:
        self.cells: dict[tuple[str, str], list[int]] = {}  # (tier, tenant) -> [items, prompt tokens]

    def add(self, tiers: Sequence[str], prompt_tokens: Sequence[int], tenants: Sequence[str]) -> None:
        for tier, prompt, tenant in zip(tiers, prompt_tokens, tenants, strict=True):
            cell = self.cells.setdefault((tier, tenant), [0, 0])
            cell[0], cell[1] = cell[0] + 1, cell[1] + int(prompt)

    def add_requests(self, requests: pa.Table, tenants: Mapping[str, str] | Sequence[str]) -> None:
        """`requests`: columns id, tier, prompt_token_ids; `tenants`: each one's tenant, in order, or by id."""
        if isinstance(tenants, Mapping):
            tenants = [tenants[i] for i in requests["id"].to_pylist()]
        self.add(requests["tier"].to_pylist(), pc.list_value_length(requests["prompt_token_ids"]).to_pylist(),
                 list(tenants))

    def tier(self, name: str) -> tuple[int, int]:
        return tuple(sum(v[i] for (t, _), v in self.cells.items() if t == name) for i in (0, 1))


def _busy_usd(config: TokenmillConfig, name: str, rate: TierRate, items: float, prompt: float, output: Range) -> Range:
    """USD of the busy GPU time of `items` items with `prompt` prompt tokens in all on tier `name`."""
    c, usd = config.cost, config.tiers[name].price_per_gpu_hour / 3600

    def at(spw, cached, out):
        return spw * usd * (c.prefill_token_weight * (1 - cached) * prompt + c.cached_token_weight * cached * prompt
                            + c.decode_token_weight * out * items)
    s, h = rate.seconds_range, rate.cached_share
    return Range(min(at(s.low, x, output.low) for x in (h.low, h.high)), at(s.mid, h.mid, output.mid),
                 max(at(s.high, x, output.high) for x in (h.low, h.high)))


def _usd(r: Range) -> dict:
    return {"est_usd": float(r.mid), "est_usd_low": float(r.low), "est_usd_high": float(r.high)}


def price_demand(demand: Demand, config: TokenmillConfig, rates: dict[str, TierRate]) -> dict:
    """Low / mid / high USD of `demand`: `tiers` (what each tier's engine runs: its items, escalations into it,
    one start-up and idle when it has work), `tenants` (midpoints), `tenant_ranges`, `est_usd` (+ `_low`, `_high`).
    Each end takes every range at that end: within a job they move together (machine load, corpus)."""
    n_all, cost, tiers = sum(c[0] for c in demand.cells.values()), {}, {}
    for name in sorted({t for t, _ in demand.cells}):
        (items, prompt), r = demand.tier(name), rates[name]
        out = r.output.predict(items)
        tiers[name] = {"items": items, "share": items / n_all, "prompt_tokens": prompt,
                       "est_output_tokens": out.mid * items, "method": r.method}
        for (t, tenant), (n, p) in demand.cells.items():
            if t == name:
                cost[(name, tenant)] = cost.get((name, tenant), ZERO) + _busy_usd(config, name, r, n, p, out)
    to = config.escalation_tier  # each escalation: its prompt again, on the escalation tier
    for name in [t for t in tiers if to is not None and rates[t].escalation is not None]:
        items, total = tiers[name]["items"], ZERO
        e = rates[name].escalation.predict(items)
        out = rates[to].output.predict(max(e.mid * items, 1.0))
        for (t, tenant), (n, p) in demand.cells.items():
            if t == name:
                added = _busy_usd(config, to, rates[to], n, p, out).times(e)
                cost[(to, tenant)], total = cost.get((to, tenant), ZERO) + added, total + added
        tiers[name]["escalation"] = {"to": to, "rate": e.mid, "rate_low": e.low, "rate_high": e.high, "items": e.mid * items,
                                     "items_low": e.low * items, "items_high": e.high * items, **_usd(total)}
        into = tiers.setdefault(to, {"items": 0, "share": 0.0, "prompt_tokens": 0, "est_output_tokens": 0.0,
                                     "method": rates[to].method})
        had = into.get("escalated_in", {})
        into["escalated_in"] = {k: had.get(k, 0.0) + v * items for k, v in (("items_low", e.low), ("items", e.mid),
                                                                             ("items_high", e.high))}
        into["est_output_tokens"] += out.mid * e.mid * items
    tenants, job = {}, ZERO
    for name, entry in tiers.items():
        own = {tenant: r for (t, tenant), r in cost.items() if t == name}
        works = [entry["items"] > 0 or entry.get("escalated_in", {}).get(k, 0.0) > 0 for k in ("items_low", "items", "items_high")]
        overhead = rates[name].overhead.times(Range(*works)).times(config.tiers[name].price_per_gpu_hour / 3600)
        entry["engine_overhead"] = {"gpu_seconds": float(rates[name].overhead.mid * works[1]), **_usd(overhead)}
        busy, total = sum(r.mid for r in own.values()), overhead
        for tenant, r in own.items():
            share = overhead.times(r.mid / busy if busy else 1 / len(own))
            tenants[tenant], total = tenants.get(tenant, ZERO) + r + share, total + r
        entry.update(_usd(total))
        job = job + total
    tenants = dict(sorted(tenants.items()))
    return {"tiers": tiers, "tenants": {t: float(r.mid) for t, r in tenants.items()},
            "tenant_ranges": {t: _usd(r) for t, r in tenants.items()}, **_usd(job)}


def estimate_usd(tiers: pa.Array, prompt_tokens: pa.Array, config: TokenmillConfig, rates: dict[str, TierRate],
                 escalations: bool = False) -> list[float]:
    """Midpoint USD of each item's busy GPU time (no start-up and idle), with `escalations` their expected cost."""
    to, out = config.escalation_tier, []
    for tier, prompt in zip(tiers.to_pylist(), prompt_tokens.to_pylist()):
        r = rates[tier]
        usd = _busy_usd(config, tier, r, 1, prompt, r.output.predict(1)).mid
        if escalations and to is not None and r.escalation is not None:
            usd += r.escalation.predict(1).mid * _busy_usd(config, to, rates[to], 1, prompt, rates[to].output.predict(1)).mid
        out.append(usd)
    return out


def with_estimates(totals: dict[str, float], requests: pa.Table, tenant_of: dict[str, str],
                   config: TokenmillConfig, rates: dict[str, TierRate]) -> dict[str, float]:
    """USD per tenant: `totals` plus the midpoint cost of `requests` and their expected escalations (ids mapped
    to tenants by `tenant_of`): busy time only, as the budget guard counts spend."""
    out = dict(totals)
    usd = estimate_usd(requests["tier"], pc.list_value_length(requests["prompt_token_ids"]), config, rates, True)
    for id_, cost in zip(requests["id"].to_pylist(), usd):
        out[tenant_of[id_]] = out.get(tenant_of[id_], 0.0) + cost
    return out


def estimate_job(config: TokenmillConfig, pool=None, input_uri: str | None = None) -> dict:
    """The pre-flight estimate, on the run's own path up to the GPU: the job's planning (read, validate,
    dedup, route; `plan_job`, into a scratch staging area) and each partition's first wave as `prepare`
    builds it (requests rendered and tokenised, documents too long for the context cut into chunks, a
    reduce per chunked document), priced with what earlier ledgers measured. `pool`: an EnginePool (its
    tokenizers are used; no engine starts)."""
    from pipeline.generate.adapters import adapter_problems
    from pipeline.generate.levers import check_levers
    check_levers(config.tiers, also=adapter_problems(config))  # LeverError (an EngineStartError), before any work
    if pool is None:
        from pipeline.generate.engine import EnginePool
        pool = EnginePool(config.tiers)
    rates = tier_rates(config, config.output.uri)
    demand, counts = planned_demand(config, pool, rates, input_uri)
    return {**counts, **price_demand(demand, config, rates), "note": NOTE}


def planned_demand(config: TokenmillConfig, pool, rates: dict[str, TierRate],
                   input_uri: str | None = None) -> tuple[Demand, dict]:
    """What the job would send to the engines, as a Demand, and the counts the estimate prints.

    Earlier jobs' cache is not searched (the planning runs with the cache off): what it holds is
    counted as generated, so the estimate errs high where a warm cache would save."""
    import tempfile

    from pipeline.generate.reuse import generation_units
    from pipeline.generate.waves import WavePlanner, unit_requests
    from pipeline.job.plan import plan_job
    from pipeline.job.staging import StagingArea
    from pipeline.stores import storage

    config = config.model_copy(update={
        "input": config.input.model_copy(update={"uri": input_uri or config.input.uri}),
        "cache": config.cache.model_copy(update={"enabled": False})})
    demand, paid = Demand(), set()  # keys some partition already generates: one generation per key per job
    counts = {"records": 0, "quarantined": 0, "duplicates": 0, "to_generate": 0, "long_documents": 0}
    with tempfile.TemporaryDirectory(prefix="tokenmill-estimate-") as scratch:
        area = StagingArea(storage.resolve(scratch), "preflight")
        plan = plan_job(config, "preflight", area)
        counts.update(records=plan.records, quarantined=plan.quarantined, skipped_files=plan.skipped)
        for partition in plan.partitions:
            records = area.read(partition, "records")
            keys = set(records["gen_key"].to_pylist()) - paid
            paid |= keys
            units = generation_units(records, keys)
            requests, too_long = unit_requests(units, config, pool)
            state, rows = WavePlanner(config, pool, None, partition).first(units, requests, too_long)
            demand.add([r["tier"] for r in rows], [len(r["prompt_token_ids"]) for r in rows],
                       [r["unit"]["tenant"] for r in rows])
            # A reduce per chunked document, over its chunks' summaries (their measured length).
            reduces = list(state.chunked.values())
            demand.add([u["tier"] for u in reduces],
                       [round(u["pieces"] * rates[u["tier"]].output_tokens_per_item) for u in reduces],
                       [u["tenant"] for u in reduces])
            counts["duplicates"] += records.num_rows - units.num_rows
            counts["quarantined"] += len(state.failed)
            counts["to_generate"] += len(rows) + len(reduces)
            counts["long_documents"] += len(reduces)
    return demand, counts


def budget_problems(config: TokenmillConfig, job_usd: float, tenant_usd: dict[str, float]) -> list[str]:
    """Caps that `job_usd` / `tenant_usd` (spent + planned) would cross, as sentences."""
    b, problems = config.budget, []
    if b.max_job_usd is not None and job_usd > b.max_job_usd:
        problems.append(f"job ${job_usd:.6f} > budget.max_job_usd ${b.max_job_usd:.6f}")
    for tenant, usd in sorted(tenant_usd.items()):
        cap = b.tenant_cap(tenant)
        if cap is not None and usd > cap:
            problems.append(f"tenant {tenant} ${usd:.6f} > its cap ${cap:.6f}")
    return problems
