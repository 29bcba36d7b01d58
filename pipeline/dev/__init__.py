"""dev: what demos, tests and benchmarks need that production does not: synthetic data and tiny models.

  samples.py     the synthetic sample corpus (the demo's input, the tests' fixtures, the tokenizer's text)
  tiny_model.py  a tiny random-weight Llama model, built offline, to exercise the real engine on CPUs
  labels.py      a synthetic labelled set for the learned router

Layer: may import pipeline.job and every layer below it; only pipeline.cli may import it.
tests/unit/test_architecture.py enforces this.
"""
