"""output: the last stage. What lands for analysts under the output root, and how it is read back.

  write.py      assemble each record's output or quarantine row and its ledger row; write a
                partition's outputs/, ledger/, quarantine/ Parquet and the job manifest, atomically
  ledger.py     DuckDB views and queries over the ledgers, outputs and quarantine
  report.py     the self-contained HTML cost report of a job
  telemetry.py  engine efficiency (MFU, MBU) for the manifest

Layer: may import pipeline.generate and every layer below it, down to the base; never pipeline.job,
pipeline.dev or pipeline.cli. tests/unit/test_architecture.py enforces this.
"""
