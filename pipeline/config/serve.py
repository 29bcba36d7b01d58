"""The OpenAI-compatible Batch API (`tokenmill serve`): where it listens, its limits, who may call it."""

from __future__ import annotations

from pydantic import Field

from pipeline.config.base import Section


class ServeConfig(Section):
    host: str = Field("127.0.0.1", description="Address `tokenmill serve` listens on.")
    port: int = Field(8000, ge=1, le=65535, description="Port `tokenmill serve` listens on.")
    max_file_bytes: int = Field(
        200 << 20, gt=0, description="Largest upload (`POST /v1/files`) accepted; larger ones are refused (413)."
    )
    max_requests: int = Field(
        50_000,
        gt=0,
        description="Most request lines in one batch's input file; a batch over it fails while `validating`.",
    )
    completion_windows: list[str] = Field(
        ["24h"],
        description=(
            "`completion_window` values a batch may ask for (of 24h, 48h, 7d). A batch not finished within its "
            "window is `expired`: what committed is returned, the rest is in the error file as `not_run`."
        ),
    )
    poll_seconds: float = Field(
        1.0, gt=0, description="How often the server's batch runner looks for work and for cancellations."
    )
