"""A partition run: one partition from claim to commit.

  claim -> heartbeat -> read staged records -> look up paid items -> generation rounds
        -> assemble outputs, ledger, quarantine -> check the accounting -> write -> index -> commit

The partition is committed (status `succeeded` with its counts) only after its files are written
and only while this worker still holds its lease. A budget cap defers it; any other error fails it
alone (its paid items stay in the catalog, so the next attempt pays nothing again), except errors
that would fail every partition (the engine or the catalog gone), which stop the job.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
from sqlalchemy.exc import OperationalError

from pipeline.dedup.index import generated_segments
from pipeline.generate.engine import EngineDeadError, EngineStartError
from pipeline.generate.followup import related_keys
from pipeline.generate.recorder import CallRecorder
from pipeline.generate.reuse import effective_keys, needed_keys
from pipeline.generate.rounds import BudgetReached, Generated, GenerationRounds, unit_requests
from pipeline.generate.shadow import verify_shadows
from pipeline.job import faults
from pipeline.job.errors import JobError
from pipeline.job.manifest import partition_counts
from pipeline.output.commit import discard, new_commit_id, publish, write_files
from pipeline.output.write import assemble_results
from pipeline.stores import storage
from pipeline.stores.catalog import Heartbeat, StateError, now

if TYPE_CHECKING:
    from pipeline.job.lifecycle import Job

log = logging.getLogger(__name__)


class LeaseLost(RuntimeError):
    """This worker's claim on a partition was taken over; what it made is not committed."""


JOB_FATAL = (EngineDeadError, EngineStartError, StateError, OperationalError)  # no point trying further partitions


class PartitionRun:
    def __init__(self, job: Job, partition: str):
        self.job, self.partition = job, partition
        self.config, self.state, self.job_id = job.config, job.state, job.job_id
        self.epoch: int | None = None  # the claim's fencing token

    def claim(self, force: bool = False) -> bool:
        self.epoch = self.state.claim(self.job_id, self.partition, self.job.worker, self.config.state.lease_seconds,
                                      force=force)
        return self.epoch is not None

    def finish(self, status: str, **fields) -> bool:
        """Set this claim's end state; False when the claim was fenced out (another worker took over)."""
        return self.state.finish_partition(self.job_id, self.partition, self.job.worker, self.epoch, status, **fields)

    def run(self) -> None:
        """Run the claimed partition to its end state: succeeded, deferred or failed."""
        job, partition = self.job, self.partition
        try:
            with Heartbeat(self.state, self.job_id, partition, job.worker, self.config.state.lease_seconds,
                           self.epoch) as beat:
                self.generate_and_commit(beat)
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

    def generate_and_commit(self, beat: Heartbeat) -> None:
        job, partition, started = self.job, self.partition, time.perf_counter()
        records = job.staging.read(partition, "records")
        quarantine = job.staging.read(partition, "quarantine")
        faults.checkpoint("before_generate", self.job_id, partition)
        job.progress.advance(quarantined=quarantine.num_rows)

        records, items, units, requests, too_long = self.prepared_requests(records) or self.unpaid_requests(records)
        copies = Counter(effective_keys(records))
        job.progress.advance(done=sum(copies[k] for k in items), reused=sum(copies[k] for k in items))
        recorder = CallRecorder(self.config, self.job_id, partition, self.state, job.cache, job.cache_status(),
                                job.budget.spent, job.progress, copies)
        generated = GenerationRounds(self.config, job.pool, job.lookup, recorder, job.budget).run(
            records, units, requests, too_long)
        job.progress.advance(quarantined=sum(copies[k] for k in generated.failed))
        self.commit(beat, records, quarantine, generated, started)

    def unpaid_requests(self, records) -> tuple:
        """(records resolved, items at hand by key, generation units, their engine requests, too_long)."""
        records, items, units = self.job.lookup.unpaid(self.partition, records)
        requests, too_long = unit_requests(units, self.config, self.job.pool)
        return records, items, units, requests, too_long

    def prepare(self) -> dict:
        """CPU work ahead of the GPU: look up paid and cached items, render and tokenise, stash the requests."""
        partition = self.partition
        records = self.job.staging.read(partition, "records")
        _, items, units, requests, too_long = self.unpaid_requests(records)
        self.job.staging.write_prepared(partition, self.config.fingerprint(),
                                    {"units": units, "requests": requests, "too_long": too_long})
        return {"partition": partition, "records": records.num_rows, "already_paid": len(items),
                "to_generate": requests.num_rows, "too_long": too_long.num_rows}

    def prepared_requests(self, records) -> tuple | None:
        """Like unpaid_requests, from prepared requests minus anything paid since; None when none are prepared."""
        prepared = self.job.staging.read_prepared(self.partition, self.config.fingerprint())
        if prepared is None:
            return None
        records, items, units = self.job.lookup.still_unpaid(records, prepared["units"])
        keep = lambda t: t.filter(pc.is_in(t["id"], units["id"]))  # noqa: E731
        return records, items, units, keep(prepared["requests"]), keep(prepared["too_long"])

    def commit(self, beat: Heartbeat, records: pa.Table, quarantine: pa.Table, generated: Generated,
               started: float) -> None:
        """Assemble the partition's rows, check that every record is accounted for, write the files,
        commit in the catalog (fenced by the claim's epoch), then publish the commit (output/commit.py)."""
        c, job, partition = self.config, self.job, self.partition
        items = generated.items
        # The last round read every needed key after its engine calls; only follow-ups found in the
        # cache after that read are not at hand yet.
        items |= job.lookup.stored([k for k in related_keys(needed_keys(records), items, c) if k not in items])
        outputs, ledger, late_quarantine = assemble_results(records, items, generated.failed, c, self.job_id, now())
        quarantine = pa.concat_tables([quarantine, late_quarantine])
        expected = job.state_partition(partition).records
        if outputs.num_rows + quarantine.num_rows != expected:  # the invariant every row depends on
            raise JobError(f"partition {partition}: accounting mismatch: {outputs.num_rows} outputs + "
                           f"{quarantine.num_rows} quarantined != {expected} records; nothing was committed")
        faults.checkpoint("before_commit", self.job_id, partition)
        if beat.lost:
            raise LeaseLost(f"partition {partition}: lease lost to another worker; not committing")
        commit = new_commit_id(self.epoch)
        files = write_files(job.out, self.job_id, partition, {"outputs": outputs, "ledger": ledger,
                                                              "quarantine": quarantine}, c.output.compression, commit)
        if c.cache.enabled and not job.cache.bypassed:
            for scope, recipe, blob in generated_segments(records, items, c.dedup.boilerplate_patterns):
                job.cache.put_segment(scope, recipe, f"{self.job_id}/{partition}", blob)
        verification = verify_shadows(records, items, job.lookup.reference_outputs(records, items),
                                      c.dedup.shadow_min_f1)
        counts = partition_counts(outputs, ledger, quarantine, generated.completions, generated.calls, c)
        counts["tokens"]["shareable_prompt_tokens"] = generated.shareable_tokens
        counts = {**counts, "verification": verification, "seconds": round(time.perf_counter() - started, 3),
                  "commit": {"id": commit, "files": files}}
        if not self.finish("succeeded", counts=counts):
            discard(job.out, files)
            raise LeaseLost(f"partition {partition}: lease lost to another worker (claim epoch {self.epoch} "
                            f"superseded); its commit was fenced out and wrote nothing visible")
        try:
            faults.checkpoint("before_publish", self.job_id, partition)
            publish(job.out, self.job_id, partition, commit, files)
        except Exception as e:  # committed in the catalog: never downgrade it; the record follows
            log.warning("partition %s committed, but its commit record could not be written yet (%s); "
                        "the job's next manifest write publishes it", partition, e)
