"""dedup: a stage of the data path (clustering runs last at staging, after routing). Generate once per
meaning-equivalent document; every other copy reuses it.

  cluster.py   content hashes (exact), then near (MinHash) and semantic (embedding) clusters, in
               the job and against the cache index of earlier jobs; adds the reuse columns
  minhash.py   MinHash signatures and LSH banding
  embed.py     the static embedder for semantic reuse (built offline)
  guards.py    meaning guards: numbers, negations, entities and length must agree
  index.py     the near/semantic cache index: segment format, building a partition's segment, loading

Layer: may import pipeline.ingest, pipeline.stores and the base (item keys come from pipeline.keys);
never pipeline.route or a later stage. tests/unit/test_architecture.py enforces this.
"""
