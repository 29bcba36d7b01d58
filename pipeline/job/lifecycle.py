"""The job: plan it once, then run its partitions, each committed whole, any number of times.

  plan (once per job):   read -> validate -> dedup -> route -> item keys -> staged per partition
  each partition:        claim -> reuse paid-for items -> plan requests -> infer -> write -> commit
  finish:                every partition succeeded -> manifest; otherwise the job fails, naming them

`run_job` is the one entry point the CLI and the DAGs call. It owns no stage logic: it wires the
stages, keeps the accounting invariant, and records progress in the state catalog so that a rerun
(or a second worker) picks up exactly what is not done and pays for nothing twice.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from sqlalchemy.exc import OperationalError

from pipeline.dedup import guards

from pipeline.stores import storage
from pipeline.stores.cache import ResilientStore, open_store, pack_segment
from pipeline.config import TokenmillConfig
from pipeline.generate.pricing import allocate_gpu_seconds, baseline_gpu_seconds
from pipeline.keys import clean_text, compile_boilerplate
from pipeline.job.estimate import budget_problems, tier_rates, with_estimates
from pipeline.generate.followup import (
    chunk_keys,
    chunk_units,
    next_attempt,
    reduce_unit,
    related_keys,
    split_for_context,
)
from pipeline.generate.engine import CALLS, EngineDeadError, EnginePool, EngineStartError, run_inference
from pipeline.job.manifest import build_manifest, partition_counts
from pipeline.generate.requests import plan_requests
from pipeline.job.stages import prepare_records
from pipeline.job.progress import Progress
from pipeline.generate.reuse import (
    ITEM_COLUMNS,
    cache_value,
    cached_items,
    effective_keys,
    generation_units,
    needed_keys,
    reference_keys,
    resolve,
    verify_shadows,
)
from pipeline.stores.catalog import Heartbeat, StateError, StateStore, default_worker, now
from pipeline.output.write import assemble_results, write_manifest, write_partition

log = logging.getLogger(__name__)
JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
JOB_FATAL = (EngineDeadError, EngineStartError, StateError, OperationalError)  # no point trying further partitions


class JobError(RuntimeError):
    """A job that could not finish; the message is the one-line reason. `budget`: stopped by a budget cap."""

    def __init__(self, message: str, budget: bool = False):
        super().__init__(message)
        self.budget = budget


class BudgetReached(RuntimeError):
    """A partition stopped admitting engine calls at a budget cap; it is deferred, not failed."""


@dataclass
class JobResult:
    job_id: str
    manifest: dict


def new_job_id() -> str:
    return f"job-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def staging_path(root: storage.Location, job_id: str, partition: str, name: str) -> str:
    return root.join("_staging", f"job={job_id}", f"partition={partition}", name)


def run_job(config: TokenmillConfig, job_id: str | None = None, pool: EnginePool | None = None,
            progress: Progress | None = None, partitions: list[str] | None = None,
            worker: str | None = None) -> JobResult:
    """Run (or continue) a job until every partition is committed. Raises JobError with a one-line reason.

    `partitions` names partitions to run again even if they succeeded (a no-op that costs nothing,
    since their items are already paid for); otherwise pending, failed and abandoned ones run.
    """
    job_id = job_id or new_job_id()
    if not JOB_ID.match(job_id):
        raise JobError(f"job id {job_id!r} must be 1-128 characters of letters, digits, '.', '_' or '-'")
    try:
        state = StateStore(config.state.url)
        return Job(config, job_id, state, pool or EnginePool(config.tiers), progress or Progress("off"),
                    worker or default_worker()).run(partitions or [])
    except JobError:
        raise
    except (storage.StorageError, StateError) as e:
        raise JobError(str(e)) from e
    except OperationalError as e:
        # Leases make this safe: what this worker held is claimable again once its lease runs out.
        raise JobError(f"state database {StateStore.safe_url(config.state.url)} unreachable: "
                       f"{str(e.orig).splitlines()[0] if e.orig else e}") from e
    except Exception as e:
        raise JobError(f"{type(e).__name__}: {e}") from e


class Job:
    def __init__(self, config: TokenmillConfig, job_id: str, state: StateStore, pool: EnginePool,
                 progress: Progress, worker: str):
        self.config, self.job_id, self.state, self.pool, self.progress, self.worker = \
            config, job_id, state, pool, progress, worker
        self.out = storage.resolve(config.output.uri, config.storage)
        self._rates = None
        self._cache = None
        self.spent: dict[str, float] = {}  # USD paid so far in this job, per tenant
        self.budget_reason = ""

    # -- plan -------------------------------------------------------------------------------------
    def ensure_planned(self) -> None:
        c = self.config
        if self.state.claim_planning(self.job_id, c.fingerprint(), c.input.uri, c.output.uri):
            return self.plan()
        while True:
            job = self.state.job(self.job_id)
            if job.status not in ("planning", "plan_failed"):
                break
            if self.state.reclaim_planning(self.job_id, now() - timedelta(seconds=c.state.lease_seconds)):
                return self.plan()  # the last planning failed or its planner died
            time.sleep(c.state.wait_seconds)  # another worker is planning it now
        if job.output_uri != c.output.uri:
            raise JobError(f"job {self.job_id} writes to {job.output_uri}, not {c.output.uri}; use that output")
        if job.config_fingerprint != c.fingerprint():
            log.warning("job %s: config changed since it was planned; items whose request changed are generated again",
                        self.job_id)

    def plan(self) -> None:
        try:
            self._plan()
        except Exception as e:
            self.state.set_job(self.job_id, status="plan_failed", error=str(e)[:2000])
            raise

    def _plan(self) -> None:
        """Read, validate, dedup and route the whole job; stage each partition's records; register partitions."""
        started = time.perf_counter()
        prepared = prepare_records(self.config, self.job_id, cache=self.cache)
        raw, records, quarantine, skipped = prepared.raw, prepared.records, prepared.quarantine, prepared.skipped
        partitions: dict[str, dict] = {}
        for part, file in zip(raw["partition"].to_pylist(), raw["file"].to_pylist()):
            partitions.setdefault(part, {"file": file, "records": 0})["records"] += 1
        for part in partitions:
            for name, table in (("records.parquet", records), ("quarantine.parquet", quarantine)):
                rows = table.filter(pc.equal(table["partition"], part))
                storage.write_parquet_atomic(self.out, staging_path(self.out, self.job_id, part, name), rows, "zstd")
        self.state.add_partitions(self.job_id, partitions)
        self.state.set_job(self.job_id, status="planned", counts={"records": raw.num_rows, "plan": {
            "records": raw.num_rows, "partitions": len(partitions), "skipped_files": skipped,
            "dedup": prepared.dedup.as_dict(), "plan_seconds": round(time.perf_counter() - started, 3)}})
        write_manifest(self.out, self.job_id, self.manifest(partial=True))

    # -- run ----------------------------------------------------------------------------------------
    def run(self, forced: list[str]) -> JobResult:
        self.ensure_planned()
        known = {p.partition for p in self.state.partitions(self.job_id)}
        unknown = sorted(set(forced) - known)
        if unknown:
            raise JobError(f"job {self.job_id} has no partition {', '.join(unknown)}")
        to_run = [p for p in self.state.partitions(self.job_id) if p.status != "succeeded" or p.partition in forced]
        if self.config.budget.active:
            self.check_budget([p.partition for p in to_run])
        self.state.set_job(self.job_id, status="running", started_at=now(), finished_at=None, error=None)
        total = sum(p.records for p in to_run)
        self.progress.start(total)
        tried: set[str] = set()
        try:
            while True:
                parts = self.state.partitions(self.job_id)
                todo = [p for p in parts if p.partition not in tried
                        and (p.status in ("pending", "failed", "running", "deferred") or p.partition in forced)]
                if not todo:
                    break
                claimed_any = False
                for p in todo:
                    if self.state.claim(self.job_id, p.partition, self.worker, self.config.state.lease_seconds,
                                        force=p.partition in forced):
                        claimed_any = True
                        tried.add(p.partition)
                        self.run_partition(p.partition)
                if not claimed_any:
                    if all(p.status != "running" for p in todo):
                        break  # only failed partitions this run already tried, or none left
                    time.sleep(self.config.state.wait_seconds)  # others hold them; their leases tell
        finally:
            self.progress.finish()
        return self.finish()

    def run_partition(self, partition: str) -> None:
        try:
            with Heartbeat(self.state, self.job_id, partition, self.worker, self.config.state.lease_seconds) as beat:
                counts = self.process_partition(partition, beat)
        except BudgetReached as e:
            log.warning("partition %s deferred: %s", partition, e)
            self.state.finish_partition(self.job_id, partition, self.worker, "deferred", error=str(e))
            return
        except Exception as e:
            reason = str(e) if isinstance(e, (storage.StorageError, StateError)) else f"{type(e).__name__}: {e}"
            log.error("partition %s failed: %s", partition, reason)
            try:
                self.state.finish_partition(self.job_id, partition, self.worker, "failed", error=reason[:2000])
            except Exception:
                pass  # the lease expires and the partition is claimable again
            if isinstance(e, OperationalError):
                raise
            if isinstance(e, JOB_FATAL):
                raise JobError(f"partition {partition}: {reason}".splitlines()[0]) from e
            return
        self.state.finish_partition(self.job_id, partition, self.worker, "succeeded", counts=counts)

    @property
    def cache(self) -> ResilientStore:
        if self._cache is None:
            self._cache = open_store(self.config.cache)
        return self._cache

    def cache_status(self) -> str:
        return "off" if not self.config.cache.enabled else "bypassed" if self.cache.bypassed else "miss"

    def process_partition(self, partition: str, beat: Heartbeat) -> dict:
        c, job_id, started = self.config, self.job_id, time.perf_counter()
        records = storage.read_parquet(self.out, staging_path(self.out, job_id, partition, "records.parquet"))
        quarantine = storage.read_parquet(self.out, staging_path(self.out, job_id, partition, "quarantine.parquet"))
        self.progress.advance(quarantined=quarantine.num_rows)

        records, items, units, requests, too_long = self.read_prepared(partition, records) or self.unpaid_requests(
            partition, records)
        copies = Counter(effective_keys(records))
        self.progress.advance(done=sum(copies[k] for k in items), reused=sum(copies[k] for k in items))
        status = self.cache_status()
        current: dict[str, dict] = {}  # request id -> its unit, for the round in flight
        extra: dict[str, dict] = {}    # item key -> fields stored with it (chunk counts)

        def on_call_done(call: dict, done: pa.Table) -> None:
            # Priced and stored as soon as the engine returns: a kill after this point loses no money.
            gpu = allocate_gpu_seconds(done, pa.Table.from_pylist([call], schema=CALLS), c.tiers, c.cost)
            base = baseline_gpu_seconds(done, gpu, c.largest_tier, c.cost)
            created, tier = now(), c.tiers[call["tier"]]
            new_items, by_scope = {}, {}
            for r, g, b in zip(done.to_pylist(), gpu, base):
                unit = current[r["id"]]
                key = unit["item_key"]
                new_items[key] = {**{f: r[f] for f in ("tier", "model", "summary", "prompt_tokens", "cached_prompt_tokens",
                                                        "output_tokens", "finish_reason", "mean_logprob")},
                                  "id": unit["id"].split("#")[0], "tenant": unit["tenant"], "partition": partition,
                                  "gpu_seconds": float(g), "baseline_gpu_seconds": float(b), "created_at": created,
                                  "cache_status": status, **extra.get(key, {})}
                usd = float(g) * tier.price_per_gpu_hour / 3600
                by_scope.setdefault(unit["scope"], {})[key] = cache_value(new_items[key], job_id, usd)
                self.spent[unit["tenant"]] = self.spent.get(unit["tenant"], 0.0) + usd
            self.state.store_items(job_id, new_items)
            for scope, values in by_scope.items():
                self.cache.put_many(scope, values)
            n = sum(copies[current[i]["item_key"]] for i in done["id"].to_pylist())
            self.progress.advance(done=n, reused=max(n - done.num_rows, 0),
                                  usd=call["seconds"] * tier.gpus * tier.price_per_gpu_hour / 3600)

        def admit(batch: pa.Table) -> bool:
            """Budget admission: spent so far + this call's estimate must stay under every cap."""
            if not c.budget.active:
                return True
            tenants = {i: current[i]["tenant"] for i in batch["id"].to_pylist()}
            planned = with_estimates(self.spent, batch, tenants, c, self.rates())
            problems = budget_problems(c, sum(planned.values()), planned)
            if problems:
                self.budget_reason = "; ".join(problems)
            return not problems

        failed: dict[str, tuple[str, str, str]] = {}
        known = {u["item_key"]: u for u in units.to_pylist()}  # every unit of this partition, by key
        chunked: dict[str, dict] = {}   # key -> its unit, for documents cut into chunks
        tried: set[str] = set()         # follow-up keys already attempted
        all_completions, all_calls, shareable = [], [], 0
        round_units = units.to_pylist()  # whole unit dicts: follow-ups carry flags the request table does not
        for _ in range(6):  # base; chunk maps; reduces; retries; escalations; escalations of late outputs
            current.clear()
            current.update({u["id"]: u for u in round_units})
            completions, call_table, engine_errors, deferred = run_inference(requests, self.pool, c.sampling,
                                                                             on_call_done, admit)
            all_completions.append(completions)
            all_calls.append(call_table)
            shareable += int(pc.sum(requests["shareable_tokens"]).as_py() or 0) if requests.num_rows else 0
            if deferred.num_rows:
                raise BudgetReached(f"budget reached before an engine call of this partition: {self.budget_reason}; "
                                    f"{deferred.num_rows} items deferred (what was generated is kept and not paid again)")
            for i, d in zip(engine_errors["id"].to_pylist(), engine_errors["detail"].to_pylist()):
                failed.setdefault(current[i]["item_key"], ("engine_error", d, i.split("#")[0]))
            next_units: list[dict] = []
            for i, d in zip(too_long["id"].to_pylist(), too_long["detail"].to_pylist()):
                unit = current[i]
                if unit.get("escalation") or unit.get("retry"):
                    continue  # a follow-up that does not fit: the earlier output stands
                if c.plan.long_documents == "chunk" and "#" not in unit["id"] and not unit.get("chunks"):
                    pieces = split_for_context(unit["text"], self.pool.tokenizer(unit["tier"]), c.prompt,
                                               self.pool.context_length(unit["tier"]), c.sampling.max_tokens)
                    chunked[unit["item_key"]] = {**unit, "pieces": len(pieces)}
                    next_units.extend(chunk_units(unit, pieces))
                else:
                    failed.setdefault(unit["item_key"], ("too_long", d, i.split("#")[0]))
            items = self.state.stored_items(job_id, sorted(set(needed_keys(records)) | set(known)
                                                           | {k for u in chunked.values()
                                                              for k in chunk_keys(u["item_key"], u["pieces"])}))
            for key, unit in chunked.items():
                if key in items or key in failed or any(u["item_key"] == key for u in next_units):
                    continue
                keys = chunk_keys(key, unit["pieces"])
                bad = next((failed[k] for k in keys if k in failed), None)
                if bad:
                    failed[key] = (bad[0], f"chunk of a long document: {bad[1]}", unit["id"])
                elif all(k in items for k in keys):
                    extra[key] = {"chunks": unit["pieces"]}
                    next_units.append(reduce_unit({k: v for k, v in unit.items() if k != "pieces"},
                                                  [items[k]["summary"] for k in keys]))
            next_units.extend(self.followups(partition, records, items, known, tried))
            if not next_units:
                break
            known.update({u["item_key"]: u for u in next_units if "#" not in u["id"]})
            round_units = next_units
            requests, too_long = self.plan_units(pa.Table.from_pylist(
                [{**{k: u[k] for k in ITEM_COLUMNS}, "max_tokens": u.get("max_tokens")} for u in next_units]))
        completions, call_table = pa.concat_tables(all_completions), pa.concat_tables(all_calls)
        self.progress.advance(quarantined=sum(copies[k] for k in failed))

        keys = needed_keys(records)
        # The last round read every needed key after its engine calls; only follow-ups found in the
        # cache after that read are not at hand yet.
        items |= self.state.stored_items(job_id, [k for k in related_keys(keys, items, c) if k not in items])
        outputs, ledger, late_quarantine = assemble_results(records, items, failed, c, job_id, now())
        quarantine = pa.concat_tables([quarantine, late_quarantine])
        expected = self.state_partition(partition).records
        if outputs.num_rows + quarantine.num_rows != expected:  # the invariant every row depends on
            raise JobError(f"partition {partition}: accounting mismatch: {outputs.num_rows} outputs + "
                           f"{quarantine.num_rows} quarantined != {expected} records; nothing was committed")
        if beat.lost:
            raise JobError(f"partition {partition}: lease lost to another worker; not committing")
        write_partition(self.out, job_id, partition, {"outputs": outputs, "ledger": ledger, "quarantine": quarantine},
                        c.output.compression)
        self.index_generated(partition, records, items)
        verification = verify_shadows(records, items, self.reference_outputs(records, items), c.dedup.shadow_min_f1)
        counts = partition_counts(outputs, ledger, quarantine, completions, call_table, c)
        counts["tokens"]["shareable_prompt_tokens"] = shareable
        return {**counts, "verification": verification, "seconds": round(time.perf_counter() - started, 3)}

    def followups(self, partition: str, records: pa.Table, items: dict[str, dict], known: dict[str, dict],
                  tried: set[str]) -> list[dict]:
        """Units for the next attempt records need: schema retries and escalations (cache hits: stored, not run)."""
        wanted = {}
        for key in sorted(set(effective_keys(records))):
            attempt = next_attempt(key, items, self.config)
            if attempt is None or attempt[0] in tried:
                continue
            target, changes = attempt
            unit = known.get(key)
            if unit is None:
                found = generation_units(records, {key}).to_pylist()
                if not found:
                    continue
                unit = found[0]
            wanted[target] = {**unit, "item_key": target, **changes}
            tried.add(target)
        found = self.store_cache_hits(partition, wanted)
        return [u for k, u in wanted.items() if k not in found]

    def store_cache_hits(self, partition: str, lookers: dict[str, dict]) -> dict[str, dict]:
        """Exact cache hits for `lookers` (key -> the unit or record asking: id, tenant, scope), stored as
        this job's items so reruns see them; returns them by key."""
        if not lookers or not self.config.cache.enabled:
            return {}
        hits: dict[str, dict] = {}
        for scope in sorted({v["scope"] for v in lookers.values()}):
            hits |= self.cache.get_many(scope, [k for k, v in lookers.items() if v["scope"] == scope])
        found = cached_items(hits, lookers, partition, now()) if hits else {}
        if found:
            self.state.store_items(self.job_id, found)
        return found

    def plan_units(self, units: pa.Table) -> tuple[pa.Table, pa.Table]:
        c = self.config
        tiers_used = sorted(set(units["tier"].to_pylist()))
        return plan_requests(units.append_column("duplicate_of", pa.nulls(units.num_rows, pa.string())),
                             c.prompt, c.sampling, c.plan,
                             {t: self.pool.tokenizer(t) for t in tiers_used},
                             {t: self.pool.context_length(t) for t in tiers_used})

    def reference_outputs(self, records: pa.Table, items: dict[str, dict]) -> dict[str, str]:
        """Outputs shadow-verified records are compared with: this job's items, else the cache's."""
        refs = set(reference_keys(records))
        out = {k: items[k]["summary"] for k in refs if k in items}
        scope_of = dict(zip(records["gen_key"].to_pylist(), records["scope"].to_pylist()))
        for scope in {scope_of[k] for k in refs - set(out)}:
            hits = self.cache.get_many(scope, [k for k in refs - set(out) if scope_of[k] == scope])
            out.update({k: v["summary"] for k, v in hits.items()})
        return out

    def index_generated(self, partition: str, records: pa.Table, items: dict[str, dict]) -> None:
        """Add what this partition generated to the cache's near/semantic index (one segment, replaced on rerun)."""
        if not self.config.cache.enabled or self.cache.bypassed:
            return
        boilerplate = compile_boilerplate(self.config.dedup.boilerplate_patterns)
        groups: dict[tuple[str, str], list[int]] = {}
        for row, (id_, key, scope, recipe) in enumerate(zip(*(records[c].to_pylist() for c in
                                                              ("id", "item_key", "scope", "recipe")))):
            item = items.get(key)
            if item is not None and item["id"] == id_ and item.get("origin") is None:
                groups.setdefault((scope, recipe), []).append(row)
        for (scope, recipe), rows in groups.items():
            part = records.take(pa.array(rows, pa.int64()))
            embeddings = None
            if pa.types.is_fixed_size_list(part["embedding"].type):
                embeddings = np.asarray(part["embedding"].combine_chunks().flatten(), np.float16).reshape(len(rows), -1)
            known = part["features"].to_pylist() if "features" in part.column_names else [None] * len(rows)
            blob = pack_segment(part["item_key"].to_pylist(), part["id"].to_pylist(),
                                np.asarray(part["signature"].combine_chunks().flatten(), np.uint32).reshape(len(rows), -1),
                                embeddings, [f or guards.features(clean_text(t, boilerplate)).to_json()
                                             for f, t in zip(known, part["text"].to_pylist())])
            self.cache.put_segment(scope, recipe, f"{self.job_id}/{partition}", blob)

    def lookup(self, partition: str, records: pa.Table, items: dict[str, dict], keys: list[str]) -> dict[str, dict]:
        """Items for `keys`: this job's paid ones, plus exact hits in the cache (stored as items, so reruns see them)."""
        missing = [k for k in keys if k not in items]
        items = items | self.state.stored_items(self.job_id, missing)
        missing = set(k for k in missing if k not in items)
        if not missing or not self.config.cache.enabled:
            return items
        lookers: dict[str, dict] = {}  # key -> the record that asks for it (labels the item)
        for id_, tenant, scope, own, gen in zip(*(records[c].to_pylist() for c in
                                                  ("id", "tenant", "scope", "item_key", "gen_key"))):
            for key in (own, gen):
                if key in missing:
                    lookers.setdefault(key, {"id": id_, "tenant": tenant, "scope": scope})
        found = self.store_cache_hits(partition, lookers)
        # Read back as stored: another worker may have stored the key first, and the first value wins.
        return items | self.state.stored_items(self.job_id, list(found)) if found else items

    def unpaid_requests(self, partition: str, records: pa.Table) -> tuple:
        """(records resolved, items at hand by key, generation units, their engine requests, too_long).

        Items at hand are this job's generations from any partition or earlier attempt, and exact
        cache hits from earlier jobs: reused, not redone.
        """
        items = self.lookup(partition, records, {}, needed_keys(records))
        records = resolve(records, set(items))
        items = self.lookup(partition, records, items, needed_keys(records))  # keys of records that fell back
        units = generation_units(records, set(needed_keys(records)) - set(items))
        requests, too_long = self.plan_units(units)
        return records, items, units, requests, too_long

    def prepared_path(self, partition: str, name: str) -> str:
        # Keyed by the config fingerprint: requests prepared under another prompt or model are not reused.
        return staging_path(self.out, self.job_id, partition, f"prepared-{self.config.fingerprint()}-{name}.parquet")

    def prepare_partition(self, partition: str) -> dict:
        """CPU work ahead of the GPU: look up paid and cached items, render and tokenise, and stage the requests."""
        records = storage.read_parquet(self.out, staging_path(self.out, self.job_id, partition, "records.parquet"))
        _, items, units, requests, too_long = self.unpaid_requests(partition, records)
        for name, table in (("units", units), ("requests", requests), ("too_long", too_long)):
            storage.write_parquet_atomic(self.out, self.prepared_path(partition, name), table, "zstd")
        return {"partition": partition, "records": records.num_rows, "already_paid": len(items),
                "to_generate": requests.num_rows, "too_long": too_long.num_rows}

    def read_prepared(self, partition: str, records: pa.Table) -> tuple | None:
        """Like unpaid_requests, from staged requests minus anything paid since; None when none are staged."""
        try:
            units, requests, too_long = (storage.read_parquet(self.out, self.prepared_path(partition, n))
                                         for n in ("units", "requests", "too_long"))
        except storage.StorageError:
            return None
        items = self.state.stored_items(self.job_id, needed_keys(records))
        records = resolve(records, set(items))
        units = units.filter(pc.invert(pc.is_in(units["item_key"], pa.array(list(items), pa.string()))))
        return (records, items, units, requests.filter(pc.is_in(requests["id"], units["id"])),
                too_long.filter(pc.is_in(too_long["id"], units["id"])))

    def run_single(self, partition: str) -> dict:
        """Run one partition to commit (an orchestrator's task): a no-op when it is already committed."""
        p = self.state_partition(partition)
        if p is None:
            raise JobError(f"job {self.job_id} has no partition {partition}")
        if p.status != "succeeded":
            if not self.state.claim(self.job_id, partition, self.worker, self.config.state.lease_seconds):
                raise JobError(f"partition {partition} is held by {p.worker} until its lease ends; retry later")
            self.run_partition(partition)
        p = self.state_partition(partition)
        if p.status != "succeeded":
            raise JobError(f"partition {partition}: {p.status}: {p.last_error}", budget=p.status == "deferred")
        return {"partition": partition, "status": p.status, "attempts": p.attempts, **json.loads(p.counts or "{}")}

    def rates(self) -> dict:
        if self._rates is None:
            self._rates = tier_rates(self.config, self.config.output.uri)
        return self._rates

    def check_budget(self, partitions: list[str]) -> None:
        """Refuse to start when spent + the estimate of what is left would cross a cap (before any GPU work)."""
        c = self.config
        self.spent = self.state.spent_by_tenant(self.job_id, {n: t.price_per_gpu_hour for n, t in c.tiers.items()})
        planned = dict(self.spent)
        for partition in partitions:
            records = storage.read_parquet(self.out, staging_path(self.out, self.job_id, partition, "records.parquet"))
            _, _, units, requests, _ = self.unpaid_requests(partition, records)
            tenant_of = dict(zip(units["id"].to_pylist(), units["tenant"].to_pylist()))
            planned = with_estimates(planned, requests, tenant_of, c, self.rates())
        problems = budget_problems(c, sum(planned.values()), planned)
        if problems:
            reason = (f"refused before any GPU work: estimated {'; '.join(problems)} "
                      f"({', '.join(sorted({r.method for r in self.rates().values()}))})")
            self.state.set_job(self.job_id, status="refused", error=reason)
            raise JobError(reason, budget=True)

    def state_partition(self, partition: str):
        return next((p for p in self.state.partitions(self.job_id) if p.partition == partition), None)

    # -- finish ---------------------------------------------------------------------------------------
    def finish(self) -> JobResult:
        parts = self.state.partitions(self.job_id)
        unfinished = [p for p in parts if p.status != "succeeded"]
        manifest = self.manifest(partial=bool(unfinished))
        write_manifest(self.out, self.job_id, manifest)
        deferred = [p for p in unfinished if p.status == "deferred"]
        if unfinished and len(deferred) == len(unfinished):
            reason = (f"budget reached: {len(deferred)} of {len(parts)} partitions ({sum(p.records for p in deferred)} "
                      f"records) deferred, nothing lost: {deferred[0].last_error}. Raise the cap (budget.*), then: "
                      f"tokenmill rerun --job-id {self.job_id}")
            self.state.set_job(self.job_id, status="deferred", finished_at=now(), error=reason, counts=self.job_counts(manifest))
            raise JobError(reason, budget=True)
        if unfinished:
            detail = "; ".join(f"{p.partition} ({p.file}): {p.status}" + (f": {p.last_error}" if p.last_error else "")
                               for p in unfinished[:5])
            error = f"{len(unfinished)} of {len(parts)} partitions not committed: {detail}"
            self.state.set_job(self.job_id, status="failed", finished_at=now(), error=error, counts=self.job_counts(manifest))
            raise JobError(f"{error}. Rerun with: tokenmill rerun --job-id {self.job_id}")
        self.state.set_job(self.job_id, status="succeeded", finished_at=now(), counts=self.job_counts(manifest))
        return JobResult(self.job_id, manifest)

    @staticmethod
    def job_counts(manifest: dict) -> dict:
        """What the catalog keeps of a finished job: its counts and how it was planned."""
        return {**manifest["counts"], "plan": manifest.get("plan", {})}

    def manifest(self, partial: bool) -> dict:
        job = self.state.job(self.job_id)
        plan = json.loads(job.counts or "{}").get("plan", {})
        parts = self.state.partitions(self.job_id)
        return build_manifest(self.config, self.job_id, job, parts, partial, plan)
