"""What a job will cost before it runs, and whether it may: the pre-flight estimate and the budget.

The requests a job would send (per item: tier, prompt tokens, tenant) are priced (`price_demand`) with what
earlier ledgers under the output root measured for the same tier and model (`tier_rates`): busy GPU-seconds
per weighted token, the prefix-cache share of prompt tokens, output tokens per item, the share of items
escalated, and the engine's start-up and idle per job, each with its spread; with no history, the projection of
the tier's model on its device (plan/hardware.py, `with_priors`; a range at most 4× wide), else configured defaults
and a wide range that says so. Low / mid / high USD per tier, per tenant and for the job.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import TokenmillConfig
from pipeline.plan.rates import ZERO, Range, TierRate, prior_rate, tier_rates

log = logging.getLogger(__name__)

NOTE = (
    "est_usd is the midpoint, est_usd_low-est_usd_high the range. Counted: each item at its tier's throughput, "
    "prefix-cache share, output length and escalation rate measured in earlier ledgers (else the "
    "hardware projection, else configured defaults), escalations on the escalation tier, each engine's start-up "
    "and idle, documents too long for the context as the run cuts them (a request per chunk, a reduce each). "
    "Not counted: reuse from earlier jobs' "
    "cache (inputs it holds cost less), shadow verification (dedup.shadow_rate of near/semantic reuses), schema "
    "retries, failed attempts, the LLM judge (checks.judge: a request per output that passes the checks, on the "
    "judge's tier)."
)


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
        self.add(
            requests["tier"].to_pylist(), pc.list_value_length(requests["prompt_token_ids"]).to_pylist(), list(tenants)
        )

    def tier(self, name: str) -> tuple[int, int]:
        return tuple(sum(v[i] for (t, _), v in self.cells.items() if t == name) for i in (0, 1))


def _busy_usd(config: TokenmillConfig, name: str, rate: TierRate, items: float, prompt: float, output: Range) -> Range:
    """USD of the busy GPU time of `items` items with `prompt` prompt tokens in all on tier `name`."""
    c, usd = config.cost, config.tiers[name].price_per_gpu_hour / 3600

    def at(spw, cached, out):
        return (
            spw
            * usd
            * (
                c.prefill_token_weight * (1 - cached) * prompt
                + c.cached_token_weight * cached * prompt
                + c.decode_token_weight * out * items
            )
        )

    s, h = rate.seconds_range, rate.cached_share
    return Range(
        min(at(s.low, x, output.low) for x in (h.low, h.high)),
        at(s.mid, h.mid, output.mid),
        max(at(s.high, x, output.high) for x in (h.low, h.high)),
    )


def _usd(r: Range) -> dict:
    return {"est_usd": float(r.mid), "est_usd_low": float(r.low), "est_usd_high": float(r.high)}


def price_demand(demand: Demand, config: TokenmillConfig, rates: dict[str, TierRate]) -> dict:
    """Low / mid / high USD of `demand`: `tiers` (what each tier's engine runs: its items, escalations into it,
    one start-up and idle when it has work), `tenants` (midpoints), `tenant_ranges`, `tenants_busy_usd` (the
    budget guard's figure), `est_usd` (+ `_low`, `_high`).
    Each end takes every range at that end: within a job they move together (machine load, corpus)."""
    n_all, cost, tiers = sum(c[0] for c in demand.cells.values()), {}, {}
    for name in sorted({t for t, _ in demand.cells}):
        (items, prompt), r = demand.tier(name), rates[name]
        out = r.output.predict(items)
        tiers[name] = {
            "items": items,
            "share": items / n_all,
            "prompt_tokens": prompt,
            "est_output_tokens": out.mid * items,
            "method": r.method,
        }
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
        tiers[name]["escalation"] = {
            "to": to,
            "rate": e.mid,
            "rate_low": e.low,
            "rate_high": e.high,
            "items": e.mid * items,
            "items_low": e.low * items,
            "items_high": e.high * items,
            **_usd(total),
        }
        into = tiers.setdefault(
            to, {"items": 0, "share": 0.0, "prompt_tokens": 0, "est_output_tokens": 0.0, "method": rates[to].method}
        )
        had = into.get("escalated_in", {})
        into["escalated_in"] = {
            k: had.get(k, 0.0) + v * items for k, v in (("items_low", e.low), ("items", e.mid), ("items_high", e.high))
        }
        into["est_output_tokens"] += out.mid * e.mid * items
    tenants, job, busy_only = {}, ZERO, {}
    for name, entry in tiers.items():
        own = {tenant: r for (t, tenant), r in cost.items() if t == name}
        works = [
            entry["items"] > 0 or entry.get("escalated_in", {}).get(k, 0.0) > 0
            for k in ("items_low", "items", "items_high")
        ]
        overhead = rates[name].overhead.times(Range(*works)).times(config.tiers[name].price_per_gpu_hour / 3600)
        entry["engine_overhead"] = {"gpu_seconds": float(rates[name].overhead.mid * works[1]), **_usd(overhead)}
        busy, total = sum(r.mid for r in own.values()), overhead
        for tenant, r in own.items():
            share = overhead.times(r.mid / busy if busy else 1 / len(own))
            tenants[tenant], total = tenants.get(tenant, ZERO) + r + share, total + r
            busy_only[tenant] = busy_only.get(tenant, 0.0) + float(r.mid)
        entry.update(_usd(total))
        job = job + total
    tenants = dict(sorted(tenants.items()))
    return {
        "tiers": tiers,
        "tenants": {t: float(r.mid) for t, r in tenants.items()},
        "tenant_ranges": {t: _usd(r) for t, r in tenants.items()},
        # busy time only (escalations in), midpoints: what the budget guard counts against the caps
        "tenants_busy_usd": dict(sorted(busy_only.items())),
        **_usd(job),
    }


def estimate_usd(
    tiers: pa.Array,
    prompt_tokens: pa.Array,
    config: TokenmillConfig,
    rates: dict[str, TierRate],
    escalations: bool = False,
) -> list[float]:
    """Midpoint USD of each item's busy GPU time (no start-up and idle), with `escalations` their expected cost."""
    to, out = config.escalation_tier, []
    for tier, prompt in zip(tiers.to_pylist(), prompt_tokens.to_pylist()):
        r = rates[tier]
        usd = _busy_usd(config, tier, r, 1, prompt, r.output.predict(1)).mid
        if escalations and to is not None and r.escalation is not None:
            usd += (
                r.escalation.predict(1).mid
                * _busy_usd(config, to, rates[to], 1, prompt, rates[to].output.predict(1)).mid
            )
        out.append(usd)
    return out


def with_estimates(
    totals: dict[str, float],
    tiers: Sequence[str],
    prompt_tokens: Sequence[int],
    tenants: Sequence[str],
    config: TokenmillConfig,
    rates: dict[str, TierRate],
) -> dict[str, float]:
    """USD per tenant: `totals` plus the midpoint cost of requests (each one's tier, prompt tokens and tenant)
    and their expected escalations: busy time only, as the budget guard counts spend."""
    out = dict(totals)
    usd = estimate_usd(pa.array(tiers, pa.string()), pa.array(prompt_tokens, pa.int64()), config, rates, True)
    for tenant, cost in zip(tenants, usd):
        out[tenant] = out.get(tenant, 0.0) + cost
    return out


def estimate_job(
    config: TokenmillConfig, pool=None, input_uri: str | None = None, report=None, cached: bool = False
) -> dict:
    """The pre-flight estimate, on the run's own path up to the GPU: the job's planning (read, validate,
    dedup, route; `plan_job`, into a scratch staging area) and each partition's first wave as `prepare`
    builds it (requests rendered and tokenised, documents too long for the context cut into chunks, a
    reduce per chunked document), priced with what earlier ledgers measured. `pool`: an EnginePool (its
    tokenizers are used; no engine starts); `report`: planning's progress (Progress.planning); `cached`:
    exact hits in the cache of earlier jobs are free (planned_demand)."""
    from pipeline.generate.adapters import adapter_problems
    from pipeline.generate.levers import check_levers

    check_levers(config.tiers, also=adapter_problems(config))  # LeverError (an EngineStartError), before any work
    if pool is None:
        from pipeline.generate.engine import EnginePool

        pool = EnginePool(config.tiers)
    rates = tier_rates(config, config.output.uri)
    demand, counts = planned_demand(config, pool, rates, input_uri, report, cached)
    rates = with_priors(config, rates, demand)
    return {**counts, **price_demand(demand, config, rates), "note": NOTE}


def with_priors(config: TokenmillConfig, rates: dict[str, TierRate], demand: Demand, home=None, probe=None) -> dict:
    """`rates`, each tier with no history (`jobs` 0) priced by the hardware projection of its share of `demand`
    where one can be made (rates.prior_rate); measured rates stand."""
    out = dict(rates)
    for name in config.tiers:
        items, prompt = demand.tier(name)
        if rates[name].jobs == 0 and items:
            out[name] = prior_rate(config, name, items, prompt, home, probe) or rates[name]
    return out


def planned_demand(
    config: TokenmillConfig,
    pool,
    rates: dict[str, TierRate],
    input_uri: str | None = None,
    report=None,
    cached: bool = False,
) -> tuple[Demand, dict]:
    """What the job would send to the engines, as a Demand, and the counts the estimate prints.

    Earlier jobs' near and semantic cache is not searched (the planning runs with the cache off): what it
    would reuse is counted as generated, so the estimate errs high where a warm cache would save. With
    `cached`, exact hits in the cache are looked up (read only) and cost nothing, as the run's lookup
    (generate/lookup.py) will find them: a file submitted again is estimated at what it will cost, $0."""
    import tempfile

    from pipeline.generate.reuse import generations_for
    from pipeline.generate.waves import WaveDeriver, engine_requests
    from pipeline.plan.streamed import plan_job
    from pipeline.stores import storage
    from pipeline.stores.cache import open_store
    from pipeline.stores.staging import StagingArea

    cache_config = config.cache
    config = config.model_copy(
        update={
            "input": config.input.model_copy(update={"uri": input_uri or config.input.uri}),
            "cache": config.cache.model_copy(update={"enabled": False}),
        }
    )
    demand, paid = Demand(), set()  # keys some partition already generates: one generation per key per job
    counts = {"records": 0, "quarantined": 0, "duplicates": 0, "to_generate": 0, "requests": 0, "long_documents": 0}
    if cached:
        counts["cache_hits"] = 0  # records answered by an exact hit in earlier jobs' cache
    # The cache as configured (`config` turns it off for planning), opened only to look exact hits up.
    opened = contextlib.closing(open_store(cache_config)) if cached else contextlib.nullcontext()
    with tempfile.TemporaryDirectory(prefix="tokenmill-estimate-") as scratch, opened as cache:
        area = StagingArea(storage.resolve(scratch), "preflight")
        plan = plan_job(config, "preflight", area, report=report)
        counts.update(records=plan.records, quarantined=plan.quarantined, skipped_files=plan.skipped)
        for partition in plan.partitions:
            records = area.records(partition)
            keys = set(records["gen_key"].to_pylist()) - paid
            paid |= keys
            if cached:
                records, keys, hits = without_cache_hits(cache, records, keys)
                counts["cache_hits"] += hits
            generations = generations_for(records, keys)
            requests, too_long = engine_requests(generations, config, pool)
            state, rows = WaveDeriver(config, pool, None, partition).first(generations, requests, too_long)
            demand.add(
                [r["tier"] for r in rows],
                [len(r["prompt_token_ids"]) for r in rows],
                [r["generation"]["tenant"] for r in rows],
            )
            # A reduce per chunked document, over its chunks' summaries (their measured length).
            reduces = list(state.chunked.values())
            demand.add(
                [u["tier"] for u in reduces],
                [round(u["pieces"] * rates[u["tier"]].output_tokens_per_item) for u in reduces],
                [u["tenant"] for u in reduces],
            )
            # As a run counts them: every record of a key that cannot be generated is quarantined.
            failed = pc.is_in(records["gen_key"], pa.array(list(state.failed), pa.string()))
            quarantined = int(pc.sum(failed).as_py() or 0)
            counts["quarantined"] += quarantined
            counts["to_generate"] += generations.num_rows - len(state.failed)  # items, as the run's "generated"
            counts["duplicates"] += records.num_rows - quarantined - (generations.num_rows - len(state.failed))
            counts["requests"] += len(rows) + len(reduces)  # chunks and reduces included
            counts["long_documents"] += len(reduces)
    return demand, counts


def without_cache_hits(cache, records: pa.Table, keys: set[str]) -> tuple[pa.Table, set[str], int]:
    """(`records` and `keys` less those whose generation key the cache answers, how many records it answers)."""
    scope_of = dict(zip(records["gen_key"].to_pylist(), records["scope"].to_pylist()))
    hits = set(cache.get_scoped({k: scope_of[k] for k in keys}))
    hit = pc.is_in(records["gen_key"], pa.array(list(hits), pa.string()))
    return records.filter(pc.invert(hit)), keys - hits, int(pc.sum(hit).as_py() or 0)


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
