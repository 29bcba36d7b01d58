"""plan: the data path's CPU stages over a whole input, before any GPU work, and what it will cost.

  stages.py    the CPU stages (read -> validate -> content_hash -> route -> item_keys -> sketch
               -> cluster), each declaring the columns it needs and adds; staged_input (in memory)
  streamed.py  planning: the stages streamed by input file and sharded by dedup scope, in a process
               pool, into the staging area (plan_job; plan_keyed, plan_shard, plan_staged as tasks)
  shards.py    the cluster stage per shard of tenant scopes; a scope too large for one process cut
  estimate.py  the pre-flight estimate (`tokenmill estimate`, estimate_job): the job's own planning, priced
  rates.py     what earlier ledgers measured per tier and model, with spreads (tier_rates); with none, the
               hardware projection (prior_rate)
  hardware.py  a tier's throughput from first principles: its model's config.json, its batch and its device's
               limits (a roofline with efficiency factors calibrated on published results: docs/estimate.md)
  whatif.py    the job projected on other GPUs, models and levers (`tokenmill estimate --hardware`)
  whatif_page.py  the what-if projection as an HTML page
  breakeven.py at what nightly volume self-hosting beats the API batch offers
  tokens.py    token counts for a what-if with no model files (the best tokenizer there is)

Layer: below pipeline.job (whose plan step runs it), above pipeline.output; may import every layer
below it, pipeline.stores and the base. tests/unit/test_architecture.py enforces this.
"""
