"""Generation waves: what a partition asks of the tier workers, one wave at a time.

Wave 0 is the partition's prepared requests, plus the chunks of documents too long for the context
(map; chunk summaries the cache holds are not run). When every key a wave waits for is in (stored by
a tier worker, or failed), the next wave is derived from what is stored: the summary of a long
document's chunk summaries (reduce), schema retries, escalations and judges (followup.next_attempt);
follow-ups found in the cache are not run: the derivation the catalog takes stores them. The
partition is generated when a wave derives nothing.

The planner is pure over its inputs (records, stored items, key failures) and a small state that
the job keeps in its staging area between waves (`WaveState`), so any worker can derive the next
wave after any other worker finished the last one, and deriving it twice gives the same wave.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pyarrow as pa

from pipeline.config import TokenmillConfig
from pipeline.generate.engine import EnginePool
from pipeline.generate.followup import (
    chunk_generations,
    is_chunk,
    next_attempt,
    record_id,
    reduce_generation,
    split_for_context,
)
from pipeline.generate.judge import judge_generation
from pipeline.generate.lookup import ItemLookup
from pipeline.generate.requests import build_requests
from pipeline.generate.reuse import effective_keys, generations_for, needed_keys
from pipeline.keys import chunk_keys
from pipeline.schema import GENERATION

# A partition needs at most: the base wave (with chunk maps); reduces; schema retries; escalations;
# escalations of outputs that arrived late (a reduce or a retry); judges (`checks.judge`), and judges of outputs
# that arrived late (an escalation of a late one); a wave of cache hits only; and one to spare.
MAX_WAVES = 9


@dataclass
class WaveState:
    """What deriving a partition's next wave needs beyond the catalog: JSON in the staging area."""

    wave: int = 0
    known: dict[str, dict] = field(default_factory=dict)  # every generation of this partition, by key
    chunked: dict[str, dict] = field(default_factory=dict)  # key -> its generation, for documents cut into chunks
    tried: list[str] = field(default_factory=list)  # follow-up keys already asked for
    failed: dict[str, list] = field(default_factory=dict)  # key -> [reason, detail, record id]
    waiting: list[str] = field(default_factory=list)  # keys the current wave waits for
    # Follow-ups found in the cache (key -> cache value and who asked): stored as items only once the catalog
    # took this derivation, so a derivation that loses its race stores nothing.
    hits: dict[str, dict] = field(default_factory=dict)
    shareable: int = 0  # prompt tokens prefix sharing could save

    def dumps(self) -> str:
        # Its fields as they are, not `asdict`: that deep-copies every generation (documents included) first.
        return json.dumps(vars(self), sort_keys=True)

    @classmethod
    def loads(cls, text: str) -> WaveState:
        return cls(**json.loads(text))


def engine_requests(generations: pa.Table, config: TokenmillConfig, pool: EnginePool) -> tuple[pa.Table, pa.Table]:
    """Engine requests for generations (and the generations whose prompts do not fit the context)."""
    tiers_used = sorted(set(generations["tier"].to_pylist()))
    return build_requests(
        generations.append_column("duplicate_of", pa.nulls(generations.num_rows, pa.string())),
        config.prompt,
        config.sampling,
        config.requests,
        {t: pool.tokenizer(t) for t in tiers_used},
        {t: pool.context_length(t) for t in tiers_used},
    )


def _table(generations: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(
        [{**{k: u.get(k) for k in GENERATION.names}, "max_tokens": u.get("max_tokens")} for u in generations],
        schema=pa.schema([*GENERATION, ("max_tokens", pa.int64())]),
    )


@dataclass
class WaveDeriver:
    config: TokenmillConfig
    pool: EnginePool
    lookup: ItemLookup | None  # None: no cache asked (the estimate prices a first wave as if nothing were cached)
    partition: str

    def first(self, generations: pa.Table, requests: pa.Table, too_long: pa.Table) -> tuple[WaveState, list[dict]]:
        """Wave 0 from a partition's prepared generations and requests: (state, its requests with their
        generations)."""
        state = WaveState(known={u["item_key"]: u for u in generations.to_pylist()})
        by_id = {u["id"]: u for u in generations.to_pylist()}
        return state, self.wave_requests(state, by_id, requests, too_long)

    def next(
        self, state: WaveState, records: pa.Table, items: dict[str, dict], failures: dict[str, tuple[str, str]]
    ) -> list[dict] | None:
        """The next wave's requests once the current one is in (None: the partition is generated).
        `items`: the stored items of the partition's keys; `failures`: key -> (reason, detail)."""
        for key, (reason, detail) in failures.items():
            gen = state.known.get(key) or next((u for u in _chunk_generations(state) if u["item_key"] == key), None)
            state.failed.setdefault(key, [reason, detail, record_id(gen) if gen else ""])
        if state.wave + 1 >= MAX_WAVES:
            return None
        hits_before = len(state.hits)
        generations = self.reduces(state, items) + self.followups(state, records, items)
        if not generations and len(state.hits) == hits_before:
            return None
        state.wave += 1  # (a wave of cache hits only waits for nothing: the next derivation stores them first)
        if not generations:
            state.waiting = []
            return []
        state.known.update({u["item_key"]: u for u in generations if not is_chunk(u)})
        requests, too_long = engine_requests(_table(generations), self.config, self.pool)
        return self.wave_requests(state, {u["id"]: u for u in generations}, requests, too_long)

    def wave_requests(
        self, state: WaveState, by_id: dict[str, dict], requests: pa.Table, too_long: pa.Table
    ) -> list[dict]:
        """Request rows (with `generation`: what they generate) of one wave, chunks of the too-long included."""
        chunks = self.split_too_long(state, too_long, by_id)
        if chunks and self.lookup:  # chunk summaries are looked up like any other key: seen before, paid once
            found = self.lookup.cache_hits({u["item_key"]: {**u, "id": record_id(u)} for u in chunks})
            state.hits.update(found)
            chunks = [u for u in chunks if u["item_key"] not in found]
        rows = [{**r, "generation": by_id[r["id"]]} for r in requests.to_pylist()]
        state.shareable += sum(r["shareable_tokens"] or 0 for r in rows)
        if chunks:
            chunk_requests, still_long = engine_requests(_table(chunks), self.config, self.pool)
            chunk_by_id = {u["id"]: u for u in chunks}
            for u in still_long.to_pylist():
                state.failed.setdefault(
                    chunk_by_id[u["id"]]["item_key"], [u["reason"], u["detail"], record_id(chunk_by_id[u["id"]])]
                )
            rows += [{**r, "generation": chunk_by_id[r["id"]]} for r in chunk_requests.to_pylist()]
        state.waiting = sorted({r["generation"]["item_key"] for r in rows})
        return rows

    def split_too_long(self, state: WaveState, too_long: pa.Table, by_id: dict[str, dict]) -> list[dict]:
        """Map step for documents too long for the context (or `too_long` when chunking is off)."""
        c, pieces_of = self.config, []
        for u in too_long.to_pylist():
            gen, d = by_id[u["id"]], u["detail"]
            if gen.get("escalation") or gen.get("retry") or gen.get("judge"):
                continue  # a follow-up that does not fit: the earlier output stands (a judge's: unjudged)
            if u["reason"] != "too_long":  # a request its model cannot render: no piece of it would do
                state.failed.setdefault(gen["item_key"], [u["reason"], d, record_id(gen)])
            elif c.requests.long_documents == "chunk" and not is_chunk(gen) and not gen.get("chunks"):
                pieces = split_for_context(
                    gen["text"],
                    self.pool.tokenizer(gen["tier"]),
                    c.prompt,
                    self.pool.context_length(gen["tier"]),
                    c.sampling.max_tokens,
                )
                state.chunked[gen["item_key"]] = {**gen, "pieces": len(pieces)}
                pieces_of.extend(chunk_generations(gen, pieces))
            else:
                state.failed.setdefault(gen["item_key"], ["too_long", d, record_id(gen)])
        return pieces_of

    def reduces(self, state: WaveState, items: dict[str, dict]) -> list[dict]:
        """Reduce step: a long document whose chunk summaries are all in becomes one generation over them."""
        out = []
        for key, gen in state.chunked.items():
            if key in items or key in state.failed or key in state.tried:
                continue
            keys = chunk_keys(key, gen["pieces"])
            bad = next((state.failed[k] for k in keys if k in state.failed), None)
            if bad:
                state.failed[key] = [bad[0], f"chunk of a long document: {bad[1]}", gen["id"]]
            elif all(k in items for k in keys):
                state.tried.append(key)
                out.append(
                    reduce_generation(
                        {k: v for k, v in gen.items() if k != "pieces"}, [items[k]["summary"] for k in keys]
                    )
                )
        return out

    def followups(self, state: WaveState, records: pa.Table, items: dict[str, dict]) -> list[dict]:
        """Generations for the next attempt records need: schema retries, escalations and judges (cache hits:
        kept in `state.hits`, not run)."""
        wanted = {}
        # Asked for in an earlier wave and not stored once it was in: failed, or too long for its tier.
        gone = frozenset(state.tried) - set(items)
        for key in sorted(set(effective_keys(records))):
            attempt = next_attempt(key, items, self.config, gone)
            if attempt is None or attempt[0] in state.tried:
                continue
            target, changes = attempt
            gen = state.known.get(key)
            if gen is None:
                found = generations_for(records, {key}).to_pylist()
                if not found:
                    continue
                gen = found[0]
            if changes.get("judge"):
                wanted[target] = judge_generation(gen, target, changes["summary"], self.config, self.pool)
            else:
                wanted[target] = {**gen, "item_key": target, **changes}
            state.tried.append(target)
        found = self.lookup.cache_hits(wanted)
        state.hits.update(found)
        return [u for k, u in wanted.items() if k not in found]


def _chunk_generations(state: WaveState) -> list[dict]:
    return [
        {"item_key": k, "id": u["id"]} for u in state.chunked.values() for k in chunk_keys(u["item_key"], u["pieces"])
    ]


def partition_keys(records: pa.Table, state: WaveState) -> list[str]:
    """Every key whose item a partition's outputs may need: its records' keys, generations and chunks."""
    chunks = {k for u in state.chunked.values() for k in chunk_keys(u["item_key"], u["pieces"])}
    return sorted(set(needed_keys(records)) | set(state.known) | chunks | set(state.tried))
