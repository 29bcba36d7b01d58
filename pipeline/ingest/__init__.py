"""ingest: the first stage. Read every input file into raw records, then split them into valid
records and quarantine rows with a reason code.

  read.py      list the input (local or s3://) and parse .jsonl, .jsonl.gz, .parquet, .txt, .md;
               assign partitions
  validate.py  the checks, in a fixed order; quarantine rows (schema.QUARANTINE)

Layer: may import pipeline.stores and the base (pipeline.config, schema, keys); never a later stage.
tests/unit/test_architecture.py enforces this.
"""
