"""Evals: the quality of every saving, measured on a hold-out set before a lever is turned on.

`tokenmill eval` runs the hold-out documents through the job's own staging path (read, validate,
dedup, route) and its own prompt and engine path on every tier, then measures offline, from those
outputs: each tier's agreement with the largest tier (ROUGE-L), its output checks and unfaithful-summary
rate; routing at each router threshold and escalation at each confidence threshold (quality kept: the
acceptable share against all-large's; share kept on the small tier, cost); near and semantic reuse's
false-hit rate. It picks
the cheapest policy that keeps the target quality and writes it where the config reads it.

  evaluate.py   `tokenmill eval`: the hold-out set on every tier, each saving scored against its cost
  runs.py       every hold-out document generated on a tier, through the job's prompt and engine path
  policies.py   routing and escalation policies scored offline from every document's output on both tiers
  reuse.py      near and semantic reuse scored on real outputs: how often a reused summary is wrong
  calibrate.py  `tokenmill checks`: the output checks on a user's own outputs, against a reader's labels
  judge_set.py  the candidates of the judge's labelled set
  llm_judge.py  an LLM judge of outputs (checks.judge), measured against a reader's labels like a check
  apply.py      what the eval chose, written into the user's YAML config in place

May import every layer below it (dev, job and down); only the CLI imports it.
"""
