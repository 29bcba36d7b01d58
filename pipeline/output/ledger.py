"""Questions analysts ask of the ledgers, answered with DuckDB over one snapshot of the Delta tables.

Each table of the output root (local or s3://, output/tables.py) is opened at its latest version, or as of
a version or a time (time travel), as a pyarrow dataset of exactly the files that snapshot names, so DuckDB
needs no extension and no network, and a partition is read whole or not at all while a job commits:
`ledger`, `outputs` and `quarantine` are views any SQL can use. Money columns are
summed as DECIMAL(38, 18) so totals do not depend on summation order.
"""

from __future__ import annotations

import re
from datetime import date, datetime

import duckdb
import pyarrow as pa

from pipeline.config import StorageConfig
from pipeline.output.tables import dataset
from pipeline.stores import storage

# Grouping keys an analyst may ask for, and the SQL that computes each.
GROUP_KEYS = {
    "tenant": "tenant",
    "tier": "tier",
    "model": "model",
    "adapter": "adapter",
    "source": "source",
    "job": "job_id",
    "partition": "partition",
    "day": "CAST(created_at AS DATE)",
}
MONEY = "CAST({col} AS DECIMAL(38, 18))"
DOCUMENT = "coalesce(kind, 'output') IN ('output', 'invalid_output')"  # a row for a record that got an output
COST = f"sum({MONEY.format(col='cost_usd')})"
DOCUMENTS, ACCEPTABLE = f"count(*) FILTER (WHERE {DOCUMENT})", "count(*) FILTER (WHERE acceptable)"
UNJUDGED = f"count(*) FILTER (WHERE {DOCUMENT} AND acceptable IS NULL) > 0"
MEASURES = {
    "items": "count(*)",
    "prompt_tokens": "CAST(sum(prompt_tokens) AS BIGINT)",
    "cached_prompt_tokens": "CAST(sum(cached_prompt_tokens) AS BIGINT)",
    "output_tokens": "CAST(sum(output_tokens) AS BIGINT)",
    "gpu_seconds": "sum(gpu_seconds)",
    "cost_usd": COST,
    "baseline_cost_usd": f"sum({MONEY.format(col='baseline_cost_usd')})",
    "saved_usd": f"sum({MONEY.format(col='baseline_cost_usd')}) - {COST}",
    "reused_items": "count(*) FILTER (WHERE source <> 'generated')",
    "quarantined_items": "count(*) FILTER (WHERE quarantined)",  # paid, then quarantined (json_schema, checks)
    "reuse_saved_usd": f"coalesce(sum({MONEY.format(col='saved_cost_usd')}), 0)",
    # What a buyer of summaries pays for: documents that got an output (served or quarantined after it was
    # paid), those of them no output check failed (ledger column `acceptable`), and the cost of each, every
    # charge of the group (failed attempts, lost work) included.
    "documents": DOCUMENTS,
    "acceptable": ACCEPTABLE,
    # Shares and costs per acceptable document are null for a group holding documents whose `acceptable` is null
    # (ledgers written before the column): counting those as not acceptable would skew both.
    "acceptable_share": f"CASE WHEN {UNJUDGED} THEN NULL ELSE {ACCEPTABLE} / nullif({DOCUMENTS}, 0) END",
    "cost_per_document_usd": f"{COST} / nullif({DOCUMENTS}, 0)",
    "cost_per_acceptable_usd": f"CASE WHEN {UNJUDGED} THEN NULL ELSE {COST} / nullif({ACCEPTABLE}, 0) END",
}


class LedgerError(ValueError):
    """A ledger question that cannot be answered as asked; the message says why."""


def connect(
    output_uri: str, storage_config: StorageConfig | None = None, as_of: int | datetime | None = None
) -> duckdb.DuckDBPyConnection:
    """A read-only DuckDB connection with views `ledger`, `outputs` and `quarantine` over an output root's
    tables: their latest snapshots, or each as of `as_of` (a table version, or a time: the last version
    committed at or before it).

    Once the views are registered, DuckDB's access to anything else is switched off and its
    configuration locked: no file, network or extension can be reached from a query, and no query
    can switch that back on (`tokenmill ledger sql` runs analysts' SQL here).
    """
    root = storage.resolve(output_uri, storage_config)
    con = duckdb.connect()
    for kind in ("ledger", "outputs", "quarantine"):
        con.register(kind, dataset(root, kind, as_of))
    # Days are UTC days (`--since`, `--until`, `day`), whatever the machine's time zone.
    con.execute("SET TimeZone = 'UTC'")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def ledger_where(
    job_id: str | None = None, tenant: str | None = None, since: date | None = None, until: date | None = None
) -> tuple[str, list]:
    """(` WHERE ...` or '', its parameters) selecting ledger rows by job, tenant and UTC day (both inclusive)."""
    where, params = [], []
    for clause, value in (
        ("job_id = ?", job_id),
        ("tenant = ?", tenant),
        ("CAST(created_at AS DATE) >= ?", since),
        ("CAST(created_at AS DATE) <= ?", until),
    ):
        if value is not None:
            where.append(clause)
            params.append(value)
    return (" WHERE " + " AND ".join(where) if where else ""), params


def summary_sql(
    by: list[str], job_id: str | None = None, since: date | None = None, until: date | None = None
) -> tuple[str, list]:
    unknown = [b for b in by if b not in GROUP_KEYS]
    if unknown:
        raise LedgerError(f"cannot group by {', '.join(unknown)}; choose from {', '.join(GROUP_KEYS)}")
    keys = [f"{GROUP_KEYS[b]} AS {b}" for b in by]
    measures = [f"{sql} AS {name}" for name, sql in MEASURES.items()]
    where, params = ledger_where(job_id or None, since=since or None, until=until or None)
    sql = f"SELECT {', '.join(keys + measures)} FROM ledger{where}"
    if by:
        sql += f" GROUP BY {', '.join(GROUP_KEYS[b] for b in by)} ORDER BY {', '.join(b for b in by)}"
    return sql, params


def summary(
    con: duckdb.DuckDBPyConnection,
    by: list[str],
    job_id: str | None = None,
    since: date | None = None,
    until: date | None = None,
) -> pa.Table:
    """Totals (items, tokens, GPU-seconds, cost, baseline, saved) grouped by any of GROUP_KEYS."""
    sql, params = summary_sql(by, job_id, since, until)
    return con.sql(sql, params=params).to_arrow_table()


_WRITES = re.compile(
    r"^\s*(insert|update|delete|create|drop|alter|copy|attach|detach|install|load|pragma|set|export|import)\b",
    re.IGNORECASE,
)


def query(con: duckdb.DuckDBPyConnection, sql: str) -> pa.Table:
    """Any read-only SQL over the views. The tables are the record: nothing here writes to them."""
    if _WRITES.match(sql):
        raise LedgerError("ledger sql answers queries only (SELECT, WITH, DESCRIBE, SUMMARIZE, …)")
    try:
        result = con.sql(sql)
        table = result.to_arrow_table() if result is not None else pa.table({})
    except duckdb.Error as e:
        raise LedgerError(str(e).splitlines()[0]) from None
    return table.rename_columns(distinct_names(table.column_names))


def distinct_names(names: list[str]) -> list[str]:
    """Column names made distinct (`a`, `a_2`, `a_3`): a join or `SELECT 1 a, 2 a` repeats one, and a row
    of a result is a mapping of names."""
    seen: set[str] = set()
    out = []
    for name in names:
        new, n = name, 1
        while new in seen:
            n += 1
            new = f"{name}_{n}"
        seen.add(new)
        out.append(new)
    return out
