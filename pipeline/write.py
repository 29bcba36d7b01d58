"""Stage 7, write: give every valid record its output or quarantine row, price it, and commit per partition.

Layout under the output root (Hive style, zstd Parquet):
  outputs/job=<job>/partition=<p>/part-0.parquet
  ledger/job=<job>/partition=<p>/part-0.parquet
  quarantine/job=<job>/partition=<p>/part-0.parquet
  jobs/<job>/manifest.json
Every partition of the job gets all three files (possibly empty), written atomically with fixed
names, so a rerun of the same job id replaces them instead of adding rows.
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


def assemble_results(records: pa.Table, completions: pa.Table, gpu_seconds: np.ndarray, baseline_seconds: np.ndarray,
                     failed: dict[str, tuple[str, str]], config: TokenmillConfig, job_id: str,
                     created_at: datetime) -> tuple[pa.Table, pa.Table, pa.Table]:
    """(outputs, ledger, quarantine) for the valid `records`, each with a `partition` column to file it under.

    `failed` maps a representative's id to (reason, detail) when it produced no output; its
    duplicates share its fate. Every record lands in exactly one of outputs or quarantine.
    """
    done = {id_: i for i, id_ in enumerate(completions["id"].to_pylist())}
    comp = {name: completions[name].to_pylist() for name in completions.column_names}
    largest = config.tiers[config.largest_tier]
    out = {name: [] for name in ["partition", *OUTPUTS.names, "gpu_seconds", "price", "baseline_usd"]}
    bad_rows, bad_reasons, bad_details = [], [], []
    for row, (id_, tenant, dup_of, part) in enumerate(zip(records["id"].to_pylist(), records["tenant"].to_pylist(),
                                                          records["duplicate_of"].to_pylist(),
                                                          records["partition"].to_pylist())):
        rep = dup_of or id_
        if rep not in done:
            reason, detail = failed[rep]  # KeyError here is a bug: a record with no fate
            bad_rows.append(row)
            bad_reasons.append(reason)
            bad_details.append(detail if dup_of is None else f"duplicate of {rep}: {detail}")
            continue
        i = done[rep]
        generated = dup_of is None
        price = config.tiers[comp["tier"][i]].price_per_gpu_hour
        values = {
            "partition": part, "id": id_, "tenant": tenant, "summary": comp["summary"][i], "tier": comp["tier"][i],
            "model": comp["model"][i], "source": "generated" if generated else "duplicate_in_job",
            "source_id": None if generated else rep,
            "prompt_tokens": comp["prompt_tokens"][i] if generated else 0,
            "cached_prompt_tokens": comp["cached_prompt_tokens"][i] if generated else 0,
            "output_tokens": comp["output_tokens"][i] if generated else 0,
            "finish_reason": comp["finish_reason"][i], "template_version": config.prompt.template_version,
            "job_id": job_id, "created_at": created_at,
            "gpu_seconds": float(gpu_seconds[i]) if generated else 0.0, "price": price,
            "baseline_usd": float(baseline_seconds[i]) * largest.price_per_gpu_hour / 3600.0,
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


def write_partitions(root: storage.Location, job_id: str, partitions: list[str], tables: dict[str, pa.Table],
                     compression: str) -> None:
    """Write every partition's outputs, ledger and quarantine files (empty ones too)."""
    schemas = {"outputs": OUTPUTS, "ledger": LEDGER, "quarantine": QUARANTINE}
    for kind in KINDS:
        table = tables[kind]
        index: dict[str, list[int]] = {}
        for i, p in enumerate(table["partition"].to_pylist()):
            index.setdefault(p, []).append(i)
        # Files hold the kind's schema; `partition` stays in the ledger's rows, elsewhere it is the path.
        body = table.select(schemas[kind].names).cast(schemas[kind])
        for p in partitions:
            rows = body.take(pa.array(index.get(p, []), pa.int64()))
            storage.write_parquet_atomic(root, part_path(root, kind, job_id, p), rows, compression)


def write_manifest(root: storage.Location, job_id: str, manifest: dict) -> None:
    data = json.dumps(manifest, indent=2, sort_keys=False, default=str).encode()
    storage.write_bytes_atomic(root, root.join("jobs", job_id, "manifest.json"), data)


def read_manifest(root: storage.Location, job_id: str) -> dict:
    return json.loads(storage.read_bytes(root, root.join("jobs", job_id, "manifest.json")))


def count_by(table: pa.Table, column: str) -> dict[str, int]:
    if table.num_rows == 0:
        return {}
    counts = pc.value_counts(table[column]).to_pylist()
    return {c["values"]: c["counts"] for c in sorted(counts, key=lambda c: str(c["values"]))}
