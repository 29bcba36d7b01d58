"""The commit step: one generated partition's CPU work after the GPU, committed whole or not at all.

  commit[p]:  claim (fencing token) -> heartbeat -> wait for the job's engine sessions to close ->
              assemble outputs, ledger with every engine-second shared in, quarantine -> check the
              accounting -> stage the tables' files -> commit in the catalog (fenced) -> one Delta
              transaction per table (output/tables.py)

The partition is committed (status `succeeded` with its counts) only after its files are staged
and only while this worker still holds its lease. A budget cap defers it; any other error fails it
alone (its paid items stay in the catalog, so the next attempt pays nothing again), except errors
that would fail every partition (the engine or the catalog gone), which stop the job. A partition
still generating is not this step's to finish: `commit_ready` says so, and the caller drains.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal

import pyarrow as pa
from sqlalchemy.exc import OperationalError

from pipeline.config import TokenmillConfig
from pipeline.dedup.index import generated_segments
from pipeline.errors import JobError
from pipeline.generate import metrics
from pipeline.generate.engine_api import EngineDeadError, EngineStartError
from pipeline.generate.engine_time import EngineTime
from pipeline.generate.followup import final_output, related_keys
from pipeline.generate.lookup import ItemLookup
from pipeline.generate.partition_waves import PartitionWaves
from pipeline.generate.reuse import cache_value, effective_keys, needed_keys
from pipeline.generate.shadow import verify_shadows
from pipeline.generate.waves import partition_keys
from pipeline.job import faults
from pipeline.job.budget import BudgetGuard
from pipeline.job.drain import release_gone
from pipeline.job.manifest import partition_counts
from pipeline.job.progress import Progress
from pipeline.output.manifest import PartitionCounts
from pipeline.output.tables import discard, new_commit_id, publish, stage
from pipeline.output.write import assemble_results, charge_rows
from pipeline.stores import storage
from pipeline.stores.cache import ResilientStore
from pipeline.stores.catalog import Partition, StateError, StateStore, now, utc
from pipeline.stores.lease import Renewal, worker_is_gone
from pipeline.stores.staging import StagingArea
from pipeline.stores.units import UnitQueue

log = logging.getLogger(__name__)
RUNNABLE = ("pending", "failed", "running", "deferred")  # partition statuses a run tries


class BudgetReached(RuntimeError):
    """Work units of a partition were not run at a budget cap; it is deferred, not failed."""


class LeaseLost(RuntimeError):
    """This worker's claim on a partition was taken over; what it made is not committed."""


# What commit_ready leaves to its caller: `drain` (partitions wait on work units this process can run), or `done`.
AfterCommits = Literal["drain", "done"]
JOB_FATAL = (EngineDeadError, EngineStartError, StateError, OperationalError)  # no point trying further partitions


@dataclass(frozen=True)
class Committing:
    """What the commit step uses, and only that (built by the job's context, `JobContext.committing`)."""

    config: TokenmillConfig
    job_id: str
    worker: str  # whose claims
    state: StateStore  # the claims, the partitions' rows, their commits
    queue: UnitQueue  # the units (what a cap held back; a gone worker's)
    budget: BudgetGuard  # why a cap held them back
    waves: PartitionWaves  # the partitions' generation: still going, its last wave, stopping it
    engine_time: EngineTime  # the engine sessions' held time shared in
    staging: StagingArea  # the partitions' records and quarantine as planned
    lookup: ItemLookup  # their paid items
    out: storage.Location  # where the tables' files are staged and published
    cache: ResilientStore | None  # None: generations are not cached (off, or unreachable)
    progress: Progress


@dataclass
class PartitionCommit:
    """One claim on a partition, run to its end state: the commit step's collaborators (`step`) and the claim's
    partition and epoch."""

    partition: str
    step: Committing
    epoch: int | None = None  # the claim's fencing token

    @classmethod
    def of(cls, c: Committing, partition: str) -> PartitionCommit:
        return cls(partition, c)

    def claim(self, force: bool = False) -> bool:
        self.epoch = self.step.state.claim(
            self.step.job_id, self.partition, self.step.worker, self.step.config.state.lease_seconds, force=force
        )
        return self.epoch is not None

    def finish(self, status: str, **fields) -> bool:
        """Set this claim's end state; False when the claim was fenced out (another worker took over)."""
        return self.step.state.finish_partition(
            self.step.job_id, self.partition, self.step.worker, self.epoch, status, **fields
        )

    def row(self) -> Partition:
        return self.step.state.partition(self.step.job_id, self.partition)

    def run_to_end_state(self, step=None) -> None:
        """Run the claimed partition to its end state (succeeded, deferred or failed), then report to the metrics.
        `step(beat)`: what commits it (default: generate_and_commit)."""
        metrics.begin(self.step.config, self.step.job_id)
        try:
            self.run_claimed(step or self.generate_and_commit)
        finally:
            self.report()

    def report(self) -> None:
        """The job's state after this commit (its totals, budget left, units still claimable), to the metrics and
        the Pushgateway. Never raises: the partition's end state is what counts."""
        metrics.report_job(self.step)  # a metrics.JobParts: its config, job id, catalog, queue and budget

    def run_claimed(self, step) -> None:
        partition = self.partition
        try:
            lease = self.step.config.state.lease_seconds
            with Renewal(
                lambda: self.step.state.heartbeat(self.step.job_id, partition, self.step.worker, lease, self.epoch),
                lease,
                f"lease-{partition}",
            ) as beat:
                step(beat)
        except BudgetReached as e:
            log.warning("partition %s deferred: %s", partition, e)
            self.finish("deferred", error=str(e))
            return
        except Exception as e:
            reason = str(e) if isinstance(e, (storage.StorageError, StateError)) else f"{type(e).__name__}: {e}"
            log.error("partition %s failed: %s", partition, reason)
            try:
                self.finish("failed", error=reason[:2000])
            except Exception:
                pass  # the lease expires and the partition is claimable again
            if isinstance(e, OperationalError):
                raise
            if isinstance(e, JOB_FATAL):
                raise JobError(f"partition {partition}: {reason}".splitlines()[0]) from e
            return

    def generate_and_commit(self, beat: Renewal) -> None:
        """Commit a generated partition: its generation must be over (a wave derived nothing)."""
        partition, started = self.partition, time.perf_counter()
        self.step.waves.advance(partition)  # the last wave may have come in through another partition's unit
        p = self.row()
        if p.generation != "generated":
            units = self.step.queue.units(self.step.job_id, partition)
            # Its own units, or those of another partition it waits on: any unit of the job a cap held back.
            deferred = [u for u in self.step.queue.units(self.step.job_id) if u.status == "deferred"]
            if deferred:
                raise BudgetReached(
                    f"budget reached before {len(deferred)} work units of this job "
                    f"({sum(u.requests for u in deferred)} requests) could run: {self.step.budget.reason or 'a cap'}; "
                    "what was generated is kept and not paid again"
                )
            waiting = [u for u in units if u.status in ("pending", "leased")]
            raise JobError(
                f"partition {partition} is not generated yet ({p.generation or 'not prepared'}; "
                f"{len(waiting)} work units unfinished): run its tier workers, then commit again"
                if p.generation != "failed"
                else f"partition {partition}: {p.last_error}"
            )
        self.step.engine_time.wait_for_engines(lambda: not beat.lost)
        records = self.step.staging.records(partition)
        quarantine = self.step.staging.quarantine(partition)
        self.commit(beat, records, quarantine, *self.generated(p, records), started)

    def generated(self, p, records: pa.Table) -> tuple[dict[str, dict], dict[str, tuple], int]:
        """What the partition's generation has made, as its current wave's state says: (its items by key, keys
        given up on with why, prompt tokens its requests could share)."""
        state = self.step.waves.state_of(p)
        items = self.step.lookup.stored(partition_keys(records, state))
        return items, {k: tuple(v) for k, v in state.failed.items()}, state.shareable

    def commit_stopped(self, beat: Renewal, reason: str, detail: str) -> None:
        """Commit a partition of a job stopped for good (its batch cancelled or expired; none of its workers
        runs) with what it has, generating nothing more: an output for every record whose answer is paid for,
        or in the cache of earlier jobs (free), every other record quarantined as `reason`. What was paid for a
        record left unanswered (a long document's chunk summaries) is in the ledger as `unfinished` rows."""
        partition, started = self.partition, time.perf_counter()
        prepared = self.row().generation in ("generating", "generated")
        if prepared:
            self.step.waves.stop(partition)
        self.step.engine_time.wait_for_engines(lambda: not beat.lost)  # a killed worker's session: gone at once
        records, quarantine = self.step.staging.records(partition), self.step.staging.quarantine(partition)
        if prepared:
            items, failed, shareable = self.generated(self.row(), records)
        else:  # never prepared (or its generation failed): what this job's partitions or the cache hold
            records, items, _ = self.step.lookup.unpaid(partition, records)
            failed, shareable = {}, 0
        self.commit(beat, records, quarantine, items, failed, shareable, started, stopped=(reason, detail))

    def cache_full_costs(self, records: pa.Table, items: dict[str, dict], ratio) -> None:
        """Cache this partition's generations again at what the ledger says they cost, start-up and
        idle share included (the worker cached them at their busy cost, before that share was known):
        a later job reusing one records it as saved."""
        scope_of = dict(zip(records["id"].to_pylist(), records["scope"].to_pylist()))
        by_scope: dict[str, dict] = {}
        for key, item in items.items():
            if (
                item.get("origin") is None
                and item.get("partition") == self.partition
                and item["id"] in scope_of
                and ratio(item) > 0
                and item["tier"] in self.step.config.tiers
            ):
                usd = (
                    item["gpu_seconds"]
                    * (1 + ratio(item))
                    * self.step.config.tiers[item["tier"]].price_per_gpu_hour
                    / 3600
                )
                by_scope.setdefault(scope_of[item["id"]], {})[key] = cache_value(item, self.step.job_id, usd)
        for scope, values in by_scope.items():
            self.step.cache.put_many(scope, values)

    def commit(
        self,
        beat: Renewal,
        records: pa.Table,
        quarantine: pa.Table,
        items: dict[str, dict],
        failed: dict[str, tuple[str, str, str]],
        shareable: int,
        started: float,
        stopped: tuple[str, str] | None = None,
    ) -> None:
        """Assemble the partition's rows, check that every record is accounted for, stage the tables' files,
        commit in the catalog (fenced by the claim's epoch), then publish them in the tables (output/tables.py).
        `stopped` (reason, detail): the job generates no more, and a record with no answer yet is quarantined so.
        What was paid for a record left without an answer and without a ledger row of its own (a long
        document's chunk summaries when a chunk failed, or when its job stopped before the reduce) is
        charged as `unfinished` rows, so the ledger holds every paid generation."""
        c, partition = self.step.config, self.partition
        items |= self.step.lookup.stored([k for k in related_keys(needed_keys(records), items, c) if k not in items])
        if stopped is not None:
            failed = failed | unanswered_keys(records, items, failed, c, *stopped)
        shares = self.step.engine_time.shares()
        ratio = self.step.engine_time.overhead_ratio(shares)
        outputs, ledger, late_quarantine = assemble_results(records, items, failed, c, self.step.job_id, now(), ratio)
        unfinished = []  # (a partition with nothing quarantined here, the common case, looks nothing up)
        if late_quarantine.num_rows:
            unanswered = set(late_quarantine["id"].to_pylist()) - set(ledger["id"].to_pylist())
            unfinished = self.step.state.generated_for(self.step.job_id, sorted(unanswered)) if unanswered else []
        charges = self.step.engine_time.charges(partition, shares) + unfinished_charges(partition, unfinished, ratio)
        ledger = pa.concat_tables([ledger, charge_rows(charges, c, self.step.job_id, now())])
        quarantine = pa.concat_tables([quarantine, late_quarantine])
        expected = self.row().records
        if outputs.num_rows + quarantine.num_rows != expected:  # the invariant every row depends on
            raise JobError(
                f"partition {partition}: accounting mismatch: {outputs.num_rows} outputs + "
                f"{quarantine.num_rows} quarantined != {expected} records; nothing was committed"
            )
        faults.checkpoint("before_commit", self.step.job_id, partition)
        if beat.lost:
            raise LeaseLost(f"partition {partition}: lease lost to another worker; not committing")
        commit = new_commit_id(self.epoch)
        files = stage(
            self.step.out,
            self.step.job_id,
            partition,
            {"outputs": outputs, "ledger": ledger, "quarantine": quarantine},
            c.output.compression,
            commit,
        )
        if self.step.cache is not None:
            for scope, recipe, blob in generated_segments(records, items, c.dedup.boilerplate_patterns):
                self.step.cache.put_segment(scope, recipe, f"{self.step.job_id}/{partition}", blob)
            self.cache_full_costs(records, items, ratio)
        verification = verify_shadows(
            records, items, self.step.lookup.reference_outputs(records, items), c.dedup.shadow_min_f1
        )
        counts = partition_counts(outputs, ledger, quarantine, items, c)
        counts.tokens.shareable_prompt_tokens = shareable
        counts.verification = verification
        counts.seconds = round(time.perf_counter() - started, 3)
        figures = metrics.partition_figures(ledger, quarantine)  # the job's running totals add these up
        if not self.finish("succeeded", counts=counts.as_json(), commit_id=commit, commit_files=files, figures=figures):
            discard(self.step.out, files)
            raise LeaseLost(
                f"partition {partition}: lease lost to another worker (claim epoch {self.epoch} "
                f"superseded); its commit was fenced out and wrote nothing visible"
            )
        self.publish_and_count(files, outputs, ledger, quarantine)

    def publish_and_count(self, files: dict, outputs: pa.Table, ledger: pa.Table, quarantine: pa.Table) -> None:
        """After the catalog committed the partition: publish its staged files in the tables, then count it in
        progress and metrics. Neither ever downgrades the commit: a table not written yet is published by the
        job's next manifest write."""
        partition = self.partition
        try:
            faults.checkpoint("before_publish", self.step.job_id, partition)
            if not publish(self.step.out, self.step.job_id, partition, self.epoch, files):
                log.warning("partition %s: a newer claim published first; this claim's rows stay invisible", partition)
        except Exception as e:  # committed in the catalog: never downgrade it; the tables follow
            log.warning(
                "partition %s committed, but its tables could not be written yet (%s); "
                "the job's next manifest write publishes it",
                partition,
                e,
            )
        try:  # counted once the catalog committed, whether or not the tables are written yet
            self.step.progress.advance(done=outputs.num_rows, quarantined=quarantine.num_rows, partition=partition)
            metrics.committed(ledger, quarantine)
        except Exception as e:  # telemetry never downgrades a committed partition
            log.warning("partition %s committed; its progress and metrics were not counted: %s", partition, e)


def unanswered_keys(
    records: pa.Table, items: dict[str, dict], failed: dict, config, reason: str, detail: str
) -> dict[str, tuple[str, str, str]]:
    """The keys of `records` with no answer among `items` and no failure of their own, each to be quarantined
    as `reason` (with the id of the first record that asks for it, as `failed` names the record tried)."""
    out: dict[str, tuple[str, str, str]] = {}
    for id_, key in zip(records["id"].to_pylist(), effective_keys(records)):
        if key not in failed and key not in out and final_output(key, items, config).item is None:
            out[key] = (reason, detail, id_)
    return out


def unfinished_charges(partition: str, items: list[dict], ratio) -> list[dict]:
    """Charges (output/write.py charge_rows) for items paid for records a stopped job left unanswered, each
    with its engine's start-up and idle share per busy second (`ratio`), as any generation carries."""
    return [
        {
            "partition": partition,
            "id": item["id"],
            "tenant": item["tenant"],
            "tier": item["tier"],
            "kind": "unfinished",
            "busy_gpu_seconds": item["gpu_seconds"],
            "overhead_gpu_seconds": item["gpu_seconds"] * ratio(item),
        }
        for item in items
    ]


def commit_ready(committing: Committing, forced: list[str], tried: set[str], announced: set[tuple]) -> AfterCommits:
    """Commit every partition left that is generated, waiting for (or taking over from) other workers
    holding one. `drain` when partitions wait on work units this process can run now (a dead worker's, or
    escalations): drain, then call again with the same `tried` and `announced`. `done` when none is left.

    `tried`: partitions this run has committed or given up on; `announced`: holders already said to be
    waited for (partition, holder, lease end)."""
    while True:
        todo = [
            p
            for p in committing.state.partitions(committing.job_id)
            if p.partition not in tried and (p.status in RUNNABLE or p.partition in forced)
        ]
        if not todo:
            return "done"
        claimed_any, generating = False, []
        for p in todo:
            if p.generation == "failed":  # failed before the GPU (its prepare): it says why; prepare it again
                tried.add(p.partition)
                continue
            if p.generation == "generating" and committing.waves.still_generating(p.partition):
                generating.append(p)
                continue
            attempt = PartitionCommit.of(committing, p.partition)
            if attempt.claim(force=p.partition in forced):
                claimed_any = True
                tried.add(p.partition)
                attempt.run_to_end_state()
        if claimed_any:
            continue
        if generating and (
            release_gone(committing.queue, committing.job_id) or committing.queue.claimable(committing.job_id)
        ):
            return "drain"
        if all(p.status != "running" for p in todo) and not generating:
            return "done"  # only failed partitions this run already tried, or none left
        if not take_over_gone_holders(committing.state, committing.job_id, todo, announced):
            time.sleep(committing.config.state.wait_seconds)  # others hold them; their leases tell


def take_over_gone_holders(state: StateStore, job_id: str, held: list, announced: set[tuple]) -> bool:
    """Release the claims of holders provably gone (True: claim again at once); say who holds the rest.

    After a crash a rerun would otherwise wait out the dead worker's whole lease with nothing on screen."""
    released = False
    for p in held:
        if p.status != "running":
            continue
        if worker_is_gone(p.worker) and state.release_gone_holder(job_id, p.partition, p.worker):
            log.warning(
                "partition %s: its holder %s is gone (no such process on this host); taking it over "
                "now instead of at %s",
                p.partition,
                p.worker,
                utc(p.lease_expires_at),
            )
            released = True
        elif (p.partition, p.worker, p.lease_expires_at) not in announced:
            announced.add((p.partition, p.worker, p.lease_expires_at))
            # Info, not a warning: waiting is normal with several workers; said again as the lease moves.
            log.info(
                "partition %s waits: held by worker %s (last heartbeat %s) until its lease ends at %s "
                "(database clock), unless it finishes first",
                p.partition,
                p.worker,
                utc(p.heartbeat_at),
                utc(p.lease_expires_at),
            )
    return released


def commit_stopped(committing: Committing, reason: str, detail: str) -> list[str]:
    """Commit every partition of a job stopped for good with what it has (PartitionCommit.commit_stopped): what
    was paid for is returned, not only kept. The caller makes sure none of the job's workers runs (their claims
    are taken over). Returns the partitions that could not be committed (each says why in the catalog)."""
    left = []
    for p in committing.state.partitions(committing.job_id):
        if p.status == "succeeded":
            continue
        if p.status == "running" and worker_is_gone(p.worker):  # a killed worker's claim: taken over at once
            committing.state.release_gone_holder(committing.job_id, p.partition, p.worker)
        attempt = PartitionCommit.of(committing, p.partition)
        if attempt.claim():  # (one still held by another host's worker: its lease ends, the caller tries again)
            attempt.run_to_end_state(lambda beat, attempt=attempt: attempt.commit_stopped(beat, reason, detail))
        if committing.state.partition(committing.job_id, p.partition).status != "succeeded":
            left.append(p.partition)
    return left


def commit_partition(committing: Committing, partition: str) -> dict:
    """Commit one generated partition (an orchestrator's task): a no-op when it is already committed."""
    p = committing.state.partition(committing.job_id, partition)
    if p is None:
        raise JobError(f"job {committing.job_id} has no partition {partition}")
    if p.generation == "failed" and p.status != "succeeded":
        raise JobError(f"partition {partition}: {p.last_error}")
    if p.status != "succeeded":
        attempt = PartitionCommit.of(committing, partition)
        if not attempt.claim() and not (
            worker_is_gone(p.worker)
            and committing.state.release_gone_holder(committing.job_id, partition, p.worker)
            and attempt.claim()
        ):
            raise JobError(
                f"partition {partition} is held by worker {p.worker} until its lease ends at "
                f"{utc(p.lease_expires_at)} (database clock); retry later"
            )
        attempt.run_to_end_state()
    p = committing.state.partition(committing.job_id, partition)
    if p.status != "succeeded":
        raise JobError(f"partition {partition}: {p.status}: {p.last_error}", budget=p.status == "deferred")
    counts = PartitionCounts.parse(p.counts)
    return {"partition": partition, "status": p.status, "attempts": p.attempts, **(counts.as_json() if counts else {})}
