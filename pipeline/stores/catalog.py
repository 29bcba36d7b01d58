"""The job-state catalog: jobs, their partitions, and the items already paid for.

SQLite under $TOKENMILL_HOME by default, PostgreSQL in production; the schema is created and
upgraded by Alembic (pipeline/stores/migrations). Three rules keep reruns exact and cheap:

- A partition is claimed with one conditional UPDATE (pending, failed, or running with an expired
  lease -> running, attempts + 1). Exactly one worker's UPDATE matches, on SQLite and PostgreSQL alike.
- A claimed partition's lease (stores/lease.py, the one lease of the catalog) is renewed while it runs; a
  worker that dies stops renewing it and another worker can take the partition once it expires.
- Every engine call's results are stored (`items`) as soon as the call returns, keyed by the request's
  content key. A rerun finds them and pays nothing again, even when the attempt that paid was killed
  before its partition committed.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

from sqlalchemy import JSON, DateTime, Float, Integer, String, Text, create_engine, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from pipeline.config import StateConfig
from pipeline.schema import ITEM
from pipeline.status import JobStatus, PartitionStatus
from pipeline.stores.lease import Lease, default_worker

DEFAULT_LEASE_SECONDS = StateConfig.model_fields["lease_seconds"].default
MIGRATIONS = Path(__file__).parent / "migrations"


class StateError(RuntimeError):
    """The state database cannot be used; the message names it without credentials."""


class Base(DeclarativeBase):
    pass


class JobRow(Base):
    """A job's row in the catalog (its status, planning lease, counts); the job itself is pipeline.job.Job."""

    __tablename__ = "jobs"

    job_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    status: Mapped[str] = mapped_column(String(20))  # a JobStatus (pipeline/status.py)
    config_fingerprint: Mapped[str] = mapped_column(String(64))
    input_uri: Mapped[str] = mapped_column(Text)
    output_uri: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    counts: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON: figures only (output/manifest.py JobCounts)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # What planning decided under: the tenant isolation fingerprint (pipeline/keys.py isolation_fingerprint;
    # None: planned before it was recorded), and the input files of batch requests it read (file -> format).
    isolation: Mapped[str | None] = mapped_column(String(64), nullable=True)
    batch_files: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    # Planning's lease: who plans the job, the claim's fencing epoch (every claim increments it; renewals,
    # failure marks and the registration of partitions must present it), and its last renewal.
    planning_worker: Mapped[str | None] = mapped_column(String(200), nullable=True)
    planning_epoch: Mapped[int] = mapped_column(Integer, default=0)
    planning_renewed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    planning_lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class Partition(Base):
    __tablename__ = "partitions"

    job_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    partition: Mapped[str] = mapped_column(String(64), primary_key=True)
    file: Mapped[str] = mapped_column(Text)
    records: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(20), default="pending")  # a PartitionStatus (pipeline/status.py)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # The fencing token: every claim increments it, and a worker's heartbeats and its commit only land
    # while the epoch is still the one its claim got (a worker whose lease was taken over is fenced out).
    epoch: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    worker: Mapped[str | None] = mapped_column(String(200), nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    counts: Mapped[str | None] = mapped_column(
        Text, nullable=True
    )  # JSON: figures (output/manifest.py PartitionCounts)
    # Its commit: the claim's commit id and epoch and the files it staged per table (output/tables.py publishes
    # them), and its metrics figures (generate/metrics.py partition_figures); None until it commits.
    commit_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    commit_epoch: Mapped[int | None] = mapped_column(Integer, nullable=True)
    commit_files: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    figures: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    wave: Mapped[int] = mapped_column(Integer, default=0)  # its work units' wave (pipeline/generate/partition_waves.py)
    wave_token: Mapped[str | None] = mapped_column(String(32), nullable=True)  # whose derivation of it stands
    generation: Mapped[str | None] = mapped_column(String(16), nullable=True)  # generating | generated | failed


class Item(Base):
    """The catalog's column for each field of schema.ITEM (the one item type), per job and item key."""

    __tablename__ = "items"

    job_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    item_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    id: Mapped[str] = mapped_column(Text)  # the record that generated it
    tenant: Mapped[str] = mapped_column(String(200))
    partition: Mapped[str] = mapped_column(String(64))
    tier: Mapped[str] = mapped_column(String(100))
    model: Mapped[str] = mapped_column(Text)
    adapter_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)  # the LoRA adapter it was made with
    summary: Mapped[str] = mapped_column(Text)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    cached_prompt_tokens: Mapped[int] = mapped_column(Integer)
    output_tokens: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str] = mapped_column(String(32))
    gpu_seconds: Mapped[float] = mapped_column(Float)
    baseline_gpu_seconds: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    origin: Mapped[str | None] = mapped_column(String(16), nullable=True)  # "cache": reused from an earlier job
    source_job: Mapped[str | None] = mapped_column(Text, nullable=True)
    source_id: Mapped[str | None] = mapped_column(Text, nullable=True)
    saved_usd: Mapped[float | None] = mapped_column(Float, nullable=True)  # what the reused generation cost
    cache_status: Mapped[str | None] = mapped_column(String(16), nullable=True)  # hit | miss | bypassed | off
    mean_logprob: Mapped[float | None] = mapped_column(Float, nullable=True)  # the confidence signal
    chunks: Mapped[int | None] = mapped_column(Integer, nullable=True)  # map-reduce: chunk summaries reduced
    unfaithful_terms: Mapped[int | None] = mapped_column(Integer, nullable=True)  # the faithfulness signal
    compression_ratio: Mapped[float | None] = mapped_column(Float, nullable=True)  # the `degenerate` check's measure
    copied_share: Mapped[float | None] = mapped_column(Float, nullable=True)  # the `copied` check's measure
    topic_overlap: Mapped[float | None] = mapped_column(Float, nullable=True)  # the `off_topic` check's measure
    session_id: Mapped[str | None] = mapped_column(String(200), nullable=True)  # engine session (units.py)


class SpentTotal(Base):
    """GPU-seconds a job has paid per tenant and tier (its stored items and failed attempts): a running total
    that the statements storing them add to, so that admission under a budget cap reads a row per tenant and
    tier, not every item of the job, while it holds the job row's lock."""

    __tablename__ = "budget_spent"

    job_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(200), primary_key=True)  # "" for GPU time of no tenant
    tier: Mapped[str] = mapped_column(String(100), primary_key=True)
    gpu_seconds: Mapped[float] = mapped_column(Float)


def add_spent(s: Session, job_id: str, paid: list[tuple[str | None, str, float | None]]) -> None:
    """Add (tenant, tier, GPU-seconds) rows just inserted to the job's running totals, in the caller's
    transaction (in a fixed order: two workers storing at once never wait on each other crosswise)."""
    totals: dict[tuple[str, str], float] = {}
    for tenant, tier, seconds in paid:
        if seconds:
            totals[(tenant or "", tier)] = totals.get((tenant or "", tier), 0.0) + seconds
    if not totals:
        return
    dialect = postgresql if s.get_bind().dialect.name == "postgresql" else sqlite
    statement = dialect.insert(SpentTotal)
    statement = statement.on_conflict_do_update(
        index_elements=["job_id", "tenant", "tier"],
        set_={"gpu_seconds": SpentTotal.gpu_seconds + statement.excluded.gpu_seconds},
    )
    for (tenant, tier), seconds in sorted(totals.items()):
        s.execute(statement, {"job_id": job_id, "tenant": tenant, "tier": tier, "gpu_seconds": seconds})


# The one lease (stores/lease.py) on planning and on partitions
PLANNING_LEASE = Lease(
    JobRow.planning_worker, JobRow.planning_lease_expires_at, JobRow.planning_epoch, JobRow.planning_renewed_at
)
PARTITION_LEASE = Lease(Partition.worker, Partition.lease_expires_at, Partition.epoch, Partition.heartbeat_at)

ITEM_FIELDS = ITEM.names  # the columns after (job_id, item_key); tests check they match the table


def now() -> datetime:
    return datetime.now(timezone.utc)


def aware(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; everything here is UTC."""
    return value.replace(tzinfo=timezone.utc) if value is not None and value.tzinfo is None else value


def utc(t: datetime | None) -> str:
    """A catalog time as logs say it: `2026-12-03 14:05:09 UTC`, or `never`."""
    return "never" if t is None else f"{aware(t).astimezone(timezone.utc):%Y-%m-%d %H:%M:%S} UTC"


# What a database raises for a value it cannot store (as opposed to being unreachable: OperationalError):
# PostgreSQL's DataError (NUL byte, over-long string, integer out of range), a NOT NULL IntegrityError,
# and the drivers' own refusals before sending (UnicodeEncodeError for a lone surrogate, SQLite's OverflowError).
REFUSED_VALUE = (DataError, IntegrityError, ValueError, OverflowError)


class ItemsRefused(ValueError):
    """The catalog refused some items of a batch and stored every other one (paid for, kept). Not a
    StateError: the catalog works, so only their partition fails. `refused`: item key -> reason."""

    def __init__(self, refused: dict[str, str], ids: dict[str, str], stored: int):
        self.refused = refused
        key = next(iter(refused))
        super().__init__(
            f"the state catalog refused {len(refused)} of {len(refused) + stored} items (the other "
            f"{stored} are stored and not paid again); first: record {ids[key]!r:.200}: {refused[key]}"
        )


def refusal(e: BaseException) -> str:
    """The database's reason for refusing a value, as one line without the statement or its parameters."""
    orig = getattr(e, "orig", None) or e
    lines = str(orig).splitlines()
    return f"{type(orig).__name__}: {lines[0] if lines else ''}"[:300]


def alembic_config(url: str):
    """Alembic's configuration for the catalog at `url`: its migrations, that database."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade_schema(url: str) -> None:
    """Bring the catalog to the latest schema; safe when several workers start at once.

    Concurrent upgrades are serialised: on SQLite by a lock file beside the database, on PostgreSQL
    by an advisory lock that pipeline/stores/migrations/env.py takes before looking at the schema version.
    """
    from alembic import command

    cfg = alembic_config(url)
    if url.startswith("sqlite:///") and len(url) > len("sqlite:///"):
        Path(url[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
        with open(url[len("sqlite:///") :] + ".migrate.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            command.upgrade(cfg, "head")
    else:
        command.upgrade(cfg, "head")


_MIGRATED: set[str] = set()  # the catalogs this process brought to the latest schema


def migrate(url: str, once: bool = False) -> None:
    """Bring the catalog at `url` to the latest schema: what a process that writes does first (`tokenmill
    migrate`, a command that writes, `tokenmill serve` at start, the DAG's first task, `run_job`), never
    opening a StateStore. `once`: only if this process has not migrated it yet."""
    if once and url in _MIGRATED:
        return
    try:
        upgrade_schema(url)
    except Exception as e:
        raise unreachable(url, e) from None
    _MIGRATED.add(url)


def unreachable(url: str, e: BaseException) -> StateError:
    """The catalog at `url` could not be used: why, in one line without credentials."""
    from pipeline.config.env import redact_url, url_error

    return StateError(f"state database {redact_url(url)} unreachable: {url_error(e, url)}")


class StateStore:
    """The catalog's tables, read and written; opening one connects and changes nothing (the schema is
    `migrate`'s)."""

    def __init__(self, url: str):
        connect_args = {"timeout": 60} if url.startswith("sqlite") else {"connect_timeout": 10}
        try:
            self.engine: Engine = create_engine(url, connect_args=connect_args, pool_pre_ping=True)
            with self.engine.connect():
                pass
        except Exception as e:
            raise unreachable(url, e) from None

    @staticmethod
    def safe_url(url: str) -> str:
        """`url` with its password hidden, even one whose raw `@`, `/` or `:` defeats URL parsers."""
        from pipeline.config.env import redact_url

        return redact_url(url)

    def db_session(self) -> Session:
        """A database session (SQLAlchemy's) on the catalog; an engine session is a row of `engine_sessions`."""
        return Session(self.engine)

    def has_schema(self) -> bool:
        """Whether the catalog's tables exist (`migrate` made them): a reader of a fresh catalog says so."""
        from sqlalchemy import inspect

        return inspect(self.engine).has_table(JobRow.__tablename__)

    def db_now(self) -> datetime:
        """The database's clock (UTC), which leases are compared against (workers' clocks disagree). Read with
        its fraction: SQLite stores DateTime as naive text and its CURRENT_TIMESTAMP has no fraction."""
        with self.db_session() as s:
            if self.engine.dialect.name == "sqlite":
                text = s.execute(select(func.strftime("%Y-%m-%d %H:%M:%f", "now"))).scalar_one()
                return datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=timezone.utc)
            return aware(s.execute(select(func.now())).scalar_one()).astimezone(timezone.utc)

    # -- jobs ---------------------------------------------------------------------------------
    def claim_planning(
        self,
        job_id: str,
        fingerprint: str,
        input_uri: str,
        output_uri: str,
        worker: str | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> int | None:
        """The planning claim's epoch (1) when this process must plan the job (it is new), else None; see
        reclaim_planning for a planning that died."""
        with self.db_session() as s:
            try:
                with s.begin():
                    t = self.db_now()
                    s.add(
                        JobRow(
                            job_id=job_id,
                            status="planning",
                            config_fingerprint=fingerprint,
                            input_uri=input_uri,
                            output_uri=output_uri,
                            created_at=t,
                            **PLANNING_LEASE.claimed(worker or default_worker(), t, lease_seconds, first=True),
                        )
                    )
                return 1
            except IntegrityError:
                return None

    def reclaim_planning(
        self,
        job_id: str,
        lease_seconds: float,
        worker: str | None = None,
        gone_worker: str | None = None,
        grace_seconds: float = 0.0,
    ) -> int | None:
        """Take over planning a job whose planning failed, whose planning lease ran out (by the database's
        clock) and so was abandoned, or whose planning worker is `gone_worker` (provably dead) and has not renewed
        for `grace_seconds` (an orchestrator's planning tasks each renew as their own process: the task
        that last renewed may have ended while the next one starts). The new claim's epoch, or None when
        the planning is not to be taken over."""
        t = self.db_now()
        abandoned = (JobRow.status == "planning") & PLANNING_LEASE.expired(t)
        if gone_worker is not None:
            abandoned = abandoned | (
                (JobRow.status == "planning")
                & (JobRow.planning_worker == gone_worker)
                & (JobRow.planning_renewed_at < t - timedelta(seconds=grace_seconds))
            )
        with self.db_session() as s, s.begin():
            return PLANNING_LEASE.claim(
                s,
                (JobRow.job_id == job_id) & ((JobRow.status == "planning_failed") | abandoned),
                worker or default_worker(),
                t,
                lease_seconds,
                status="planning",
                error=None,
            )

    def renew_planning(
        self, job_id: str, epoch: int, worker: str | None = None, lease_seconds: float = DEFAULT_LEASE_SECONDS
    ) -> bool:
        """The planning is alive: its lease counts again from now, held by `worker` (the renewing process).
        False when the claim `epoch` was taken over, or the planning is no longer in progress."""
        with self.db_session() as s, s.begin():
            return (
                PLANNING_LEASE.renew(
                    s,
                    self._planning(job_id, epoch),
                    self.db_now(),
                    lease_seconds,
                    planning_worker=worker or default_worker(),
                )
                == 1
            )

    @staticmethod
    def _planning(job_id: str, epoch: int):
        return (JobRow.job_id == job_id) & (JobRow.status == "planning") & PLANNING_LEASE.fenced(epoch)

    def fail_planning(self, job_id: str, epoch: int, error: str) -> bool:
        """Mark the planning of claim `epoch` failed (a rerun takes it over at once); False when fenced out."""
        with self.db_session() as s, s.begin():
            return (
                s.execute(
                    update(JobRow)
                    .where(self._planning(job_id, epoch))
                    .values(status="planning_failed", error=error[:2000])
                ).rowcount
                == 1
            )

    def register_partitions(
        self,
        job_id: str,
        epoch: int,
        partitions: dict[str, dict],
        counts: dict,
        isolation: str | None = None,
        batch_files: dict[str, str] | None = None,
    ) -> bool:
        """Planning's end, in one transaction fenced by its claim: add the partitions, mark the job planned with
        its `counts` and what it was planned under (`isolation`, `batch_files`: JobRow). False (and nothing
        written) when another worker took the planning over."""
        with self.db_session() as s, s.begin():
            planned = (
                s.execute(
                    update(JobRow)
                    .where(self._planning(job_id, epoch))
                    .values(
                        status="planned",
                        counts=json.dumps(counts),
                        isolation=isolation,
                        batch_files=batch_files or None,
                        **PLANNING_LEASE.ended(),
                    )
                ).rowcount
                == 1
            )
            if planned:
                self._add_partitions(s, job_id, partitions)
            return planned

    def job(self, job_id: str) -> JobRow | None:
        with self.db_session() as s:
            return s.get(JobRow, job_id)

    def set_job(self, job_id: str, status: JobStatus | None = None, **values) -> None:
        """Write the job row's `values` (and its `status`, when given); `counts` as JSON."""
        if status is not None:
            values["status"] = status
        if "counts" in values and values["counts"] is not None:
            values["counts"] = json.dumps(values["counts"])
        with self.db_session() as s, s.begin():
            s.execute(update(JobRow).where(JobRow.job_id == job_id).values(**values))

    def jobs(self) -> list[JobRow]:
        with self.db_session() as s:
            return list(s.scalars(select(JobRow).order_by(JobRow.created_at.desc())))

    # -- partitions -----------------------------------------------------------------------------
    def add_partitions(self, job_id: str, partitions: dict[str, dict]) -> None:
        """Register partitions as pending; ones already registered (planning again) keep their state."""
        with self.db_session() as s, s.begin():
            self._add_partitions(s, job_id, partitions)

    @staticmethod
    def _add_partitions(s: Session, job_id: str, partitions: dict[str, dict]) -> None:
        known = set(s.scalars(select(Partition.partition).where(Partition.job_id == job_id)))
        for name, p in partitions.items():
            if name not in known:
                s.add(
                    Partition(
                        job_id=job_id,
                        partition=name,
                        file=p["file"],
                        records=p["records"],
                        status="pending",
                        attempts=0,
                    )
                )

    def partitions(self, job_id: str) -> list[Partition]:
        with self.db_session() as s:
            return list(s.scalars(select(Partition).where(Partition.job_id == job_id).order_by(Partition.partition)))

    def partition(self, job_id: str, partition: str) -> Partition | None:
        with self.db_session() as s:
            return s.get(Partition, (job_id, partition))

    def claim(self, job_id: str, partition: str, worker: str, lease_seconds: float, force: bool = False) -> int | None:
        """Atomically take a partition: one conditional UPDATE. Returns the claim's epoch (the fencing
        token its heartbeats and its commit must present), or None when another worker holds it."""
        t = self.db_now()  # the database's clock, not this worker's
        free = Partition.status.in_(
            ("pending", "failed", "deferred", "succeeded") if force else ("pending", "failed", "deferred")
        )
        claimable = free | ((Partition.status == "running") & PARTITION_LEASE.expired(t))
        with self.db_session() as s, s.begin():
            return PARTITION_LEASE.claim(
                s,
                (Partition.job_id == job_id) & (Partition.partition == partition) & claimable,
                worker,
                t,
                lease_seconds,
                status="running",
                attempts=Partition.attempts + 1,
                started_at=t,
                last_error=None,
                finished_at=None,
            )

    def _held(self, job_id: str, partition: str, worker: str, epoch: int):
        return (Partition.job_id == job_id) & (Partition.partition == partition) & PARTITION_LEASE.fenced(epoch, worker)

    def heartbeat(self, job_id: str, partition: str, worker: str, lease_seconds: float, epoch: int) -> bool:
        """Renew the claim `epoch`'s lease; False once it was taken over (the worker must not commit)."""
        t = self.db_now()  # the database's clock, not this worker's
        with self.db_session() as s, s.begin():
            where = self._held(job_id, partition, worker, epoch) & (Partition.status == "running")
            return PARTITION_LEASE.renew(s, where, t, lease_seconds) == 1

    def finish_partition(
        self,
        job_id: str,
        partition: str,
        worker: str,
        epoch: int,
        status: PartitionStatus,
        counts: dict | None = None,
        error: str | None = None,
        commit_id: str | None = None,
        commit_files: dict | None = None,
        figures: dict | None = None,
    ) -> bool:
        """Set a claimed partition's end state, fenced: False (and nothing changed) when the claim of
        `epoch` is no longer the partition's latest, i.e. another worker took it over. A commit gives its
        `counts`, `commit_id` and `commit_files` (at the claim's epoch) and metrics `figures`; any other end
        state clears them."""
        with self.db_session() as s, s.begin():
            result = s.execute(
                update(Partition)
                .where(self._held(job_id, partition, worker, epoch))
                .values(
                    status=status,
                    finished_at=now(),
                    last_error=error,
                    **PARTITION_LEASE.ended(),
                    counts=json.dumps(counts) if counts is not None else None,
                    commit_id=commit_id,
                    commit_epoch=epoch if commit_id is not None else None,
                    commit_files=commit_files,
                    figures=figures,
                )
            )
            return result.rowcount == 1

    # -- items ----------------------------------------------------------------------------------
    def _items_where(self, job_id: str, column: str, values: list[str], *where) -> Iterator[dict]:
        """The job's items whose `column` is one of `values` (and `where`), each a dict with its `item_key`."""
        table = Item.__table__
        columns = [table.c.item_key, *(table.c[f] for f in ITEM_FIELDS)]
        with self.db_session() as s:
            for start in range(0, len(values), 900):  # under SQLite's oldest limit of 999 parameters
                chunk = values[start : start + 900]
                # Core rows, not ORM objects: tens of thousands of items per partition.
                query = select(*columns).where(table.c.job_id == job_id, table.c[column].in_(chunk), *where)
                for row in s.execute(query).mappings():
                    item = dict(row)
                    item["created_at"] = aware(item["created_at"])
                    yield item

    def stored_items(self, job_id: str, keys: list[str]) -> dict[str, dict]:
        return {item.pop("item_key"): item for item in self._items_where(job_id, "item_key", keys)}

    def has_items(self, job_id: str) -> bool:
        """Whether the job holds any item (paid for, or an exact cache hit stored as its own)."""
        with self.db_session() as s:
            return s.scalar(select(Item.item_key).where(Item.job_id == job_id).limit(1)) is not None

    def generated_for(self, job_id: str, ids: list[str]) -> list[dict]:
        """The items the job paid to generate for the records `ids` (each item names the record whose key it
        is for, whichever partition enqueued it), with their keys (`item_key`); reused ones (an `origin`) cost
        nothing and are left out."""
        return list(self._items_where(job_id, "id", ids, Item.__table__.c.origin.is_(None)))

    def store_items(self, job_id: str, items: dict[str, dict]) -> None:
        """Record paid-for generations; a key stored by another worker first keeps its first value.

        One idempotent INSERT .. ON CONFLICT DO NOTHING: workers storing overlapping keys at once all
        succeed (a read-then-insert lost the later batch, its other keys too, to an IntegrityError).
        When the database refuses a value, the batch is stored again row by row, so one bad item never
        discards the others, which are paid for; ItemsRefused then names the bad ones.
        """
        rows = [{"job_id": job_id, "item_key": key, **values} for key, values in items.items()]
        try:
            self.insert_items(rows)
            return
        except REFUSED_VALUE:
            pass  # the whole batch was rolled back; find the rows that cannot be stored
        refused: dict[str, str] = {}
        for row in rows:
            try:
                self.insert_items([row])
            except REFUSED_VALUE as e:
                refused[row["item_key"]] = refusal(e)
        if refused:
            raise ItemsRefused(refused, {k: str(items[k].get("id")) for k in refused}, len(rows) - len(refused))

    def insert_items(self, rows: list[dict]) -> None:
        """Insert item rows in one transaction, leaving keys already stored as they are."""
        dialect = postgresql if self.engine.dialect.name == "postgresql" else sqlite
        statement = dialect.insert(Item).on_conflict_do_nothing(index_elements=["job_id", "item_key"])
        by_shape: dict[tuple, list[dict]] = {}  # an executemany needs the same columns in every row
        for row in rows:
            by_shape.setdefault(tuple(sorted(row)), []).append(row)
        statement = statement.returning(Item.tenant, Item.tier, Item.gpu_seconds)  # the rows inserted, only
        with self.db_session() as s, s.begin():
            for same in by_shape.values():
                add_spent(s, same[0]["job_id"], list(s.execute(statement, same)))  # Core executemany

    def release_gone_holder(self, job_id: str, partition: str, holder: str) -> bool:
        """End the lease of `holder`'s claim now, because its process is provably gone (worker_is_gone),
        so that the partition is claimable at once instead of after the rest of the lease. Only while
        `holder` still holds it; claim then decides, as always, which worker takes it."""
        with self.db_session() as s, s.begin():
            where = (Partition.job_id == job_id) & (Partition.partition == partition) & (Partition.status == "running")
            return PARTITION_LEASE.cut_gone(s, where, holder, self.db_now())
