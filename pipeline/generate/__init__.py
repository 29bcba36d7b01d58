"""generate: turn what records still need into engine requests, run them on tier workers, follow up.

  requests.py  build engine requests: render, tokenise, fit the context, order, cut into engine calls
  engine.py    the engine pool, one engine per tier per process (vLLM, or the fake one: `engine: fake`)
  vllm_engine.py the vLLM engine: its own engine loop as the streaming interface, counters, a dead engine
  engine_api.py  what every engine speaks: the Engine protocol, Completion, Progressed, errors, tokenizer
  fake_engine.py the deterministic fake engine (tests of logic, overhead benchmarks, dry runs)
  lookup.py    item lookup: this job's paid items (catalog), then exact hits in the cache
  reuse.py     what each record gets: a paid output, a cached one, or a generation
  waves.py     a partition's generation waves, with their follow-ups (followup.py: escalation, map-reduce
               chunks, schema retries, judges), derived from what is stored
  judge.py     the LLM judge (checks.judge): its verdicts on outputs that passed the checks, a follow-up wave
  worker.py    the tier worker: one engine kept fed with its tier's work units from every partition;
               it measures start-up, busy and idle time and prices each finished request (pricing.py)
  shadow.py    shadow verification: the measured false-hit rate of near/semantic reuse
  metrics.py   the Prometheus metrics of a run (one registry): served by tier workers, pushed by CPU steps
  partition_waves.py  PartitionWaves: each partition's waves of work units in the catalog (start, advance, fail)
  memory_units.py  requests run through the tier worker with no job (evals, benchmarks): units in memory
  engine_time.py  what the engines' held time comes to per partition: the shares a commit writes
  adapters.py  LoRA adapters: one per tenant, served beside the base model in the tier's engine
  levers.py    a tier's engine levers by vLLM's own names, checked before any work
  vllm_options.py  vLLM's own option types, read from the installed vLLM for the lever checks
  quality.py   output quality without a reference model: ROUGE-L, unfaithful terms, the output checks

Layer: may import pipeline.route, pipeline.dedup, pipeline.ingest, pipeline.stores and the base;
never pipeline.output or pipeline.job. tests/unit/test_architecture.py enforces this.
"""
