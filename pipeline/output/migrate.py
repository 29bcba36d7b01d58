"""`tokenmill tables migrate`: an output root of the layout before Delta tables, converted once.

That layout kept each kind as Hive folders of Parquet files (`<kind>/job=<job>/partition=<p>/part-<commit>.parquet`,
and `part-0.parquet` from versions before commit records) and named a partition's committed files in a commit
record, `_commits/job=<job>/partition=<p>.json`. Each committed partition is published into the tables as a
commit of the epoch its record names (app transactions: a partition converted before is skipped, so a killed
migration is run again as it is); then the old files and, last, the commit records are deleted, so the root
stops being refused by jobs only once all of it is in the tables.
"""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.fs as pafs

from pipeline.output.tables import KINDS, LEGACY_MARKER, SCHEMAS, app_id, commit_rows, old_layout, open_table
from pipeline.stores import storage
from pipeline.stores.paths import OutputPath

log = logging.getLogger(__name__)
LEGACY_FILE = "part-0.parquet"


def committed_partitions(root: storage.Location) -> dict[tuple[str, str], tuple[int, dict[str, str]]]:
    """(job, partition) -> (the commit's epoch, kind -> full path of its file), from the commit records, and
    from the `part-0.parquet` files of jobs that have no record (epoch 0)."""
    found: dict[tuple[str, str], tuple[int, dict[str, str]]] = {}
    selector = pafs.FileSelector(root.join(LEGACY_MARKER), recursive=True, allow_not_found=True)
    for info in root.fs.get_file_info(selector):
        if info.type == pafs.FileType.File and info.path.endswith(".json") and not info.base_name.startswith("."):
            record = json.loads(storage.read_bytes(root, info.path))
            epoch = int(record["commit"].split("-", 1)[0])
            files = {kind: root.join(record["files"][kind]) for kind in KINDS}
            found[(record["job_id"], record["partition"])] = (epoch, files)
    with_records = {job for job, _ in found}
    for kind in KINDS:
        for info in root.fs.get_file_info(pafs.FileSelector(root.join(kind), recursive=True, allow_not_found=True)):
            path = OutputPath.parse(info.path, root)
            if info.base_name != LEGACY_FILE or not path.old or path.partition is None:
                continue
            job, partition = path.job, path.partition
            if job not in with_records:
                found.setdefault((job, partition), (0, {}))[1][kind] = info.path
    return found


def conform(table: pa.Table, kind: str, partition: str) -> pa.Table:
    """An old file's rows in the table's schema: `partition` from the record, columns it predates as null."""
    schema = SCHEMAS[kind]
    if "partition" not in table.column_names:
        table = table.append_column("partition", pa.array([partition] * table.num_rows, pa.string()))
    columns = [
        table[f.name].cast(f.type) if f.name in table.column_names else pa.nulls(table.num_rows, f.type) for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def migrate(root: storage.Location, compression: str = "zstd") -> dict[str, int]:
    """Convert the root (see above). Returns {"partitions": converted now, "skipped": converted before,
    "files_deleted": old files and records deleted}."""
    if not old_layout(root):
        return {"partitions": 0, "skipped": 0, "files_deleted": 0}
    tables = {kind: open_table(root, kind) for kind in KINDS}
    done = {"partitions": 0, "skipped": 0, "files_deleted": 0}
    for (job, partition), (epoch, files) in sorted(committed_partitions(root).items()):
        epoch = max(epoch, 1)  # an app transaction's version: the first claim's epoch is 1
        have = [t.transaction_version(app_id(job, partition)) if t is not None else None for t in tables.values()]
        if all(v is not None and v >= epoch for v in have):
            done["skipped"] += 1
            continue
        rows = {
            kind: conform(storage.read_parquet(root, files[kind]), kind, partition)
            if kind in files
            else SCHEMAS[kind].empty_table()
            for kind in KINDS
        }
        commit_rows(root, job, partition, rows, epoch, compression)
        done["partitions"] += 1
    # The old files, then the records: a migration killed here is run again and finds every partition done.
    for kind in KINDS:
        for info in root.fs.get_file_info(pafs.FileSelector(root.join(kind), allow_not_found=True)):
            if info.type == pafs.FileType.Directory and OutputPath.parse(info.path, root).old:
                done["files_deleted"] += delete_tree(root, info.path)
    done["files_deleted"] += delete_tree(root, root.join(LEGACY_MARKER))
    return done


def delete_tree(root: storage.Location, path: str) -> int:
    files = [
        i
        for i in root.fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
        if i.type == pafs.FileType.File
    ]
    if root.fs.get_file_info(path).type == pafs.FileType.Directory:
        root.fs.delete_dir(path)
    return len(files)
