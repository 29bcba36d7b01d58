"""stores: where state lives, below every stage.

  storage.py   object storage: local folders, file:// and s3:// through pyarrow.fs, atomic writes
  catalog.py   the job-state catalog (SQLite or PostgreSQL): tables jobs, partitions, items;
               migrations/ is its Alembic schema history
  units.py     the GPU side of the catalog: work units and their keys, engine sessions, charges
  cache.py     the reuse cache across jobs (local SQLite or Redis): outputs by item key, and the
               near/semantic index segments as opaque blobs (pipeline/dedup/index.py owns their format)

Layer: may import pipeline.config, pipeline.schema and pipeline.keys (the base) only; every stage
and pipeline.job may import it. tests/unit/test_architecture.py enforces this.
"""
