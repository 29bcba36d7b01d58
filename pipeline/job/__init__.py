"""job: the control beside the data path: four steps over one context, run partition by partition.

  lifecycle.py    Job: the four steps in order in one process (`tokenmill run`); run_job; finish
  context.py      JobContext: built once per process and job; builds each step's collaborators (config, job id,
                  catalog, staging area, cache, engine pool, worker id, progress) as the step's own type
  plan.py         the plan step: planning (pipeline/plan/) once per job under a lease, partitions registered
  prepare.py      the prepare step: paid-item lookup, requests rendered and tokenised, wave 0 enqueued
  drain.py        the drain step: one tier worker over the job's units (TierDrain is its job side)
  commit.py       the commit step: claim, assemble with the engines' time shared in, write, commit
  preflight.py    what a step refuses before work: engines that cannot run here, a job's isolation changed
  budget.py       BudgetGuard: USD caps before the job starts and before every work unit runs
  orchestrate.py  one idempotent function per orchestrator task (the Airflow DAG wires them)
  manifest.py     the job manifest, summed from committed partitions
  progress.py     progress bar or log lines
  faults.py       the documented seam through which tests inject faults
  lineage.py      the job as OpenLineage sees it (input prefix -> three tables), for the DAG's summary
  maintain.py     what outlives a job and no step reads again: dead reservations, finished jobs' metrics

Layer: may import planning (pipeline.plan), every layer of the data path (output, generate, route, dedup, ingest),
pipeline.stores and the base; never pipeline.dev or pipeline.cli. The facade pipeline/__init__.py re-exports its
public names.
tests/unit/test_architecture.py enforces this.
"""
