"""The partition commit protocol: readers see a partition whole, or not at all.

An attempt writes the partition's outputs, ledger and quarantine files under names unique to it
(`<kind>/job=<job>/partition=<p>/part-<commit>.parquet`), which no reader that honours commits
reads. The commit point is one object, written atomically and last:

    _commits/job=<job>/partition=<p>.json    {"commit": ..., "files": {kind: path under the root}}

Readers (the ledger views, `tokenmill ledger sql`, the report, the estimate's rates) read exactly the
files that commit records name. Every file is written under a temporary name that no glob of
`*.parquet` or `*.json` matches (`.<name>.tmp-<uuid>`), then renamed. After a record is published,
and again at every manifest write (every run and rerun), `sweep_leftovers` deletes the partition's
files of older commits and what killed writes left. Only the claim holding the partition's latest
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
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pyarrow.fs as pafs

from pipeline.schema import LEDGER, OUTPUTS, QUARANTINE
from pipeline.stores import storage

log = logging.getLogger(__name__)
KINDS = ("outputs", "ledger", "quarantine")
SCHEMAS = {"outputs": OUTPUTS, "ledger": LEDGER, "quarantine": QUARANTINE}
COMMITS = "_commits"
LEGACY_FILE = "part-0.parquet"  # what versions before commit records wrote, one rename at a time
TEMPORARY_RECORD_SECONDS = 600  # a temporary commit record this old is a killed write's, not one in flight


def new_commit_id(epoch: int) -> str:
    return f"{epoch:06d}-{uuid.uuid4().hex[:12]}"


def part_path(root: storage.Location, kind: str, job_id: str, partition: str, commit: str) -> str:
    return root.join(kind, f"job={job_id}", f"partition={partition}", f"part-{commit}.parquet")


def commit_path(root: storage.Location, job_id: str, partition: str) -> str:
    return root.join(COMMITS, f"job={job_id}", f"partition={partition}.json")


def write_files(
    root: storage.Location, job_id: str, partition: str, tables: dict[str, pa.Table], compression: str, commit: str
) -> dict[str, str]:
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
    return path[len(root.path.rstrip("/")) + 1 :]


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
    sweep_leftovers(root, job_id, {partition: commit}, whole_job=False)
    return True


def sweep_leftovers(root: storage.Location, job_id: str, committed: dict[str, str], whole_job: bool = True) -> int:
    """Delete what no reader should see of the job's partitions committed as `committed` (partition ->
    commit): files of older commits (a kill between a commit record and its clean-up leaves them) and
    temporary files a killed write of an older commit left. Files of newer commits (a forced rerun in
    flight) are kept. `whole_job` (every manifest write): one recursive listing per kind, and temporary
    commit records of those partitions older than TEMPORARY_RECORD_SECONDS (a younger one may be another
    worker's publish in flight); otherwise (a publish) only the committed partitions' own folders are
    listed. Returns how many files it deleted."""
    deleted = 0
    for kind in KINDS:
        folders = (
            [root.join(kind, f"job={job_id}")]
            if whole_job
            else [root.join(kind, f"job={job_id}", f"partition={p}") for p in committed]
        )
        for folder in folders:
            for info in root.fs.get_file_info(pafs.FileSelector(folder, recursive=True, allow_not_found=True)):
                partition = info.path.rsplit("/", 2)[-2].removeprefix("partition=")
                if (
                    info.type == pafs.FileType.File
                    and partition in committed
                    and _older(info.base_name, epoch_of(committed[partition]))
                ):
                    deleted += _delete(root, info.path)
    if not whole_job:
        return deleted
    old = datetime.now(timezone.utc) - timedelta(seconds=TEMPORARY_RECORD_SECONDS)
    for info in root.fs.get_file_info(pafs.FileSelector(root.join(COMMITS, f"job={job_id}"), allow_not_found=True)):
        target = storage.temporary_target(info.base_name)
        if (
            target is not None
            and target.removeprefix("partition=").removesuffix(".json") in committed
            and info.mtime is not None
            and info.mtime.astimezone(timezone.utc) < old
        ):
            deleted += _delete(root, info.path)
    return deleted


def _older(name: str, epoch: int) -> bool:
    """A partition file of an older commit (or an older version's part-0), or a temporary one a killed
    write of an older commit left; never a file of this commit or a newer one."""
    name = storage.temporary_target(name) or name
    if name == LEGACY_FILE:
        return True
    if not (name.startswith("part-") and name.endswith(".parquet")):
        return False
    try:
        return epoch_of(name[len("part-") : -len(".parquet")]) < epoch
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


def _delete(root: storage.Location, path: str) -> int:
    try:
        root.fs.delete_file(path)
        return 1
    except FileNotFoundError:
        return 0
    except OSError as e:  # a leftover is invisible to readers; the next sweep of the partition retries
        log.warning("could not delete %s: %s", root.uri(path), e)
        return 0


def committed_files(root: storage.Location) -> dict[str, list[str]]:
    """Full paths of every committed partition's files under the root, per kind.

    One listing of the commit records; the folders themselves are listed only for jobs that have no
    record at all (written by versions before commit records), to find their `part-0` files.
    """
    named: dict[str, list[str]] = {kind: [] for kind in KINDS}
    jobs_with_records = set()
    for info in root.fs.get_file_info(pafs.FileSelector(root.join(COMMITS), recursive=True, allow_not_found=True)):
        # A record is written whole under its own name; a dot-file is a temporary one a kill left.
        if info.type == pafs.FileType.File and info.path.endswith(".json") and not info.base_name.startswith("."):
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
