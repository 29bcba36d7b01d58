"""Planning: the CPU stages over a job's whole input, streamed file by file and sharded by dedup scope.

  keyed    per input file, in parallel, a partition at a time as the file is read (one-document files
           packed: ingest/read.py `packs`): read -> validate -> content_hash -> route -> item_keys ->
           sketch (stages.py, the declared STAGES, as every step here runs them); each partition's
           keyed records and quarantine rows go to the staging area
  ids      in job order: a record whose id an earlier valid record already has is quarantined
  cluster  per shard of dedup scopes, in parallel (shards.py): near, semantic and cache reuse over the
           shard's compact columns (keys, signatures, embeddings); texts are read back from the staging
           area only for the pairs the guards compare
  staged   per partition, in parallel: the keyed records with their reuse columns -> gen_text -> `records`

No step holds the job's texts: a planning process keeps one file's bytes and one partition's records
(`input.records_per_partition`), or one shard's dedup index plus a bounded cache of partition texts.
A shard holds about `planning.shard_rows` records (as many shards as workers, more for a large job).

Scopes never share an output (cluster.py), so a shard of whole scopes clusters exactly as the whole
job would: partitions, item keys and reuse are the same for any number of shards. A scope of more
than `planning.shard_rows` records is cut into parts of whole components of its LSH buckets
(dedup/split.py): exact and near reuse are still the same, and what the cut can miss is a semantic
match across parts (counted by benchmarks/planning_scale.py).

`workers` processes run each step (`planning.workers`; unset, one per 32 MB of input up to the machine's
cores); with one, everything runs in this process. Under Airflow the steps are tasks of their own:
`key` keys the input with its worker's cores, `cluster` is mapped by shard, and `plan` writes each partition's
records and registers them (in its process, unless `planning.workers` is set).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing import get_context

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import TokenmillConfig
from pipeline.dedup.cluster import DedupStats
from pipeline.dedup.split import shards_of
from pipeline.errors import JobError
from pipeline.ingest.read import FileReader, input_files, pack_partition, packs
from pipeline.ingest.validate import duplicate_rows, quarantine_rows
from pipeline.plan.shards import ROW, SHARD_COLUMNS, cluster_shard, cut_scopes
from pipeline.plan.stages import STAGED_COLUMNS, StageContext, run_stages, stage_named, stages_between
from pipeline.stores import storage

log = logging.getLogger(__name__)

# The declared stages by step: read is the file reader's (a partition at a time); cluster needs whole
# scopes (shards.py); gen_text needs the shards' decisions.
KEYED_STAGES = stages_between("validate", "sketch")
PLAN_BYTES_PER_WORKER = 32 << 20  # input per planning process when `planning.workers` is unset


@dataclass
class Plan:
    """What planning found, for the catalog and the manifest."""

    records: int = 0  # raw records read, good or bad
    partitions: dict[str, dict] = field(default_factory=dict)  # partition -> {"file", "records"}
    quarantined: int = 0
    skipped: list[str] = field(default_factory=list)  # "<file>: why" for files that gave no record
    dedup: DedupStats = field(default_factory=DedupStats)
    shard_scopes: list[list[list]] = field(default_factory=list)  # shard -> its [scope, part]s (part 0: a whole scope)
    cut: dict[str, list[int]] = field(default_factory=dict)  # a scope cut into parts -> rows per part (split.py)
    duplicates: dict[str, list[int]] = field(default_factory=dict)  # partition -> rows quarantined as duplicate_id
    seconds: dict[str, float] = field(default_factory=dict)
    attempt: str = ""  # this planning's token: a shard's figures name the planning they belong to
    batch_files: dict[str, str] = field(default_factory=dict)  # input file of batch requests -> its format

    @property
    def shards(self) -> int:
        return len(self.shard_scopes)

    def to_dict(self) -> dict:
        return {
            "records": self.records,
            "partitions": self.partitions,
            "quarantined": self.quarantined,
            "skipped": self.skipped,
            "dedup": self.dedup.to_dict(),
            "shard_scopes": self.shard_scopes,
            "cut": self.cut,
            "duplicates": self.duplicates,
            "seconds": self.seconds,
            "attempt": self.attempt,
            "batch_files": self.batch_files,
        }

    @staticmethod
    def from_dict(data: dict) -> "Plan":
        return Plan(**{**data, "dedup": DedupStats.from_dict(data["dedup"])})


def planning_workers(config: TokenmillConfig, input_bytes: int) -> int:
    """`planning.workers`, or by the input's size: a process per PLAN_BYTES_PER_WORKER, at most one per core
    (a pool process costs a second or two to start: small inputs plan faster in this one)."""
    if config.planning.workers:
        return config.planning.workers
    # macOS has no affinity
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, input_bytes // PLAN_BYTES_PER_WORKER))


@contextmanager
def planning_pool(workers: int):
    """A process pool of `workers`, or this process when one is enough."""
    if workers <= 1:
        yield None
        return
    # spawn: the parent may hold threads (an embedder's, a catalog's) that fork would copy mid-state.
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        yield pool


# What planning reports as it goes (Progress.planning): step, inputs done, inputs in all.
Report = Callable[[str, int, int], None]


def _map(pool: Executor | None, fn, *iterables, step: str = "", report: Report | None = None) -> list:
    columns = [list(values) for values in iterables]
    total = min(map(len, columns), default=0)
    out: list = []
    try:
        for result in (map if pool is None else pool.map)(fn, *columns):
            out.append(result)
            if report is not None:
                report(step, len(out), total)
        return out
    except BrokenProcessPool as e:
        raise JobError(
            f"a planning process died ({e}): out of memory (lower planning.workers), or a script "
            "that starts a job at import time (the pool starts its processes by importing the "
            'main module: put the call under `if __name__ == "__main__":`)'
        ) from None


def plan_job(
    config: TokenmillConfig, job_id: str, staging, cache=None, workers: int | None = None, report: Report | None = None
) -> Plan:
    """Plan the job into `staging` (a StagingArea): each partition's `records` (STAGED_COLUMNS) and
    `quarantine`. `cache`: a ResilientStore whose near/semantic index is searched (None: each shard opens
    its own from `config.cache`, when it is enabled). The three steps, in this process and its pool;
    an orchestrator may run them as tasks of their own (`plan_keyed`, `plan_shard` per shard, `plan_staged`).
    `report`: told after each input of each step (Progress.planning)."""
    listed = list_input(config)
    workers = workers or planning_workers(config, sum(size for _, _, size in listed[0]))
    with planning_pool(workers) as pool:
        plan = plan_keyed(config, job_id, staging, listed, workers, pool, report)
        started = time.perf_counter()
        n = plan.shards
        _map(
            pool,
            plan_shard,
            [config] * n,
            [job_id] * n,
            [staging] * n,
            range(n),
            [cache if pool is None else None] * n,
            step="clustered",
            report=report,
        )
        clustered = time.perf_counter() - started
        plan = plan_staged(config, job_id, staging, pool, report=report)
        plan.seconds["cluster"] = clustered
        return plan


def list_input(config: TokenmillConfig) -> tuple[list[tuple[str, str, int]], list[str]]:
    """The job's input files (relative, full path, bytes) and the notes on files skipped: listed once per
    planning (ingest/read.py input_files), then handed to every step that needs them."""
    return input_files(storage.resolve(config.input.uri, config.storage))


def plan_keyed(
    config: TokenmillConfig,
    job_id: str,
    staging,
    listed: tuple[list, list[str]],
    workers: int,
    pool: Executor | None = None,
    report: Report | None = None,
) -> Plan:
    """Step 1: key every input file of `listed` (list_input), find ids repeated across files, cut the scopes
    into shards; the plan so far is saved in the staging area (`plan.json`) for the other steps."""
    plan = Plan()
    files, skipped = listed
    plan.skipped = list(skipped)
    for note in plan.skipped:
        log.warning("input file %s", note)
    started = time.perf_counter()
    groups = packs(files, config.input.records_per_partition)
    keyed = _map(
        pool,
        key_files,
        [config] * len(groups),
        [job_id] * len(groups),
        [staging] * len(groups),
        groups,
        step="keyed",
        report=report,
    )
    plan.seconds["keyed"] = time.perf_counter() - started

    started = time.perf_counter()
    seen: set[str] = set()
    scope_rows: dict[str, int] = {}
    for result in keyed:
        for note in result.file_notes:
            plan.skipped.append(note)
            log.warning("input file %s", note)
        plan.dedup.notes.extend(n for n in result.notes if n not in plan.dedup.notes)
        plan.records += result.raw
        plan.quarantined += result.quarantined
        if result.format not in (None, "records"):
            plan.batch_files[result.file] = result.format
        for partition, (ids, scopes, raw) in result.partitions.items():
            plan.partitions[partition] = {"file": result.file, "records": raw}
            rows = duplicate_rows(ids, seen)
            if rows:
                plan.duplicates[partition] = rows
                plan.quarantined += len(rows)
            for scope, count in scopes.items():
                scope_rows[scope] = scope_rows.get(scope, 0) + count
    del seen
    shard_rows = config.planning.shard_rows
    big = {scope: n for scope, n in scope_rows.items() if n > shard_rows}
    plan.cut = cut_scopes(config, staging, list(plan.partitions), big) if big else {}
    scopes = {(scope, part): n for scope, rows in plan.cut.items() for part, n in enumerate(rows) if n}
    scopes.update({(scope, 0): n for scope, n in scope_rows.items() if scope not in plan.cut})
    shards = shards_of(scopes, max(workers, -(-sum(scope_rows.values()) // shard_rows)))
    # At least one shard, even with no valid record: every partition's staged step reads its decisions.
    plan.shard_scopes = [[list(scope) for scope in shard] for shard in shards] or [[]]
    plan.seconds["ids"] = time.perf_counter() - started
    plan.attempt = uuid.uuid4().hex
    staging.write_plan(plan.to_dict())
    return plan


def plan_shard(config: TokenmillConfig, job_id: str, staging, shard: int, cache=None) -> DedupStats:
    """Step 2, once per shard (in any order, on any host that reaches the staging area): cluster its scopes."""
    plan = Plan.from_dict(staging.plan())
    stats = cluster_shard(
        config,
        job_id,
        staging,
        plan.shard_scopes[shard],
        set(plan.cut),
        list(plan.partitions),
        plan.duplicates,
        cache,
        shard,
    )
    staging.write_shard_figures(shard, {"attempt": plan.attempt, **stats.to_dict()})
    return stats


def clustered_plan(staging) -> Plan | None:
    """The plan in `staging` when every one of its shards is clustered for it, else None (not keyed yet,
    a shard still to cluster, or shards left by an earlier planning of the job); with the shards' figures."""
    try:
        plan = Plan.from_dict(staging.plan())
        shards = [staging.shard_figures(shard) for shard in range(plan.shards)]
    except (storage.StorageError, TypeError, KeyError):  # none, or one an older version wrote: planned again
        return None
    if any(done.get("attempt") != plan.attempt for done in shards):
        return None
    for done in shards:
        plan.dedup.merge(DedupStats.from_dict({k: v for k, v in done.items() if k != "attempt"}))
    return plan


def plan_staged(
    config: TokenmillConfig,
    job_id: str,
    staging,
    pool: Executor | None = None,
    plan: Plan | None = None,
    report: Report | None = None,
) -> Plan:
    """Step 3, once every shard is clustered: each partition's staged records and quarantine rows.
    `plan`: what `clustered_plan` returned, when the caller has it already."""
    plan = plan or clustered_plan(staging)
    if plan is None:
        raise JobError(
            f"job {job_id} is not keyed, or a shard is not clustered for its latest planning; run "
            "the missing steps (under Airflow: clear `plan` with downstream)"
        )
    started = time.perf_counter()
    parts = list(plan.partitions)
    _map(
        pool,
        stage_partition,
        [config] * len(parts),
        [job_id] * len(parts),
        [staging] * len(parts),
        parts,
        [plan.shards] * len(parts),
        [plan.duplicates.get(p, []) for p in parts],
        step="staged",
        report=report,
    )
    plan.seconds["staged"] = time.perf_counter() - started
    return plan


# -- keyed: one input file ------------------------------------------------------------------------
@dataclass
class KeyedFile:
    file: str  # the file, or a pack's `first … last (n files)`
    raw: int  # records read
    quarantined: int  # quarantined by validate (not counting duplicate ids)
    file_notes: list[str]  # why a file gave no record (empty, unreadable), for the manifest
    notes: list[str]  # what was asked for and could not be done (e.g. semantic reuse off)
    partitions: dict[str, tuple[pa.Array, dict[str, int], int]]  # partition -> (valid ids, rows per scope, raw records)
    format: str | None = None  # what the file holds: records, or a batch format (ingest/batch.py)


def key_files(config: TokenmillConfig, job_id: str, staging, files: list[tuple[str, str, int]]) -> KeyedFile:
    """Run the keyed stages on one input file, a partition at a time as the reader yields it (a file's
    records are never held at once), or on a pack of one-document files (ingest/read.py `packs`) as one
    partition; stage each partition's keyed records and quarantine rows."""
    name = files[0][0] if len(files) == 1 else f"{files[0][0]} … {files[-1][0]} ({len(files)} files)"
    out = KeyedFile(name, 0, 0, [], [], {})

    def key_partition(raw: pa.Table) -> None:  # one whole partition
        partition = raw["partition"][0].as_py()
        ctx = StageContext(config, job_id, config.input.uri, duplicate_ids=False, raw=raw)
        records = run_stages(KEYED_STAGES, raw, ctx)
        records = records.append_column(ROW, pa.array(range(records.num_rows), pa.int32()))
        out.raw, out.quarantined = out.raw + raw.num_rows, out.quarantined + ctx.quarantine.num_rows
        out.notes.extend(n for n in ctx.notes if n not in out.notes)
        staging.write_keyed(partition, records)
        staging.write_sketch(partition, records.select(list(SHARD_COLUMNS)))  # what the shards read: no text
        staging.write_read_quarantine(partition, ctx.quarantine)
        counts = pc.value_counts(records["scope"]).to_pylist()
        out.partitions[partition] = (records["id"], {c["values"]: c["counts"] for c in counts}, raw.num_rows)

    root = storage.resolve(config.input.uri, config.storage)
    if len(files) == 1:
        reader = FileReader(root, files[0][0], files[0][1], config.input)
        for raw in reader.partitions():
            key_partition(raw)
        out.file_notes, out.format = [reader.note] if reader.note else [], reader.format
        return out
    pack, tables = pack_partition([f[0] for f in files]), []
    for relative, path, _ in files:
        reader = FileReader(root, relative, path, config.input, partition=pack)
        tables.append(reader.table())
        out.file_notes += [reader.note] if reader.note else []
    key_partition(pa.concat_tables(tables))
    out.format = "records"  # one-document files: never a batch file
    return out


# -- staged: one partition ------------------------------------------------------------------------
def stage_partition(
    config: TokenmillConfig, job_id: str, staging, partition: str, shards: int, duplicates: list[int]
) -> None:
    """Join a partition's keyed records with the shards' reuse decisions; stage `records` and `quarantine`."""
    keyed = staging.keyed(partition)
    quarantine = staging.read_quarantine(partition)
    if duplicates:
        dup = pc.is_in(keyed[ROW], pa.array(duplicates, pa.int32()))
        bad = keyed.filter(dup)
        reasons = pa.array(["duplicate_id"] * bad.num_rows, pa.string())
        quarantine = pa.concat_tables([quarantine, quarantine_rows(bad, reasons, job_id, config.input.excerpt_chars)])
        keyed = keyed.filter(pc.invert(dup))
    decided = pa.concat_tables([staging.reuse(partition, s) for s in range(shards)]).sort_by(ROW)
    if decided.num_rows != keyed.num_rows or decided[ROW] != keyed[ROW]:
        raise JobError(
            f"partition {partition}: {keyed.num_rows} keyed records but {decided.num_rows} reuse "
            "decisions: the staging area holds shards of another plan; stage the job again"
        )
    sources, texts = _sources(staging, decided["gen_partition"].to_pylist(), decided["gen_row"].to_pylist())
    records = keyed
    for name in ("gen_key", "gen_id", "gen_tier", "reuse", "similarity", "shadow", "features"):
        records = records.append_column(name, decided[name])
    records = records.append_column("gen_source", sources)
    ctx = StageContext(config, job_id, config.input.uri, texts=texts.__getitem__)
    records = run_stages((stage_named("gen_text"),), records, ctx)
    staging.write_staged(partition, records.select(list(STAGED_COLUMNS)), quarantine)


def _sources(staging, partitions: list[str | None], rows: list[int | None]) -> tuple[pa.Array, list[str]]:
    """(each member's source: an index into the texts, -1 for none; the raw texts of the representatives
    in other partitions the members carry)."""
    sources, texts = [-1] * len(partitions), []
    wanted: dict[str, list[tuple[int, int]]] = {}
    for i, (partition, row) in enumerate(zip(partitions, rows)):
        if partition is not None:
            wanted.setdefault(partition, []).append((i, row))
    for partition, pairs in wanted.items():
        column = staging.keyed(partition, columns=["text"])["text"]
        for i, row in pairs:
            sources[i] = len(texts)
            texts.append(column[row].as_py())
    return pa.array(sources, pa.int64()), texts
