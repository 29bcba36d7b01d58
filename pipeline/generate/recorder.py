"""The call recorder: prices each engine call's results and stores them the moment the engine returns.

A call's seconds are shared among its items by token weight (pricing.py); each item is stored in
the state catalog (so a kill after this point loses no money and a rerun pays nothing again), put
in the cache for later jobs, and added to what its tenant has spent (the budget guard reads it).
"""

from __future__ import annotations

from collections import Counter

import pyarrow as pa

from pipeline.config import TokenmillConfig
from pipeline.generate.engine import CALLS
from pipeline.generate.followup import record_id
from pipeline.generate.pricing import allocate_gpu_seconds, baseline_gpu_seconds
from pipeline.generate.quality import unfaithful_terms
from pipeline.generate.reuse import cache_value
from pipeline.schema import GENERATION_FIELDS
from pipeline.stores.cache import ResilientStore
from pipeline.stores.catalog import StateStore, now


class CallRecorder:
    def __init__(self, config: TokenmillConfig, job_id: str, partition: str, state: StateStore,
                 cache: ResilientStore, cache_status: str, spent: dict[str, float], progress, copies: Counter):
        self.config, self.job_id, self.partition, self.state, self.cache = config, job_id, partition, state, cache
        self.cache_status, self.spent, self.progress, self.copies = cache_status, spent, progress, copies
        self.units: dict[str, dict] = {}  # request id -> its unit, for the round in flight
        self.extra: dict[str, dict] = {}  # item key -> fields stored with it (chunk counts)

    def __call__(self, call: dict, done: pa.Table) -> None:
        c = self.config
        gpu = allocate_gpu_seconds(done, pa.Table.from_pylist([call], schema=CALLS), c.tiers, c.cost)
        base = baseline_gpu_seconds(done, gpu, c.largest_tier, c.cost)
        created, tier = now(), c.tiers[call["tier"]]
        items, by_scope = {}, {}
        for r, g, b in zip(done.to_pylist(), gpu, base):
            unit = self.units[r["id"]]
            key = unit["item_key"]
            items[key] = {**{f: r[f] for f in GENERATION_FIELDS},
                          "id": record_id(unit), "tenant": unit["tenant"], "partition": self.partition,
                          "gpu_seconds": float(g), "baseline_gpu_seconds": float(b), "created_at": created,
                          "cache_status": self.cache_status,
                          # checked once, here, where the output meets the text it summarises
                          "unfaithful_terms": len(unfaithful_terms(r["summary"], unit.get("document", unit["text"]))),
                          **self.extra.get(key, {})}
            usd = float(g) * tier.price_per_gpu_hour / 3600
            by_scope.setdefault(unit["scope"], {})[key] = cache_value(items[key], self.job_id, usd)
            self.spent[unit["tenant"]] = self.spent.get(unit["tenant"], 0.0) + usd
        self.state.store_items(self.job_id, items)
        for scope, values in by_scope.items():
            self.cache.put_many(scope, values)
        n = sum(self.copies[self.units[i]["item_key"]] for i in done["id"].to_pylist())
        self.progress.advance(done=n, reused=max(n - done.num_rows, 0),
                              usd=call["seconds"] * tier.gpus * tier.price_per_gpu_hour / 3600)
