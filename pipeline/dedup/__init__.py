"""dedup: a layer of the data path (clustering runs last in planning, after routing). Generate once per
meaning-equivalent document; every other copy reuses it.

  cluster.py   content hashes (exact), then near (MinHash) and semantic (embedding) clusters, in
               the job and against the cache index of earlier jobs; adds the reuse columns
  minhash.py   MinHash signatures and LSH banding
  embed.py     the static embedder for semantic reuse (built offline)
  guards.py    meaning guards: numbers, negations, entities and length must agree
  index.py     the near/semantic cache index: segment format, building a partition's segment, loading
  sketch.py    dedup sketches: what clustering compares instead of texts, computed per record
  neighbours.py  earlier neighbours by cosine for semantic dedup: exact up to a size, an IVF index beyond
  split.py     a job's records cut into shards that cluster apart (a scope too large cut into parts)

Layer: may import pipeline.ingest, pipeline.stores and the base (item keys come from pipeline.keys);
never pipeline.route or a later layer. tests/unit/test_architecture.py enforces this.
"""
