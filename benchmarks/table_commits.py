"""Partition commits: latency per partition, `ledger summary` over all of them, and files per partition.

Commits N partitions (default 1,000) of one job into a fresh local output root, each with the rows a partition
of 200 documents gives (200 outputs, 200 ledger rows, 2 quarantined), as the commit step writes them, and
times each partition's commit: in the Delta layout (pipeline/output/tables.py) staging its three files and one
transaction per table; in the layout before it (pipeline/output/commit.py, run from a checkout of that
version: this script imports whichever the tree has) its three files, the commit record and the sweep. Then
times `tokenmill ledger summary --by tenant` (in process, the CLI's own function) over the root, and, in the
Delta layout, `tables maintain` and the files per partition after it.

    python benchmarks/table_commits.py [N]      one JSON line
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.output.ledger import connect, summary  # noqa: E402
from pipeline.schema import LEDGER, OUTPUTS, QUARANTINE  # noqa: E402
from pipeline.stores import storage  # noqa: E402

ROWS = 200


def partition_rows(partition: str, n: int) -> dict[str, pa.Table]:
    now = datetime.now(timezone.utc)
    rows = [
        {
            "partition": partition,
            "job_id": "bench",
            "id": f"{partition}-{i}",
            "tenant": f"tenant-{i % 5}",
            "tier": "small" if i % 3 else "large",
            "model": "m",
            "summary": "a summary of about this many words " * 4,
            "source": "generated",
            "kind": "output",
            "prompt_tokens": 500 + i,
            "output_tokens": 80,
            "gpu_seconds": 0.01 * i,
            "cost_usd": 1e-5 * i,
            "baseline_cost_usd": 2e-5 * i,
            "created_at": now,
        }
        for i in range(n)
    ]
    bad = [{"partition": partition, "id": f"{partition}-bad-{i}", "reason": "empty_text", "job_id": "bench"}
           for i in range(2)]  # fmt: skip
    return {
        "outputs": pa.Table.from_pylist(rows, schema=pa.schema([("partition", pa.string()), *OUTPUTS])),
        "ledger": pa.Table.from_pylist(rows, schema=LEDGER),
        "quarantine": pa.Table.from_pylist(bad, schema=pa.schema([("partition", pa.string()), *QUARANTINE])),
    }


def committer():
    """(layout name, commit(root, partition, tables)) for the layout this tree has."""
    try:
        from pipeline.output import tables
    except ImportError:
        from pipeline.output import commit as records

        def commit_record(root, partition, rows):
            cid = records.new_commit_id(1)
            records.publish(
                root, "bench", partition, cid, records.write_files(root, "bench", partition, rows, "zstd", cid)
            )

        return "commit records", commit_record

    def commit_delta(root, partition, rows):
        tables.publish(
            root, "bench", partition, 1, tables.stage(root, "bench", partition, rows, "zstd", tables.new_commit_id(1))
        )

    return "delta", commit_delta


def main(n: int) -> dict:
    layout, commit = committer()
    with tempfile.TemporaryDirectory() as tmp:
        root = storage.resolve(str(Path(tmp) / "out"))
        data = [partition_rows(f"p{i:05d}", ROWS) for i in range(n)]
        seconds = []
        for i, rows in enumerate(data):
            start = time.perf_counter()
            commit(root, f"p{i:05d}", rows)
            seconds.append(time.perf_counter() - start)
        start = time.perf_counter()
        totals = summary(connect(root.path), ["tenant"])
        summary_s = time.perf_counter() - start
        assert sum(totals["items"].to_pylist()) == n * ROWS
        out = {
            "benchmark": "table_commits",
            "layout": layout,
            "partitions": n,
            "commit_ms_median": round(statistics.median(seconds) * 1000, 1),
            "commit_ms_p90": round(sorted(seconds)[int(0.9 * n)] * 1000, 1),
            "commit_ms_first_100_median": round(statistics.median(seconds[:100]) * 1000, 1),
            "commit_ms_last_100_median": round(statistics.median(seconds[-100:]) * 1000, 1),
            "ledger_summary_s": round(summary_s, 2),
        }
        if layout == "delta":
            from pipeline.output.tables import maintain, open_table

            before = len(open_table(root, "ledger").file_uris())
            start = time.perf_counter()
            maintain(root, retention_hours=0, target_mb=128)
            out["maintain_s"] = round(time.perf_counter() - start, 2)
            out["ledger_files_per_partition"] = {
                "before_maintain": before / n,
                "after_maintain": len(open_table(root, "ledger").file_uris()) / n,
            }
            start = time.perf_counter()
            summary(connect(root.path), ["tenant"])
            out["ledger_summary_after_maintain_s"] = round(time.perf_counter() - start, 2)
    return out


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 1000)))
