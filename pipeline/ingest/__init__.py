"""ingest: the first layer of the data path. Read every input file into raw records, then split them into valid
records and quarantine rows with a reason code.

  read.py      list the input (local or s3://) and parse .jsonl, .jsonl.gz, .parquet, .txt, .md;
               assign partitions
  validate.py  the checks, in a fixed order; quarantine rows (schema.QUARANTINE)
  batch.py     a line of an OpenAI or Anthropic batch file as a record
  gunzip.py    a .gz input file decompressed, the complete lines before any damage salvaged

Layer: may import pipeline.stores and the base (pipeline.config, schema, keys); never a later layer.
tests/unit/test_architecture.py enforces this.
"""
