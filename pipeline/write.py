"""Stage 7, write: give every valid record its output or quarantine row, price it, and commit per partition.

Layout under the output root (Hive style, zstd Parquet):
  outputs/job=<job>/partition=<p>/part-0.parquet
  ledger/job=<job>/partition=<p>/part-0.parquet
  quarantine/job=<job>/partition=<p>/part-0.parquet
  jobs/<job>/manifest.json
Every partition of the job gets all three files (possibly empty), written atomically with fixed
names, so running a partition again replaces them instead of adding rows.
"""

from __future__ import annotations

import json
from datetime import datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import storage
from pipeline.config import TokenmillConfig
from pipeline.schema import LEDGER, OUTPUTS, QUARANTINE
from pipeline.validate import quarantine_rows

KINDS = ("outputs", "ledger", "quarantine")


def assemble_results(records: pa.Table, items: dict[str, dict], failed: dict[str, tuple[str, str, str]],
                     config: TokenmillConfig, job_id: str, created_at: datetime) -> tuple[pa.Table, pa.Table, pa.Table]:
    """(outputs, ledger, quarantine) for a partition's valid `records`, each with a `partition` column.

    `items` maps an item key to its paid-for generation (state catalog); the record that generated
    it carries its cost, every other record with that key reuses it at zero cost. `failed` maps an
    item key to (reason, detail, id of the record tried) when no output exists. Every record lands in
    exactly one table.
    """
    largest_price = config.tiers[config.largest_tier].price_per_gpu_hour
    out: dict[str, list] = {name: [] for name in ["partition", *OUTPUTS.names, "gpu_seconds", "price", "baseline_usd"]}
    bad_rows, bad_reasons, bad_details = [], [], []
    for row, (id_, tenant, key, part) in enumerate(zip(records["id"].to_pylist(), records["tenant"].to_pylist(),
                                                       records["item_key"].to_pylist(),
                                                       records["partition"].to_pylist())):
        item = items.get(key)
        if item is None:
            reason, detail, tried = failed[key]  # KeyError here is a bug: a record with no fate
            bad_rows.append(row)
            bad_reasons.append(reason)
            bad_details.append(detail if tried == id_ else f"duplicate of {tried}: {detail}")
            continue
        generated = item["id"] == id_
        values = {
            "partition": part, "id": id_, "tenant": tenant, "summary": item["summary"], "tier": item["tier"],
            "model": item["model"], "source": "generated" if generated else "duplicate_in_job",
            "source_id": None if generated else item["id"],
            "prompt_tokens": item["prompt_tokens"] if generated else 0,
            "cached_prompt_tokens": item["cached_prompt_tokens"] if generated else 0,
            "output_tokens": item["output_tokens"] if generated else 0,
            "finish_reason": item["finish_reason"], "template_version": config.prompt.template_version,
            "job_id": job_id, "created_at": created_at,
            "gpu_seconds": item["gpu_seconds"] if generated else 0.0,
            "price": config.tiers[item["tier"]].price_per_gpu_hour,
            "baseline_usd": item["baseline_gpu_seconds"] * largest_price / 3600.0,
        }
        for name, value in values.items():
            out[name].append(value)

    outputs = pa.table({name: out[name] for name in ["partition", *OUTPUTS.names]},
                       schema=pa.schema([("partition", pa.string()), *OUTPUTS]))
    gpu = np.asarray(out["gpu_seconds"], dtype=np.float64)
    price = np.asarray(out["price"], dtype=np.float64)
    ledger = pa.table({
        "job_id": out["job_id"], "partition": out["partition"], "id": out["id"],
        "tenant": out["tenant"], "tier": out["tier"], "model": out["model"], "source": out["source"],
        "prompt_tokens": out["prompt_tokens"], "cached_prompt_tokens": out["cached_prompt_tokens"],
        "output_tokens": out["output_tokens"], "gpu_seconds": gpu, "price_per_gpu_hour": price,
        "cost_usd": gpu * price / 3600.0, "baseline_cost_usd": out["baseline_usd"], "created_at": out["created_at"],
    }, schema=LEDGER)
    bad = records.take(pa.array(bad_rows, pa.int64()))
    quarantine = quarantine_rows(bad, pa.array(bad_reasons, pa.string()), job_id, config.input.excerpt_chars,
                                 detail=pa.array(bad_details, pa.string()))
    return outputs, ledger, quarantine


def part_path(root: storage.Location, kind: str, job_id: str, partition: str) -> str:
    return root.join(kind, f"job={job_id}", f"partition={partition}", "part-0.parquet")


def write_partition(root: storage.Location, job_id: str, partition: str, tables: dict[str, pa.Table],
                    compression: str) -> None:
    """Write one partition's outputs, ledger and quarantine files (empty ones too), each atomically.

    `tables` hold this partition's rows only (with a `partition` column, as `assemble_results` makes them).

    The files are a pure function of the partition's records and the paid-for items, so a partition
    interrupted between its three renames is rewritten identically by the rerun that commits it.
    """
    schemas = {"outputs": OUTPUTS, "ledger": LEDGER, "quarantine": QUARANTINE}
    for kind in KINDS:
        # Files hold the kind's schema; `partition` stays in the ledger's rows, elsewhere it is the path.
        body = tables[kind].select(schemas[kind].names).cast(schemas[kind])
        storage.write_parquet_atomic(root, part_path(root, kind, job_id, partition), body, compression)


def write_manifest(root: storage.Location, job_id: str, manifest: dict) -> None:
    data = json.dumps(manifest, indent=2, sort_keys=False, default=str).encode()
    storage.write_bytes_atomic(root, root.join("jobs", job_id, "manifest.json"), data)


def count_by(table: pa.Table, column: str) -> dict[str, int]:
    if table.num_rows == 0:
        return {}
    counts = pc.value_counts(table[column]).to_pylist()
    return {c["values"]: c["counts"] for c in sorted(counts, key=lambda c: str(c["values"]))}
