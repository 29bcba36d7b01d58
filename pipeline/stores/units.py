"""Work units, the engines that drain them, and the GPU time no item carries: the GPU side of the catalog.

A work unit is one partition's requests for one tier in one wave (wave 0: the prepared requests;
later waves: chunk maps, reduces, schema retries, escalations). Tier workers claim units with
leases, `FOR UPDATE SKIP LOCKED` on PostgreSQL and the same conditional UPDATE as partition claims
on SQLite, and renew them while they generate; a worker that dies stops renewing and its units are
claimed again when their leases run out.

Every item key in flight has one row in `unit_keys`, owned by the first unit that enqueued it (an
`INSERT .. ON CONFLICT DO NOTHING`): a second partition needing the same content waits for that unit
instead of paying for it again at the same moment. A key's state is `pending` until a worker stores
its item (`done`) or gives up on it (`failed`, with the reason), and a failed key may be enqueued
again by a later attempt.

An engine session is one engine's time on one job, from its start (or the end of its previous
session: idle between jobs is the next job's) to its close: start-up, busy and idle seconds,
renewed like a lease. `charges` hold GPU time that no item carries (failed attempts, work lost with
a dead worker), so that a job's ledger adds up to every GPU-second its engines were held.

Budget caps are one amount per job, whichever workers spend it: an engine call is admitted only by a
reservation of its estimated cost (`reserve`), made one at a time per job under the job row's lock, that
counts against the caps until its item is stored (then its measured cost counts instead) or its unit's
lease is gone (a dead worker's reservation frees itself when its units become claimable again).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from sqlalchemy import BigInteger, DateTime, Float, Integer, String, Text, delete, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Row
from sqlalchemy.orm import Mapped, Session, mapped_column

from pipeline.status import UnitStatus
from pipeline.stores.catalog import (
    DEFAULT_LEASE_SECONDS,
    Base,
    Item,
    JobRow,
    Partition,
    SpentTotal,
    StateStore,
    add_spent,
    aware,
)
from pipeline.stores.lease import Lease, worker_is_gone

IN_CHUNK = 900  # values bound in one IN (...): under SQLite's oldest limit of 999 parameters


def in_chunks(values: list) -> list[list]:
    """`values` in runs of IN_CHUNK, one statement each."""
    return [values[start : start + IN_CHUNK] for start in range(0, len(values), IN_CHUNK)]


UNFINISHED = ("pending", "leased")
SESSION_COUNTERS = ("spec_drafted", "spec_accepted", "prefix_queries", "prefix_hits")


class WorkUnit(Base):
    __tablename__ = "work_units"

    job_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    unit_id: Mapped[str] = mapped_column(String(200), primary_key=True)  # <partition>/<wave>/<tier>
    partition: Mapped[str] = mapped_column(String(64))
    tier: Mapped[str] = mapped_column(String(100))
    wave: Mapped[int] = mapped_column(Integer)
    requests: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))  # a UnitStatus (pipeline/status.py)
    worker: Mapped[str | None] = mapped_column(String(200), nullable=True)
    session_id: Mapped[str | None] = mapped_column(String(200), nullable=True)  # the engine session holding it
    epoch: Mapped[int] = mapped_column(Integer, default=0)
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class UnitKey(Base):
    __tablename__ = "unit_keys"

    job_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    item_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    unit_id: Mapped[str] = mapped_column(String(200))
    state: Mapped[str] = mapped_column(String(16))  # pending | done | failed
    reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    detail: Mapped[str | None] = mapped_column(Text, nullable=True)


class EngineSession(Base):
    __tablename__ = "engine_sessions"

    session_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    job_id: Mapped[str] = mapped_column(String(200))
    tier: Mapped[str] = mapped_column(String(100))
    worker: Mapped[str] = mapped_column(String(200))
    gpus: Mapped[int] = mapped_column(Integer)
    started: Mapped[int] = mapped_column(Integer)  # 1 when this engine session started its engine
    status: Mapped[str] = mapped_column(String(16))  # an EngineSessionStatus (pipeline/status.py)
    startup_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    busy_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    idle_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    recorded_seconds: Mapped[float] = mapped_column(Float, default=0.0)  # busy seconds stored with items or charges
    # The engine's counters over this engine session, written at its close (None: not kept, or never closed)
    spec_drafted: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # speculative tokens proposed
    spec_accepted: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # ... and accepted
    prefix_queries: Mapped[int | None] = mapped_column(
        BigInteger, nullable=True
    )  # prompt tokens looked up in the prefix cache
    prefix_hits: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # ... and found there
    opened_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    closed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    @property
    def held_seconds(self) -> float:
        return self.startup_seconds + self.busy_seconds + self.idle_seconds


class Charge(Base):
    """GPU time no item carries, landing in its partition's ledger as a row of its `kind`."""

    __tablename__ = "charges"

    job_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    charge_id: Mapped[str] = mapped_column(String(300), primary_key=True)
    partition: Mapped[str] = mapped_column(String(64))
    session_id: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(
        String(16)
    )  # failed_attempt | lost (a session that generated nothing: engine_time.py)
    id: Mapped[str | None] = mapped_column(Text, nullable=True)  # the record it was for
    tenant: Mapped[str | None] = mapped_column(String(200), nullable=True)
    tier: Mapped[str] = mapped_column(String(100))
    gpu_seconds: Mapped[float] = mapped_column(Float)


class UnitClaim(Base):
    """One claim of a work unit (its epoch), by an engine session: kept for good, so that the work a dead
    session lost is charged to the units it claimed and did not finish, however often they change hands."""

    __tablename__ = "unit_claims"

    job_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    unit_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer, primary_key=True)
    session_id: Mapped[str] = mapped_column(String(200))
    partition: Mapped[str] = mapped_column(String(64))
    requests: Mapped[int] = mapped_column(Integer)
    finished: Mapped[int] = mapped_column(Integer, default=0)  # 1 once its session finished the unit (done, deferred)


class Reservation(Base):
    """The estimated USD of one admitted request, held against the job's caps while its unit's claim is live."""

    __tablename__ = "budget_reservations"

    job_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    unit_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer, primary_key=True)  # the claim it was made under
    item_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(200))
    usd: Mapped[float] = mapped_column(Float)


# The one lease (stores/lease.py) on work units, and on engine sessions (nobody takes a session over: its
# lease only says whether its worker still lives)
UNIT_LEASE = Lease(WorkUnit.worker, WorkUnit.lease_expires_at, WorkUnit.epoch)
SESSION_LEASE = Lease(EngineSession.worker, EngineSession.lease_expires_at, renewed=EngineSession.heartbeat_at)


def unit_id(partition: str, wave: int, tier: str) -> str:
    return f"{partition}/{wave}/{tier}"  # partition names and tier names hold no '/'


class UnitQueue:
    """The catalog's work units, unit keys, engine sessions and charges."""

    def __init__(self, state: StateStore):
        self.state = state
        self.postgres = state.engine.dialect.name == "postgresql"

    def db_session(self) -> Session:
        """A database session on the catalog (an engine's time on a job is an engine session: `open_session`)."""
        return self.state.db_session()

    def _insert(self, model):
        return (postgresql if self.postgres else sqlite).insert(model)

    # -- enqueue --------------------------------------------------------------------------------
    def enqueue(
        self, job_id: str, partition: str, wave: int, keys_by_tier: dict[str, list[str]]
    ) -> dict[str, list[str]]:
        """Create this partition's units of `wave` (idempotent) and return, per unit id, the keys it
        owns: keys already owned by a live unit (of any partition) or done are left to their owner."""
        t = self.state.db_now()
        owned: dict[str, list[str]] = {}
        with self.db_session() as s, s.begin():
            for tier, keys in keys_by_tier.items():
                uid = unit_id(partition, wave, tier)
                rows = [{"job_id": job_id, "item_key": k, "unit_id": uid, "state": "pending"} for k in keys]
                for start in range(0, len(rows), 500):
                    s.execute(
                        self._insert(UnitKey).on_conflict_do_nothing(index_elements=["job_id", "item_key"]),
                        rows[start : start + 500],
                    )
                for chunk in in_chunks(keys):  # a failed key belongs to whoever tries it again
                    s.execute(
                        update(UnitKey)
                        .where(UnitKey.job_id == job_id, UnitKey.state == "failed", UnitKey.item_key.in_(chunk))
                        .values(unit_id=uid, state="pending", reason=None, detail=None)
                    )
                mine = self._owned(s, job_id, uid)
                owned[uid] = mine
                if mine:  # a unit that ran before (its failed keys are enqueued again) is pending again
                    # A unit withdrawn and enqueued again goes on from its last claim's epoch: epochs never repeat.
                    epoch = (
                        s.scalar(
                            select(func.max(UnitClaim.epoch)).where(
                                UnitClaim.job_id == job_id, UnitClaim.unit_id == uid
                            )
                        )
                        or 0
                    )
                    insert = self._insert(WorkUnit)
                    s.execute(
                        insert.on_conflict_do_update(
                            index_elements=["job_id", "unit_id"],
                            set_={
                                "status": "pending",
                                "requests": len(mine),
                                "finished_at": None,
                                "lease_expires_at": None,
                            },
                            where=WorkUnit.status.in_(("done", "deferred")),
                        ),
                        [
                            {
                                "job_id": job_id,
                                "unit_id": uid,
                                "partition": partition,
                                "tier": tier,
                                "wave": wave,
                                "requests": len(mine),
                                "status": "pending",
                                "epoch": epoch,
                                "created_at": t,
                            }
                        ],
                    )
        return owned

    @staticmethod
    def _owned(s, job_id: str, uid: str) -> list[str]:
        return list(
            s.scalars(
                select(UnitKey.item_key).where(
                    UnitKey.job_id == job_id, UnitKey.unit_id == uid, UnitKey.state == "pending"
                )
            )
        )

    def give_up(self, job_id: str, uid: str, keys: set[str]) -> None:
        """Delete `uid`'s pending rows of `keys`: no unit owns them any more (whoever waits on one enqueues it)."""
        with self.db_session() as s, s.begin():
            for chunk in in_chunks(list(keys)):
                s.execute(
                    delete(UnitKey).where(
                        UnitKey.job_id == job_id,
                        UnitKey.unit_id == uid,
                        UnitKey.state == "pending",
                        UnitKey.item_key.in_(chunk),
                    )
                )

    def owned_keys(self, job_id: str, uid: str) -> set[str]:
        with self.db_session() as s:
            return set(self._owned(s, job_id, uid))

    def withdraw(self, job_id: str, partition: str, dead_too: bool = False) -> int:
        """Remove a partition's units no worker holds (pending or deferred) and free their keys, so that
        preparing it again starts over; units a worker holds finish, and their keys stay theirs (a dead
        worker's are taken over by the drain, which says so). `dead_too` (a partition ended for good, whose
        units nobody will drain): also those leased by a worker that is provably gone or whose lease ran out.
        (A dead worker's claims stay in `unit_claims`: its lost work is still charged.)"""
        nobody = WorkUnit.status.in_(("pending", "deferred"))
        if dead_too:
            dead = [
                self._unit(job_id, u.unit_id) & UNIT_LEASE.fenced(u.epoch, u.worker)
                for u in self.units(job_id, partition)
                if u.status == "leased" and worker_is_gone(u.worker)
            ]
            expired = (WorkUnit.status == "leased") & UNIT_LEASE.expired(self.state.db_now())
            nobody = or_(nobody, expired, *((WorkUnit.status == "leased") & d for d in dead))
        with self.db_session() as s, s.begin():
            gone = list(
                s.scalars(
                    delete(WorkUnit)
                    .where(
                        WorkUnit.job_id == job_id,
                        WorkUnit.partition == partition,
                        nobody,
                    )
                    .returning(WorkUnit.unit_id)
                )
            )
            for chunk in in_chunks(gone):
                s.execute(
                    delete(UnitKey).where(UnitKey.job_id == job_id, UnitKey.state != "done", UnitKey.unit_id.in_(chunk))
                )
                s.execute(delete(Reservation).where(Reservation.job_id == job_id, Reservation.unit_id.in_(chunk)))
        return len(gone)

    # -- claim, renew, finish -------------------------------------------------------------------
    def claim(self, job_id: str, tier: str, worker: str, session_id: str, lease_seconds: float) -> WorkUnit | None:
        """Lease the oldest claimable unit of `tier`: pending, or leased with an expired lease (its
        worker is gone); the claim is kept in `unit_claims`."""
        t = self.state.db_now()
        claimable = self._claimable(t)
        with self.db_session() as s, s.begin():
            pick = (
                select(WorkUnit)
                .where(WorkUnit.job_id == job_id, WorkUnit.tier == tier, claimable)
                .order_by(WorkUnit.wave, WorkUnit.created_at, WorkUnit.unit_id)
                .limit(1)
            )
            if self.postgres:
                pick = pick.with_for_update(skip_locked=True)
            unit = s.scalars(pick).first()
            if unit is None:
                return None
            where = self._unit(job_id, unit.unit_id) & UNIT_LEASE.fenced(unit.epoch) & claimable
            if UNIT_LEASE.claim(s, where, worker, t, lease_seconds, status="leased", session_id=session_id) is None:
                return None  # another worker's conditional UPDATE won (SQLite)
            s.add(
                UnitClaim(
                    job_id=job_id,
                    unit_id=unit.unit_id,
                    epoch=unit.epoch + 1,
                    session_id=session_id,
                    partition=unit.partition,
                    requests=unit.requests,
                )
            )
            # The claims taken over are dead: what they reserved counts no more, so it goes in this commit.
            s.execute(
                delete(Reservation).where(
                    Reservation.job_id == job_id, Reservation.unit_id == unit.unit_id, Reservation.epoch <= unit.epoch
                )
            )
            s.expire(unit)
            s.refresh(unit)
            s.expunge(unit)
            return unit

    def release_gone(self, job_id: str) -> list[WorkUnit]:
        """End the leases of units whose worker is provably gone (worker_is_gone), so they are claimable at
        once instead of when their leases run out; returns them as they were."""
        t = self.state.db_now()
        gone = [u for u in self.units(job_id) if u.status == "leased" and worker_is_gone(u.worker)]
        with self.db_session() as s, s.begin():
            for u in gone:
                where = self._unit(job_id, u.unit_id) & UNIT_LEASE.fenced(u.epoch) & (WorkUnit.status == "leased")
                UNIT_LEASE.cut_gone(s, where, u.worker, t)
        return gone

    @staticmethod
    def _unit(job_id: str, uid: str):
        return (WorkUnit.job_id == job_id) & (WorkUnit.unit_id == uid)

    @staticmethod
    def _claimable(t: datetime):
        return (WorkUnit.status == "pending") | ((WorkUnit.status == "leased") & UNIT_LEASE.expired(t))

    def claimable(self, job_id: str, tier: str | None = None) -> int:
        """Units a worker could claim now (pending, or leased with an expired lease), of `tier` or any."""
        t = self.state.db_now()
        with self.db_session() as s:
            q = select(func.count()).select_from(WorkUnit).where(WorkUnit.job_id == job_id, self._claimable(t))
            return int(s.execute(q if tier is None else q.where(WorkUnit.tier == tier)).scalar_one())

    def renew(self, job_id: str, session_id: str, lease_seconds: float) -> None:
        t = self.state.db_now()
        with self.db_session() as s, s.begin():
            UNIT_LEASE.renew(
                s,
                (WorkUnit.job_id == job_id) & (WorkUnit.session_id == session_id) & (WorkUnit.status == "leased"),
                t,
                lease_seconds,
            )

    def finish(self, job_id: str, unit: WorkUnit, status: UnitStatus = "done") -> bool:
        """End a leased unit, fenced by its claim's epoch (False: it was taken over; nothing changes)."""
        with self.db_session() as s, s.begin():
            result = s.execute(
                update(WorkUnit)
                .where(self._unit(job_id, unit.unit_id), UNIT_LEASE.fenced(unit.epoch), WorkUnit.status == "leased")
                .values(status=status, finished_at=self.state.db_now(), **UNIT_LEASE.ended())
            )
            if result.rowcount != 1:
                return False
            s.execute(
                update(UnitClaim)
                .where(UnitClaim.job_id == job_id, UnitClaim.unit_id == unit.unit_id, UnitClaim.epoch == unit.epoch)
                .values(finished=1)
            )
            s.execute(
                delete(Reservation).where(
                    Reservation.job_id == job_id, Reservation.unit_id == unit.unit_id, Reservation.epoch == unit.epoch
                )
            )
            return True

    # -- the budget -----------------------------------------------------------------------------
    def spent(self, job_id: str, prices: dict[str, float], s=None) -> dict[str, float]:
        """USD per tenant this job has spent or reserved: its stored items and failed attempts priced by their
        tier's USD per GPU-hour (`prices`), plus live reservations for items not stored yet."""
        if s is None:
            with self.db_session() as s:
                return self.spent(job_id, prices, s)
        out: dict[str | None, float] = {}
        totals = select(SpentTotal.tenant, SpentTotal.tier, SpentTotal.gpu_seconds).where(SpentTotal.job_id == job_id)
        for tenant, tier, seconds in s.execute(totals):  # running totals: a row per tenant and tier
            out[tenant or None] = out.get(tenant or None, 0.0) + seconds * prices.get(tier, 0.0) / 3600
        t = self.state.db_now()
        stored = select(Item.item_key).where(Item.job_id == job_id, Item.item_key == Reservation.item_key).exists()
        for tenant, usd in s.execute(
            select(Reservation.tenant, func.sum(Reservation.usd))
            .join(
                WorkUnit,
                (WorkUnit.job_id == Reservation.job_id)
                & (WorkUnit.unit_id == Reservation.unit_id)
                & (WorkUnit.epoch == Reservation.epoch),
            )
            .where(Reservation.job_id == job_id, WorkUnit.status == "leased", UNIT_LEASE.live(t), ~stored)
            .group_by(Reservation.tenant)
        ):
            out[tenant] = out.get(tenant, 0.0) + (usd or 0.0)
        return out

    def reserve(
        self,
        job_id: str,
        unit: WorkUnit,
        requests: list[tuple[str, str, float]],
        prices: dict[str, float],
        problems: Callable[[dict[str, float]], list[str]],
    ) -> list[str]:
        """Reserve `requests` ((item key, tenant, estimated USD)) for `unit`'s claim if what the job has spent
        and reserved plus them crosses no cap (`problems`: the caps crossed by a total per tenant); else
        reserve nothing and return the caps crossed. One admission per job at a time: the transaction
        first writes the job's row, which PostgreSQL locks and SQLite serialises (a write lock), so two
        workers never both see the room that only one of them may take."""
        with self.db_session() as s, s.begin():
            s.execute(update(JobRow).where(JobRow.job_id == job_id).values(status=JobRow.status))
            planned = self.spent(job_id, prices, s)
            for _, tenant, usd in requests:
                planned[tenant] = planned.get(tenant, 0.0) + usd
            found = problems(planned)
            if not found:
                s.execute(
                    self._insert(Reservation).on_conflict_do_nothing(),
                    [
                        {
                            "job_id": job_id,
                            "unit_id": unit.unit_id,
                            "epoch": unit.epoch,
                            "item_key": key,
                            "tenant": tenant,
                            "usd": usd,
                        }
                        for key, tenant, usd in requests
                    ],
                )
            return found

    def delete_dead_reservations(self) -> int:
        """Delete the reservations no live claim holds (its unit not leased at their epoch any more): the step
        that ends a claim deletes its own; these are what a version before that left. How many went."""
        live = (
            select(WorkUnit.unit_id)
            .where(
                WorkUnit.job_id == Reservation.job_id,
                WorkUnit.unit_id == Reservation.unit_id,
                WorkUnit.epoch == Reservation.epoch,
                WorkUnit.status == "leased",
            )
            .exists()
        )
        with self.db_session() as s, s.begin():
            return s.execute(delete(Reservation).where(~live)).rowcount

    def set_keys(self, job_id: str, states: dict[str, tuple[str, str | None, str | None]]) -> None:
        """key -> (state, reason, detail), in one transaction: one statement per state and IN_CHUNK keys, not
        one per key (a step finishing a batch stores thousands)."""
        groups: dict[tuple[str, str | None, str | None], list[str]] = {}
        for key, value in states.items():
            groups.setdefault(value, []).append(key)
        with self.db_session() as s, s.begin():
            for (state, reason, detail), keys in groups.items():
                for chunk in in_chunks(keys):
                    s.execute(
                        update(UnitKey)
                        .where(UnitKey.job_id == job_id, UnitKey.item_key.in_(chunk))
                        .values(state=state, reason=reason, detail=detail)
                    )

    def key_states(self, job_id: str, keys: list[str]) -> dict[str, Row]:
        """key -> (state, reason, detail) of each key enqueued, as named rows: plain columns, not ORM objects
        (a partition's wave asks for every one of its keys each time it checks whether the wave is in)."""
        cols = (UnitKey.item_key, UnitKey.state, UnitKey.reason, UnitKey.detail)
        out = {}
        with self.db_session() as s:
            for chunk in in_chunks(keys):
                for row in s.execute(select(*cols).where(UnitKey.job_id == job_id, UnitKey.item_key.in_(chunk))):
                    out[row.item_key] = row
        return out

    def units(self, job_id: str, partition: str | None = None) -> list[WorkUnit]:
        with self.db_session() as s:
            q = select(WorkUnit).where(WorkUnit.job_id == job_id)
            if partition is not None:
                q = q.where(WorkUnit.partition == partition)
            rows = list(s.scalars(q.order_by(WorkUnit.unit_id)))
            for r in rows:
                s.expunge(r)
            return rows

    def partitions_without_open_units(self, job_id: str) -> list[str]:
        """The job's generating partitions none of whose current wave's units is pending, leased or deferred:
        those whose next wave waits only on keys that units of other partitions own (or is ready now). One
        query, so that a finished unit looks at these few, not at every partition's wave state."""
        open_unit = (
            select(WorkUnit.unit_id)
            .where(
                WorkUnit.job_id == Partition.job_id,
                WorkUnit.partition == Partition.partition,
                WorkUnit.wave == Partition.wave,
                WorkUnit.status.in_(("pending", "leased", "deferred")),
            )
            .exists()
        )
        with self.db_session() as s:
            query = select(Partition.partition).where(
                Partition.job_id == job_id, Partition.generation == "generating", ~open_unit
            )
            return list(s.scalars(query.order_by(Partition.partition)))

    def depth(self, job_id: str | None = None) -> dict[str, dict[str, int]]:
        """tier -> {status: units}: the queue depth `tokenmill status` shows."""
        with self.db_session() as s:
            q = select(WorkUnit.tier, WorkUnit.status, func.count(), func.sum(WorkUnit.requests))
            if job_id is not None:
                q = q.where(WorkUnit.job_id == job_id)
            out: dict[str, dict[str, int]] = {}
            for tier, status, n, requests in s.execute(q.group_by(WorkUnit.tier, WorkUnit.status)):
                out.setdefault(tier, {})[status] = int(n)
                out[tier][f"{status}_requests"] = int(requests or 0)
            return out

    # -- engine sessions ------------------------------------------------------------------------
    def open_session(
        self,
        session_id: str,
        job_id: str,
        tier: str,
        worker: str,
        gpus: int,
        started: bool,
        startup_seconds: float,
        idle_seconds: float,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> None:
        t = self.state.db_now()
        with self.db_session() as s, s.begin():
            s.add(
                EngineSession(
                    session_id=session_id,
                    job_id=job_id,
                    tier=tier,
                    gpus=gpus,
                    started=int(started),
                    status="running",
                    startup_seconds=startup_seconds,
                    busy_seconds=0.0,
                    idle_seconds=idle_seconds,
                    recorded_seconds=0.0,
                    opened_at=t,
                    **SESSION_LEASE.claimed(worker, t, lease_seconds),
                )
            )

    def beat_session(
        self,
        session_id: str,
        busy: float,
        idle: float,
        recorded: float,
        closed: bool = False,
        counters: dict[str, int | None] | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> None:
        """Renew a session's lease and figures; `counters`: the engine's counts over it (SESSION_COUNTERS), at
        its close."""
        t = self.state.db_now()
        values = {
            "busy_seconds": busy,
            "idle_seconds": idle,
            "recorded_seconds": recorded,
            **{k: v for k, v in (counters or {}).items() if k in SESSION_COUNTERS},
        }
        if closed:
            values.update(status="closed", closed_at=t, **SESSION_LEASE.ended())
        with self.db_session() as s, s.begin():
            SESSION_LEASE.renew(s, EngineSession.session_id == session_id, t, lease_seconds, **values)

    def sessions(self, job_id: str) -> list[EngineSession]:
        with self.db_session() as s:
            rows = list(
                s.scalars(
                    select(EngineSession)
                    .where(EngineSession.job_id == job_id)
                    .order_by(EngineSession.opened_at, EngineSession.session_id)
                )
            )
            for r in rows:
                s.expunge(r)
                r.heartbeat_at, r.lease_expires_at = aware(r.heartbeat_at), aware(r.lease_expires_at)
            return rows

    def live_sessions(self) -> list[EngineSession]:
        """Sessions still running whose lease has not run out (`tokenmill status`)."""
        t = self.state.db_now()
        with self.db_session() as s:
            rows = list(
                s.scalars(select(EngineSession).where(EngineSession.status == "running", SESSION_LEASE.live(t)))
            )
            for r in rows:
                s.expunge(r)
            return rows

    # -- charges --------------------------------------------------------------------------------
    def add_charges(self, job_id: str, rows: list[dict]) -> None:
        if rows:
            statement = self._insert(Charge).on_conflict_do_nothing(index_elements=["job_id", "charge_id"])
            with self.db_session() as s, s.begin():
                added = s.execute(
                    statement.returning(Charge.kind, Charge.tenant, Charge.tier, Charge.gpu_seconds),
                    [{"job_id": job_id, **r} for r in rows],
                )
                # (not lost work: it has no tenant, and a cap admits engine calls, not their takeovers)
                add_spent(s, job_id, [(tenant, tier, g) for kind, tenant, tier, g in added if kind == "failed_attempt"])

    def unfinished_claims(self, job_id: str, session_id: str) -> list[UnitClaim]:
        """The claims `session_id` made and did not finish (its unit taken over, or still leased to it)."""
        with self.db_session() as s:
            rows = list(
                s.scalars(
                    select(UnitClaim).where(
                        UnitClaim.job_id == job_id, UnitClaim.session_id == session_id, UnitClaim.finished == 0
                    )
                )
            )
            s.expunge_all()
            return rows

    def charges(self, job_id: str, partition: str) -> list[dict]:
        with self.db_session() as s:
            return [
                dict(r)
                for r in s.execute(
                    select(*Charge.__table__.c).where(Charge.job_id == job_id, Charge.partition == partition)
                ).mappings()
            ]

    def recorded_by_session(self, job_id: str) -> dict[str, float]:
        """Busy GPU-seconds stored per engine session: its items' plus its charges' (the shares'
        denominator; items and charges of a job all land in committed ledger rows)."""
        from pipeline.stores.catalog import Item

        out: dict[str, float] = {}
        with self.db_session() as s:
            for model in (Item, Charge):
                for sid, seconds in s.execute(
                    select(model.session_id, func.sum(model.gpu_seconds))
                    .where(model.job_id == job_id)
                    .group_by(model.session_id)
                ):
                    if sid is not None:
                        out[sid] = out.get(sid, 0.0) + float(seconds or 0.0)
        return out
