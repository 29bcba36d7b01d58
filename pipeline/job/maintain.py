"""Maintenance of what outlives a job: rows of the catalog no step will read again, and the job's metrics
groups on the Pushgateway, which keeps serving a group's last values until it is deleted."""

from __future__ import annotations

import logging
from datetime import timedelta

from pipeline.config import TokenmillConfig, redact_url
from pipeline.generate import metrics
from pipeline.stores.catalog import StateStore
from pipeline.stores.units import UnitQueue

log = logging.getLogger(__name__)

# A job is finished for good in these statuses only while nobody reruns it: a rerun pushes a new group.
FINISHED = ("succeeded", "failed", "deferred", "refused", "cancelled", "expired")


def maintain(config: TokenmillConfig, grace_seconds: float) -> dict[str, int]:
    """Delete the catalog's dead budget reservations, and the Pushgateway groups (`metrics.job_label`) of jobs
    that finished more than `grace_seconds` ago on the database's clock (time enough for Prometheus to
    scrape their last values). Groups of jobs this catalog does not know, or still running, are kept.
    Returns what went: {"reservations": n, "groups": n}."""
    state = StateStore(config.state.url)
    out = {"reservations": UnitQueue(state).delete_dead_reservations(), "groups": 0}
    if not config.metrics.pushgateway_url:
        return out
    cutoff = state.db_now() - timedelta(seconds=grace_seconds)
    done = {
        j.job_id
        for j in state.jobs()
        if j.status in FINISHED and j.finished_at is not None and j.finished_at.replace(tzinfo=cutoff.tzinfo) <= cutoff
    }
    for labels in metrics.pushed_groups(config.metrics):
        if labels.get("job_id") in done:
            metrics.delete_group(config.metrics, labels)
            log.info("deleted metrics group %s of %s", labels, redact_url(config.metrics.pushgateway_url))
            out["groups"] += 1
    return out
