"""The partition commit protocol: readers see a partition whole, or not at all.

An attempt writes the partition's outputs, ledger and quarantine files under names unique to it
(`<kind>/job=<job>/partition=<p>/part-<commit>.parquet`), which no reader that honours commits
reads. The commit point is one object, written atomically and last:

    _commits/job=<job>/partition=<p>.json    {"commit": ..., "files": {kind: path under the root}}

Readers (the ledger views, `tokenmill ledger sql`, the report, the estimate's rates) read exactly the
files that commit records name. After a record is published, files of the partition that it does not
name (earlier attempts, a crashed one) are deleted. Only the claim holding the partition's latest
epoch publishes: the state catalog fences the commit first (catalog.finish_partition), so a worker
whose lease was taken over writes nothing visible.

Why a commit record and not a table format (Delta Lake via `deltalake`): a partition's commit must
cover three tables at once, and Delta commits one table at a time; Delta on S3 also needs
conditional puts or a lock, which the catalog's fencing already gives here. The price: tools that
glob the Parquet folders (DuckDB, Spark) should read the files the commit records name (docs/analyst.md
shows how), or glob only after a job has finished (when the folders hold committed files only).

Partitions that older versions wrote (`part-0.parquet`, no commit record) are read as committed.
"""

from __future__ import annotations

import json
import logging
import uuid

import pyarrow as pa
import pyarrow.fs as pafs

from pipeline.schema import LEDGER, OUTPUTS, QUARANTINE
from pipeline.stores import storage

log = logging.getLogger(__name__)
KINDS = ("outputs", "ledger", "quarantine")
SCHEMAS = {"outputs": OUTPUTS, "ledger": LEDGER, "quarantine": QUARANTINE}
COMMITS = "_commits"
LEGACY_FILE = "part-0.parquet"  # what versions before commit records wrote, one rename at a time


def new_commit_id(epoch: int) -> str:
    return f"{epoch:06d}-{uuid.uuid4().hex[:12]}"


def part_path(root: storage.Location, kind: str, job_id: str, partition: str, commit: str) -> str:
    return root.join(kind, f"job={job_id}", f"partition={partition}", f"part-{commit}.parquet")


def commit_path(root: storage.Location, job_id: str, partition: str) -> str:
    return root.join(COMMITS, f"job={job_id}", f"partition={partition}.json")


def write_files(root: storage.Location, job_id: str, partition: str, tables: dict[str, pa.Table],
                compression: str, commit: str) -> dict[str, str]:
    """Write a partition's three files (empty ones too) under this commit's names; returns kind -> path
    relative to the root. Nothing is visible until `publish`.

    `tables` hold this partition's rows only (with a `partition` column, as `assemble_results` makes them).
    """
    files = {}
    for kind in KINDS:
        # Files hold the kind's schema; `partition` stays in the ledger's rows, elsewhere it is the path.
        body = tables[kind].select(SCHEMAS[kind].names).cast(SCHEMAS[kind])
        path = part_path(root, kind, job_id, partition, commit)
        storage.write_parquet_atomic(root, path, body, compression)
        files[kind] = relative(root, path)
    return files


def relative(root: storage.Location, path: str) -> str:
    return path[len(root.path.rstrip("/")) + 1:]


def publish(root: storage.Location, job_id: str, partition: str, commit: str, files: dict[str, str]) -> None:
    """The commit point: write the commit record, then delete the partition's files it does not name."""
    record = {"job_id": job_id, "partition": partition, "commit": commit, "files": files}
    storage.write_bytes_atomic(root, commit_path(root, job_id, partition), json.dumps(record).encode())
    for kind, name in files.items():
        keep = root.join(name)
        folder = keep.rsplit("/", 1)[0]
        for info in root.fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True)):
            if info.type == pafs.FileType.File and info.path != keep:
                _delete(root, info.path)


def is_published(root: storage.Location, job_id: str, partition: str) -> bool:
    return root.fs.get_file_info(commit_path(root, job_id, partition)).type == pafs.FileType.File


def discard(root: storage.Location, files: dict[str, str]) -> None:
    """Remove an attempt's files that will not be published (its commit was fenced out)."""
    for name in files.values():
        _delete(root, root.join(name))


def _delete(root: storage.Location, path: str) -> None:
    try:
        root.fs.delete_file(path)
    except FileNotFoundError:
        pass
    except OSError as e:  # a leftover is invisible to readers; the next commit of the partition retries
        log.warning("could not delete %s: %s", root.uri(path), e)


def committed_files(root: storage.Location, kind: str) -> list[str]:
    """Full paths of the `kind` files of every committed partition under the root."""
    named = {}
    for info in root.fs.get_file_info(pafs.FileSelector(root.join(COMMITS), recursive=True, allow_not_found=True)):
        if info.type == pafs.FileType.File and info.path.endswith(".json"):
            record = json.loads(storage.read_bytes(root, info.path))
            named[(record["job_id"], record["partition"])] = root.join(record["files"][kind])
    legacy = []
    for info in root.fs.get_file_info(pafs.FileSelector(root.join(kind), recursive=True, allow_not_found=True)):
        if info.type == pafs.FileType.File and info.path.endswith("/" + LEGACY_FILE):
            job, part = info.path.rsplit("/", 3)[1:3]
            if (job.removeprefix("job="), part.removeprefix("partition=")) not in named:
                legacy.append(info.path)
    return sorted([*named.values(), *legacy])
