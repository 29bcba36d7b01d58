"""What a step refuses before any work: engines that cannot run on this host, and a job planned under other
tenant isolation than its config's. Functions of what they check (the config, the job's catalog row), so that the
step that needs one calls it once, where the work it guards begins."""

from __future__ import annotations

from pipeline.config import TokenmillConfig
from pipeline.errors import JobError
from pipeline.generate.adapters import adapter_problems
from pipeline.generate.levers import config_lever_problems
from pipeline.keys import isolation_fingerprint
from pipeline.stores.catalog import StateStore


def check_engines(config: TokenmillConfig, tiers: list[str]) -> None:
    """Before any work on `tiers` (an engine refusing them costs minutes): their levers and their tenants'
    adapters, checked on this host; one JobError naming every problem and its fix."""
    problems = config_lever_problems({t: config.tiers[t] for t in tiers}) + adapter_problems(config, tiers)
    if problems:
        raise JobError("engines that cannot run: " + "; ".join(problems))


def check_isolation(state: StateStore, job_id: str, config: TokenmillConfig) -> None:
    """Refuse to go on with a job planned under other tenant isolation than `config`'s: planning decided which
    tenants share outputs and keyed items by their adapters' digests, so another `dedup.shared_tenants`, or an
    adapter retrained since (say between the DAG's `plan` and drain tasks), could serve a tenant an output it may
    not see, or store new weights' outputs under the old adapter's keys. Jobs planned before the fingerprint was
    recorded are not checked."""
    row = state.job(job_id)
    planned = row.isolation if row is not None else None
    if planned is not None and planned != isolation_fingerprint(config):
        raise JobError(
            f"job {job_id} was planned under other tenant isolation settings (dedup.shared_tenants, "
            "or a tenant's adapter, retrained or moved since) than this config's: its reuse decisions "
            "and item keys could give a tenant outputs it may no longer see. Restore those settings "
            "to continue it, or run the input as a new job id"
        )
