"""Item lookup: the outputs a partition's records need, found where they are cheapest.

First this job's paid items (the state catalog: any partition's generations, or an earlier attempt's),
then exact hits in the cache of earlier jobs, stored as this job's items so that reruns find them
in the catalog. What is still missing becomes generations (reuse.generations_for).
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.generate.reuse import cached_items, generations_for, needed_keys, reference_keys, resolve
from pipeline.stores.cache import ResilientStore
from pipeline.stores.catalog import StateStore, now


class ItemLookup:
    def __init__(self, state: StateStore, cache: ResilientStore, job_id: str, cache_enabled: bool):
        self.state, self.cache, self.job_id, self.cache_enabled = state, cache, job_id, cache_enabled

    def unpaid(self, partition: str, records: pa.Table) -> tuple[pa.Table, dict[str, dict], pa.Table]:
        """(records resolved, items at hand by key, generations for what is not paid for)."""
        items = self.items(partition, records, {}, needed_keys(records))
        records = resolve(records, set(items))
        items = self.items(partition, records, items, needed_keys(records))  # keys of records that fell back
        return records, items, generations_for(records, set(needed_keys(records)) - set(items))

    def still_unpaid(self, records: pa.Table, generations: pa.Table) -> tuple[pa.Table, dict[str, dict], pa.Table]:
        """Like `unpaid`, for generations prepared earlier: drops what has been paid for since."""
        items = self.state.stored_items(self.job_id, needed_keys(records))
        records = resolve(records, set(items))
        return (
            records,
            items,
            generations.filter(pc.invert(pc.is_in(generations["item_key"], pa.array(list(items), pa.string())))),
        )

    def stored(self, keys: list[str]) -> dict[str, dict]:
        """This job's items for `keys`, as the catalog holds them."""
        return self.state.stored_items(self.job_id, keys)

    def items(self, partition: str, records: pa.Table, items: dict[str, dict], keys: list[str]) -> dict[str, dict]:
        """`items` plus the catalog's and the cache's for `keys`."""
        missing = [k for k in keys if k not in items]
        items = items | self.state.stored_items(self.job_id, missing)
        missing = set(k for k in missing if k not in items)
        if not missing or not self.cache_enabled:
            return items
        lookers: dict[str, dict] = {}  # key -> the record that asks for it (labels the item)
        for id_, tenant, scope, own, gen in zip(
            *(records[c].to_pylist() for c in ("id", "tenant", "scope", "item_key", "gen_key"))
        ):
            for key in (own, gen):
                if key in missing:
                    lookers.setdefault(key, {"id": id_, "tenant": tenant, "scope": scope})
        found = self.store_cache_hits(partition, lookers)
        # Read back as stored: another worker may have stored the key first, and the first value wins.
        return items | self.state.stored_items(self.job_id, list(found)) if found else items

    def store_cache_hits(self, partition: str, lookers: dict[str, dict]) -> dict[str, dict]:
        """Exact cache hits for `lookers` (key -> the generation or record asking: id, tenant, scope), stored as
        this job's items so reruns see them; returns them by key."""
        return self.store_hits(partition, self.cache_hits(lookers))

    def cache_hits(self, lookers: dict[str, dict]) -> dict[str, dict]:
        """Exact cache hits for `lookers`, not stored: key -> {"value": the cache's value, "looker": who asked
        (id, tenant, scope)}, plain JSON, to be stored later by `store_hits`."""
        if not lookers or not self.cache_enabled:
            return {}
        hits = self.cache.get_scoped({k: v["scope"] for k, v in lookers.items()})
        return {
            k: {"value": v, "looker": {f: lookers[k][f] for f in ("id", "tenant", "scope")}} for k, v in hits.items()
        }

    def store_hits(self, partition: str, hits: dict[str, dict]) -> dict[str, dict]:
        """Store cache hits found by `cache_hits` as this job's items (a key stored first keeps its value)."""
        if not hits:
            return {}
        lookers = {k: h["looker"] for k, h in hits.items()}
        found = cached_items({k: h["value"] for k, h in hits.items()}, lookers, partition, now())
        self.state.store_items(self.job_id, found)
        return found

    def reference_outputs(self, records: pa.Table, items: dict[str, dict]) -> dict[str, str]:
        """Outputs shadow-verified records are compared with: this job's items, else the cache's."""
        refs = set(reference_keys(records))
        out = {k: items[k]["summary"] for k in refs if k in items}
        scope_of = dict(zip(records["gen_key"].to_pylist(), records["scope"].to_pylist()))
        hits = self.cache.get_scoped({k: scope_of[k] for k in refs - set(out)})
        return out | {k: v["summary"] for k, v in hits.items()}
