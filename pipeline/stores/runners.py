"""The runner lease: which `tokenmill serve` process runs the batches of an output root.

One row per output root (named by the SHA-256 of its URI) holds the one lease (stores/lease.py). Its holder
runs batches and renews it; another server on the same root claims nothing while it lives, and serves the
API only (its batches are in the shared root: the holder runs them). A holder that provably no longer runs
(`worker_is_gone`) is cut at once; one that hangs or lost its host is taken over when the lease expires,
and its epoch no longer renews: it stops its job and stands by (serve/runner.py).
"""

from __future__ import annotations

import hashlib
from datetime import datetime

from sqlalchemy import DateTime, Integer, String, Text, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, mapped_column

from pipeline.stores.catalog import Base, StateStore, aware
from pipeline.stores.lease import Lease, worker_is_gone


class RunnerLease(Base):
    __tablename__ = "runner_leases"

    root: Mapped[str] = mapped_column(String(64), primary_key=True)
    output_uri: Mapped[str] = mapped_column(Text)
    holder: Mapped[str | None] = mapped_column(String(200), nullable=True)
    epoch: Mapped[int] = mapped_column(Integer, default=0)
    renewed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


RUNNER_LEASE = Lease(RunnerLease.holder, RunnerLease.lease_expires_at, RunnerLease.epoch, RunnerLease.renewed_at)


def root_key(output_uri: str) -> str:
    return hashlib.sha256(output_uri.encode()).hexdigest()


class RunnerLeases:
    def __init__(self, state: StateStore, output_uri: str):
        self.state, self.output_uri, self.root = state, output_uri, root_key(output_uri)

    def holder(self) -> str | None:
        """Who holds the lease now (None: nobody, or an expired holder)."""
        with self.state.db_session() as s:
            row = s.get(RunnerLease, self.root)
            live = row is not None and row.lease_expires_at is not None and row.holder is not None
            return row.holder if live and aware(row.lease_expires_at) >= self.state.db_now() else None

    def claim(self, holder: str, seconds: float) -> int | None:
        """The lease for `holder` (its epoch), when it is free, expired or its holder is provably gone; None
        while another live holder has it."""
        self._ensure_row()
        t = self.state.db_now()
        with self.state.db_session() as s, s.begin():
            mine = RunnerLease.root == self.root
            current = s.execute(select(RunnerLease.holder).where(mine)).scalar_one_or_none()
            if current is not None and current != holder and worker_is_gone(current):
                RUNNER_LEASE.cut_gone(s, mine, current, t)
            free = RunnerLease.lease_expires_at.is_(None) | RUNNER_LEASE.expired(t)
            return RUNNER_LEASE.claim(s, mine & free, holder, t, seconds)

    def renew(self, holder: str, epoch: int, seconds: float) -> bool:
        """Extend `holder`'s claim `epoch`; False once another server has taken it over."""
        with self.state.db_session() as s, s.begin():
            where = (RunnerLease.root == self.root) & RUNNER_LEASE.fenced(epoch, holder)
            return RUNNER_LEASE.renew(s, where, self.state.db_now(), seconds) == 1

    def release(self, holder: str, epoch: int) -> None:
        """End the claim now (a server stopping): another server takes over at once."""
        with self.state.db_session() as s, s.begin():
            where = (RunnerLease.root == self.root) & RUNNER_LEASE.fenced(epoch, holder)
            RUNNER_LEASE.renew(s, where, self.state.db_now(), 0, **RUNNER_LEASE.ended())

    def _ensure_row(self) -> None:
        with self.state.db_session() as s:
            if s.get(RunnerLease, self.root) is not None:
                return
        try:
            with self.state.db_session() as s, s.begin():
                s.add(RunnerLease(root=self.root, output_uri=self.output_uri, epoch=0))
        except IntegrityError:  # another server inserted it at the same moment
            pass
