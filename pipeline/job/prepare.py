"""The prepare step: one partition's CPU work ahead of the GPU.

  prepare[p]:  staged records -> look up paid and cached items -> render and tokenise the rest
               -> wave 0 work units in the catalog (generate/partition_waves.py)

Preparing a partition again starts its generation over (units no worker holds are withdrawn) and pays
for nothing twice: what was generated is in the catalog, and the lookup finds it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy.exc import OperationalError

from pipeline.config import TokenmillConfig
from pipeline.generate import metrics
from pipeline.generate.engine import EnginePool
from pipeline.generate.engine_api import EngineStartError
from pipeline.generate.lookup import ItemLookup
from pipeline.generate.partition_waves import PartitionWaves
from pipeline.generate.waves import engine_requests
from pipeline.job import faults
from pipeline.job.budget import BudgetGuard
from pipeline.plan.estimate import Demand, price_demand
from pipeline.stores import storage
from pipeline.stores.catalog import StateError, StateStore
from pipeline.stores.staging import StagingArea
from pipeline.stores.units import UnitQueue

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preparing:
    """What the prepare step uses, and only that (built by the job's context, `JobContext.preparing`)."""

    config: TokenmillConfig
    job_id: str
    staging: StagingArea  # the partition's records as planned
    lookup: ItemLookup  # items already paid for, by this job or in the cache
    pool: EnginePool  # the tiers' tokenizers, to build the engine requests
    waves: PartitionWaves  # wave 0 enqueued; a partition failed
    budget: BudgetGuard  # the check before any GPU work; the rates of the run's expected end
    state: StateStore  # (with queue and budget: what the step's metrics report reads, metrics.JobParts)
    queue: UnitQueue


def unpaid_requests(preparing: Preparing, partition: str, records) -> tuple:
    """(records resolved, items at hand by key, generations, their engine requests, too_long)."""
    records, items, generations = preparing.lookup.unpaid(partition, records)
    requests, too_long = engine_requests(generations, preparing.config, preparing.pool)
    return records, items, generations, requests, too_long


def prepare(preparing: Preparing, partition: str, demand: Demand | None = None) -> dict:
    """Look up paid and cached items, render and tokenise the rest, enqueue wave 0; what it found. `demand`:
    where to add the requests enqueued, for the run's estimate of its end (`expected_engine_seconds`)."""
    records = preparing.staging.records(partition)
    faults.checkpoint("before_generate", preparing.job_id, partition)
    _, items, generations, requests, too_long = unpaid_requests(preparing, partition, records)
    enqueued = preparing.waves.start(partition, generations, requests, too_long)
    if demand is not None and requests.num_rows:
        demand.add_requests(requests, dict(zip(generations["id"].to_pylist(), generations["tenant"].to_pylist())))
    report_prepared(preparing)
    return {
        "partition": partition,
        "records": records.num_rows,
        "already_paid": len(items),
        "to_generate": requests.num_rows,
        "enqueued": enqueued,
        "too_long": too_long.num_rows,
    }


def report_prepared(preparing: Preparing) -> None:
    """The job's state a prepare leaves (the queue it filled), to the metrics and the Pushgateway."""
    metrics.report_job(preparing)


def expected_engine_seconds(preparing: Preparing, demand: Demand) -> float:
    """Engine seconds the high end of the estimate gives `demand` (busy, escalations, start-up and idle), its tiers
    drained one after the other as one process does: each tier's USD back to seconds at its price per hour. A tier
    priced at 0 tells no time and adds none."""
    if not demand.cells:
        return 0.0
    priced = price_demand(demand, preparing.config, preparing.budget.rates())
    seconds = 0.0
    for name, tier in priced["tiers"].items():
        per_hour = preparing.config.tier_prices.get(name, 0.0)
        if per_hour > 0:
            seconds += tier["est_usd_high"] * 3600 / per_hour
    return seconds


def prepare_or_fail(preparing: Preparing, partition: str, demand: Demand | None = None) -> None:
    """`prepare`, failing that partition alone on an error of its own (it says why; a rerun prepares it again)."""
    try:
        prepare(preparing, partition, demand)
    except (EngineStartError, StateError, OperationalError):
        raise  # every partition would fail the same way
    except Exception as e:
        reason = str(e) if isinstance(e, storage.StorageError) else f"{type(e).__name__}: {e}"
        log.error("partition %s failed in prepare: %s", partition, reason)
        preparing.waves.fail(partition, f"prepare: {reason}")


def check_budget(preparing: Preparing, partitions: list[str]) -> None:
    """Refuse to start when spent + the estimate of what is left would cross a cap (before any GPU work)."""

    def unpaid():
        for partition in partitions:
            _, _, generations, requests, _ = unpaid_requests(preparing, partition, preparing.staging.records(partition))
            yield generations, requests

    preparing.budget.check_start(unpaid())
