"""The job's control: budget caps, the state catalog and its leases, the orchestrator's shape, what a run
exports for Prometheus."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pipeline.config.base import Section


class BudgetConfig(Section):
    """Hard caps in USD. A job whose estimate exceeds a cap does not start; a running job stops admitting
    engine calls once spent + the call's estimate would cross a cap, and defers the partitions left."""

    max_job_usd: float | None = Field(None, ge=0, description="Cap on one job's generation cost; unset: no cap.")
    max_tenant_usd: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict, description="Cap per tenant within one job, e.g. `{acme: 20.0}`."
    )
    default_tenant_usd: float | None = Field(
        None, ge=0, description="Cap for every tenant not named in `max_tenant_usd`; unset: none."
    )

    def tenant_cap(self, tenant: str) -> float | None:
        return self.max_tenant_usd.get(tenant, self.default_tenant_usd)

    @property
    def active(self) -> bool:
        return self.max_job_usd is not None or bool(self.max_tenant_usd) or self.default_tenant_usd is not None


class StateConfig(Section):
    url: str = Field(
        "sqlite:///${TOKENMILL_HOME}/state.db",
        description=(
            "SQLAlchemy URL of the job-state catalog (SQLite locally, PostgreSQL in production, "
            "e.g. `postgresql+psycopg://user@host/db`; put the password in the environment, not "
            "here)."
        ),
    )
    lease_seconds: float = Field(
        300.0,
        gt=0,
        le=7 * 86400,
        description=(
            "Every lease (a job's planning, a partition, a work unit, an engine session) is held this long "
            "without a renewal (renewed every third of it); a worker that dies loses it after this and "
            "another may take over (at once, when its process is provably gone from this host)."
        ),
    )
    wait_seconds: float = Field(
        1.0, gt=0, le=3600, description="How often a worker looks again at partitions other workers hold."
    )


class RunConfig(Section):
    schedule: str | None = Field(
        "0 2 * * *",
        description=(
            "Cron schedule of the Airflow DAG (`dags/nightly_summarization.py`); nightly at 02:00 UTC by default. "
            "null: no schedule, the DAG runs only when triggered (its REST API, the UI, another DAG)."
        ),
    )
    retries: int = Field(
        2, ge=0, description="Airflow retries of each task (a partition is retried alone), with exponential backoff."
    )
    retry_delay_seconds: float = Field(
        60.0, ge=0, description="First Airflow retry delay; doubles per retry, at most 15 minutes."
    )
    progress: Literal["auto", "bar", "log", "off"] = Field(
        "auto", description="`auto`: a bar on a terminal, plain log lines otherwise."
    )
    log_every_seconds: float = Field(10.0, gt=0, description="Interval of progress log lines when not on a terminal.")
    tier_workers: dict[str, Annotated[int, Field(ge=1, le=64)]] = Field(
        default_factory=dict,
        description=(
            "GPU worker tasks per tier in the Airflow DAG (`drain_<tier>`, each on queue and "
            "pool `gpu-<tier>`); a tier not named gets one. Each worker starts its tier's engine "
            "once and drains that tier's work units from every partition."
        ),
    )


class MetricsConfig(Section):
    """Prometheus metrics (docs/ops.md, "Watching a run"): each tier worker serves them over HTTP; the short CPU
    steps push the job's state to a Pushgateway. Off by default: no port opened, nothing pushed."""

    port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description=(
            "Port each tier worker (and `tokenmill run`, from its first drain) serves `/metrics` on; unset or 0: "
            "no endpoint. A port already in use is logged and skipped: the job goes on unwatched."
        ),
    )
    host: str = Field("127.0.0.1", description="Address the metrics endpoint listens on (`0.0.0.0`: every interface).")
    pushgateway_url: str | None = Field(
        None,
        description=(
            "Prometheus Pushgateway (e.g. `http://pushgateway:9091`) each step pushes the job's state to as it ends "
            "(prepare, drain, commit, the DAG's summary, `tokenmill run`): the job's running totals from the state "
            "catalog, the budget left; one group per pipeline. Unset: nothing is pushed. A push that "
            "fails is logged, never a task's failure."
        ),
    )
    job_label: str = Field(
        "tokenmill",
        min_length=1,
        description="The `job` label of pushed groups (grouped further by `pipeline` alone).",
    )
    pipeline: str | None = Field(
        None,
        description=(
            "The `pipeline` label of the job's totals and its Pushgateway group: the Airflow DAG sets its DAG id; "
            "unset: `run`. A Batch API batch's job reads `<pipeline>-batch`."
        ),
    )
    final_scrape_grace_seconds: float = Field(
        60.0,
        ge=0,
        le=3600,
        description=(
            "How long `tokenmill run`, serving `/metrics` with no Pushgateway, keeps serving after the job until "
            "a scrape reads its final values; 0: it exits at once."
        ),
    )
    push_timeout_seconds: float = Field(
        5.0, gt=0, le=300, description="How long one push may take before it is given up (and logged)."
    )

    @property
    def serving(self) -> bool:
        return bool(self.port)
