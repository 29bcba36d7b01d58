"""The one lease: how a worker holds a row of the catalog (a job's planning, a partition, a work unit, an
engine session) so that exactly one live worker does its work and a dead one's work is taken over.

A lease is three columns of its row: the holder (`host:pid`, default_worker), the fencing epoch (every
claim increments it; whatever the holder writes under the claim must present it, so a holder that was
taken over changes nothing) and the expiry, always on the database's clock (StateStore.db_now: workers'
clocks disagree). One conditional UPDATE claims a row whose lease is free or expired, so exactly one
claimant wins on SQLite and PostgreSQL alike; the holder renews every third of the lease (`Renewal`);
a holder that provably no longer runs (`worker_is_gone`) has its lease cut at once instead of waited out.

Each table keeps its own meaning of "free" (a pending partition, a failed planning) and its own other
values; `Lease` supplies the parts they share.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, and_, update
from sqlalchemy.orm import InstrumentedAttribute, Session

log = logging.getLogger(__name__)


def default_worker() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def worker_is_gone(worker: str | None) -> bool:
    """True only when `worker` (named `host:pid` by default_worker) provably no longer runs: it ran on
    this host and no process has its pid. Any doubt (another host, another naming, a pid now used by
    some other process, a process of another user) is False: its lease then has to run out.
    Caveat: containers sharing a host name but not a pid namespace look gone to each other; the
    commit fence (the epoch) still keeps such a wrongly released worker from committing."""
    host, _, pid = (worker or "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit() or int(pid) in (0, os.getpid()):
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # e.g. PermissionError: it exists, as another user
    return False


@dataclass(frozen=True)
class Lease:
    """A table's lease columns. `epoch` is None for a lease nobody takes over (an engine session: its
    holder is the only writer; others only need to know whether it still lives); `renewed` records the
    last renewal for people reading the row."""

    holder: InstrumentedAttribute
    expires: InstrumentedAttribute
    epoch: InstrumentedAttribute | None = None
    renewed: InstrumentedAttribute | None = None

    @property
    def table(self):
        return self.holder.class_

    # -- conditions ------------------------------------------------------------------------------
    def expired(self, t: datetime) -> ColumnElement:
        return self.expires < t

    def live(self, t: datetime) -> ColumnElement:
        return self.expires >= t

    def fenced(self, epoch: int, holder: str | None = None) -> ColumnElement:
        """Only the claim `epoch` (and, when given, its `holder`) may write under it."""
        clauses = [self.epoch == epoch] + ([self.holder == holder] if holder is not None else [])
        return and_(*clauses)

    # -- values ----------------------------------------------------------------------------------
    def claimed(self, holder: str, t: datetime, seconds: float, first: bool = False) -> dict:
        """A new claim by `holder`, expiring `seconds` from `t`: the next epoch, or epoch 1 for a row
        that the claim inserts (`first`)."""
        values = {**self.renewed_values(t, seconds), self.holder.key: holder}
        if self.epoch is not None:
            values[self.epoch.key] = 1 if first else self.epoch + 1
        return values

    def renewed_values(self, t: datetime, seconds: float) -> dict:
        values = {self.expires.key: t + timedelta(seconds=seconds)}
        if self.renewed is not None:
            values[self.renewed.key] = t
        return values

    def ended(self) -> dict:
        return {self.expires.key: None}

    # -- statements --------------------------------------------------------------------------------
    def claim(self, s: Session, where: ColumnElement, holder: str, t: datetime, seconds: float, **values) -> int | None:
        """Claim the row matching `where` (which says when it is free): its new epoch, or None when another
        holder has it. One conditional UPDATE: exactly one concurrent claimant wins."""
        row = s.execute(
            update(self.table)
            .where(where)
            .values({**self.claimed(holder, t, seconds), **values})
            .returning(self.epoch)
            .execution_options(synchronize_session=False)
        ).first()
        return None if row is None else row[0]

    def renew(self, s: Session, where: ColumnElement, t: datetime, seconds: float, **values) -> int:
        """Extend the leases matching `where` (fence it), writing `values` with them (they win over the
        renewal's: a closing session's lease ends); how many were extended."""
        return s.execute(
            update(self.table)
            .where(where)
            .values({**self.renewed_values(t, seconds), **values})
            .execution_options(synchronize_session=False)
        ).rowcount

    def cut_gone(self, s: Session, where: ColumnElement, holder: str, t: datetime) -> bool:
        """End `holder`'s live lease on the row matching `where` now, because its process is provably gone
        (worker_is_gone), so that the row is claimable at once; the claim then decides who takes it."""
        return (
            s.execute(
                update(self.table)
                .where(where, self.holder == holder, self.live(t))
                .values({self.expires.key: t - timedelta(seconds=1)})
                .execution_options(synchronize_session=False)
            ).rowcount
            == 1
        )


class Renewal:
    """Renews a lease every third of it on a thread while a step runs. `renew()` returns False when the
    claim was taken over: the renewal stops and `lost` is set (the step must then not commit). A catalog
    unreachable for a while is logged and tried again: the lease has room for two missed beats."""

    def __init__(self, renew: Callable[[], bool], lease_seconds: float, name: str):
        self.renew, self.interval = renew, max(lease_seconds / 3, 0.5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)

    lost = False

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if not self.renew():
                    self.lost = True
                    return
            except Exception as e:  # noqa: BLE001 - any failure of one beat is the next beat's to retry
                log.warning("%s: could not renew the lease: %s", self._thread.name, e)

    def __enter__(self) -> Renewal:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
