"""The job's control: budget caps, the state catalog and its leases, the orchestrator's shape."""

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
