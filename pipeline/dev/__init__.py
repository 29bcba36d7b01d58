"""dev: what demos, tests and benchmarks need that production does not: synthetic data and tiny models.

  samples.py     the synthetic sample corpus (the demo's input, the tests' fixtures, the tokenizer's text)
  tiny_model.py  a tiny random-weight Llama model, built offline, to exercise the real engine on CPUs
  labels.py      a synthetic labelled set for the learned router
  holdout.py     a hold-out set of real text tokenmill did not write, with labelled reuse variants
  real_model.py  the real instruct model and its quantised variants, built offline from installed packages
  adapters.py    small demo LoRA adapters, one per tenant on a shared base model, built offline

Layer: may import pipeline.job and every layer below it; only pipeline.cli may import it.
tests/unit/test_architecture.py enforces this.
"""
