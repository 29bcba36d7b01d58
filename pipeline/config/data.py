"""Where a job reads and writes: the input (formats, partitions, limits), the output, object storage."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from pipeline.config.base import Section, no_credentials


class InputConfig(Section):
    uri: str = Field(
        "./data/input",
        description=(
            "Input folder or prefix (local path, `file://…` or `s3://bucket/prefix`) holding "
            ".jsonl, .jsonl.gz, .parquet, .txt and .md files."
        ),
    )
    default_tenant: str = Field(
        "default", description="Tenant for records that carry none, and for every .txt/.md file."
    )
    max_document_bytes: int = Field(
        200_000, gt=0, description="Documents whose text is larger (UTF-8 bytes) are quarantined as `too_large`."
    )
    records_per_partition: int = Field(
        10_000,
        gt=0,
        description=(
            "A file with more records is split into partitions of this many records; runs of one-document files "
            "(.txt, .md) are packed into partitions of up to this many files (and 64 MB)."
        ),
    )
    excerpt_chars: int = Field(
        200, ge=0, description="Characters of the raw input kept in a quarantine row's `excerpt`."
    )
    request_tenant: Literal["metadata", "default"] = Field(
        "metadata",
        description=(
            "A batch request's tenant: `metadata` (its `body.metadata.tenant`, else `default_tenant`) or `default` "
            "(always `default_tenant`: the API server sets it to the caller's, so no request bills another tenant)."
        ),
    )
    format: Literal["auto", "records", "openai", "anthropic"] = Field(
        "auto",
        description=(
            "What a .jsonl file holds: `records` ({id, text, tenant, metadata}), `openai` (OpenAI batch "
            "requests: custom_id, method, url, body) or `anthropic` (Message Batches requests: custom_id, "
            "params); `auto`: each file's first object decides (a `custom_id` makes it a batch file). "
            "docs/batch.md says what a batch request may ask."
        ),
    )

    _uri_has_no_credentials = field_validator("uri")(no_credentials)


class OutputConfig(Section):
    uri: str = Field(
        "./data/output",
        description=(
            "Output root (local path, `file://…` or `s3://bucket/prefix`): outputs/, ledger/, "
            "quarantine/ (Delta Lake tables), jobs/<job_id>/manifest.json and _staging/."
        ),
    )
    compression: Literal["zstd", "snappy", "gzip", "none"] = Field("zstd", description="Parquet compression codec.")
    vacuum_retention_hours: int = Field(
        168,
        ge=0,
        description=(
            "`tokenmill tables maintain` deletes table files no version newer than this many hours names: how far "
            "back time travel (`--as-of`) reaches. Hours under 1 risk deleting a file a reader still reads."
        ),
    )
    compact_target_mb: int = Field(
        128,
        ge=1,
        description="`tokenmill tables maintain` compacts each partition's small files into files of this size.",
    )

    _uri_has_no_credentials = field_validator("uri")(no_credentials)


class StorageConfig(Section):
    """Object storage (s3:// URIs). Credentials come from the standard AWS chain (environment variables,
    shared profile, instance or pod role), never from this file."""

    s3_endpoint_url: str | None = Field(
        None, description="Endpoint of an S3-compatible store, e.g. `http://127.0.0.1:8333`; unset for AWS S3."
    )
    s3_region: str | None = Field(None, description="Bucket region; unset: from the environment / profile.")
    s3_max_attempts: int = Field(
        5,
        ge=1,
        description=(
            "Attempts per S3 request; throttling, 5xx and timeouts are retried with exponential backoff and jitter."
        ),
    )
    s3_connect_timeout_seconds: float = Field(5.0, gt=0, description="Connect timeout per S3 request.")
    s3_request_timeout_seconds: float = Field(60.0, gt=0, description="Timeout per S3 request.")

    _endpoint_has_no_credentials = field_validator("s3_endpoint_url")(no_credentials)
