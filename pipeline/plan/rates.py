"""What earlier jobs measured per tier and model, with spreads: the rates the pre-flight estimate and
the budget guard price with (`tier_rates`), and the ranges they are kept in (`Range`, `Measured`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import duckdb
import numpy as np

from pipeline.config import TokenmillConfig
from pipeline.stores.storage import StorageError

log = logging.getLogger(__name__)

Z, RECENT_JOBS = 1.96, 20  # 95% predictive intervals; history: the latest 20 jobs with generated rows
MIN_JOBS = 3  # fewer measured jobs: the floors below (declared, not measured: one or two jobs cannot
THIN_RATE_SPREAD = 0.25  # show how runs differ with the machine's load; engine start-up varies more, 20-45 s
THIN_OVERHEAD_SPREAD = 0.5  # on 2 shared cores for one model)
DEFAULT_RATE_FACTOR = 4.0  # no history: the configured throughput may be off by this factor either way, and
DEFAULT_OVERHEAD = 60.0  # an engine's start-up and idle 0-60 s (× GPUs); unmeasured: the middle of the range
# No history but a known device and model (plan/hardware.py): the projection's throughput within ×1/1.5-×1.5 (its
# calibration rows fall within ±30%; a CPU shared with other work varies more), outputs at 75-100% of max_tokens
# (summaries run near their cap; a ledger measures it), start-up and idle ×1/2-×2 of the declared figure: busy and
# start-up each at most 3-4× wide, so the job's range is too.
PRIOR_RATE_SPREAD = 1.5
PRIOR_OUTPUT_LOW = 0.75
PRIOR_OVERHEAD_SPREAD = 2.0


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
        return Range(max(self.bounds[0], min((low, *self.jobs))), p, min(self.bounds[1], max((high, *self.jobs))))


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

    seconds_per_weight: float  # midpoints, as before
    output_tokens_per_item: float
    method: str  # how it was obtained, for humans
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
    jobs = [
        r[0]
        for r in con.execute(
            f"SELECT job_id FROM ledger WHERE {GENERATED} GROUP BY 1 ORDER BY max(created_at) DESC LIMIT ?",
            [RECENT_JOBS],
        ).fetchall()
    ]
    common = (
        "count(*), sum(coalesce(busy_gpu_seconds, gpu_seconds)), sum(coalesce(overhead_gpu_seconds, 0)), "
        "sum(prompt_tokens), sum(cached_prompt_tokens), sum(output_tokens)"
    )
    plain = "FILTER (WHERE coalesce(chunks, 0) = 0)"
    pure = con.execute(
        f"SELECT job_id, partition, tier, model, {common}, count(*) {plain}, sum(output_tokens) {plain}, "
        f"sum(output_tokens * output_tokens) {plain}, min(price_per_gpu_hour), max(price_per_gpu_hour) FROM ledger "
        f"WHERE {GENERATED} AND list_contains(?, job_id) AND NOT coalesce(escalated, false) "
        "AND coalesce(attempts, 1) <= 1 GROUP BY ALL",
        [jobs],
    ).fetchall()
    multi = con.execute(
        f"SELECT job_id, tier, model, coalesce(route_reason, ''), coalesce(escalated, false), {common}, "
        f"sum(gpu_seconds), sum(cost_usd) FROM ledger WHERE {GENERATED} AND list_contains(?, job_id) "
        "AND (coalesce(escalated, false) OR coalesce(attempts, 1) > 1) GROUP BY ALL",
        [jobs],
    ).fetchall()
    return pure, multi


def _origin(config: TokenmillConfig, route_reason: str, to: str) -> str | None:
    """The tier an escalated row's first attempt ran on: the one other tier, else its route reason's."""
    others = [t for t in config.tiers if t != to]
    rules = {f"rule:{r.name}": r.tier for r in config.route.rules} | {"default": config.route.default_tier}
    tier = others[0] if len(others) == 1 else rules.get(route_reason)
    return tier if tier in others else None


def _measure(config: TokenmillConfig, pure: list, multi: list) -> dict[str, dict]:
    """Per tier: one-tier batches (its escalations' share of escalated rows), per job start-up and idle, escalations."""
    models = {name: t.generator for name, t in config.tiers.items()}
    out = {t: {"batches": [], "derived": [], "overhead": {}, "escalated": {}, "routed": {}} for t in config.tiers}
    prices: dict[tuple[str, str], float] = {}

    def add(tier, key, job, value):
        out[tier][key][job] = out[tier][key].get(job, 0) + value

    for job, _, tier, model, n, busy, over, prompt, cached, output, plain, p_out, p_out2, lo, hi in pure:
        if tier not in out or model != models[tier]:
            continue
        out[tier]["batches"].append(
            (job, n, busy, _weight(config, prompt, cached, output), prompt, cached, plain, p_out or 0, p_out2 or 0)
        )
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
            out[tier]["derived"].append(
                (job, n, busy * (1 - share), _weight(config, *half), *half[:2], n, half[2], half[2] ** 2 / n)
            )
        elif not escalated:
            add(tier, "routed", job, n)
        add(tier, "overhead", job, over * (1 - share))
    return out


def _configured(config: TokenmillConfig, name: str) -> TierRate:
    mid, k = 1.0 / config.tiers[name].default_tokens_per_gpu_second, float(config.sampling.max_tokens)
    escalates = config.escalation_tier not in (None, name)
    return TierRate(
        mid,
        k,
        f"configured default (no ledger of this tier's model yet): throughput ×{1 / DEFAULT_RATE_FACTOR:g}"
        f"-×{DEFAULT_RATE_FACTOR:g} of default_tokens_per_gpu_second, output up to max_tokens"
        + (", escalations 0-100%" if escalates else "")
        + f", engine start-up and idle 0-{DEFAULT_OVERHEAD:g} s",
        Range(mid / DEFAULT_RATE_FACTOR, mid, mid * DEFAULT_RATE_FACTOR),
        ZERO,
        Measured(k, default=Range(1.0, k, k)),
        Measured(0.5, default=Range(0.0, 0.5, 1.0)) if escalates else None,
        Range(0.0, 0.5, 1.0).times(DEFAULT_OVERHEAD * config.tiers[name].gpus),
    )


def prior_rate(
    config: TokenmillConfig, name: str, items: float, prompt_tokens: float, home=None, probe=None
) -> TierRate | None:
    """Tier `name`'s rate from the hardware projection (plan/hardware.py) for `items` requests of `prompt_tokens`
    in all, for a tier with no history; None where it cannot project (the fake engine, a GPU tier without a known
    `gpu_model`, a model whose config.json is not readable): the configured default stands there."""
    from pipeline.plan import hardware

    tier = config.tiers[name]
    model = hardware.tier_shape(tier) if tier.engine == "vllm" and items > 0 else None
    device = hardware.tier_device(tier, home, probe) if model else None
    if model is None or device is None:
        return None
    shape, levers = model
    k = float(config.sampling.max_tokens)
    p = hardware.project(shape, device, hardware.tier_workload(tier, shape, levers, items, prompt_tokens / items, k))
    mid = p.seconds * tier.gpus / max(_weight(config, prompt_tokens, 0, k * items), 1e-12)
    start = hardware.startup_seconds(shape, device) * tier.gpus
    configured = _configured(config, name)
    return TierRate(
        mid,
        k,
        f"projection (no ledger of this tier's model yet): {device.name}"
        f"{f' ×{device.count}' if device.count > 1 else ''}, {shape.params / 1e6:,.1f} M parameters at "
        f"{shape.weight_bits}-bit, batch {p.batch:.0f}: {items * k / p.seconds:,.0f} output tok/s; range: throughput "
        f"×{1 / PRIOR_RATE_SPREAD:.2g}-×{PRIOR_RATE_SPREAD:g}, output {PRIOR_OUTPUT_LOW:.0%}-100% of max_tokens"
        + (", escalations 0-100%" if configured.escalation is not None else "")
        + f", engine start-up and idle {start / PRIOR_OVERHEAD_SPREAD:.0f}-{start * PRIOR_OVERHEAD_SPREAD:.0f} s",
        Range(mid / PRIOR_RATE_SPREAD, mid, mid * PRIOR_RATE_SPREAD),
        ZERO,
        Measured(k, default=Range(PRIOR_OUTPUT_LOW * k, k, k)),
        configured.escalation,
        Range(start / PRIOR_OVERHEAD_SPREAD, start, start * PRIOR_OVERHEAD_SPREAD),
    )


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
    half = (
        Z * math.sqrt(2 * ((b[:, 1] - mid * b[:, 2]) ** 2).sum() * k / (k - 1)) / max(b[:, 2].sum(), 1e-12)
        if k > 1
        else 0.0
    )
    job_rates = [s[1] / s[2] for s in per_job if s[2] > 0] or [mid]
    seconds = Range(max(min(mid - half, *job_rates), 0.0), mid, max(mid + half, *job_rates))
    shares = [s[4] / s[3] for s in per_job if s[3] > 0]
    cached = Range(min(shares), b[:, 4].sum() / b[:, 3].sum(), max(shares)) if shares else ZERO
    n, top = int(b[:, 5].sum()), float(config.sampling.max_tokens)
    mean = float(b[:, 6].sum() / n) if n else top
    sd = math.sqrt(max(b[:, 7].sum() / n - mean * mean, 0.0) * n / (n - 1)) if n > 1 else 0.0
    # No one-attempt unchunked row (a tier sent only long documents): its outputs were never measured alone.
    output = (
        Measured(
            mean,
            max(n, 1),
            sd,
            tuple(s[6] / s[5] for s in per_job if s[5] > 0),
            (0.0, top),
            Range(mean, mean, mean).widened(THIN_RATE_SPREAD) if derived else None,
        )
        if n
        else _configured(config, name).output
    )
    escalation, routed = None, sum(m["routed"].values())
    if config.escalation_tier not in (None, name):
        escalation = (
            Measured(
                sum(m["escalated"].values()) / routed,
                routed,
                None,
                tuple(m["escalated"].get(j, 0) / r for j, r in m["routed"].items() if r),
                (0.0, 1.0),
            )
            if routed
            else _configured(config, name).escalation
        )
    over = list(m["overhead"].values())
    overhead = Range(min(over), sum(over) / len(over), max(over)) if over else ZERO
    if len(jobs) < MIN_JOBS:
        seconds, overhead = seconds.widened(THIN_RATE_SPREAD), overhead.widened(THIN_OVERHEAD_SPREAD)
    items = int(b[:, 0].sum())
    method = (
        f"measured: {items} {'escalated' if derived else 'generated'} item{'s' * (items != 1)} in {len(jobs)} earlier "
        f"job{'s' * (len(jobs) != 1)}{' (second attempts: half the tokens, GPU time split by price)' * derived}"
        + (
            f"; fewer than {MIN_JOBS} jobs: ranges at least ±{THIN_RATE_SPREAD:.0%} for throughput, "
            f"±{THIN_OVERHEAD_SPREAD:.0%} for start-up and idle"
            if len(jobs) < MIN_JOBS
            else ""
        )
    )
    return TierRate(mid, mean, method, seconds, cached, output, escalation, overhead, items, len(jobs))


def tier_rates(config: TokenmillConfig, output_uri: str | None = None) -> dict[str, TierRate]:
    """Per tier, what earlier ledgers under `output_uri` measured of its model, else configured defaults."""
    pure, multi = [], []
    if output_uri:
        try:
            pure, multi = _ledger_history(config, output_uri)
        except (StorageError, duckdb.Error, OSError) as e:  # no readable history: configured defaults
            log.warning("no throughput history under %s (%s); using configured defaults", output_uri, e)
    return rates_from_history(config, pure, multi)


def rates_from_history(config: TokenmillConfig, pure: list, multi: list) -> dict[str, TierRate]:
    """Per tier, its rates from ledger history as `_ledger_history` groups it: `pure` one-tier rows per (job,
    partition, tier, model), `multi` escalated and retried rows per (job, tier, model, route reason)."""
    measured = _measure(config, pure, multi)
    return {name: _rate(config, name, measured[name]) for name in config.tiers}
