"""The staging area: a job's own files between its steps, never read by analysts.

  _staging/job=<job>/plan.json, shard-<n>.json           planning's hand-off between its tasks
  _staging/job=<job>/partition=<p>/records.parquet       the partition's staged records (plan's output)
                                   quarantine.parquet    the rows planning quarantined
                                   keyed, sketch, split, reuse-<shard>, quarantine-read   planning's scratch
                                   wave-<n>-<token>-<tier>.parquet  wave n's engine requests for one tier
                                     (each with its generation, typed: partition_waves.WAVE_GENERATION)
                                   wave-state-<n>-<token>.parquet   the partition's wave state after wave n

A wave's files are named by the token of the derivation that wrote them: workers racing to derive the
same wave each write their own, and the one whose token the catalog took (Partition.wave_token) is the
wave; the others' are never read. (No token: files of a job staged before tokens, read by their old names.)

Its paths are built by stores/paths.py (`OutputPath.staging`). Every file is written atomically (a reader
sees the old file or the new one, never half of one).
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.fs as pafs

from pipeline.schema import REQUEST
from pipeline.stores import storage
from pipeline.stores.paths import OutputPath


class StagingArea:
    """One method per artefact: nothing outside addresses the area's files by name."""

    def __init__(self, root: storage.Location, job_id: str):
        self.root, self.job_id = root, job_id

    def _path(self, partition: str, name: str) -> str:
        return OutputPath.staging(self.job_id, f"{name}.parquet", partition).full(self.root)

    def _write(self, partition: str, name: str, table: pa.Table) -> None:
        storage.write_parquet_atomic(self.root, self._path(partition, name), table, "zstd")

    def _read(self, partition: str, name: str, columns: list[str] | None = None) -> pa.Table:
        table = storage.read_parquet(self.root, self._path(partition, name), columns)
        if "request" in table.column_names and pa.types.is_string(table.schema.field("request").type):
            # Staged before requests were typed: a document job's column is all null, read as a null REQUEST
            # column; a batch job's holds request JSON, which is not read as something else.
            if table["request"].null_count < table.num_rows:
                raise self.staged_before_typed_requests()
            at = table.column_names.index("request")
            table = table.set_column(at, pa.field("request", REQUEST), pa.nulls(table.num_rows, REQUEST))
        return table

    def staged_before_typed_requests(self) -> storage.StorageError:
        """A batch job staged when a batch request was JSON text (`schema.REQUEST` is what every step reads now)."""
        return storage.StorageError(
            f"job {self.job_id} was planned by an earlier tokenmill, which staged batch requests as JSON text; "
            "it cannot be continued: run its input as a new job (item keys are unchanged, so what this job "
            "generated is reused where the catalog or the cache holds it)"
        )

    def _json_path(self, name: str) -> str:
        return OutputPath.staging(self.job_id, f"{name}.json").full(self.root)

    def remove(self) -> None:
        """Delete the job's whole area (its staged records hold the input's text): for a job that has ended
        for good, such as a Batch API batch once it is finalised."""
        folder = OutputPath.staging(self.job_id).full(self.root)
        if self.root.fs.get_file_info(folder).type != pafs.FileType.NotFound:
            self.root.fs.delete_dir(folder)

    # -- planning's hand-offs between its steps (plan/streamed.py, plan/shards.py) ---------------------
    def write_plan(self, plan: dict) -> None:
        """The keyed step's plan (plan.json) for the shard and staged steps."""
        storage.write_bytes_atomic(self.root, self._json_path("plan"), json.dumps(plan).encode())

    def plan(self) -> dict:
        return json.loads(storage.read_bytes(self.root, self._json_path("plan")))

    def write_shard_figures(self, shard: int, figures: dict) -> None:
        """A clustered shard's dedup figures (shard-<n>.json): its presence says the shard is done."""
        storage.write_bytes_atomic(self.root, self._json_path(f"shard-{shard}"), json.dumps(figures).encode())

    def shard_figures(self, shard: int) -> dict:
        return json.loads(storage.read_bytes(self.root, self._json_path(f"shard-{shard}")))

    def write_keyed(self, partition: str, records: pa.Table) -> None:
        """A partition's records after the keyed stages (text included)."""
        self._write(partition, "keyed", records)

    def keyed(self, partition: str, columns: list[str] | None = None) -> pa.Table:
        return self._read(partition, "keyed", columns)

    def write_sketch(self, partition: str, sketch: pa.Table) -> None:
        """What the shards cluster by (scope, key, signature, embedding): the keyed records without text."""
        self._write(partition, "sketch", sketch)

    def sketch(self, partition: str, columns: list[str] | None = None) -> pa.Table:
        return self._read(partition, "sketch", columns)

    def write_read_quarantine(self, partition: str, rows: pa.Table) -> None:
        """The rows the reader and validation quarantined (duplicate ids are added when staged)."""
        self._write(partition, "quarantine-read", rows)

    def read_quarantine(self, partition: str) -> pa.Table:
        return self._read(partition, "quarantine-read")

    def write_split(self, partition: str, parts: pa.Table) -> None:
        """Each record's part of its cut scope (plan/shards.py cut_scopes)."""
        self._write(partition, "split", parts)

    def split(self, partition: str) -> pa.Table:
        return self._read(partition, "split")

    def write_reuse(self, partition: str, shard: int, decisions: pa.Table) -> None:
        """One shard's reuse decisions for the partition's records it clustered."""
        self._write(partition, f"reuse-{shard}", decisions)

    def reuse(self, partition: str, shard: int) -> pa.Table:
        return self._read(partition, f"reuse-{shard}")

    # -- what planning hands to the other steps ---------------------------------------------------------
    def write_staged(self, partition: str, records: pa.Table, quarantine: pa.Table) -> None:
        self._write(partition, "records", records)
        self._write(partition, "quarantine", quarantine)

    def records(self, partition: str, columns: list[str] | None = None) -> pa.Table:
        return self._read(partition, "records", columns)

    def quarantine(self, partition: str) -> pa.Table:
        return self._read(partition, "quarantine")

    # -- the generation's waves ------------------------------------------------------------------------
    @staticmethod
    def _wave(name: str, wave: int, token: str | None) -> str:
        return f"{name}-{wave}-{token}" if token else f"{name}-{wave}"

    def write_wave(self, partition: str, wave: int, token: str, tier: str, requests: pa.Table) -> None:
        self._write(partition, f"{self._wave('wave', wave, token)}-{tier}", requests)

    def wave(self, partition: str, wave: int, token: str | None, tier: str) -> pa.Table:
        """Wave `wave`'s requests of `tier` (StorageError when the wave sent none to that tier)."""
        return self._read(partition, f"{self._wave('wave', wave, token)}-{tier}")

    def write_wave_state(self, partition: str, wave: int, token: str, state: str) -> None:
        self._write(partition, self._wave("wave-state", wave, token), pa.table({"state": [state]}))

    def wave_state(self, partition: str, wave: int, token: str | None) -> str:
        return self._read(partition, self._wave("wave-state", wave, token))["state"][0].as_py()
