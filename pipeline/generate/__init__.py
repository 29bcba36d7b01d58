"""generate: the stage that runs per partition. Turn what records still need into engine calls, run them, follow up.

  requests.py  build engine requests: render, tokenise, fit the context, order, cut into engine calls
  engine.py    the vLLM engine pool, one engine per tier per process
  lookup.py    item lookup: this job's paid items (catalog), then exact hits in the cache
  reuse.py     what each record gets: a paid output, a cached one, or a generation unit
  rounds.py    the generation rounds, with their follow-ups (followup.py: escalation, map-reduce chunks,
               schema retries)
  recorder.py  the call recorder: price each call (pricing.py), store its items, put them in the cache
  shadow.py    shadow verification: the measured false-hit rate of near/semantic reuse

Layer: may import pipeline.route, pipeline.dedup, pipeline.ingest, pipeline.stores and the base;
never pipeline.output or pipeline.job. tests/test_architecture.py enforces this.
"""
