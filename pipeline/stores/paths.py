"""Every path under an output root, built and parsed here and nowhere else (as dlt's ParsedLoadJobFileName).

  _staging/job=<job>/<name>                             a job's staging area: planning's hand-offs (staging.py)
  _staging/job=<job>/partition=<p>/<name>               a partition's staged files
  <table>/job_id=<job>/partition=<p>/part-<commit>.parquet   a Delta table's file (outputs, ledger, quarantine)
  <table>/job=<job>/partition=<p>/part-0.parquet        a file of the layout before Delta tables (`old`)
  jobs/<job>/manifest.json                              a job's manifest
  batches/job=<job>/<file>.<output|errors|results>.jsonl   a batch input file's result files
  _api/<folder>/<name>                                  the Batch API's objects (serve/store.py)

An `OutputPath` is relative to the output root; `full(root)` is where it is, `OutputPath.parse(path, root)`
reads one back. A table's folder names are cosmetic (every reader takes a partition's values from the
table's log): a value that is not plain is written as a digest, and parsed back as that digest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipeline.stores import storage

STAGING, MANIFESTS, BATCHES, API = "_staging", "jobs", "batches", "_api"
TABLES = ("outputs", "ledger", "quarantine")
MANIFEST = "manifest.json"
_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


@dataclass(frozen=True)
class OutputPath:
    area: str  # the root's top folder: _staging, a table, jobs, batches, _api
    job: str | None = None
    partition: str | None = None
    name: str | None = None  # the file's name under its folder (may hold '/': a batch input file's own path)
    folder: str | None = None  # _api only: files, batches, inputs, active
    old: bool = False  # a table's folder of the layout before Delta tables (`job=` where tables write `job_id=`)

    # -- building ---------------------------------------------------------------------------------------
    @classmethod
    def staging(cls, job: str, name: str | None = None, partition: str | None = None) -> OutputPath:
        """A file of the job's staging area (name None: the job's whole area)."""
        return cls(STAGING, job, partition, name)

    @classmethod
    def table_file(cls, table: str, job: str, partition: str, commit: str) -> OutputPath:
        """A partition's file of one commit in a Delta table."""
        return cls(table, job, partition, f"part-{commit}.parquet")

    @classmethod
    def manifest(cls, job: str) -> OutputPath:
        return cls(MANIFESTS, job, name=MANIFEST)

    @classmethod
    def batch_result(cls, job: str, file: str, kind: str) -> OutputPath:
        """The result file of `kind` (output, errors, results) for the batch input file `file`."""
        return cls(BATCHES, job, name=f"{file}.{kind}.jsonl")

    @classmethod
    def api(cls, folder: str, name: str | None = None) -> OutputPath:
        return cls(API, name=name, folder=folder)

    def _folders(self) -> list[str]:
        if self.area == MANIFESTS:
            return [self.area, self.job] if self.job is not None else [self.area]
        if self.area == API:
            return [self.area] + ([self.folder] if self.folder is not None else [])
        table = self.area in TABLES and not self.old
        out = [self.area]
        if self.job is not None:
            out.append(f"job_id={_encode(self.job)}" if table else f"job={self.job}")
        if self.partition is not None:
            out.append(f"partition={_encode(self.partition)}" if table else f"partition={self.partition}")
        return out

    def __str__(self) -> str:
        return "/".join(self._folders() + ([self.name] if self.name is not None else []))

    def in_table(self) -> str:
        """A table file's path as the table's log names it: relative to the table's folder."""
        return str(self).split("/", 1)[1]

    def full(self, root: storage.Location) -> str:
        return root.join(str(self))

    # -- parsing ----------------------------------------------------------------------------------------
    @classmethod
    def parse(cls, path: str, root: storage.Location | None = None) -> OutputPath:
        """`path` (relative to the root, or a full path under `root`) read back into its parts."""
        if root is not None:
            prefix = root.path.rstrip("/") + "/"
            if not path.startswith(prefix):
                raise ValueError(f"{path}: not under the output root {root.path}")
            path = path[len(prefix) :]
        area, *rest = path.split("/")
        if area == MANIFESTS:
            return cls(area, rest[0] if rest else None, name="/".join(rest[1:]) or None)
        if area == API:
            return cls(area, name="/".join(rest[1:]) or None, folder=rest[0] if rest else None)
        job = partition = None
        old = False
        if rest and (rest[0].startswith("job=") or rest[0].startswith("job_id=")):
            key, job = rest.pop(0).split("=", 1)
            old = key == "job" and area in TABLES
        if rest and rest[0].startswith("partition="):
            partition = rest.pop(0).split("=", 1)[1]
        return cls(area, job, partition, "/".join(rest) or None, old=old)


def _encode(value: str) -> str:
    """A partition value as a table's folder name: itself when it is plain, else a digest of it. Only cosmetic:
    every reader takes partition values from the table's log, and a `%` in a Delta path would be read as an
    escape."""
    if _PLAIN.fullmatch(value):
        return value
    import xxhash

    return f"h{xxhash.xxh3_64_hexdigest(value.encode())}"
