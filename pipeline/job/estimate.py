"""What a job will cost before it runs, and whether it may: the pre-flight estimate and the budget.

GPU-seconds per weighted token and output tokens per item come from the ledgers already under the
output root (generated rows of the same tier and model), or, with no history, from the tier's
`default_tokens_per_gpu_second` and `sampling.max_tokens`. Every estimate says which it used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import TokenmillConfig
from pipeline.stores.storage import StorageError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierRate:
    seconds_per_weight: float      # GPU-seconds per weighted token
    output_tokens_per_item: float
    method: str                    # how it was obtained, for humans


def tier_rates(config: TokenmillConfig, output_uri: str | None = None) -> dict[str, TierRate]:
    """Throughput per tier from earlier ledgers under `output_uri`, else configured defaults."""
    history: dict[str, tuple] = {}
    if output_uri:
        from pipeline.output.ledger import connect

        c = config.cost
        weight = (f"{c.prefill_token_weight} * (prompt_tokens - cached_prompt_tokens) + "
                  f"{c.cached_token_weight} * cached_prompt_tokens + {c.decode_token_weight} * output_tokens")
        try:
            con = connect(output_uri, config.storage)
            for tier, model, seconds, weights, outputs, n in con.execute(
                    f"SELECT tier, model, sum(gpu_seconds), sum({weight}), avg(output_tokens), count(*) FROM ledger "
                    "WHERE source = 'generated' GROUP BY 1, 2").fetchall():
                if tier in config.tiers and model == config.tiers[tier].model and weights:
                    history[tier] = (float(seconds) / float(weights), float(outputs), n)
        except (StorageError, duckdb.Error, OSError) as e:  # no readable history: configured defaults
            log.warning("no throughput history under %s (%s); using configured defaults", output_uri, e)
            history = {}
    rates = {}
    for name, tier in config.tiers.items():
        if name in history:
            spw, out, n = history[name]
            rates[name] = TierRate(spw, out, f"measured: {n} generated items in earlier ledgers")
        else:
            rates[name] = TierRate(1.0 / tier.default_tokens_per_gpu_second, float(config.sampling.max_tokens),
                                   "configured default (no ledger of this tier's model yet)")
    return rates


def estimate_usd(tiers: pa.Array, prompt_tokens: pa.Array, config: TokenmillConfig,
                 rates: dict[str, TierRate]) -> list[float]:
    """Estimated cost of generating each item (no prefix-cache credit: estimates err high)."""
    c = config.cost
    out = []
    for tier, prompt in zip(tiers.to_pylist(), prompt_tokens.to_pylist()):
        r = rates[tier]
        weight = c.prefill_token_weight * prompt + c.decode_token_weight * r.output_tokens_per_item
        out.append(weight * r.seconds_per_weight * config.tiers[tier].gpus * config.tiers[tier].price_per_gpu_hour / 3600)
    return out


def with_estimates(totals: dict[str, float], requests: pa.Table, tenant_of: dict[str, str],
                   config: TokenmillConfig, rates: dict[str, TierRate]) -> dict[str, float]:
    """USD per tenant: `totals` plus the estimated cost of `requests` (ids mapped to tenants by `tenant_of`)."""
    out = dict(totals)
    usd = estimate_usd(requests["tier"], pc.list_value_length(requests["prompt_token_ids"]), config, rates)
    for id_, cost in zip(requests["id"].to_pylist(), usd):
        out[tenant_of[id_]] = out.get(tenant_of[id_], 0.0) + cost
    return out


def estimate_job(config: TokenmillConfig, pool=None, input_uri: str | None = None) -> dict:
    """The pre-flight estimate: read, validate, dedup and route the input, tokenise what would be
    generated, and price it, before any GPU work. `pool`: an EnginePool (its tokenizers are used)."""
    from pipeline.generate.adapters import adapter_problems
    from pipeline.generate.levers import check_levers
    check_levers(config.tiers, also=adapter_problems(config))  # LeverError (an EngineStartError), before any work
    if pool is None:
        from pipeline.generate.engine import EnginePool
        pool = EnginePool(config.tiers)
    from pipeline.dedup.cluster import mark_duplicates
    from pipeline.generate.requests import build_requests
    from pipeline.job.stages import staged_input

    staged = staged_input(config, "preflight", input_uri)
    raw, quarantine, skipped = staged.raw, staged.quarantine, staged.skipped
    records = mark_duplicates(staged.records, "gen_key")
    tiers_used = sorted(set(records["tier"].to_pylist()))
    requests, too_long = build_requests(records, config.prompt, config.sampling, config.requests,
                                       {t: pool.tokenizer(t) for t in tiers_used},
                                       {t: pool.context_length(t) for t in tiers_used})
    rates = tier_rates(config, config.output.uri)
    prompt_tokens = pc.list_value_length(requests["prompt_token_ids"])
    usd = estimate_usd(requests["tier"], prompt_tokens, config, rates)
    tenant_of = dict(zip(records["id"].to_pylist(), records["tenant"].to_pylist()))
    per_tier: dict[str, dict] = {}
    per_tenant: dict[str, float] = {}
    for tier, id_, tokens, cost in zip(requests["tier"].to_pylist(), requests["id"].to_pylist(),
                                       prompt_tokens.to_pylist(), usd):
        t = per_tier.setdefault(tier, {"items": 0, "prompt_tokens": 0, "est_output_tokens": 0.0, "est_usd": 0.0})
        t["items"] += 1
        t["prompt_tokens"] += tokens
        t["est_output_tokens"] += rates[tier].output_tokens_per_item
        t["est_usd"] += cost
        per_tenant[tenant_of[id_]] = per_tenant.get(tenant_of[id_], 0.0) + cost
    generate = requests.num_rows
    for name, t in per_tier.items():
        t["share"] = t["items"] / generate if generate else 0.0
        t["method"] = rates[name].method
    return {
        "records": raw.num_rows, "quarantined": quarantine.num_rows + too_long.num_rows,
        "duplicates": int(pc.sum(pc.is_valid(records["duplicate_of"])).as_py() or 0),
        "to_generate": generate, "tiers": per_tier, "tenants": dict(sorted(per_tenant.items())),
        "est_usd": sum(usd), "skipped_files": skipped,
        "note": "estimates count no prefix-cache hits and no reuse from earlier runs, so they err high",
    }


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
