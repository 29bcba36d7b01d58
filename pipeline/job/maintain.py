"""Maintenance of what outlives a job: rows of the catalog no step will read again, and the metrics groups on
the Pushgateway, which keeps serving a group's last values until it is deleted."""

from __future__ import annotations

import logging
from datetime import timedelta

from pipeline.config import TokenmillConfig, redact_url
from pipeline.generate import metrics
from pipeline.status import FINISHED
from pipeline.stores.catalog import StateStore, migrate
from pipeline.stores.units import UnitQueue

log = logging.getLogger(__name__)


def maintain(config: TokenmillConfig, grace_seconds: float) -> dict[str, int]:
    """Delete the catalog's dead budget reservations, and the Pushgateway groups (`metrics.job_label`) whose jobs
    all finished more than `grace_seconds` ago on the database's clock (time enough for Prometheus to scrape their
    last values): a pipeline's group (its job named by `tokenmill_job_info`; the next run pushes it again), and
    the per-process groups older versions pushed (`job_id`, `instance`). A group of a job this catalog does not
    know, or still running, is kept. Returns what went: {"reservations": n, "groups": n}."""
    migrate(config.state.url, once=True)
    state = StateStore(config.state.url)
    out = {"reservations": UnitQueue(state).delete_dead_reservations(), "groups": 0}
    if not config.metrics.pushgateway_url:
        return out
    cutoff = state.db_now() - timedelta(seconds=grace_seconds)
    # A job is finished for good in FINISHED statuses only while nobody reruns it: a rerun pushes its group again.
    done = {
        j.job_id
        for j in state.jobs()
        if j.status in FINISHED and j.finished_at is not None and j.finished_at.replace(tzinfo=cutoff.tzinfo) <= cutoff
    }
    for group in metrics.pushed_groups(config.metrics):
        if group["job_ids"] and set(group["job_ids"]) <= done:
            metrics.delete_group(config.metrics, group["labels"])
            log.info("deleted metrics group %s of %s", group["labels"], redact_url(config.metrics.pushgateway_url))
            out["groups"] += 1
    return out
