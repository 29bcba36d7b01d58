"""tokenmill: batch LLM summarisation at the lowest cost per document.

The public facade: what the CLI, the Airflow DAG, benchmarks and tests use.

    config = load_config("configs/local.yaml")   # the one typed config, built once
    estimate = estimate_job(config)              # pre-flight: what the job would generate and cost
    result = run_job(config)                     # run (or continue) a job to its last partition

`Job` runs a job's four steps (plan, prepare, drain, commit) in order over its `JobContext`;
orchestrators call the same steps as separate tasks (pipeline/job/orchestrate.py). `JobError`
carries a one-line reason.
Everything else lives in the data path's folders (ingest, dedup, route, generate, output) and the
stores beside them; docs/architecture.md maps them.
"""

from pipeline.config import ConfigError, TokenmillConfig, load_config
from pipeline.job.context import JobContext
from pipeline.job.lifecycle import Job, JobError, JobResult, run_job
from pipeline.plan.estimate import estimate_job

__all__ = [
    "ConfigError",
    "TokenmillConfig",
    "load_config",
    "estimate_job",
    "run_job",
    "Job",
    "JobContext",
    "JobError",
    "JobResult",
]
__version__ = "0.1.0"
