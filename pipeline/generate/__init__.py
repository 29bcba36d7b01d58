"""generate: turn what records still need into engine requests, run them on tier workers, follow up.

  requests.py  build engine requests: render, tokenise, fit the context, order, cut into engine calls
  engine.py    the engine pool, one engine per tier per process (vLLM, or the fake one: `engine: fake`)
  engine_api.py  what every engine speaks: the Engine protocol, Completion, Progressed, errors, tokenizer
  fake_engine.py the deterministic fake engine (tests of logic, overhead benchmarks, dry runs)
  lookup.py    item lookup: this job's paid items (catalog), then exact hits in the cache
  reuse.py     what each record gets: a paid output, a cached one, or a generation
  waves.py     a partition's generation waves, with their follow-ups (followup.py: escalation, map-reduce
               chunks, schema retries), derived from what is stored
  worker.py    the tier worker: one engine kept fed with its tier's work units from every partition;
               it measures start-up, busy and idle time and prices each finished request (pricing.py)
  shadow.py    shadow verification: the measured false-hit rate of near/semantic reuse
  metrics.py   the Prometheus metrics of a run (one registry): served by tier workers, pushed by CPU steps

Layer: may import pipeline.route, pipeline.dedup, pipeline.ingest, pipeline.stores and the base;
never pipeline.output or pipeline.job. tests/unit/test_architecture.py enforces this.
"""
