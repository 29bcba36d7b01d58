"""Stages 1-4 over a whole input: read -> validate -> dedup -> route, each record given its item key.

Shared by job planning (which stages the result per partition) and the pre-flight estimate (which
prices it), so both see exactly the same records, duplicates and tiers.
"""

from __future__ import annotations

import logging

import pyarrow as pa

from pipeline.config import TokenmillConfig
from pipeline.dedup import add_content_hashes
from pipeline.plan import add_item_keys
from pipeline.read import read_records
from pipeline.route import assign_tiers
from pipeline.validate import validate_records

log = logging.getLogger(__name__)


def prepare_records(config: TokenmillConfig, job_id: str,
                    input_uri: str | None = None) -> tuple[pa.Table, pa.Table, pa.Table, list[str]]:
    """(raw records, valid keyed records, quarantine rows, skipped files)."""
    raw, skipped = read_records(input_uri or config.input.uri, config.input, config.storage)
    for path in skipped:
        log.warning("skipped %s: not .jsonl, .jsonl.gz, .parquet, .txt or .md", path)
    records, quarantine = validate_records(raw, config.input, job_id)
    records = add_content_hashes(records, config.dedup)
    records = assign_tiers(records, config.route)
    records = add_item_keys(records, config.prompt, config.sampling, config.tiers)
    return raw, records, quarantine, skipped
