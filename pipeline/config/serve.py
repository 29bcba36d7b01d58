"""The OpenAI-compatible Batch API (`tokenmill serve`): where it listens, its limits, who may call it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr

from pipeline.config.base import Section


class AirflowTriggerConfig(Section):
    """Run each batch as a run of the nightly DAG on the Airflow deployment instead of in a child process."""

    url: str = Field(description="Airflow's api-server (e.g. `http://airflow-apiserver:8080`).")
    dag_id: str = Field("nightly_summarization", min_length=1, description="The DAG a batch runs as.")
    username: str = Field(description="The Airflow user that triggers runs (`POST /auth/token`).")
    password: SecretStr = Field(
        description="Its password: put it in the environment as `${VAR}`, never in the file (shown as `**********`)."
    )
    config: str = Field(
        description=(
            "The tokenmill config **on the Airflow workers** (the DAG's `config` param). Its `state.url` and "
            "`output.uri` must be this server's: the server reads the batch's progress from the same catalog "
            "and its results from the same output root."
        )
    )
    timeout_seconds: float = Field(30.0, gt=0, description="How long one call to Airflow's REST API may take.")


class ServeConfig(Section):
    host: str = Field("127.0.0.1", description="Address `tokenmill serve` listens on.")
    port: int = Field(8000, ge=1, le=65535, description="Port `tokenmill serve` listens on.")
    max_file_bytes: int = Field(
        200 << 20, gt=0, description="Largest upload (`POST /v1/files`) accepted; larger ones are refused (413)."
    )
    estimate_max_requests: int = Field(
        20_000,
        ge=0,
        description="With budget caps, `POST /v1/batches` estimates a batch of at most this many requests before "
        "creating it and refuses one over a cap (400, `budget_exceeded`); a larger batch is created and its job "
        "checks the caps when it starts. 0: never in the call.",
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
            "window is `expired`: what it answered is returned, the rest is in the error file as `batch_expired`."
        ),
    )
    max_active_batches: int = Field(
        50,
        gt=0,
        description="Most batches one tenant may have queued or running (`validating` to `finalizing`); a create "
        "over it is refused (429, `too_many_batches`). The runner takes the tenants' queued batches in turn.",
    )
    estimate_queue: int = Field(
        4,
        ge=0,
        description="With budget caps, how many creates of one tenant may wait while another of its batches is "
        "estimated (one estimate per tenant at a time; tenants do not wait for each other); one more is refused "
        "(429, `estimate_busy`).",
    )
    header_timeout_seconds: float = Field(
        10.0,
        gt=0,
        description="A connection whose request headers are not complete this long after it opened (or after its "
        "last response) is closed.",
    )
    keep_alive_seconds: float = Field(
        5.0, gt=0, description="An idle keep-alive connection is closed after this long without a new request."
    )
    file_retention_days: float | None = Field(
        None,
        gt=0,
        description="Files (uploads and batches' result files) older than this are deleted by the batch runner, "
        "as a client's `DELETE /v1/files/{id}` would (an active batch's input is kept until it ends); unset: kept "
        "until a client deletes them. A batch's own copies of its input are removed when it ends, whatever this says.",
    )
    validation: Literal["strict", "lenient"] = Field(
        "strict",
        description=(
            "`strict`: as OpenAI does, a batch whose input file has a line that is not a JSON object, a `url` other "
            "than the batch's `endpoint`, or a repeated `custom_id` fails while `validating`, each named by its "
            "`line` in `errors`. `lenient`: such lines become error lines and the rest runs, as `tokenmill run` "
            "treats them."
        ),
    )
    poll_seconds: float = Field(
        1.0, gt=0, description="How often the server's batch runner looks for work and for cancellations."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info",
        description=(
            "The least severe log line `tokenmill serve` prints (its own, its batch runner's and uvicorn's, on "
            "stderr, one format, passwords of URLs shown as `***`)."
        ),
    )
    airflow: AirflowTriggerConfig | None = Field(
        None,
        description=(
            "Run batches on Airflow (a run of `airflow.dag_id` per batch, through its REST API); unset: in a "
            "child process of the server (`tokenmill run`), the embedded default."
        ),
    )
