"""job: the control beside the data path. Runs the stages over an input, partition by partition.

  lifecycle.py    Job: stage the input once, run its partitions, finish with the manifest; run_job
  stages.py       the CPU stages (read -> validate -> content_hash -> route -> item_keys -> sketch
                  -> cluster), each declaring the columns it needs and adds; staged_input (in memory)
  plan.py         planning: the stages streamed by input file and sharded by dedup scope, in a pool
  staging.py      the staging area (`_staging/`): staged records and prepared requests per partition
  partition.py    PartitionRun: prepare (lookups, wave 0), then claim, heartbeat, assemble, write, commit
  generation.py   Generation: waves as work units in the catalog, tier workers draining them, the
                  engines' held time shared into partitions' ledgers
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
