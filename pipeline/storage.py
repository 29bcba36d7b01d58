"""Where bytes live: local folders and file:// URIs today, through pyarrow.fs so object stores plug in.

All writes are atomic: a reader sees a whole file or none. Locally that is a temporary name in
the same folder and a rename; object stores publish an object only when its upload completes.
"""

from __future__ import annotations

import io
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq


class StorageError(RuntimeError):
    """A storage location that cannot be used; the message names it."""


@dataclass(frozen=True)
class Location:
    fs: pafs.FileSystem
    path: str  # filesystem path of the root, without a trailing slash

    def join(self, *parts: str) -> str:
        return "/".join([self.path.rstrip("/"), *parts])


def resolve(uri: str) -> Location:
    if "://" not in uri:
        uri = str(Path(uri).expanduser().resolve())
    elif not uri.startswith("file://"):
        scheme = uri.split("://", 1)[0]
        raise StorageError(f"{uri}: the {scheme}:// scheme is not supported yet (local paths and file:// are)")
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, OSError) as e:
        raise StorageError(f"{uri}: {e}") from None
    return Location(fs, path.rstrip("/") or "/")


def list_files(root: Location) -> list[tuple[str, int]]:
    """(path relative to root, size) of every file under root, sorted by path."""
    info = root.fs.get_file_info(root.path)
    if info.type == pafs.FileType.NotFound:
        raise StorageError(f"input not found: {root.path}")
    if info.type == pafs.FileType.File:
        return [(os.path.basename(root.path), info.size)]
    entries = root.fs.get_file_info(pafs.FileSelector(root.path, recursive=True))
    prefix = root.path.rstrip("/") + "/"
    return sorted((e.path[len(prefix):], e.size) for e in entries if e.type == pafs.FileType.File)


def input_path(root: Location, relative: str) -> str:
    info = root.fs.get_file_info(root.path)
    return root.path if info.type == pafs.FileType.File else root.join(relative)


def read_bytes(root: Location, path: str) -> bytes:
    # compression=None: hand back the stored bytes; the reader decides how to decode (.gz included).
    with root.fs.open_input_stream(path, compression=None) as f:
        return f.read()


def write_bytes_atomic(root: Location, path: str, data: bytes) -> None:
    parent = path.rsplit("/", 1)[0]
    root.fs.create_dir(parent, recursive=True)
    if root.fs.type_name != "local":
        with root.fs.open_output_stream(path, compression=None) as f:
            f.write(data)
        return
    tmp = f"{parent}/.tmp-{uuid.uuid4().hex}-{path.rsplit('/', 1)[1]}"
    try:
        with root.fs.open_output_stream(tmp, compression=None) as f:
            f.write(data)
        root.fs.move(tmp, path)
    finally:
        if root.fs.get_file_info(tmp).type != pafs.FileType.NotFound:
            root.fs.delete_file(tmp)


def write_parquet_atomic(root: Location, path: str, table: pa.Table, compression: str) -> None:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression=None if compression == "none" else compression)
    write_bytes_atomic(root, path, buf.getvalue())


def delete_dir_if_exists(root: Location, path: str) -> None:
    if root.fs.get_file_info(path).type == pafs.FileType.Directory:
        root.fs.delete_dir(path)
