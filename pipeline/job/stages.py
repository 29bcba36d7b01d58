"""Stages 1-4 over a whole input: read -> validate -> dedup -> route, each record given its item key.

Shared by job planning (which stages the result per partition) and the pre-flight estimate (which
prices it), so both see exactly the same records, reuse clusters and tiers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pyarrow as pa

from pipeline.config import TokenmillConfig
from pipeline.dedup.cluster import DedupStats, add_content_hashes, cluster_records
from pipeline.keys import add_item_keys
from pipeline.ingest.read import read_records
from pipeline.route.rules import assign_tiers
from pipeline.ingest.validate import validate_records

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    raw: pa.Table           # every record read, good or bad
    records: pa.Table       # valid records with item keys and reuse columns
    quarantine: pa.Table    # rows for the bad ones
    skipped: list[str]      # files of unknown formats
    dedup: DedupStats


def load_embedder(config: TokenmillConfig) -> tuple[object | None, str | None]:
    """(the static embedder or None, why semantic reuse is off when it was asked for).

    A missing model does not stop a nightly job: it runs without semantic reuse, says so in the
    log and in the manifest, and pays for what semantic reuse would have saved."""
    if not config.dedup.semantic:
        return None, None
    from pipeline.dedup.embed import EmbedderError, StaticEmbedder

    try:
        return StaticEmbedder(config.dedup.embedder), None
    except EmbedderError as e:
        log.warning("semantic reuse off for this job: %s", e)
        return None, str(e)


def prepare_records(config: TokenmillConfig, job_id: str, input_uri: str | None = None, cache=None) -> Prepared:
    """`cache`: a ResilientStore whose near/semantic index is searched too (None: in-job reuse only)."""
    raw, skipped = read_records(input_uri or config.input.uri, config.input, config.storage)
    for path in skipped:
        log.warning("skipped %s: not .jsonl, .jsonl.gz, .parquet, .txt or .md", path)
    records, quarantine = validate_records(raw, config.input, job_id)
    records = add_content_hashes(records, config.dedup)
    router = None
    if config.route.router:
        from pipeline.route.router import Router

        router = Router.load(config.route.router)
    records = assign_tiers(records, config.route, router)
    records = add_item_keys(records, config.prompt, config.sampling, config.tiers)
    embedder, problem = load_embedder(config)
    records, stats = cluster_records(records, config.dedup, embedder, cache, config.tier_prices)
    if problem:
        stats.notes.append(f"semantic reuse off: {problem}")
    return Prepared(raw, records, quarantine, skipped, stats)
