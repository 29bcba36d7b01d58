"""The CPU stages that planning runs over a job's input, each with a declared contract.

  read -> validate -> content_hash -> route -> item_keys -> sketch -> cluster -> gen_text

Each `Stage` names the columns it needs in its input and the columns it adds (and drops);
`run_stages` runs them in order and checks every contract as it goes (column names only, so the
check costs nothing next to the stages). `staged_input` runs them all in memory over a whole input
(evaluation sets, tests). Planning (streamed.py, for staging and the pre-flight estimate alike) runs
the same entries in three steps: read (the file reader, a partition at a time) to sketch per input
file, cluster per shard of scopes, gen_text per partition, with the same result
(tests/integration/test_plan.py). A shard carries no texts: the two stages that read them
(`reads_text`) take them from the table's `text` column, or from `StageContext.texts` when the table
has none (a shard reads them back from the staging area, a few pairs at a time).

Side outputs that are not columns of the record table (every raw record, quarantine rows, skipped
files, dedup statistics) are kept on the `StageContext` the stages share.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa

from pipeline.config import TokenmillConfig
from pipeline.dedup.cluster import DedupStats, add_content_hashes, cluster_rows
from pipeline.dedup.sketch import sketch_records
from pipeline.ingest.read import read_records
from pipeline.ingest.validate import requested_models, validate_records
from pipeline.keys import adapter_digest, add_item_keys
from pipeline.route.rules import assign_tiers
from pipeline.schema import RAW_RECORDS

log = logging.getLogger(__name__)


class StageContractError(RuntimeError):
    """A stage got a table without the columns it needs, or returned other columns than it declares."""


@dataclass
class StageContext:
    """What the stages share besides the record table: their inputs and their side outputs."""

    config: TokenmillConfig
    job_id: str
    input_uri: str
    cache: object | None = None  # a ResilientStore whose near/semantic index is searched too
    # from input_files (relative, full path, bytes); None: all of input_uri
    files: list[tuple[str, str, int]] | None = None
    duplicate_ids: bool = True  # validate quarantines repeated ids (the planner does it across files)
    raw: pa.Table | None = None  # every record read, good or bad (set by read)
    quarantine: pa.Table | None = None  # rows for the bad ones (set by validate)
    skipped: list[str] = field(default_factory=list)  # "<file>: why" for files that gave no record (set by read)
    dedup: DedupStats | None = None  # set by cluster
    embedder: object | None = None  # set by sketch: the static embedder, when semantic reuse is on
    notes: list[str] = field(default_factory=list)  # what was asked for and could not be done (set by sketch)
    # The text of a row of the table a `reads_text` stage runs on, for a table without a `text` column.
    texts: Callable[[int], str] | None = None


@dataclass(frozen=True)
class Stage:
    """One CPU stage: `fn(table, context) -> table` adds exactly `adds` and removes exactly `drops`."""

    name: str
    needs: tuple[str, ...]
    adds: tuple[str, ...]
    fn: Callable[[pa.Table, StageContext], pa.Table]
    drops: tuple[str, ...] = ()
    reads_text: bool = False  # rows' texts: the `text` column, or `StageContext.texts` without one


def check_needs(stage: Stage, table: pa.Table, context: StageContext) -> None:
    missing = [c for c in stage.needs if c not in table.column_names]
    if stage.reads_text and context.texts is None and "text" not in table.column_names:
        missing.append("text")
    if missing:
        raise StageContractError(
            f"stage {stage.name!r} needs columns {missing} missing from its input (input has {table.column_names})"
        )


def texts_of(table: pa.Table, ctx: StageContext) -> Callable[[int], str]:
    """Row -> text for a `reads_text` stage: the context's source, else the table's own column."""
    if ctx.texts is not None:
        return ctx.texts
    column = table["text"]
    return lambda row: column[row].as_py()


def stage_named(name: str) -> Stage:
    return next(s for s in STAGES if s.name == name)


def stages_between(first: str, last: str) -> tuple[Stage, ...]:
    """The declared stages from `first` to `last`, both included."""
    names = [s.name for s in STAGES]
    return STAGES[names.index(first) : names.index(last) + 1]


def check_adds(stage: Stage, before: pa.Table, after: pa.Table) -> None:
    names = after.column_names
    doubled = sorted({c for c in names if names.count(c) > 1})
    added, removed = set(names) - set(before.column_names), set(before.column_names) - set(names)
    problems = []
    if doubled:
        problems.append(f"returned columns {doubled} twice")
    if added - set(stage.adds):
        problems.append(f"added undeclared columns {sorted(added - set(stage.adds))}")
    if set(stage.adds) - added:
        problems.append(f"did not add declared columns {sorted(set(stage.adds) - added)}")
    if removed != set(stage.drops):
        problems.append(f"removed {sorted(removed)}, declared drops {sorted(stage.drops)}")
    if problems:
        raise StageContractError(f"stage {stage.name!r} broke its contract: {'; '.join(problems)}")


def run_stages(stages: tuple[Stage, ...], table: pa.Table, context: StageContext) -> pa.Table:
    """Run `stages` in order on `table`, checking each one's contract before and after."""
    for stage in stages:
        check_needs(stage, table, context)
        out = stage.fn(table, context)
        check_adds(stage, table, out)
        table = out
    return table


def columns_after(stages: tuple[Stage, ...], start: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The columns a table has after `stages`, by their declarations alone."""
    columns = list(start)
    for stage in stages:
        columns = [c for c in columns if c not in stage.drops] + list(stage.adds)
    return tuple(columns)


def load_embedder(config: TokenmillConfig, job_id: str = "") -> tuple[object | None, str | None]:
    """(the static embedder or None, why semantic reuse is off when it was asked for).

    A missing model does not stop a nightly job: it runs without semantic reuse, says so in the
    log (once per job `job_id`, though planning asks once per input file) and in the manifest, and pays for
    what semantic reuse would have saved."""
    if not config.dedup.semantic:
        return None, None
    from pipeline.dedup.embed import EmbedderError, StaticEmbedder

    try:
        return _loaded(StaticEmbedder, config.dedup.embedder, _stamp(config.dedup.embedder)), None
    except EmbedderError as e:
        _warn_once(job_id, f"semantic reuse off for this job: {e}")
        return None, str(e)


@functools.lru_cache(maxsize=64)
def _warn_once(job_id: str, message: str) -> None:
    """Log `message` the first time a job meets it (the cache is what makes it once)."""
    log.warning("%s", message)


def _stamp(path: str) -> tuple:
    """What changes when a model or router file is rebuilt in place (so it is loaded anew)."""
    try:
        st = os.stat(path)
        return st.st_mtime_ns, st.st_size
    except OSError:
        return None, None


@functools.lru_cache(maxsize=8)
def _loaded(kind, path: str, stamp: tuple):
    """One load per process of the embedder or router at `path`: planning runs the stages once per
    input file, and a folder of small .txt files would otherwise load them hundreds of times."""
    return kind(path)


def _router(path: str):
    from pipeline.route.router import Router

    return Router.load(path)


def read(table: pa.Table, ctx: StageContext) -> pa.Table:
    raw, ctx.skipped = read_records(ctx.input_uri, ctx.config.input, ctx.config.storage, ctx.files)
    for note in ctx.skipped:  # "<file>: skipped, not .jsonl, …" or "<file>: empty file (0 bytes), no records"
        log.warning("input file %s", note)
    ctx.raw = raw
    return raw


def validate(table: pa.Table, ctx: StageContext) -> pa.Table:
    c = ctx.config
    models = c.served_models if c.route.requested_model == "tier" else None
    records, ctx.quarantine = validate_records(table, c.input, ctx.job_id, ctx.duplicate_ids, models)
    return records


def content_hashes(table: pa.Table, ctx: StageContext) -> pa.Table:
    adapted = frozenset(n for n, t in ctx.config.tenants.items() if t.adapter is not None)
    return add_content_hashes(table, ctx.config.dedup, adapted, ctx.config.sampling)


def route(table: pa.Table, ctx: StageContext) -> pa.Table:
    path = ctx.config.route.router
    router = _loaded(_router, path, _stamp(path)) if path else None
    fixed = None
    if ctx.config.route.requested_model == "tier" and table["request"].null_count < table.num_rows:
        served = ctx.config.served_models
        fixed = [served.get(m) if m is not None else None for m in requested_models(table)]
    return assign_tiers(table, ctx.config.route, router, fixed)


def item_keys(table: pa.Table, ctx: StageContext) -> pa.Table:
    c = ctx.config
    return add_item_keys(table, c.prompt, c.sampling, c.tiers, c.adapter)


def sketch(table: pa.Table, ctx: StageContext) -> pa.Table:
    ctx.embedder, problem = load_embedder(ctx.config, ctx.job_id)
    if problem:
        ctx.notes.append(f"semantic reuse off: {problem}")
    return sketch_records(table, ctx.config.dedup, ctx.embedder, ctx.config.cache.enabled)


def row_adapters(config: TokenmillConfig, table: pa.Table) -> list[str | None] | None:
    """Per row, the digest of the LoRA adapter its tenant runs on its tier (None: no tenant has one)."""
    if not config.tenants:
        return None
    pairs = list(zip(table["tenant"].to_pylist(), table["tier"].to_pylist()))
    digests = {(n, t): adapter_digest(config.adapter(n, t)) for n, t in set(pairs)}
    return [digests[p] for p in pairs]


def cluster(table: pa.Table, ctx: StageContext) -> pa.Table:
    """Near, semantic and cache reuse; `gen_source`: the row whose text a member needs (its representative
    in another partition), else -1. Texts are read for the pairs the guards compare only."""
    c = ctx.config
    out, ctx.dedup = cluster_rows(
        table, c.dedup, texts_of(table, ctx), ctx.cache, c.tier_prices, row_adapters(c, table)
    )
    ctx.dedup.notes.extend(n for n in ctx.notes if n not in ctx.dedup.notes)
    return out


def gen_text(table: pa.Table, ctx: StageContext) -> pa.Table:
    """The raw text each member carries to generate its representative's output in its own partition."""
    text = texts_of(table, ctx)
    sources = table["gen_source"].to_pylist()
    values = pa.array([text(s) if s is not None and s >= 0 else None for s in sources], pa.string())
    return table.drop_columns(["gen_source"]).append_column("gen_text", values)


STAGES: tuple[Stage, ...] = (
    Stage("read", needs=(), adds=tuple(RAW_RECORDS.names), fn=read),
    Stage(
        "validate",
        needs=(
            "id",
            "text",
            "tenant",
            "request",
            "file",
            "line",
            "partition",
            "read_error",
            "read_detail",
            "raw_excerpt",
        ),
        adds=(),
        drops=("read_error", "read_detail", "raw_excerpt"),
        fn=validate,
    ),
    Stage("content_hash", needs=("id", "tenant", "text", "request"), adds=("scope", "content_hash"), fn=content_hashes),
    Stage("route", needs=("text", "tenant", "metadata", "request"), adds=("tier", "route_reason"), fn=route),
    Stage("item_keys", needs=("tier", "tenant", "content_hash", "request"), adds=("recipe", "item_key"), fn=item_keys),
    Stage("sketch", needs=("text", "item_key"), adds=("signature", "embedding"), fn=sketch),
    Stage(
        "cluster",
        needs=("id", "tenant", "partition", "tier", "scope", "recipe", "item_key", "signature", "embedding"),
        adds=("gen_key", "gen_id", "gen_tier", "reuse", "similarity", "shadow", "features", "gen_source"),
        fn=cluster,
        reads_text=True,
    ),
    Stage("gen_text", needs=("gen_source",), adds=("gen_text",), drops=("gen_source",), fn=gen_text, reads_text=True),
)
STAGED_COLUMNS = columns_after(STAGES)  # what every staged record carries into its partition run


@dataclass
class StagedInput:
    raw: pa.Table  # every record read, good or bad
    records: pa.Table  # valid records with item keys and reuse columns (STAGED_COLUMNS)
    quarantine: pa.Table  # rows for the bad ones
    skipped: list[str]  # "<file>: why" for files that gave no record
    dedup: DedupStats


def staged_input(
    config: TokenmillConfig, job_id: str, input_uri: str | None = None, cache=None, stages: tuple[Stage, ...] = STAGES
) -> StagedInput:
    """Run the staging stages over the whole input. `cache`: a ResilientStore whose near/semantic
    index is searched too (None: in-job reuse only)."""
    ctx = StageContext(config, job_id, input_uri or config.input.uri, cache)
    records = run_stages(stages, pa.table({}), ctx)
    return StagedInput(ctx.raw, records, ctx.quarantine, ctx.skipped, ctx.dedup)
