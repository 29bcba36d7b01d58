"""The staging area: a job's own files between its steps, never read by analysts.

  _staging/job=<job>/plan.json, shard-<n>.json           planning's hand-off between its tasks
  _staging/job=<job>/partition=<p>/records.parquet       the partition's staged records (plan's output)
                                   quarantine.parquet    the rows planning quarantined
                                   keyed, sketch, split, reuse-<shard>, quarantine-read   planning's scratch
                                   wave-<n>-<token>-<tier>.parquet  wave n's engine requests for one tier
                                   wave-state-<n>-<token>.parquet   the partition's wave state after wave n

A wave's files are named by the token of the derivation that wrote them: workers racing to derive the
same wave each write their own, and the one whose token the catalog took (Partition.wave_token) is the
wave; the others' are never read. (No token: files of a job staged before tokens, read by their old names.)

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
        storage.write_bytes_atomic(
            self.root, self.root.join("_staging", f"job={self.job_id}", f"{name}.json"), json.dumps(data).encode()
        )

    def read_json(self, name: str) -> dict:
        return json.loads(
            storage.read_bytes(self.root, self.root.join("_staging", f"job={self.job_id}", f"{name}.json"))
        )

    # -- what planning hands to the other steps ---------------------------------------------------------
    def records(self, partition: str) -> pa.Table:
        return self.read(partition, "records")

    def quarantine(self, partition: str) -> pa.Table:
        return self.read(partition, "quarantine")

    # -- the generation's waves ------------------------------------------------------------------------
    @staticmethod
    def _wave(name: str, wave: int, token: str | None) -> str:
        return f"{name}-{wave}-{token}" if token else f"{name}-{wave}"

    def write_wave(self, partition: str, wave: int, token: str, tier: str, requests: pa.Table) -> None:
        self.write(partition, f"{self._wave('wave', wave, token)}-{tier}", requests)

    def wave(self, partition: str, wave: int, token: str | None, tier: str) -> pa.Table:
        """Wave `wave`'s requests of `tier` (StorageError when the wave sent none to that tier)."""
        return self.read(partition, f"{self._wave('wave', wave, token)}-{tier}")

    def write_wave_state(self, partition: str, wave: int, token: str, state: str) -> None:
        self.write(partition, self._wave("wave-state", wave, token), pa.table({"state": [state]}))

    def wave_state(self, partition: str, wave: int, token: str | None) -> str:
        return self.read(partition, self._wave("wave-state", wave, token))["state"][0].as_py()
