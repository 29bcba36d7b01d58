"""Fault injection: the one documented seam through which tests and chaos drills make a partition fail.

    def lose_worker(point, job_id, partition):
        if point == "before_generate" and partition == victim:
            raise OSError("GPU worker lost")

    with faults.inject(lose_worker):
        run_job(config)            # that partition fails as if its worker had; the others commit

Points, in the order a job meets them (`partition` is "" at the job's own points):
  before_register   planning is done, its records written; its partitions are not registered, the job is `planning`
  before_generate   the staged records are read; no lookup, engine call or write has happened
  wave_written      a partition's wave (its first, or the next) is derived and its files written; the
                    catalog has not taken it, and its keys are not enqueued
  before_commit     outputs, ledger and quarantine are assembled; nothing is written yet
  before_publish    committed in the catalog; no Delta table has the partition yet
An injector that raises fails the partition at that point, exactly as a real fault would there.
Injectors are process-wide (the Airflow DAG's `dag.test()` runs tasks in the test's process).

The disk itself: `inject_storage(fn)` calls `fn(path, data)` before the storage layer writes each local file
(its temporary name, then renamed into place); an `fn` that raises OSError (ENOSPC, EIO) fails that write
exactly as the disk would, after writing to `path` whatever part it chose to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pipeline.stores import storage

Injector = Callable[[str, str, str], None]  # (point, job_id, partition)
POINTS = ("before_register", "before_generate", "wave_written", "before_commit", "before_publish")
_injectors: list[Injector] = []


@contextmanager
def inject(injector: Injector) -> Iterator[None]:
    """Run `injector` at every fault point of every partition run while the block lasts."""
    _injectors.append(injector)
    try:
        yield
    finally:
        _injectors.remove(injector)


@contextmanager
def inject_storage(injector: Callable[[str, bytes], None]) -> Iterator[None]:
    """Run `injector(path, data)` before every local file write of the storage layer while the block lasts."""
    storage.WRITE_FAULTS.append(injector)
    try:
        yield
    finally:
        storage.WRITE_FAULTS.remove(injector)


def checkpoint(point: str, job_id: str, partition: str) -> None:
    """Called by the job at each point; a no-op unless an injector is active."""
    assert point in POINTS, point
    for injector in list(_injectors):
        injector(point, job_id, partition)
