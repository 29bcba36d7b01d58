"""Where bytes live: local folders, file:// URIs and s3:// buckets, all through pyarrow.fs.

pyarrow's S3 filesystem (the AWS C++ SDK) gives what object storage needs without extra code:
the standard credential chain (environment, profile, instance/pod role), listing that pages
through large prefixes, multipart uploads for large objects, and bounded retries of throttling,
5xx answers and timeouts with exponential backoff and jitter (`storage.s3_max_attempts`). Errors
surface as StorageError naming the object, never the credentials.

All writes are atomic: a reader sees a whole file or none. Locally that is a temporary name in
the same folder and a rename; an S3 object appears only when its upload completes.
"""

from __future__ import annotations

import errno
import functools
import io
import logging
import os
import re
import stat
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.config import StorageConfig
from pipeline.config.env import redact_url, scrub, url_credentials

log = logging.getLogger(__name__)


class StorageError(RuntimeError):
    """A storage location or object that cannot be used; the message names it."""


@dataclass(frozen=True)
class Location:
    fs: pafs.FileSystem
    path: str  # filesystem path of the root, without a trailing slash ("bucket/prefix" on S3)
    scheme: str = ""  # "s3" for object storage, "" for local
    config: StorageConfig | None = field(default=None, compare=False)  # how to reach the object store

    def join(self, *parts: str) -> str:
        return "/".join([self.path.rstrip("/"), *parts])

    def uri(self, path: str) -> str:
        return f"{self.scheme}://{path}" if self.scheme else path


def _configured_endpoint(session, profile: dict) -> str | None:
    """The S3 endpoint the AWS SDKs and CLI would use, in their order: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL,
    the profile's `services` section (`s3 = endpoint_url = ...`), the profile's `endpoint_url`; none at all
    when AWS_IGNORE_CONFIGURED_ENDPOINT_URLS is true."""
    if session.get_config_variable("ignore_configured_endpoint_urls"):
        return None
    env = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if env:
        return env
    services = (
        session.full_config.get("services", {}).get(profile.get("services"), {}) if profile.get("services") else {}
    )
    s3 = services.get("s3") if isinstance(services, dict) else None
    return (s3.get("endpoint_url") if isinstance(s3, dict) else None) or profile.get("endpoint_url")


def aws_storage_config(config: StorageConfig) -> StorageConfig:
    """`config` with the endpoint and region the AWS SDKs would use where it leaves them unset.

    pyarrow's S3 client (the AWS C++ SDK) takes credentials from the standard chain, AWS_PROFILE
    included, but not an endpoint from the environment or the profile: a local S3-compatible server
    named only in AWS_ENDPOINT_URL_S3 (which boto3 and the AWS CLI honour) would be looked up on AWS.
    Region: AWS_REGION, then AWS_DEFAULT_REGION, then the profile's (botocore reads the shared config
    file, AWS_CONFIG_FILE and AWS_PROFILE as the CLI does); still unset, pyarrow's own heuristics."""
    if config.s3_endpoint_url and config.s3_region:
        return config
    import botocore.session
    from botocore.exceptions import BotoCoreError

    try:
        session = botocore.session.Session()
        profile = session.get_scoped_config()
        endpoint = config.s3_endpoint_url or _configured_endpoint(session, profile)
        region = config.s3_region or os.environ.get("AWS_REGION") or session.get_config_variable("region")
    except BotoCoreError as e:  # AWS_PROFILE names no profile, a malformed shared config file
        raise StorageError(f"AWS configuration: {e}") from None
    return config.model_copy(update={"s3_endpoint_url": endpoint or None, "s3_region": region or None})


def s3_filesystem(config: StorageConfig) -> pafs.S3FileSystem:
    """pyarrow's S3 client for `config` as resolve() completes it (aws_storage_config)."""
    endpoint = urlparse(config.s3_endpoint_url) if config.s3_endpoint_url else None
    return pafs.S3FileSystem(
        region=config.s3_region,
        endpoint_override=endpoint.netloc if endpoint else None,
        scheme=endpoint.scheme if endpoint else "https",
        connect_timeout=config.s3_connect_timeout_seconds,
        request_timeout=config.s3_request_timeout_seconds,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=config.s3_max_attempts),
        allow_bucket_creation=False,
        check_directory_existence_before_creation=False,
    )


def resolve(uri: str, config: StorageConfig | None = None) -> Location:
    config = config or StorageConfig()
    shown = redact_url(uri)  # messages name the location, never a password in it
    if url_credentials(uri) is not None:
        raise StorageError(
            f"{shown}: credentials in a URI are not supported; object storage takes them from "
            "the AWS chain (environment variables, profile, instance or pod role)"
        )
    if uri.startswith("s3://"):
        bucket_and_prefix = uri[len("s3://") :].rstrip("/")
        if not bucket_and_prefix:
            raise StorageError(f"{shown}: no bucket")
        config = aws_storage_config(config)  # the Location's writers reach the same endpoint and region
        try:
            return Location(s3_filesystem(config), bucket_and_prefix, "s3", config)
        except (pa.ArrowException, OSError) as e:
            raise StorageError(f"{shown}: {scrub(str(e), uri, config.s3_endpoint_url)}") from None
    if "://" not in uri:
        uri = str(Path(uri).expanduser().resolve())
    elif not uri.startswith("file://"):
        raise StorageError(
            f"{shown}: the {uri.split('://', 1)[0]}:// scheme is not supported (local paths, file:// and s3:// are)"
        )
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, OSError) as e:
        raise StorageError(f"{shown}: {scrub(str(e), uri)}") from None
    return Location(fs, path.rstrip("/") or "/")


def check_writable(root: Location) -> None:
    """Raise StorageError naming the root when a local root cannot be written (a read-only mount, no
    permission, a path through a file): said before any work, not by a partition's first write after
    engines started. An empty file is created and deleted. Object stores are not probed: a write costs a
    request there, and their first write's error names the object."""
    if root.scheme:
        return
    probe = root.join(f".tokenmill-write-check-{uuid.uuid4().hex}")
    try:
        os.makedirs(root.path, exist_ok=True)
        with open(probe, "xb"):
            pass
        os.remove(probe)
    except OSError as e:
        why = f"{e.strerror} ({errno.errorcode.get(e.errno, e.errno)})" if e.strerror else str(e)
        raise StorageError(f"{root.path} cannot be written: {why}") from None


def _error(root: Location, path: str, e: Exception) -> StorageError:
    message = str(e).splitlines()[0] if str(e) else type(e).__name__
    return StorageError(f"{root.uri(path)}: {message}")


def list_files(root: Location, skipped: list[str] | None = None) -> list[tuple[str, str, int]]:
    """(path relative to root, full path, size) of every regular file under root, sorted by path. What is
    not read (links out of the root, FIFOs and devices, folders that cannot be listed) is logged and, as
    one `<relative path>: <why>` line each, appended to `skipped`."""
    skipped = [] if skipped is None else skipped
    try:
        info = root.fs.get_file_info(root.path)
        if info.type == pafs.FileType.NotFound:
            raise StorageError(f"input not found: {root.uri(root.path)}")
        if not root.scheme:
            return _local_files(root.path, skipped)
        if info.type == pafs.FileType.File:
            return [(os.path.basename(root.path), root.path, info.size)]
        entries = root.fs.get_file_info(pafs.FileSelector(root.path, recursive=True))
    except OSError as e:
        raise _error(root, root.path, e) from None
    prefix = root.path.rstrip("/") + "/"
    return sorted((e.path[len(prefix) :], e.path, e.size) for e in entries if e.type == pafs.FileType.File)


def _local_files(top: str, skipped: list[str]) -> list[tuple[str, str, int]]:
    """Files under a local root (or the root itself, a file). Only regular files are inputs: a FIFO named
    like one would block its reader forever, a device would be read without bound. Symbolic links are
    hostile input: a link whose target is missing or lies outside the root is skipped (an input folder
    must not read, say, /etc), and a linked folder is not followed (its files would be read twice, or
    from outside)."""
    if not os.path.isdir(top):
        name = os.path.basename(top)
        mode = os.stat(top).st_mode
        if not stat.S_ISREG(mode):
            raise StorageError(f"input {top} is not a regular file or a folder ({_kind(mode)})")
        return [(name, top, os.path.getsize(top))]
    real_top, out = os.path.realpath(top), []

    def skip(path: str, why: str) -> None:
        log.warning("input: skipped %s: %s", path, why)
        skipped.append(f"{os.path.relpath(path, top)}: skipped, {why}")

    def unlistable(e: OSError) -> None:
        skip(e.filename or top, f"a folder that cannot be listed ({e.strerror or e}); its files are not read")

    for folder, subfolders, names in os.walk(top, followlinks=False, onerror=unlistable):
        for name in sorted(subfolders):
            if os.path.islink(os.path.join(folder, name)):
                skip(os.path.join(folder, name), "a linked folder is not followed")
        for name in sorted(names):
            path = os.path.join(folder, name)
            try:
                path.encode("utf-8")
            except UnicodeEncodeError:  # a name that is not UTF-8: no record could say where it came from
                log.warning("input: skipped %r: its name is not valid UTF-8; rename it to read it", path)
                skipped.append(f"{os.path.relpath(path, top)!r}: skipped, its name is not valid UTF-8")
                continue
            if os.path.islink(path):
                target = os.path.realpath(path)
                if not os.path.exists(target):
                    skip(path, f"a link to {os.readlink(path)}, which does not exist")
                    continue
                if os.path.commonpath([real_top, target]) != real_top or not os.path.isfile(target):
                    skip(path, f"a link to {target}, outside the input folder")
                    continue
            mode = os.stat(path).st_mode
            if not stat.S_ISREG(mode):
                skip(path, f"not a regular file ({_kind(mode)}); only regular files are read")
                continue
            out.append((os.path.relpath(path, top).replace(os.sep, "/"), path, os.path.getsize(path)))
    return sorted(out)


def _kind(mode: int) -> str:
    return (
        "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a character device"
        if stat.S_ISCHR(mode)
        else "a block device"
        if stat.S_ISBLK(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "not a file"
    )


def read_bytes(root: Location, path: str) -> bytes:
    try:
        # compression=None: hand back the stored bytes; the reader decides how to decode (.gz included).
        with root.fs.open_input_stream(path, compression=None) as f:
            return f.read()
    except OSError as e:
        raise _error(root, path, e) from None


def write_bytes_atomic(root: Location, path: str, data: bytes) -> None:
    """Write `path` so that readers see the old object or all of the new one, never a part of it.

    On S3, through boto3's transfer manager: the object appears only once all of it has arrived, and a
    failed multipart upload is aborted, leaving nothing behind. (pyarrow's output stream is not used
    for writes: an exception inside one still completes its multipart upload on close and publishes
    a partial object, apache/arrow#40502, and a failed upload is left incomplete, with no way to
    abort it.)
    Locally, the bytes go to a temporary name beside `path`, are fsynced, renamed into place, and the
    folder is fsynced, so a power cut cannot leave a named but empty or partial file.
    """
    if root.scheme:
        return _put_object(root, path, data)
    parent, name = path.rsplit("/", 1)
    # Not ending in the real name's extension: a glob of `*.parquet` or `*.json` never reads a half-written file.
    tmp = f"{parent}/.{name}.tmp-{uuid.uuid4().hex}"
    try:
        root.fs.create_dir(parent, recursive=True)
        try:
            _write_local_durably(tmp, data)
            root.fs.move(tmp, path)
            _fsync_dir(parent)
        finally:
            if root.fs.get_file_info(tmp).type != pafs.FileType.NotFound:
                root.fs.delete_file(tmp)
    except OSError as e:
        raise _error(root, path, e) from None


def _s3_client(config: StorageConfig):
    return _cached_s3_client(config.model_dump_json())


@functools.lru_cache(maxsize=8)
def _cached_s3_client(config_json: str):
    """boto3's client for the same store pyarrow reads: the Location's config, which resolve()
    completed with the endpoint and region the AWS SDKs would use."""
    import boto3
    from botocore.config import Config

    config = StorageConfig.model_validate_json(config_json)
    return boto3.session.Session().client(
        "s3",
        endpoint_url=config.s3_endpoint_url,
        region_name=config.s3_region,
        config=Config(
            retries={"max_attempts": config.s3_max_attempts, "mode": "standard"},
            connect_timeout=config.s3_connect_timeout_seconds,
            read_timeout=config.s3_request_timeout_seconds,
        ),
    )


def _put_object(root: Location, path: str, data: bytes) -> None:
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = path.split("/", 1)
    try:
        # Up to the multipart threshold one PutObject; above it a multipart upload that boto3's
        # transfer manager completes only once every part is in, and aborts when one fails.
        _s3_client(root.config or StorageConfig()).upload_fileobj(io.BytesIO(data), bucket, key)
    except (BotoCoreError, ClientError, S3UploadFailedError) as e:
        raise _error(root, path, e) from None


# Fault injection's seam into the storage layer (pipeline/job/faults.py, `inject_storage`): each is called with
# a local file's temporary path and bytes before they are written; one that raises OSError fails the write as
# the disk would (having written to the path what it chose to first).
WRITE_FAULTS: list[Callable[[str, bytes], None]] = []


def _write_local_durably(path: str, data: bytes) -> None:
    for fault in list(WRITE_FAULTS):
        fault(path, data)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_TEMPORARY = re.compile(r"\.(?:tmp-[0-9a-f]{32}-(?P<old>.+)|(?P<new>.+)\.tmp-[0-9a-f]{32})")


def temporary_target(name: str) -> str | None:
    """The name a temporary file of `write_bytes_atomic` was to be renamed to (one a killed write left,
    in this version's naming or the older `.tmp-<uuid>-<name>`), or None when `name` is not one."""
    m = _TEMPORARY.fullmatch(name)
    return None if m is None else m["old"] or m["new"]


def write_parquet_atomic(root: Location, path: str, table: pa.Table, compression: str) -> None:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression=None if compression == "none" else compression)
    write_bytes_atomic(root, path, buf.getvalue())


def read_parquet(root: Location, path: str, columns: list[str] | None = None) -> pa.Table:
    return pq.read_table(pa.BufferReader(read_bytes(root, path)), columns=columns)
