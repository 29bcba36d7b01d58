"""tokenmill: batch LLM summarisation at the lowest cost per document.

Public facade: `load_config` builds the one typed config; `run_job` runs a job with it.
"""

from pipeline.config import TokenmillConfig, load_config
from pipeline.job.lifecycle import JobError, JobResult, run_job

__all__ = ["TokenmillConfig", "load_config", "run_job", "JobError", "JobResult"]
__version__ = "0.1.0"
