"""Generation rounds: a partition's units through the engine, then the follow-ups they call for.

Each round runs its requests (engine calls priced and stored by the call recorder), then derives the
next round's units: chunks of documents too long for the context (map), the summary of a long
document's chunk summaries (reduce), schema retries and escalations (followup.next_attempt).
Follow-ups found in the cache are stored and not run. Rounds end when nothing follows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import TokenmillConfig
from pipeline.generate.engine import EnginePool, run_inference
from pipeline.generate.followup import (
    chunk_units,
    is_chunk,
    next_attempt,
    record_id,
    reduce_unit,
    split_for_context,
)
from pipeline.generate.lookup import ItemLookup
from pipeline.generate.recorder import CallRecorder
from pipeline.generate.requests import build_requests
from pipeline.generate.reuse import effective_keys, generation_units, needed_keys
from pipeline.keys import chunk_keys
from pipeline.schema import UNIT

# A partition needs at most: the base round; chunk maps; reduces; schema retries; escalations; and
# escalations of outputs that arrived late (a reduce or a retry).
MAX_ROUNDS = 6


class BudgetReached(RuntimeError):
    """A partition stopped admitting engine calls at a budget cap; it is deferred, not failed."""


class Admission(Protocol):
    reason: str

    def admit(self, batch: pa.Table, tenant_of: dict[str, str]) -> bool: ...


def unit_requests(units: pa.Table, config: TokenmillConfig, pool: EnginePool) -> tuple[pa.Table, pa.Table]:
    """Engine requests for generation units (and the units whose prompts do not fit the context)."""
    tiers_used = sorted(set(units["tier"].to_pylist()))
    return build_requests(units.append_column("duplicate_of", pa.nulls(units.num_rows, pa.string())),
                          config.prompt, config.sampling, config.requests,
                          {t: pool.tokenizer(t) for t in tiers_used},
                          {t: pool.context_length(t) for t in tiers_used})


@dataclass
class Generated:
    """What a partition's rounds produced: items by key, the keys that failed and why, and telemetry."""

    items: dict[str, dict]
    failed: dict[str, tuple[str, str, str]]  # key -> (reason, detail, record id)
    completions: pa.Table
    calls: pa.Table
    shareable_tokens: int


@dataclass
class GenerationRounds:
    config: TokenmillConfig
    pool: EnginePool
    lookup: ItemLookup
    recorder: CallRecorder
    budget: Admission
    failed: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    known: dict[str, dict] = field(default_factory=dict)    # every unit of this partition, by key
    chunked: dict[str, dict] = field(default_factory=dict)  # key -> its unit, for documents cut into chunks
    tried: set[str] = field(default_factory=set)            # follow-up keys already attempted
    completions: list = field(default_factory=list)
    calls: list = field(default_factory=list)
    shareable: int = 0

    def run(self, records: pa.Table, units: pa.Table, requests: pa.Table, too_long: pa.Table) -> Generated:
        self.known = {u["item_key"]: u for u in units.to_pylist()}
        round_units = units.to_pylist()  # whole unit dicts: follow-ups carry flags the request table does not
        items: dict[str, dict] = {}
        for _ in range(MAX_ROUNDS):
            next_units = self.generate(round_units, requests, too_long)
            chunks = {k for u in self.chunked.values() for k in chunk_keys(u["item_key"], u["pieces"])}
            items = self.lookup.stored(sorted(set(needed_keys(records)) | set(self.known) | chunks))
            next_units += self.reduces(items, next_units)
            next_units += self.followups(records, items)
            if not next_units:
                break
            self.known.update({u["item_key"]: u for u in next_units if not is_chunk(u)})
            round_units = next_units
            requests, too_long = unit_requests(pa.Table.from_pylist(
                [{**{k: u[k] for k in UNIT.names}, "max_tokens": u.get("max_tokens")} for u in next_units]),
                self.config, self.pool)
        return Generated(items, self.failed, pa.concat_tables(self.completions), pa.concat_tables(self.calls),
                         self.shareable)

    def generate(self, round_units: list[dict], requests: pa.Table, too_long: pa.Table) -> list[dict]:
        """Run one round's requests; returns the chunk units of documents that did not fit."""
        current = self.recorder.units
        current.clear()
        current.update({u["id"]: u for u in round_units})

        def admit(batch: pa.Table) -> bool:
            return self.budget.admit(batch, {i: current[i]["tenant"] for i in batch["id"].to_pylist()})

        completions, calls, engine_errors, deferred = run_inference(requests, self.pool, self.config.sampling,
                                                                    self.recorder, admit)
        self.completions.append(completions)
        self.calls.append(calls)
        self.shareable += int(pc.sum(requests["shareable_tokens"]).as_py() or 0) if requests.num_rows else 0
        if deferred.num_rows:
            raise BudgetReached(f"budget reached before an engine call of this partition: {self.budget.reason}; "
                                f"{deferred.num_rows} items deferred (what was generated is kept and not paid again)")
        for i, d in zip(engine_errors["id"].to_pylist(), engine_errors["detail"].to_pylist()):
            self.failed.setdefault(current[i]["item_key"], ("engine_error", d, record_id(current[i])))
        return self.split_too_long(too_long, current)

    def split_too_long(self, too_long: pa.Table, current: dict[str, dict]) -> list[dict]:
        """Map step for documents too long for the context (or `too_long` when chunking is off)."""
        c, pieces_of = self.config, []
        for i, d in zip(too_long["id"].to_pylist(), too_long["detail"].to_pylist()):
            unit = current[i]
            if unit.get("escalation") or unit.get("retry"):
                continue  # a follow-up that does not fit: the earlier output stands
            if c.requests.long_documents == "chunk" and not is_chunk(unit) and not unit.get("chunks"):
                pieces = split_for_context(unit["text"], self.pool.tokenizer(unit["tier"]), c.prompt,
                                           self.pool.context_length(unit["tier"]), c.sampling.max_tokens)
                self.chunked[unit["item_key"]] = {**unit, "pieces": len(pieces)}
                pieces_of.extend(chunk_units(unit, pieces))
            else:
                self.failed.setdefault(unit["item_key"], ("too_long", d, record_id(unit)))
        return pieces_of

    def reduces(self, items: dict[str, dict], pending: list[dict]) -> list[dict]:
        """Reduce step: a long document whose chunk summaries are all in becomes one unit over them."""
        out = []
        for key, unit in self.chunked.items():
            if key in items or key in self.failed or any(u["item_key"] == key for u in pending):
                continue
            keys = chunk_keys(key, unit["pieces"])
            bad = next((self.failed[k] for k in keys if k in self.failed), None)
            if bad:
                self.failed[key] = (bad[0], f"chunk of a long document: {bad[1]}", unit["id"])
            elif all(k in items for k in keys):
                self.recorder.extra[key] = {"chunks": unit["pieces"]}
                out.append(reduce_unit({k: v for k, v in unit.items() if k != "pieces"},
                                       [items[k]["summary"] for k in keys]))
        return out

    def followups(self, records: pa.Table, items: dict[str, dict]) -> list[dict]:
        """Units for the next attempt records need: schema retries and escalations (cache hits: stored, not run)."""
        wanted = {}
        for key in sorted(set(effective_keys(records))):
            attempt = next_attempt(key, items, self.config)
            if attempt is None or attempt[0] in self.tried:
                continue
            target, changes = attempt
            unit = self.known.get(key)
            if unit is None:
                found = generation_units(records, {key}).to_pylist()
                if not found:
                    continue
                unit = found[0]
            wanted[target] = {**unit, "item_key": target, **changes}
            self.tried.add(target)
        found = self.lookup.store_cache_hits(self.recorder.partition, wanted)
        return [u for k, u in wanted.items() if k not in found]
