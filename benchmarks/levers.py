"""Every cost lever on the real model, one run: speed, engine time, ledger dollars and quality against float32.

Model: SmolLM2-135M-Instruct as `tokenmill models real` builds it (float32, W8A8 INT8, W4A16 INT4).
Corpus: the hold-out set's real text (pipeline/dev/holdout.py, this machine's READMEs, man pages,
licences, docstrings), `--documents` originals plus a quarter as many should-reuse variants (a
mirror header, reflowed whitespace, a footer, punctuation), spread over `--tenants` tenants whose
documents all open with the tenant's own long preamble (about 260 tokens of synthetic policy text:
the shared prefix a template or a few-shot block gives), shuffled so that tenants interleave.

Each lever runs as a real tokenmill job (`run_job`) on the same corpus, with configs/local.yaml's
prompt and sampling, fresh engines and an empty cache, no reuse unless the lever is reuse:

  float32                   the baseline every row's quality is measured against
  W8A8 INT8 / W4A16 INT4    the quantised variants on the same device and price
  FP8 KV cache              kv_cache_dtype fp8 (needs AVX-512 or AMX on a CPU)
  KV pressure, input order  prefix caching on, a KV cache of a few blocks more than two requests need
  KV pressure, ordered      the same, requests sorted by token ids (tokenmill's default)
  speculative (n-gram)      speculative_config ngram, 4 tokens
  routing                   INT8 as a cheaper small tier, the compliance rule and unfaithful outputs to float32
  all off                   float32 with prefix caching off, input order: the prefix-caching lever too
  all on                    every lever that can run here at once (see its note)

Per run: output tokens per busy engine-second, engine-seconds (busy and held), ledger dollars per
1,000 documents (as billed, start-up included; and busy time only), prefix-cache hit rate
(cached / prompt tokens from the ledger), ROUGE-L agreement with float32's summary of the same
document, identical share and unfaithful rate (with its 95% Wilson interval), by the evals' own
functions. Then multi-LoRA: one engine serving `--adapters` tenants' LoRA adapters against one
engine per tenant (each adapter merged into its own full checkpoint, as a dedicated fine-tune is
served), engine memory (peak RSS of the engine processes) and output tokens per second.

Every engine runs under the machine's engine lock (/tmp/tokenmill-engine.lock), one at a time.
Prints a table and one JSON line. Usage:

    python benchmarks/levers.py [--documents 24] [--tenants 4] [--adapters 4] [--skip-lora] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import random
import re
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from benchmarks.common import emit, machine  # noqa: E402
from pipeline import load_config, run_job  # noqa: E402
from pipeline.config import tokenmill_home  # noqa: E402
from pipeline.dev.holdout import build_holdout  # noqa: E402
from pipeline.dev.samples import synthetic_document  # noqa: E402
from pipeline.generate.engine import EnginePool, shutdown_engines  # noqa: E402
from pipeline.generate.levers import cpu_flags  # noqa: E402
from pipeline.generate.quality import rouge_l, unfaithful_terms  # noqa: E402
from pipeline.generate.shadow import wilson_interval  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LOCK_PATH = "/tmp/tokenmill-engine.lock"
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
BLOCK = 128  # vLLM's KV block size on the CPU backend
# $/device-hour: configs/local.yaml's large tier; the INT8 tier as quality.py prices it
LARGE_PRICE, SMALL_PRICE = 2.00, 1.00


# -- the engine lock ------------------------------------------------------------------------------
class EngineLock:
    """fcntl lock on LOCK_PATH, held while this process has any engine (one engine's life at a time)."""

    def __init__(self, path: str = LOCK_PATH):
        self.path, self.file, self.waited = path, None, 0.0

    def acquire(self) -> None:
        if self.file is None:
            started = time.monotonic()
            self.file = open(self.path, "a")
            fcntl.flock(self.file, fcntl.LOCK_EX)
            self.waited += time.monotonic() - started

    def release(self) -> None:
        if self.file is not None:
            wait_for_engine_processes()
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()
            self.file = None


LOCK = EngineLock()

# The figures printed per lever
SHOWN = (
    "output_tokens_per_second",
    "busy_engine_seconds",
    "ledger_usd_per_1k_docs",
    "prefix_hit_rate",
    "rouge_l_vs_float32",
)


def engine_processes() -> list:
    """This process's live child processes but multiprocessing's helpers (its resource tracker lives on)."""
    import psutil

    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.status() != psutil.STATUS_ZOMBIE and not any("tracker" in a or "forkserver" in a for a in c.cmdline()):
                out.append(c)
        except psutil.Error:
            pass
    return out


def wait_for_engine_processes(timeout: float = 15.0) -> None:
    """Until vLLM's engine-core processes have exited, so that their memory is free for the next engine."""
    deadline = time.monotonic() + timeout
    while engine_processes() and time.monotonic() < deadline:
        time.sleep(0.1)


class LockedPool(EnginePool):
    """The job's engine pool, taking the engine lock before an engine starts and giving it back once none
    runs. The wait happens before the pool's start-up clock, so it is not billed as engine start-up."""

    def engine(self, name: str):
        if self.running(name) is None:
            LOCK.acquire()
        try:
            return super().engine(name)
        except BaseException:
            if not self.any_running():
                LOCK.release()
            raise

    def any_running(self) -> bool:
        return any(self.running(t) is not None for t in self.tiers)

    def shutdown(self, name: str) -> None:
        try:
            super().shutdown(name)
        finally:
            if not self.any_running():
                LOCK.release()


# -- the machine ----------------------------------------------------------------------------------
def describe_machine() -> dict:
    import psutil

    flags = cpu_flags()
    return {
        **machine(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "avx512f": "avx512f" in flags,
        "amx": "amx_tile" in flags,
        "gpu": None,
    }


# -- the corpus -----------------------------------------------------------------------------------
def cut(text: str, chars: int) -> str:
    """The text's opening `chars` characters, ended at a sentence or paragraph boundary where one is near."""
    if len(text) <= chars:
        return text
    piece = text[:chars]
    end = max(piece.rfind(". "), piece.rfind("\n\n"))
    return piece[: end + 1] if end > chars // 2 else piece


def corpus(folder: Path, documents: int, tenants: int, chars: int, seed: int = 0) -> list[dict]:
    """Hold-out originals plus should-reuse variants, each opening with its tenant's preamble, shuffled."""
    holdout = folder / "holdout.jsonl"
    build_holdout(holdout, documents, max(2 * (documents // 4), 8), seed)
    rows = [json.loads(line) for line in holdout.read_text().splitlines() if line.strip()]
    originals = [r for r in rows if "variant_of" not in r][:documents]
    keep = {r["id"] for r in originals}
    variants = [r for r in rows if r.get("should_reuse") and r["variant_of"] in keep][: documents // 4]
    rng = random.Random(seed + 29)
    # No word the compliance rule looks for (the generator's vocabulary has "audit", "compliance" and
    # "contract"): the routing rows would otherwise send every document to the large tier by its preamble.
    rule = re.compile(ROUTING["rules"][0]["regex"])
    preambles = [
        rule.sub("policy", f"Tenant {k} standing policy. " + synthetic_document(rng, 16)) for k in range(tenants)
    ]
    tenant_of = {r["id"]: i % tenants for i, r in enumerate(originals)}
    docs = []
    for r in originals + variants:
        t = tenant_of[r.get("variant_of", r["id"])]
        docs.append(
            {
                "id": r["id"],
                "tenant": f"tenant{t}",
                "text": preambles[t] + "\n\n" + cut(r["text"], chars),
                "variant_of": r.get("variant_of"),
                "variant": r.get("variant"),
            }
        )
    rng.shuffle(docs)
    return docs


# -- configs --------------------------------------------------------------------------------------
def tier(
    model: str,
    price: float,
    dtype: str = "float32",
    prefix: bool = True,
    kv: str | None = None,
    speculative: bool = False,
    blocks: int | None = None,
    max_num_seqs: int = 64,
) -> dict:
    vllm = {
        "max_model_len": 2048,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": 4096,
        "enable_prefix_caching": prefix,
        "dtype": dtype,
        "enforce_eager": True,
    }
    extra = {}
    if kv:
        vllm["kv_cache_dtype"] = kv
    if speculative:
        extra["speculative_config"] = dict(SPECULATIVE)
    if blocks:
        # VLLM_CPU_KVCACHE_SPACE (which tokenmill always sets) overrides kv_cache_memory_bytes on the CPU
        # platform (vllm/platforms/cpu.py, "Legacy setting"); the block count override applies after it.
        extra["num_gpu_blocks_override"] = blocks
    if extra:
        vllm["extra"] = extra
    return {
        "model": f"${{TOKENMILL_HOME}}/models/real/{model}",
        "device": "cpu",
        "gpus": 1,
        "price_per_gpu_hour": price,
        "cpu_kvcache_space_gib": 2,
        "vllm": vllm,
    }


def f32(**kw) -> dict:
    return tier("smollm2-f32", LARGE_PRICE, **kw)


ROUTING = {
    "default_tier": "small",
    "router": None,
    "rules": [{"name": "compliance", "tier": "large", "regex": "(?i)\\b(compliance|audit|contract)\\b"}],
    "escalation": {
        "enabled": True,
        "to_tier": "large",
        "min_mean_logprob": None,
        "on_truncation": False,
        "on_unfaithful": True,
    },
}


def runs(fp8_ok: bool, blocks: int) -> list[dict]:
    """name, tiers, route (None: everything on `large`), reuse, prefix ordering, and what a CPU cannot show."""
    int8 = {"model": "smollm2-w8a8", "dtype": "float32"}
    rows = [
        {"name": "float32 (baseline)", "lever": "baseline", "tiers": {"large": f32()}},
        {"name": "W8A8 INT8 weights", "lever": "quantisation", "tiers": {"large": tier("smollm2-w8a8", LARGE_PRICE)}},
        {
            "name": "W4A16 INT4 weights (bf16)",
            "lever": "quantisation",
            "tiers": {"large": tier("smollm2-w4a16", LARGE_PRICE, dtype="bfloat16")},
            "note": "CPU: INT4 (WNA16) kernels are not faster than float32 here; a GPU's Marlin kernels are",
        },
        {
            "name": "FP8 KV cache",
            "lever": "kv_cache_dtype",
            "tiers": {"large": f32(kv="fp8")},
            "skip": None if fp8_ok else "not supported here: the CPU FP8 KV cache needs AVX-512 or AMX",
            "note": "CPU: the saving is KV memory (4x the tokens in the same GiB vs float32), not speed",
        },
        {
            "name": "KV pressure, input order",
            "lever": "prefix ordering",
            "ordering": False,
            "tiers": {"large": f32(blocks=blocks, max_num_seqs=2)},
        },
        {
            "name": "KV pressure, prefix-ordered",
            "lever": "prefix ordering",
            "tiers": {"large": f32(blocks=blocks, max_num_seqs=2)},
        },
        {"name": "speculative (n-gram, 4)", "lever": "speculative decoding", "tiers": {"large": f32(speculative=True)}},
        {
            "name": "routing (INT8 small, float32 large)",
            "lever": "routing",
            "route": ROUTING,
            "tiers": {"small": tier(int8["model"], SMALL_PRICE), "large": f32()},
        },
        {
            "name": "all off (prefix cache off, input order)",
            "lever": "all off / prefix caching",
            "ordering": False,
            "tiers": {"large": f32(prefix=False)},
            "note": "float32, no reuse, no routing, no speculation, auto KV: the baseline with prefix caching off",
        },
        {
            "name": "all on",
            "lever": "all on",
            "route": ROUTING,
            "reuse": True,
            "tiers": {
                "small": tier(int8["model"], SMALL_PRICE, kv="fp8" if fp8_ok else None, speculative=True),
                "large": f32(kv="fp8" if fp8_ok else None, speculative=True),
            },
            "note": "INT8 small tier + routing + exact/near reuse + prefix caching and ordering + FP8 KV + n-gram "
            "speculation; not INT4 (slower here and the worst quality)",
        },
    ]
    return rows


def job_config(run: dict, work: Path, input_dir: Path):
    raw = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    raw["input"]["uri"] = str(input_dir)
    raw["output"]["uri"] = str(work / "out")
    raw["state"] = {"url": f"sqlite:///{work}/state.db"}
    raw["cache"] = {"store": "local", "path": str(work / "cache"), "enabled": False}
    reuse = bool(run.get("reuse"))
    raw["dedup"] = {**raw["dedup"], "exact": reuse, "near": reuse, "semantic": False, "shadow_rate": 0.0}
    raw["tiers"] = run["tiers"]
    raw["route"] = run.get("route") or {
        "default_tier": "large",
        "rules": [],
        "router": None,
        "escalation": {"enabled": False},
    }
    raw.setdefault("requests", {})["prefix_ordering"] = run.get("ordering", True)
    raw["run"] = {**raw.get("run", {}), "progress": "off"}
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_config(path, environ={k: v for k, v in os.environ.items() if k == "TOKENMILL_HOME"})


def read_kind(output: Path, kind: str, job_id: str):
    import pyarrow.dataset as ds

    from pipeline.output.tables import read
    from pipeline.stores import storage

    return read(storage.resolve(str(output)), kind, filter=ds.field("job_id") == job_id).to_pylist()


def run_one(run: dict, work: Path, input_dir: Path) -> dict:
    work.mkdir(parents=True)
    config = job_config(run, work, input_dir)
    started = time.monotonic()
    try:
        result = run_job(
            config,
            job_id="levers",
            pool=LockedPool(config.tiers, adapters=config.tier_adapters()),
            release_engines=True,
        )
    finally:
        shutdown_engines()
        LOCK.release()
    m = result.manifest.as_json()
    ledger = read_kind(work / "out", "ledger", "levers")
    outputs = {r["id"]: r for r in read_kind(work / "out", "outputs", "levers")}
    engines = {
        t: {
            k: e.get(k)
            for k in (
                "items",
                "output_tokens",
                "starts",
                "startup_seconds",
                "busy_seconds",
                "idle_seconds",
                "held_seconds",
                "utilisation",
            )
        }
        for t, e in m["engines"].items()
    }
    return {
        "manifest": m,
        "ledger": ledger,
        "outputs": outputs,
        "engines": engines,
        "wall_seconds": round(time.monotonic() - started, 1),
    }


def figures(run: dict, got: dict, base: dict | None, docs: dict[str, dict]) -> dict:
    m, ledger, outputs = got["manifest"], got["ledger"], got["outputs"]
    n = len(docs)
    busy = sum(e["busy_seconds"] or 0 for e in got["engines"].values())
    held = sum(e["held_seconds"] or 0 for e in got["engines"].values())
    out_tokens = sum(e["output_tokens"] or 0 for e in got["engines"].values())
    cost = sum(r["cost_usd"] for r in ledger)
    busy_cost = sum(r["busy_gpu_seconds"] * r["price_per_gpu_hour"] / 3600.0 for r in ledger)
    tokens = m["tokens"]
    row = {
        "lever": run["lever"],
        "documents": n,
        "outputs": len(outputs),
        "by_tier": m["counts"]["by_tier"],
        "by_source": m["counts"]["by_source"],
        "output_tokens": out_tokens,
        "output_tokens_per_second": round(out_tokens / busy, 1) if busy else None,
        "busy_engine_seconds": round(busy, 2),
        "held_engine_seconds": round(held, 2),
        "ledger_usd_per_1k_docs": round(1000 * cost / n, 5),
        "busy_usd_per_1k_docs": round(1000 * busy_cost / n, 5),
        "prompt_tokens": tokens["prompt_tokens"],
        "cached_prompt_tokens": tokens["cached_prompt_tokens"],
        "prefix_hit_rate": m["prefix_cache"]["hit_ratio"],
        "escalated": m["routing"].get("escalated", 0),
        "engines": got["engines"],
        "wall_seconds": got["wall_seconds"],
    }
    scored = [i for i in outputs if base is None or i in base["outputs"]]
    unfaithful = sum(bool(unfaithful_terms(outputs[i]["summary"], docs[i]["text"])) for i in scored)
    low, high = wilson_interval(unfaithful, len(scored))
    row["unfaithful_rate"] = round(unfaithful / len(scored), 4) if scored else None
    row["unfaithful_ci95"] = [round(low, 4), round(high, 4)]
    if base is not None:
        ref = base["outputs"]
        agreement = [rouge_l(outputs[i]["summary"], ref[i]["summary"]) for i in scored]
        row["rouge_l_vs_float32"] = round(sum(agreement) / len(agreement), 4) if agreement else None
        row["identical_share"] = (
            round(sum(outputs[i]["summary"] == ref[i]["summary"] for i in scored) / len(scored), 4) if scored else None
        )
    if run.get("note"):
        row["note"] = run["note"]
    return row


def pressure_blocks(base: dict, max_num_seqs: int = 2) -> int:
    """KV blocks for the pressure runs: what `max_num_seqs` average requests need, at least one
    max_model_len (vLLM refuses less), plus two: room for about one tenant's preamble, not all of them."""
    rows = list(base["outputs"].values())
    per_request = sum(r["prompt_tokens"] + r["output_tokens"] for r in rows) / len(rows)
    return max(math.ceil(max_num_seqs * per_request / BLOCK), 2048 // BLOCK) + 2


# -- multi-LoRA -----------------------------------------------------------------------------------
class PeakRss:
    """Peak summed RSS of this process's children (vLLM's engine-core processes), sampled every 0.2 s."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import psutil

        while not self._stop.is_set():
            total = 0
            for c in engine_processes():
                try:
                    total += c.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(0.2)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def wait_for(path: Path, what: str, timeout: float = 1800.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} ({path}) did not appear in {timeout:.0f} s")
        print(f"waiting for {what} ({path})", file=sys.stderr, flush=True)
        time.sleep(30)


def merged_checkpoint(base: Path, adapter: Path, out: Path) -> Path:
    """The adapter folded into a full float32 copy of the base model: one tenant's dedicated fine-tune."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, local_files_only=True)
    model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def serve(
    model: str, prompts: list[list[int]], max_tokens: int, lora: dict | None = None, requests: list | None = None
) -> dict:
    """Start one engine under the lock, generate `prompts` (greedy), stop it. Returns start-up and
    generation seconds, output tokens, peak engine RSS and the token ids generated."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    LOCK.acquire()
    try:
        with PeakRss() as rss:
            t0 = time.perf_counter()
            llm = LLM(
                model=model,
                dtype="float32",
                enforce_eager=True,
                max_model_len=2048,
                max_num_seqs=64,
                max_num_batched_tokens=4096,
                seed=0,
                **(lora or {}),
            )
            t1 = time.perf_counter()
            try:
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
                outs = llm.generate(
                    [TokensPrompt(prompt_token_ids=p) for p in prompts], params, lora_request=requests, use_tqdm=False
                )
                t2 = time.perf_counter()
            finally:
                llm.llm_engine.engine_core.shutdown()
                del llm
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        return {
            "startup_seconds": round(t1 - t0, 2),
            "generate_seconds": round(t2 - t1, 2),
            "output_tokens": sum(map(len, tokens)),
            "peak_rss_gib": round(rss.peak / 2**30, 3),
            "tokens": tokens,
        }
    finally:
        LOCK.release()


def multi_lora(folder: Path, docs: list[dict], adapters: int, per_tenant: int, max_tokens: int) -> dict:
    from vllm.lora.request import LoRARequest

    from pipeline.config import PromptConfig
    from pipeline.generate.engine_api import load_tokenizer
    from pipeline.generate.requests import render_messages

    wait_for(REPO / "pipeline" / "dev" / "adapters.py", "pipeline/dev/adapters.py (build_demo_adapter)")
    from pipeline.dev.adapters import build_demo_adapter

    base = tokenmill_home() / "models" / "real" / "smollm2-f32"
    started = time.monotonic()
    paths = [build_demo_adapter(base, folder / f"adapter-{i}", f"tenant-{i}", rank=8) for i in range(adapters)]
    merged = [merged_checkpoint(base, p, folder / f"merged-{i}") for i, p in enumerate(paths)]
    build_seconds = time.monotonic() - started
    tokenizer = load_tokenizer(str(base))
    prompt = PromptConfig()
    texts = [d["text"].split("\n\n", 1)[-1] for d in docs]  # the document without its tenant's preamble
    by_tenant = [
        [
            tokenizer.encode(
                tokenizer.apply_chat_template(
                    render_messages(texts[(i * per_tenant + j) % len(texts)], prompt),
                    tokenize=False,
                    add_generation_prompt=True,
                ),
                add_special_tokens=False,
            )
            for j in range(per_tenant)
        ]
        for i in range(adapters)
    ]
    prompts = [p for tenant in by_tenant for p in tenant]
    requests = [LoRARequest(f"tenant-{i}", i + 1, str(paths[i])) for i in range(adapters) for _ in range(per_tenant)]
    # One slot left free (max_loras = adapters + 1): vLLM 0.32's CPU LoRA ops give requests of a mixed
    # batch the last slot's adapter otherwise (this benchmark's outputs showed it; vllm-project/vllm#48421).
    one = serve(
        str(base),
        prompts,
        max_tokens,
        lora={"enable_lora": True, "max_loras": adapters + 1, "max_lora_rank": 8},
        requests=requests,
    )
    each = [serve(str(merged[i]), by_tenant[i], max_tokens) for i in range(adapters)]
    same = sum(a == b for a, b in zip(one.pop("tokens"), [t for e in each for t in e.pop("tokens")]))
    n_gen = sum(e["generate_seconds"] for e in each)
    n_tokens = sum(e["output_tokens"] for e in each)
    return {
        "adapters": adapters,
        "requests_per_tenant": per_tenant,
        "max_tokens": max_tokens,
        "rank": 8,
        "build_seconds": round(build_seconds, 1),
        "one_engine_with_adapters": {
            **one,
            "devices": 1,
            "output_tokens_per_second": round(one["output_tokens"] / one["generate_seconds"], 1),
        },
        "engine_per_tenant": {
            "devices": adapters,
            "engines": each,
            "peak_rss_gib_each": [e["peak_rss_gib"] for e in each],
            "memory_gib_total": round(sum(e["peak_rss_gib"] for e in each), 3),
            "startup_seconds_total": round(sum(e["startup_seconds"] for e in each), 2),
            "generate_seconds_total": round(n_gen, 2),
            "output_tokens": n_tokens,
            "output_tokens_per_second_per_engine": round(n_tokens / n_gen, 1) if n_gen else None,
        },
        "memory_ratio": round(sum(e["peak_rss_gib"] for e in each) / one["peak_rss_gib"], 2)
        if one["peak_rss_gib"]
        else None,
        "engine_seconds_ratio": round(
            (n_gen + sum(e["startup_seconds"] for e in each)) / (one["generate_seconds"] + one["startup_seconds"]), 2
        ),
        "same_tokens_as_merged": f"{same}/{len(prompts)}",
    }


# -- output ---------------------------------------------------------------------------------------
def fmt(v, spec: str = "") -> str:
    if v is None:
        return "–"
    return format(v, spec) if spec else str(v)


def table(rows: dict[str, dict]) -> str:
    head = (
        "| run | out tok/s | busy s | held s | ledger $/1k docs | busy $/1k docs | prefix hit | ROUGE-L vs f32 "
        "| identical | unfaithful (95% CI) | note |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in rows.items():
        if "skipped" in r or "error" in r:
            lines.append(f"| {name} | " + " | ".join(["–"] * 9) + f" | {r.get('skipped') or r.get('error')} |")
            continue
        ci = r["unfaithful_ci95"]
        lines.append(
            f"| {name} | {fmt(r['output_tokens_per_second'], ',.1f')} | {r['busy_engine_seconds']:.1f} | "
            f"{r['held_engine_seconds']:.1f} | {r['ledger_usd_per_1k_docs']:.4f} | {r['busy_usd_per_1k_docs']:.4f} | "
            f"{fmt(r['prefix_hit_rate'], '.1%')} | {fmt(r.get('rouge_l_vs_float32'), '.3f')} | "
            f"{fmt(r.get('identical_share'), '.0%')} | {fmt(r['unfaithful_rate'], '.1%')} ({ci[0]:.0%}–{ci[1]:.0%}) | "
            f"{r.get('note', '')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--documents", type=int, default=16, help="hold-out originals (a quarter as many variants are added)"
    )
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--chars", type=int, default=1500, help="each document cut to about this many characters")
    parser.add_argument("--adapters", type=int, default=4, help="multi-LoRA: tenants with their own adapter")
    parser.add_argument("--lora-requests", type=int, default=4, help="multi-LoRA: requests per tenant")
    parser.add_argument("--skip-lora", action="store_true")
    parser.add_argument("--lora-only", action="store_true", help="only the multi-LoRA comparison")
    parser.add_argument(
        "--only", nargs="*", help="run only these lever runs (names as printed; the baseline always runs)"
    )
    args = parser.parse_args(argv)
    t_start = time.monotonic()
    info = describe_machine()
    home = tokenmill_home()
    missing = [
        v
        for v in ("smollm2-f32", "smollm2-w8a8", "smollm2-w4a16")
        if not (home / "models" / "real" / v / "tokenmill-model.json").is_file()
    ]
    if missing:
        print(
            f"the real model is not built under {home}/models/real ({', '.join(missing)}): "
            "run `tokenmill models real` (or `make models`)",
            file=sys.stderr,
        )
        return 2
    results: dict[str, dict] = {}
    errors = 0
    with tempfile.TemporaryDirectory(prefix="levers-") as tmp:
        tmp = Path(tmp)
        docs = corpus(tmp, args.documents, args.tenants, args.chars)
        (tmp / "in").mkdir()
        (tmp / "in" / "corpus.jsonl").write_text(
            "".join(json.dumps({k: d[k] for k in ("id", "tenant", "text")}) + "\n" for d in docs)
        )
        by_id = {d["id"]: d for d in docs}
        plan = runs(info["avx512f"] or info["amx"], blocks=0)
        base_run, base = plan[0], None
        for i, run in enumerate([] if args.lora_only else plan):
            name = run["name"]
            if i and args.only and name not in args.only:
                continue
            if run.get("skip"):
                results[name] = {"lever": run["lever"], "skipped": run["skip"]}
                continue
            if run["name"].startswith("KV pressure"):
                blocks = pressure_blocks(base)
                for t in run["tiers"].values():
                    t["vllm"].setdefault("extra", {})["num_gpu_blocks_override"] = blocks
                run["note"] = f"{blocks} KV blocks of {BLOCK} tokens, max_num_seqs 2"
            print(f"[{time.monotonic() - t_start:6.0f} s] {name}", file=sys.stderr, flush=True)
            try:
                got = run_one(run, tmp / f"run{i}", tmp / "in")
            except Exception as e:  # one lever vLLM refuses is a row, not the end of the benchmark
                traceback.print_exc()
                results[name] = {"lever": run["lever"], "error": f"not runnable here: {type(e).__name__}: {e}"[:600]}
                if run is base_run:
                    print(f"baseline failed: {e}", file=sys.stderr)
                    return 1
                continue
            if run is base_run:
                base = got
            results[name] = figures(run, got, None if run is base_run else base, by_id)
            print(
                f"  {json.dumps({k: results[name].get(k) for k in SHOWN})}",
                file=sys.stderr,
                flush=True,
            )
        lora = None
        if not args.skip_lora:
            print(f"[{time.monotonic() - t_start:6.0f} s] multi-LoRA", file=sys.stderr, flush=True)
            try:
                lora = multi_lora(
                    tmp / "lora",
                    docs,
                    args.adapters,
                    args.lora_requests,
                    load_config(REPO / "configs" / "local.yaml").sampling.max_tokens,
                )
            except Exception as e:
                traceback.print_exc()
                lora = {"error": f"not runnable here: {type(e).__name__}: {e}"[:600]}
                errors += 1
    off, on = results.get("all off (prefix cache off, input order)", {}), results.get("all on", {})
    ratio = {}
    for key in ("ledger_usd_per_1k_docs", "busy_usd_per_1k_docs"):
        if off.get(key) and on.get(key):
            ratio[key] = round(off[key] / on[key], 2)
    print(table(results))
    if lora and "error" not in lora:
        a, b = lora["one_engine_with_adapters"], lora["engine_per_tenant"]
        print(
            f"\nmulti-LoRA, {lora['adapters']} tenants x {lora['requests_per_tenant']} requests: one engine "
            f"{a['peak_rss_gib']} GiB, {a['output_tokens_per_second']} tok/s, start {a['startup_seconds']} s; "
            f"{lora['adapters']} engines {b['memory_gib_total']} GiB ({b['peak_rss_gib_each']}), "
            f"{b['output_tokens_per_second_per_engine']} tok/s each, start {b['startup_seconds_total']} s in all; "
            f"same tokens {lora['same_tokens_as_merged']}"
        )
    elif lora:
        print(f"\nmulti-LoRA: {lora['error']}")
    emit(
        "levers",
        {
            "engine": (
                "SmolLM2-135M-Instruct (float32 / W8A8 / W4A16) on vllm-cpu, greedy, max_tokens from configs/local.yaml"
            ),
            "machine_detail": info,
            "documents": len(docs),
            "originals": sum(d["variant_of"] is None for d in docs),
            "tenants": args.tenants,
            "prices_per_device_hour": {
                "float32 and single-lever rows": LARGE_PRICE,
                "INT8 small tier (routing, all on)": SMALL_PRICE,
            },
            "runs": results,
            "all_off_over_all_on": ratio,
            "multi_lora": lora,
            "lock_wait_seconds": round(LOCK.waited, 1),
            "seconds": round(time.monotonic() - t_start, 1),
        },
    )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
