"""Each partition's generation as waves of work units in the catalog: the state machine the steps drive.

  start[p]:    prepared requests -> wave 0 units (per tier, keys deduplicated across partitions)
  advance[p]:  when a wave's keys are all in, derive the next wave (waves.py) and enqueue it, on
               whatever tier; when one derives nothing, the partition is generated
  fail[p]:     its units withdrawn, the other partitions go on

A partition's wave state lives in the staging area, its wave number, the token of the derivation
that stands and its generation status (generating | generated | failed) in its catalog row. Workers
racing to derive the same wave may derive different ones (one found a follow-up in the reuse cache,
the other did not): each writes its files under a token of its own, one compare-and-set in the
catalog takes one token with the wave, and only its taker enqueues the wave's keys. Cache hits a
derivation found are in its state and stored once it stands, so a derivation that lost stores nothing.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable

import pyarrow as pa
from sqlalchemy import update
from sqlalchemy.exc import OperationalError

from pipeline.config import TokenmillConfig
from pipeline.generate.engine import EnginePool
from pipeline.generate.engine_api import EngineDeadError
from pipeline.generate.lookup import ItemLookup
from pipeline.generate.waves import WaveDeriver, WaveState, partition_keys
from pipeline.schema import GENERATION
from pipeline.stores import storage
from pipeline.stores.catalog import Partition, StateError, StateStore
from pipeline.stores.staging import StagingArea
from pipeline.stores.units import UNFINISHED, UnitQueue, WorkUnit

log = logging.getLogger(__name__)
# A wave file's generations, typed: what a worker reads of each request (GENERATION's columns, the request a
# schema.REQUEST struct) and what a follow-up adds (waves.py, followup.py, judge.py). A field a follow-up sets
# beyond these is refused when the wave is written, never dropped.
WAVE_GENERATION = pa.struct(
    [
        *GENERATION,
        ("max_tokens", pa.int64()),
        ("retry", pa.bool_()),
        ("escalation", pa.bool_()),
        ("judge", pa.bool_()),
        ("summary", pa.string()),
        ("record_id", pa.string()),
        ("chunks", pa.int64()),
        ("document", pa.string()),
    ]
)
_FIELDS = {f.name for f in WAVE_GENERATION}


def wave_generations(generations: list[dict]) -> pa.Array:
    unknown = {k for g in generations for k in g} - _FIELDS
    if unknown:
        raise ValueError(f"generation fields {sorted(unknown)} have no place in a wave file (WAVE_GENERATION)")
    return pa.array(generations, WAVE_GENERATION)


def read_generation(value: dict) -> dict:
    """A wave file's generation as its derivation made it: a follow-up's field it did not set is absent."""
    return {k: v for k, v in value.items() if v is not None or k in GENERATION.names}


def wave_rows(staging: StagingArea, table: pa.Table) -> list[dict]:
    """A wave file's rows, each generation as its derivation made it. A wave file written before generations were
    typed holds them as JSON text: parsed here, and refused only where one holds a batch request as JSON text
    (a document's request is null)."""
    if not pa.types.is_string(table.schema.field("generation").type):
        return [{**r, "generation": read_generation(r["generation"])} for r in table.to_pylist()]
    rows = [{**r, "generation": json.loads(r["generation"])} for r in table.to_pylist()]
    if any(isinstance(r["generation"].get("request"), str) for r in rows):
        raise staging.staged_before_typed_requests()
    return rows


class PartitionWaves:
    def __init__(
        self,
        config: TokenmillConfig,
        job_id: str,
        state: StateStore,
        queue: UnitQueue,
        staging: StagingArea,
        lookup: ItemLookup,
        pool: EnginePool,
        written: Callable[[str], None] = lambda partition: None,
    ):
        self.config, self.job_id, self.state, self.queue = config, job_id, state, queue
        self.staging, self.lookup, self.pool = staging, lookup, pool
        self.written = written  # called with a derived wave's files written, before the catalog takes it

    def deriver(self, partition: str) -> WaveDeriver:
        return WaveDeriver(self.config, self.pool, self.lookup, partition)

    def start(self, partition: str, generations: pa.Table, requests: pa.Table, too_long: pa.Table) -> int:
        """Wave 0 of a partition (preparing it again starts over: units no worker holds are withdrawn, and
        of two prepares at once the later one's wave stands). Returns how many requests it enqueued (keys
        other partitions already enqueued are theirs)."""
        self.queue.withdraw(self.job_id, partition)
        state, rows = self.deriver(partition).first(generations, requests, too_long)
        token = self.write(partition, state, rows)
        self.set_generation(partition, 0, "generating", token)
        enqueued = self.enqueue(partition, state.wave, rows)
        self.advance(partition)  # nothing to wait for (all paid, all too long): generated at once
        return enqueued

    def write(self, partition: str, state: WaveState, rows: list[dict]) -> str:
        """Write a derived wave's files (its requests per tier, its state) under a new token: nothing reads
        them until the catalog takes the token."""
        token = secrets.token_hex(8)
        for tier, tier_rows in by_tier(rows).items():
            self.staging.write_wave(
                partition,
                state.wave,
                token,
                tier,
                pa.table(
                    {
                        "item_key": [r["generation"]["item_key"] for r in tier_rows],
                        "prompt_token_ids": pa.array([r["prompt_token_ids"] for r in tier_rows], pa.list_(pa.int32())),
                        "max_tokens": pa.array([r["max_tokens"] for r in tier_rows], pa.int64()),
                        "generation": wave_generations([r["generation"] for r in tier_rows]),
                    }
                ),
            )
        self.staging.write_wave_state(partition, state.wave, token, state.dumps())
        self.written(partition)
        return token

    def enqueue(self, partition: str, wave: int, rows: list[dict]) -> int:
        owned = self.queue.enqueue(
            self.job_id,
            partition,
            wave,
            {t: [r["generation"]["item_key"] for r in rs] for t, rs in by_tier(rows).items()},
        )
        return sum(len(keys) for keys in owned.values())

    def state_of(self, p: Partition) -> WaveState:
        """The partition's wave state: its current wave's, as the derivation the catalog took wrote it."""
        state = WaveState.loads(self.staging.wave_state(p.partition, p.wave, p.wave_token))
        if any(isinstance(g.get("request"), str) for g in state.known.values()):
            raise self.staging.staged_before_typed_requests()
        return state

    def requests(self, unit: WorkUnit) -> list[dict]:
        """A unit's requests still owned and pending (a unit taken over from a dead worker: what it left).

        Keys it owns that its partition's current wave does not request (enqueued by a prepare that a later
        prepare superseded, or by a wave of a partition that failed since) are given up: their rows are
        deleted, so a partition waiting on one finds it unowned and enqueues it itself. Keys whose item is
        stored already (a unit taken over after its worker stored them) are done, not run."""
        p = self.state.partition(self.job_id, unit.partition)
        owned = self.queue.owned_keys(self.job_id, unit.unit_id)
        if p is None or p.generation != "generating" or p.wave != unit.wave:
            rows = []
        else:  # (a missing file is a fault of the staging area: the unit fails its partition)
            table = self.staging.wave(unit.partition, unit.wave, p.wave_token, unit.tier)
            rows = [r for r in wave_rows(self.staging, table) if r["item_key"] in owned]
        self.queue.give_up(self.job_id, unit.unit_id, owned - {r["item_key"] for r in rows})
        stored = self.lookup.stored([r["item_key"] for r in rows])
        if stored:
            self.queue.set_keys(self.job_id, dict.fromkeys(stored, ("done", None, None)))
        return [r for r in rows if r["item_key"] not in stored]

    def advance(self, partition: str) -> None:
        """Derive and enqueue the partition's next waves while the current one is in; mark it generated
        when one derives nothing. A no-op while it waits, or when it is not generating."""
        for _ in range(10):
            p = self.state.partition(self.job_id, partition)
            if p is None or p.generation != "generating":
                return
            state = self.state_of(p)
            keys = self.queue.key_states(self.job_id, state.waiting)
            missing = [k for k in state.waiting if k not in keys]
            if missing:  # the partition that owned them was prepared again or failed: this one enqueues them
                self.enqueue_again(p, set(missing))
                return
            if any(keys[k].state not in ("done", "failed") for k in state.waiting):
                return  # still generating (here, or in the partition that enqueued the key first)
            records = self.staging.records(partition)
            items = self.lookup.stored(partition_keys(records, state))
            unstored = {k: h for k, h in state.hits.items() if k not in items}
            if unstored:  # the standing derivation's cache hits (its taker may have died before storing them)
                self.lookup.store_hits(partition, unstored)
                items = self.lookup.stored(partition_keys(records, state))
            failures = {k: (v.reason, v.detail) for k, v in keys.items() if v.state == "failed" and k not in items}
            rows = self.deriver(partition).next(state, records, items, failures)
            token = self.write(partition, state, rows or [])
            if not self.set_generation(
                partition,
                state.wave,
                "generated" if rows is None else "generating",
                token,
                expect=(p.wave, p.wave_token),
            ):
                return  # another worker's derivation of this wave was taken first: its files are the wave
            if rows is None:
                return
            if rows:
                self.enqueue(partition, state.wave, rows)

    def still_generating(self, partition: str) -> bool:
        """True while the partition's generation can still move: after deriving what it can, it is generating
        and the job has units pending or leased (its own, or the other partitions' it waits for)."""
        self.safely(self.advance, partition)
        p = self.state.partition(self.job_id, partition)
        depth = self.queue.depth(self.job_id)
        return p.generation == "generating" and any(d.get(s) for d in depth.values() for s in UNFINISHED)

    def enqueue_again(self, p: Partition, keys: set[str]) -> None:
        """Enqueue keys this partition's wave waits for that no unit owns any more (its staged requests hold
        every key it asked for, owned or not)."""
        for tier in self.config.tiers:
            try:
                staged = self.staging.wave(p.partition, p.wave, p.wave_token, tier)
            except storage.StorageError:
                continue
            mine = [k for k in staged["item_key"].to_pylist() if k in keys]
            if mine:
                self.queue.enqueue(self.job_id, p.partition, p.wave, {tier: mine})

    def set_generation(
        self,
        partition: str,
        wave: int,
        status: str,
        token: str | None = None,
        expect: tuple[int, str | None] | None = None,
    ) -> bool:
        """Set the partition's wave, its generation status and (given) the token of the derivation that
        stands; with `expect`, only while it is still generating (wave, token) (a compare-and-set)."""
        where = [Partition.job_id == self.job_id, Partition.partition == partition]
        if expect is not None:
            wave_was, token_was = expect
            where += [
                Partition.wave == wave_was,
                Partition.generation == "generating",
                Partition.wave_token == token_was if token_was is not None else Partition.wave_token.is_(None),
            ]
        values = {"wave": wave, "generation": status} | ({"wave_token": token} if token is not None else {})
        with self.state.db_session() as s, s.begin():
            return s.execute(update(Partition).where(*where).values(**values)).rowcount == 1

    def stop(self, partition: str) -> None:
        """End a partition's generation where it stands (its job stopped for good): the units no worker holds
        are withdrawn (a dead worker's too: nobody drains them now), and the current wave is its last
        (`generated`), so no unit of it serves a request again."""
        self.queue.withdraw(self.job_id, partition, dead_too=True)
        p = self.state.partition(self.job_id, partition)
        self.set_generation(partition, p.wave, "generated")

    def fail(self, partition: str, error: str) -> None:
        """A partition whose generation could not go on: its units are withdrawn, the others go on."""
        self.queue.withdraw(self.job_id, partition)
        self.set_generation(partition, 0, "failed")
        with self.state.db_session() as s, s.begin():
            s.execute(
                update(Partition)
                .where(Partition.job_id == self.job_id, Partition.partition == partition, Partition.status != "running")
                .values(status="failed", last_error=error[:2000])
            )

    def advance_all(self) -> None:
        """Advance every generating partition that can be (one waiting on another partition's keys)."""
        for p in self.state.partitions(self.job_id):
            if p.generation == "generating":
                self.safely(self.advance, p.partition)

    def safely(self, step, partition: str) -> None:
        """`step(partition)`, failing that partition alone on an error of its own."""
        try:
            step(partition)
        except (OperationalError, StateError, EngineDeadError):
            raise  # every partition would fail the same way
        except Exception as e:  # this partition's generation cannot go on; the others can
            log.error("partition %s: generation failed: %s", partition, e)
            self.fail(partition, f"generation: {type(e).__name__}: {e}")


def by_tier(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["tier"], []).append(r)
    return out
