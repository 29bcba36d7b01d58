"""The job-state catalog: one row per job (SQLite under $TOKENMILL_HOME by default, PostgreSQL in production).

The spine records jobs only; partitions, leases and migrations build on this table.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import DateTime, String, Text, create_engine, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column


class Base(DeclarativeBase):
    pass


class Job(Base):
    __tablename__ = "jobs"

    job_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    status: Mapped[str] = mapped_column(String(20))  # running | succeeded | failed
    config_fingerprint: Mapped[str] = mapped_column(String(64))
    input_uri: Mapped[str] = mapped_column(Text)
    output_uri: Mapped[str] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    counts: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON
    error: Mapped[str | None] = mapped_column(Text, nullable=True)


def now() -> datetime:
    return datetime.now(timezone.utc)


class StateStore:
    def __init__(self, url: str):
        if url.startswith("sqlite:///"):
            Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        self.engine: Engine = create_engine(url)
        Base.metadata.create_all(self.engine)

    def job_started(self, job_id: str, fingerprint: str, input_uri: str, output_uri: str) -> None:
        with Session(self.engine) as s, s.begin():
            job = s.get(Job, job_id) or Job(job_id=job_id)
            job.status, job.config_fingerprint = "running", fingerprint
            job.input_uri, job.output_uri, job.started_at = input_uri, output_uri, now()
            job.finished_at = job.error = job.counts = None
            s.add(job)

    def job_finished(self, job_id: str, status: str, counts: dict | None = None, error: str | None = None) -> None:
        with Session(self.engine) as s, s.begin():
            job = s.get(Job, job_id)
            job.status, job.finished_at, job.error = status, now(), error
            job.counts = json.dumps(counts) if counts is not None else None

    def jobs(self) -> list[Job]:
        with Session(self.engine) as s:
            return list(s.scalars(select(Job).order_by(Job.started_at.desc())))
