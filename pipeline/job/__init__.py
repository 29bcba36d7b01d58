"""job: the control beside the data path. Runs the stages over an input, partition by partition.

  lifecycle.py    Job: the four steps in order in one process (`tokenmill run`); run_job; finish
  context.py      JobContext: what every step receives (config, job id, catalog, staging area, cache,
                  engine pool, worker id, progress), built once per process and job
  staging.py      the plan step: planning (plan.py) once per job under a lease, partitions registered
  prepare.py      the prepare step: paid-item lookup, requests rendered and tokenised, wave 0 enqueued
  drain.py        the drain step: one tier worker over the job's units (TierDrain is its job side)
  commit.py       the commit step: claim, assemble with the engines' time shared in, write, commit
  stages.py       the CPU stages (read -> validate -> content_hash -> route -> item_keys -> sketch
                  -> cluster), each declaring the columns it needs and adds; staged_input (in memory)
  plan.py         planning: the stages streamed by input file and sharded by dedup scope, in a pool
  budget.py       BudgetGuard: USD caps before the job starts and before every work unit runs
  estimate.py     the pre-flight estimate (`tokenmill estimate`, estimate_job): the job's own planning, priced
  rates.py        what earlier ledgers measured per tier and model, with spreads (tier_rates)
  orchestrate.py  one idempotent function per orchestrator task (the Airflow DAG wires them)
  manifest.py     the job manifest, summed from committed partitions
  progress.py     progress bar or log lines
  faults.py       the documented seam through which tests inject faults
  errors.py       JobError

Layer: may import every stage (output, generate, route, dedup, ingest), pipeline.stores and the base;
never pipeline.dev or pipeline.cli. The facade pipeline/__init__.py re-exports its public names.
tests/unit/test_architecture.py enforces this.
"""
