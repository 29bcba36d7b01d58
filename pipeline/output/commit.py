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


def epoch_of(commit: str) -> int:
    return int(commit.split("-", 1)[0])


def publish(root: storage.Location, job_id: str, partition: str, commit: str, files: dict[str, str]) -> bool:
    """The commit point: write the commit record, then delete the partition's files of older commits.

    A record of a newer commit (a higher epoch: a forced rerun committed since) is never replaced, and
    only files of lower epochs are deleted, so a late publish cannot remove what a newer commit
    names; False when a newer commit was found. (Read-then-write: should a newer record land between
    the two, the next manifest write of the job, which compares records with the catalog, restores it.)
    """
    current = published_commit(root, job_id, partition)
    if current is not None and current != commit and epoch_of(current) > epoch_of(commit):
        return False
    record = {"job_id": job_id, "partition": partition, "commit": commit, "files": files}
    storage.write_bytes_atomic(root, commit_path(root, job_id, partition), json.dumps(record).encode())
    for name in files.values():
        keep = root.join(name)
        folder = keep.rsplit("/", 1)[0]
        for info in root.fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True)):
            if info.type == pafs.FileType.File and info.path != keep and _older(info.path, epoch_of(commit)):
                _delete(root, info.path)
    return True


def _older(path: str, epoch: int) -> bool:
    """A partition file of an older commit (or an older version's part-0); never a temporary file."""
    name = path.rsplit("/", 1)[1]
    if name == LEGACY_FILE:
        return True
    if not (name.startswith("part-") and name.endswith(".parquet")):
        return False
    try:
        return epoch_of(name[len("part-"):-len(".parquet")]) < epoch
    except ValueError:
        return False


def published_commit(root: storage.Location, job_id: str, partition: str) -> str | None:
    """The commit id the partition's record names, or None when it has none."""
    try:
        return json.loads(storage.read_bytes(root, commit_path(root, job_id, partition)))["commit"]
    except storage.StorageError:
        return None


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


def committed_files(root: storage.Location) -> dict[str, list[str]]:
    """Full paths of every committed partition's files under the root, per kind.

    One listing of the commit records; the folders themselves are listed only for jobs that have no
    record at all (written by versions before commit records), to find their `part-0` files.
    """
    named: dict[str, list[str]] = {kind: [] for kind in KINDS}
    jobs_with_records = set()
    for info in root.fs.get_file_info(pafs.FileSelector(root.join(COMMITS), recursive=True, allow_not_found=True)):
        if info.type == pafs.FileType.File and info.path.endswith(".json"):
            record = json.loads(storage.read_bytes(root, info.path))
            jobs_with_records.add(record["job_id"])
            for kind in KINDS:
                named[kind].append(root.join(record["files"][kind]))
    for kind in KINDS:
        for job in root.fs.get_file_info(pafs.FileSelector(root.join(kind), allow_not_found=True)):
            if job.type != pafs.FileType.Directory or job.base_name.removeprefix("job=") in jobs_with_records:
                continue
            for info in root.fs.get_file_info(pafs.FileSelector(job.path, recursive=True)):
                if info.type == pafs.FileType.File and info.base_name == LEGACY_FILE:
                    named[kind].append(info.path)
    return {kind: sorted(paths) for kind, paths in named.items()}
