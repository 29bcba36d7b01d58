"""Evals: the quality of every saving, measured on a hold-out set before a lever is turned on.

`tokenmill eval` runs the hold-out documents through the job's own staging path (read, validate,
dedup, route) and its own prompt and engine path on every tier, then measures offline, from those
outputs: each tier's agreement with the largest tier (ROUGE-L) and its unfaithful-summary rate;
routing at each router threshold and escalation at each confidence threshold (quality kept against
all-large, share kept on the small tier, cost); near and semantic reuse's false-hit rate. It picks
the cheapest policy that keeps the target quality and writes it where the config reads it.

May import every layer below it (dev, job and down); only the CLI imports it.
"""
