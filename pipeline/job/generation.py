"""A job's generation: partitions' waves as work units in the catalog, drained by tier workers.

  prepare[p]:  prepared requests -> wave 0 units (per tier, keys deduplicated across partitions)
  drain[tier]: a TierWorker claims that tier's units from every partition; when a unit is done, its
               partition's next wave is derived (generate/waves.py) and enqueued, on whatever tier
  commit[p]:   once a partition is generated (a wave derived nothing), it is written (partition.py)

Each partition's wave state lives in the staging area, its wave number and generation status
(generating | generated | failed) in its catalog row; deriving a wave is idempotent (deterministic
unit ids, ON CONFLICT inserts, a compare-and-set on the wave), so two workers racing to derive the
same wave enqueue it once.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

import pyarrow as pa
from sqlalchemy import update
from sqlalchemy.exc import OperationalError

from pipeline.generate.engine_api import EngineDeadError
from pipeline.generate.pricing import session_shares
from pipeline.generate.waves import WavePlanner, WaveState, partition_keys
from pipeline.generate.worker import Failure, TierWorker, WorkerReport
from pipeline.stores import storage
from pipeline.stores.catalog import ItemsRefused, Partition, StateError
from pipeline.stores.units import UNFINISHED, UnitQueue, WorkUnit, worker_is_gone

if TYPE_CHECKING:
    from pipeline.job.lifecycle import Job

log = logging.getLogger(__name__)


class Generation:
    def __init__(self, job: Job):
        self.job, self.config, self.job_id = job, job.config, job.job_id
        self.queue = UnitQueue(job.state)

    def planner(self, partition: str) -> WavePlanner:
        return WavePlanner(self.config, self.job.pool, self.job.lookup, partition)

    # -- waves ------------------------------------------------------------------------------------
    def start(self, partition: str, units: pa.Table, requests: pa.Table, too_long: pa.Table) -> int:
        """Wave 0 of a partition (preparing it again starts over: units no worker holds are withdrawn).
        Returns how many requests it enqueued (keys other partitions already enqueued are theirs)."""
        self.queue.withdraw(self.job_id, partition)
        state, rows = self.planner(partition).first(units, requests, too_long)
        self.set_generation(partition, 0, "generating")
        enqueued = self.enqueue(partition, state, rows)
        self.advance(partition)  # nothing to wait for (all paid, all too long): generated at once
        return enqueued

    def enqueue(self, partition: str, state: WaveState, rows: list[dict]) -> int:
        by_tier: dict[str, list[dict]] = {}
        for r in rows:
            by_tier.setdefault(r["tier"], []).append(r)
        for tier, tier_rows in by_tier.items():
            self.job.staging.write(partition, f"wave-{state.wave}-{tier}", pa.table({
                "item_key": [r["unit"]["item_key"] for r in tier_rows],
                "prompt_token_ids": pa.array([r["prompt_token_ids"] for r in tier_rows], pa.list_(pa.int32())),
                "max_tokens": pa.array([r["max_tokens"] for r in tier_rows], pa.int64()),
                "unit": [json.dumps(r["unit"], sort_keys=True) for r in tier_rows]}))
        self.save(partition, state)
        owned = self.queue.enqueue(self.job_id, partition, state.wave,
                                   {t: [r["unit"]["item_key"] for r in rs] for t, rs in by_tier.items()})
        return sum(len(keys) for keys in owned.values())

    def save(self, partition: str, state: WaveState) -> None:
        self.job.staging.write(partition, f"wave-state-{state.wave}", pa.table({"state": [state.dumps()]}))

    def state(self, partition: str, wave: int) -> WaveState:
        return WaveState.loads(self.job.staging.read(partition, f"wave-state-{wave}")["state"][0].as_py())

    def load(self, unit: WorkUnit) -> list[dict]:
        """A unit's requests still owned and pending (a unit taken over from a dead worker: what it left)."""
        table = self.job.staging.read(unit.partition, f"wave-{unit.wave}-{unit.tier}")
        owned = self.queue.owned_keys(self.job_id, unit.unit_id)
        return [{**r, "unit": json.loads(r["unit"])} for r in table.to_pylist() if r["item_key"] in owned]

    def advance(self, partition: str) -> None:
        """Derive and enqueue the partition's next waves while the current one is in; mark it generated
        when one derives nothing. A no-op while it waits, or when it is not generating."""
        for _ in range(10):
            p = self.job.state_partition(partition)
            if p is None or p.generation != "generating":
                return
            state = self.state(partition, p.wave)
            keys = self.queue.key_states(self.job_id, state.waiting)
            missing = [k for k in state.waiting if k not in keys]
            if missing:  # the partition that owned them was prepared again or failed: this one enqueues them
                self.enqueue_again(partition, state.wave, set(missing))
                return
            if any(keys[k].state not in ("done", "failed") for k in state.waiting):
                return  # still generating (here, or in the partition that enqueued the key first)
            records = self.job.staging.read(partition, "records")
            items = self.job.lookup.stored(partition_keys(records, state))
            failures = {k: (v.reason, v.detail) for k, v in keys.items() if v.state == "failed" and k not in items}
            rows = self.planner(partition).next(state, records, items, failures)
            if rows is None:
                self.save(partition, state)
                self.set_generation(partition, p.wave, "generated", expect=(p.wave, "generating"))
                return
            self.enqueue(partition, state, rows)
            if not self.set_generation(partition, state.wave, "generating", expect=(p.wave, "generating")):
                return  # another worker derived this wave first (the same wave: its units are the same)

    def still_generating(self, partition: str) -> bool:
        """True while the partition's generation can still move: after deriving what it can, it is generating
        and the job has units pending or leased (its own, or the other partitions' it waits for)."""
        self.safe(self.advance, partition)
        p = self.job.state_partition(partition)
        depth = self.queue.depth(self.job_id)
        return p.generation == "generating" and any(d.get(s) for d in depth.values() for s in UNFINISHED)

    def enqueue_again(self, partition: str, wave: int, keys: set[str]) -> None:
        """Enqueue keys this partition's wave waits for that no unit owns any more (its staged requests hold
        every key it asked for, owned or not)."""
        for tier in self.config.tiers:
            try:
                staged = self.job.staging.read(partition, f"wave-{wave}-{tier}")
            except storage.StorageError:
                continue
            mine = [k for k in staged["item_key"].to_pylist() if k in keys]
            if mine:
                self.queue.enqueue(self.job_id, partition, wave, {tier: mine})

    def set_generation(self, partition: str, wave: int, status: str, expect: tuple[int, str] | None = None) -> bool:
        where = [Partition.job_id == self.job_id, Partition.partition == partition]
        if expect is not None:
            where += [Partition.wave == expect[0], Partition.generation == expect[1]]
        with self.job.state.session() as s, s.begin():
            return s.execute(update(Partition).where(*where).values(wave=wave, generation=status)).rowcount == 1

    def fail(self, partition: str, error: str) -> None:
        """A partition whose generation could not go on: its units are withdrawn, the others go on."""
        self.queue.withdraw(self.job_id, partition)
        self.set_generation(partition, 0, "failed")
        with self.job.state.session() as s, s.begin():
            s.execute(update(Partition).where(Partition.job_id == self.job_id, Partition.partition == partition,
                                              Partition.status != "running")
                      .values(status="failed", last_error=error[:2000]))

    def sweep(self) -> None:
        """Advance every generating partition that can be (one waiting on another partition's keys)."""
        for p in self.job.state.partitions(self.job_id):
            if p.generation == "generating":
                self.safe(self.advance, p.partition)

    def safe(self, step, partition: str) -> None:
        try:
            step(partition)
        except (OperationalError, StateError, EngineDeadError):
            raise  # every partition would fail the same way
        except Exception as e:  # this partition's generation cannot go on; the others can
            log.error("partition %s: generation failed: %s", partition, e)
            self.fail(partition, f"generation: {type(e).__name__}: {e}")

    # -- tier workers -----------------------------------------------------------------------------
    def feeders(self, tier: str) -> set[str]:
        """Tiers whose units can lead to units of `tier` (escalations): chunks, reduces and retries stay on theirs."""
        return {t for t in self.config.tiers if t != tier} if tier == self.config.escalation_tier else set()

    def more_may_come(self, tier: str) -> bool:
        self.sweep()
        depth = self.queue.depth(self.job_id)
        return any(depth.get(t, {}).get(s) for t in self.feeders(tier) for s in UNFINISHED)

    def store(self, items: dict[str, dict], failed: dict[str, Failure]) -> None:
        if items:
            try:
                self.job.state.store_items(self.job_id, items)
            except ItemsRefused as e:  # the others are stored (paid, kept); the refused ones fail their partitions
                for key in e.refused:
                    self.fail(items[key]["partition"], f"ItemsRefused: {e}")
                failed = failed | {k: Failure("engine_error", e.refused[k], None, {}) for k in e.refused}
                items = {k: v for k, v in items.items() if k not in e.refused}
        self.queue.add_charges(self.job_id, [
            {"charge_id": f"{f.unit.unit_id}/{f.unit.epoch}/{key}", "partition": f.unit.partition,
             "session_id": f.unit.session_id, "kind": "failed_attempt", "id": f.request_unit.get("record_id", f.request_unit["id"]),
             "tenant": f.request_unit["tenant"], "tier": f.unit.tier, "gpu_seconds": f.gpu_seconds}
            for key, f in failed.items() if f.gpu_seconds > 0 and f.unit is not None])
        states = {k: ("done", None, None) for k in items}
        states |= {k: ("failed", f.reason, f.detail) for k, f in failed.items()}
        self.queue.set_keys(self.job_id, states)
        spent = self.job.budget.spent  # what the budget guard admits the next units against
        for item in items.values():
            usd = item["gpu_seconds"] * self.config.tiers[item["tier"]].price_per_gpu_hour / 3600
            spent[item["tenant"]] = spent.get(item["tenant"], 0.0) + usd
        self.job.progress.advance(usd=sum(
            i["gpu_seconds"] * self.config.tiers[i["tier"]].price_per_gpu_hour / 3600 for i in items.values()))

    def release_gone(self) -> bool:
        """Make the units of provably gone workers claimable now; True when there were any."""
        gone = self.queue.release_gone(self.job_id)
        for unit in gone:
            log.warning("work unit %s: its holder %s is gone (no such process on this host); taking it over now "
                        "instead of when its lease ends", unit.unit_id, unit.worker)
        return bool(gone)

    def drain(self, tier: str, release: bool = False) -> WorkerReport:
        """Run one tier worker for this job until its tier has no unit left or to come."""
        job, c = self.job, self.config
        cache_on = c.cache.enabled and not job.cache.bypassed
        self.release_gone()

        def cache_put(by_scope: dict[str, dict]) -> None:
            if cache_on:
                for scope, values in by_scope.items():
                    job.cache.put_many(scope, values)

        def admit(rows: list[dict]) -> bool:
            batch = pa.table({"id": [r["unit"]["id"] for r in rows], "tier": [r.get("tier", tier) for r in rows],
                              "prompt_token_ids": [r["prompt_token_ids"] for r in rows],
                              "max_tokens": [r["max_tokens"] for r in rows]})
            return job.budget.admit(batch, {r["unit"]["id"]: r["unit"]["tenant"] for r in rows})

        worker = TierWorker(c, tier, self.job_id, self.queue, job.pool, job.worker, self.load,
                            lambda unit: self.safe(self.advance, unit.partition), lambda: self.more_may_come(tier),
                            lambda unit, error: self.fail(unit.partition, f"generation: {error}"),
                            self.store, admit, cache_put, job.cache_status(), release)
        return worker.drain()

    # -- what the engines' held time comes to, per partition ------------------------------------------
    def stale(self):
        """A session is stale (its worker died) when it is still open and its renewal is over a lease old, or
        its worker is provably gone."""
        lease, t = self.config.state.lease_seconds, self.job.state.db_now()
        return lambda s: s.status != "closed" and ((t - s.heartbeat_at).total_seconds() > lease
                                                   or worker_is_gone(s.worker))

    def wait_for_engines(self, still_held) -> None:
        """Wait while another worker's engine session of this job is open: the start-up and idle time a
        commit shares into its ledger must be final. `still_held()`: False once this commit's claim is lost."""
        announced = False
        while still_held():
            stale = self.stale()
            live = [s for s in self.queue.sessions(self.job_id) if s.status != "closed" and not stale(s)]
            if not live:
                return
            if not announced:
                log.info("commit waits for %d engine sessions of this job to close (%s)", len(live),
                         ", ".join(s.session_id for s in live))
                announced = True
            time.sleep(self.config.state.wait_seconds)

    def shares(self) -> dict:
        """Per engine session of this job: how its held GPU-seconds are shared (pricing.session_shares)."""
        return session_shares(self.queue.sessions(self.job_id), self.queue.recorded_by_session(self.job_id),
                              self.stale())

    def charges(self, partition: str, shares: dict) -> list[dict]:
        """This partition's GPU time no output carries: its failed attempts, with their overhead share, and
        its share of the work lost with dead workers (pro rata to the requests of units taken over from them)."""
        out = [{**ch, "busy_gpu_seconds": ch["gpu_seconds"],
                "overhead_gpu_seconds": ch["gpu_seconds"] * shares[ch["session_id"]].overhead_ratio
                if ch["session_id"] in shares else 0.0}
               for ch in self.queue.charges(self.job_id, partition)]
        units = self.queue.units(self.job_id)
        for sid, share in shares.items():
            if share.lost <= 0:
                continue
            # Whose work died with it: units taken over from it, else its own, else (it claimed none) every unit.
            touched = [u for u in units if u.lost_session == sid] or [u for u in units if u.session_id == sid] or units
            total = sum(u.requests for u in touched)
            mine = sum(u.requests for u in touched if u.partition == partition)
            if total and mine:
                out.append({"partition": partition, "session_id": sid, "kind": "lost", "id": None, "tenant": None,
                            "tier": next(s.tier for s in self.queue.sessions(self.job_id) if s.session_id == sid),
                            "busy_gpu_seconds": share.lost * mine / total,
                            "overhead_gpu_seconds": 0.0})
        return out

    @staticmethod
    def overhead_ratio(shares: dict):
        def ratio(item: dict) -> float:
            share = shares.get(item.get("session_id"))
            return share.overhead_ratio if share is not None else 0.0
        return ratio
