"""stores: where state lives, below every layer.

  storage.py   object storage: local folders, file:// and s3:// through pyarrow.fs, atomic writes
  catalog.py   the job-state catalog (SQLite or PostgreSQL): tables jobs, partitions, items;
               migrations/ is its Alembic schema history
  units.py     the GPU side of the catalog: work units and their keys, engine sessions, charges
  lease.py     the one lease: holder, fencing epoch and expiry of a catalog row, on the database's clock
  paths.py     every path under an output root (`OutputPath`): the one place that builds and parses them
  staging.py   the staging area (`_staging/`): one method per artefact planning and the steps hand on
  runners.py   which `tokenmill serve` runs the batches of an output root (its runner lease)
  cache.py     the reuse cache across jobs (local SQLite or Redis): outputs by item key, and the
               near/semantic index segments as opaque blobs (pipeline/dedup/index.py owns their format)

Layer: may import pipeline.config, pipeline.schema and pipeline.keys (the base) only; every layer
and pipeline.job may import it. tests/unit/test_architecture.py enforces this.
"""
