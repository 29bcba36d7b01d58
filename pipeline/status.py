"""The statuses that cross a process, each set named once: the catalog stores them as strings, the steps,
the CLI, the DAG and the Batch API's runner read them, and a type checker holds every literal to its set.

  JobStatus         a job's row (`jobs.status`): planning, then running, then how it ended
  PartitionStatus   a partition's row (`partitions.status`): its commit's progress
  GenerationStatus  a partition's generation (`partitions.generation`): its waves of work units
  UnitStatus        a work unit's row (`work_units.status`)
  EngineSessionStatus  an engine session's row (`engine_sessions.status`)
  BatchStatus       a Batch API batch (OpenAI's names), kept by the server in object storage

Base layer: imports nothing of ours.
"""

from __future__ import annotations

from typing import Literal, get_args

JobStatus = Literal[
    "planning", "planning_failed", "planned", "running", "succeeded", "failed", "deferred", "refused", "cancelled",
    "expired",
]  # fmt: skip
PartitionStatus = Literal["pending", "running", "succeeded", "failed", "deferred"]
GenerationStatus = Literal["generating", "generated", "failed"]
UnitStatus = Literal["pending", "leased", "done", "deferred"]
EngineSessionStatus = Literal["running", "closed"]
BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]  # fmt: skip

# Planning has begun and not ended: the job's partitions are not registered yet.
PLANNING: tuple[JobStatus, ...] = ("planning", "planning_failed")
# A job finished for good, while nobody reruns it.
FINISHED: tuple[JobStatus, ...] = ("succeeded", "failed", "deferred", "refused", "cancelled", "expired")
# A job stopped at a budget cap: refused as it started, or deferred mid-run.
AT_BUDGET_CAP: tuple[JobStatus, ...] = ("refused", "deferred")
# A batch the runner still works on.
ACTIVE_BATCH: tuple[BatchStatus, ...] = ("validating", "in_progress", "finalizing", "cancelling")


def values(alias) -> tuple[str, ...]:
    """The strings a status alias allows (for a check, a table, an error message)."""
    return get_args(alias)
