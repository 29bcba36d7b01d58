"""output: the last stage. What lands for analysts under the output root, and how it is read back.

  write.py      assemble each record's output or quarantine row and its ledger row, and the job manifest
  manifest.py   the job manifest and a committed partition's counts as types: built, written and read back
  tables.py     outputs/, ledger/ and quarantine/ as Delta Lake tables: a partition published once per table
  migrate.py    `tokenmill tables migrate`: an output root of the layout before the tables, converted once
  ledger.py     DuckDB views and queries over the tables' snapshots (ledger, outputs, quarantine)
  batch.py      a batch file's answers in the format its client reads back (OpenAI, Anthropic)
  focus.py      the ledger as FOCUS 1.2 cost and usage rows, for FinOps tools
  report.py     the self-contained HTML cost report of a job
  charts.py     inline SVG charts for the report
  devices.py    the devices' limits: GPU datasheet peaks, this machine's CPU measured by a probe
  telemetry.py  engine efficiency (MFU, MBU) for the manifest
  safe_text.py  CSV and JSONL text made safe for the programs that read it

Layer: may import pipeline.generate and every layer below it, down to the base; never pipeline.job,
pipeline.dev or pipeline.cli. tests/unit/test_architecture.py enforces this.
"""
