"""The staging area: a job's own files between its steps, never read by analysts.

  _staging/job=<job>/plan.json, shard-<n>.json           planning's hand-off between its tasks
  _staging/job=<job>/partition=<p>/records.parquet       the partition's staged records (plan's output)
                                   quarantine.parquet    the rows planning quarantined
                                   keyed, sketch, split, reuse-<shard>, quarantine-read   planning's scratch
                                   wave-<n>-<tier>.parquet  wave n's engine requests for one tier
                                   wave-state-<n>.parquet   the partition's wave state after wave n

Every file is written atomically (a reader sees the old file or the new one, never half of one).
"""

from __future__ import annotations

import json

import pyarrow as pa

from pipeline.stores import storage


class StagingArea:
    def __init__(self, root: storage.Location, job_id: str):
        self.root, self.job_id = root, job_id

    def path(self, partition: str, name: str) -> str:
        return self.root.join("_staging", f"job={self.job_id}", f"partition={partition}", name)

    def write(self, partition: str, name: str, table: pa.Table) -> None:
        storage.write_parquet_atomic(self.root, self.path(partition, f"{name}.parquet"), table, "zstd")

    def read(self, partition: str, name: str, columns: list[str] | None = None) -> pa.Table:
        return storage.read_parquet(self.root, self.path(partition, f"{name}.parquet"), columns)

    def write_json(self, name: str, data: dict) -> None:
        """A job-level file of planning's (`plan.json`, `shard-<n>.json`), beside the partitions."""
        storage.write_bytes_atomic(self.root, self.root.join("_staging", f"job={self.job_id}", f"{name}.json"),
                                   json.dumps(data).encode())

    def read_json(self, name: str) -> dict:
        return json.loads(storage.read_bytes(self.root, self.root.join("_staging", f"job={self.job_id}", f"{name}.json")))

    # -- what planning hands to the other steps ---------------------------------------------------------
    def records(self, partition: str) -> pa.Table:
        return self.read(partition, "records")

    def quarantine(self, partition: str) -> pa.Table:
        return self.read(partition, "quarantine")

    # -- the generation's waves ------------------------------------------------------------------------
    def write_wave(self, partition: str, wave: int, tier: str, requests: pa.Table) -> None:
        self.write(partition, f"wave-{wave}-{tier}", requests)

    def wave(self, partition: str, wave: int, tier: str) -> pa.Table:
        """Wave `wave`'s requests of `tier` (StorageError when the wave sent none to that tier)."""
        return self.read(partition, f"wave-{wave}-{tier}")

    def write_wave_state(self, partition: str, wave: int, state: str) -> None:
        self.write(partition, f"wave-state-{wave}", pa.table({"state": [state]}))

    def wave_state(self, partition: str, wave: int) -> str:
        return self.read(partition, f"wave-state-{wave}")["state"][0].as_py()
