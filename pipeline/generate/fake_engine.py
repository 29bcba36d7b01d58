"""The deterministic fake engine: everything the tier worker drives, without a model.

Selected per tier with `engine: fake` (tests of the pipeline's logic, benchmarks of its overhead, and a
user dry-running a config on a laptop all use this one). It speaks the vLLM engine's interface
(`add` / `step`, `generate`, `counters`, `reset_prefix_cache`, `shutdown`) and keeps what the logic above
it relies on:

- **Outputs are a pure function of the request**: the prompt's token ids, `max_tokens`, the sampling
  parameters, the adapter and the tier's model. Words drawn from a hash of those (function words and
  the prompt's own words, so that an answer is on its document's topic), tokenised with the tier's real
  tokenizer, so token counts are the ones the ledger would see. Batch composition, order and timing
  never change an output (unlike random-weight models, whose outputs drift with the batch).
- **Lengths and finish reasons**: each answer runs to `fake.output_tokens` and stops (`stop`), or to
  `max_tokens` when that is smaller or unset (`length`). With `sampling.json_schema`, the answer is a
  minimal JSON instance of the schema (cut off, and so invalid, when `max_tokens` is too small).
- **Confidence**: `mean_logprob` is drawn from the hash, uniformly in `fake.mean_logprob`, so an
  escalation threshold inside that range splits items the same way on every run.
- **Continuous batching**: at most `vllm.max_num_seqs` requests run at once; each step advances every
  running request by one token; the first step of a request is its prefill.
- **Prefix cache**: with `vllm.enable_prefix_caching`, a request's cached prompt tokens are the longest run
  of whole `fake.prefix_block_tokens` blocks an earlier request already computed (as vLLM counts them).
- **Time**: each step sleeps `fake.step_seconds` plus `fake.token_seconds` per token it processes (uncached
  prompt tokens of the requests it admits, one per running request), so engine-time arithmetic has time to
  share, in proportion to the work as the ledger's token weights assume (0 and 0: no time).
- **Scripted answers**: `fake.answers` maps a text to the answer of any request whose prompt contains it (an LLM
  judge's verdicts in a test), stopping there.
- **A worker frozen mid-drain, on purpose**: with `fake.stall_after: N`, once N requests have finished no
  other request ever finishes; steps go on (and are timed) with work in flight. Tests that kill a worker
  with work in flight make that moment happen with it instead of hoping to catch one.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import time
from array import array
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import xxhash

from pipeline.config import LOOP_KNOBS, SamplingConfig, TierConfig
from pipeline.generate.engine_api import Completion, EngineStartError, Progressed, load_tokenizer, plain_backend

# Words the fake answers with: common English, so the tier's tokenizer splits them as it would real text.
WORDS = (
    "the",
    "report",
    "states",
    "that",
    "revenue",
    "grew",
    "in",
    "quarter",
    "while",
    "costs",
    "fell",
    "and",
    "team",
    "plans",
    "to",
    "review",
    "contract",
    "terms",
    "with",
    "supplier",
    "before",
    "next",
    "audit",
    "customers",
    "asked",
    "for",
    "faster",
    "delivery",
    "of",
    "orders",
    "a",
    "new",
    "policy",
    "covers",
    "data",
    "retention",
    "by",
    "region",
    "board",
    "approved",
    "budget",
    "summary",
    "notes",
    "risk",
    "remains",
    "low",
    "high",
    "market",
    "share",
    "rose",
    "product",
    "launch",
    "was",
    "delayed",
)

FILLER = (
    "the",
    "and",
    "of",
    "in",
    "to",
    "a",
    "for",
    "with",
    "by",
    "on",
    "is",
    "was",
    "that",
    "as",
    "its",
    "from",
    "at",
    "or",
    "an",
    "this",
)
_TOPIC = re.compile(r"[^\W\d_]{4,}")


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    token_ids: list[int]  # everything it will generate (a pure function of the request)
    finish_reason: str
    mean_logprob: float
    adapter: str | None
    cached: int = 0  # prompt tokens found in the prefix cache at its prefill
    done: int = 0  # output tokens generated so far


class FakeEngine:
    """A deterministic stand-in for VllmEngine (see the module's docstring for what it keeps)."""

    def __init__(self, tier: TierConfig, adapters: list[str] | None = None):
        try:
            self.tokenizer = load_tokenizer(tier.model)
        except Exception as e:
            raise EngineStartError(f"fake engine: cannot load the tokenizer of {tier.model}: {e}") from e
        self.codec = _Codec(self.tokenizer)
        self.tier, self.fake = tier, tier.fake
        # The model by its folder's name: the same answers wherever the folder lies (a test session's tmp).
        self.model_name = Path(tier.model).expanduser().name or tier.model
        self.adapters = set(adapters or [])
        self.max_num_seqs = tier.vllm.max_num_seqs or 256
        self.caching = tier.vllm.enable_prefix_caching is not False  # vLLM's default is on
        self.ids = itertools.count()
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.blocks: set[int] = set()  # hashes of prompt prefixes (whole blocks) computed so far
        self.finished = self.queried = self.hits = 0

    # -- the streaming interface (the tier worker's) -------------------------------------------------

    def add(
        self, request_id: str, prompt: list[int], max_tokens: int, sampling: SamplingConfig, adapter: str | None = None
    ) -> None:
        self.check(prompt, max_tokens, adapter)
        self.waiting.append(self.answer(request_id, prompt, max_tokens, sampling, adapter))

    def check(self, prompt: list[int], max_tokens: int, adapter: str | None) -> None:
        """What vLLM refuses when a request is added."""
        if adapter is not None and adapter not in self.adapters:
            raise ValueError(f"adapter {adapter} is not served by this engine (it serves {sorted(self.adapters)})")
        if not prompt:
            raise ValueError("the prompt is empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        limit = self.tier.vllm.max_model_len
        if limit and len(prompt) > limit:
            raise ValueError(f"the prompt ({len(prompt)} tokens) is longer than max_model_len ({limit})")

    def step(self) -> list[Progressed]:
        prefilled = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            request.cached = self.prefill(request.prompt, request.adapter)
            prefilled += len(request.prompt) - request.cached
            self.running.append(request)
        seconds = self.fake.step_seconds + self.fake.token_seconds * (prefilled + len(self.running))
        if seconds:
            time.sleep(seconds)
        out, still = [], []
        for r in self.running:
            r.done = min(r.done + 1, len(r.token_ids))
            if r.done < len(r.token_ids) or self.stalled():
                still.append(r)
                out.append(Progressed(r.request_id, r.done, None))
            else:
                self.finished += 1
                out.append(Progressed(r.request_id, r.done, self.completion(r)))
        self.running = still
        return out

    def stalled(self) -> bool:
        return self.fake.stall_after is not None and self.finished >= self.fake.stall_after

    # -- the one-call interface (benchmarks') -----------------------------------------------------

    def generate(self, prompts: list[list[int]], max_tokens: list[int], sampling: SamplingConfig) -> list[Completion]:
        """One call: all requests or none (checked before any is added), like vLLM's `LLM.generate`."""
        for prompt, m in zip(prompts, max_tokens):
            self.check(prompt, m, None)
        if self.fake.stall_after is not None:
            raise RuntimeError("fake.stall_after is set: a stalled engine never finishes a generate call")
        ids = [f"generate-{next(self.ids)}" for _ in prompts]
        for rid, prompt, m in zip(ids, prompts, max_tokens):
            self.add(rid, prompt, m, sampling)
        mine, done = set(ids), {}
        while len(done) < len(ids):
            done.update(
                (p.request_id, p.completion) for p in self.step() if p.completion is not None and p.request_id in mine
            )
        return [done[rid] for rid in ids]

    def counters(self) -> dict[str, int | None]:
        """The counters VllmEngine.counters() reads from vLLM (stores/units.py SESSION_COUNTERS): no speculation."""
        return {"spec_drafted": None, "spec_accepted": None, "prefix_queries": self.queried, "prefix_hits": self.hits}

    def reset_prefix_cache(self) -> None:
        self.blocks.clear()

    def shutdown(self) -> None:
        self.waiting.clear()
        self.running.clear()

    # -- what a request gets ----------------------------------------------------------------------------

    def answer(
        self, request_id: str, prompt: list[int], max_tokens: int, sampling: SamplingConfig, adapter: str | None
    ) -> _Request:
        """The request's whole answer, decided when it is added: a pure function of the request."""
        knobs = {k: v for k, v in sampling.keyed().items() if k in LOOP_KNOBS}  # set loop knobs change the answer
        request = [
            self.model_name,
            adapter and Path(adapter).name,
            prompt,
            max_tokens,
            sampling.temperature,
            sampling.top_p,
            sampling.seed,
            sampling.json_schema,
            *([knobs] if knobs else []),
        ]
        seed = xxhash.xxh3_64_intdigest(json.dumps(request, separators=(",", ":")).encode())
        scripted = next((a for k, a in self.fake.answers.items() if k in self.codec.decode(prompt)), None)
        if scripted is not None:
            ids = self.codec.encode(scripted)
            wanted = len(ids)
        elif sampling.json_schema is not None:
            text = json.dumps(instance(sampling.json_schema, seed), separators=(",", ":"))
            ids = self.codec.encode(text)
            wanted = len(ids)
        elif (seed >> 20) % 10_000 < self.fake.loop_share * 10_000:  # a loop runs to max_tokens
            wanted = max_tokens
            ids = self.codec.encode(" ".join([WORDS[seed % len(WORDS)]] * (max_tokens + 8)))
        else:
            wanted, vocabulary = self.fake.output_tokens or max_tokens, self.vocabulary(prompt)
            ids = self.codec.encode(words(seed, min(wanted, max_tokens) + 8, vocabulary))
            while len(ids) < min(wanted, max_tokens):  # a tokenizer that merges words: draw more of them
                seed = xxhash.xxh3_64_intdigest(str(seed).encode())
                ids += self.codec.encode(" " + words(seed, max_tokens, vocabulary))
        ids = ids[: min(wanted, max_tokens)]
        low, high = self.fake.mean_logprob
        logprob = low + (high - low) * ((seed >> 11) / 2**53)
        return _Request(request_id, list(prompt), ids, "length" if wanted >= max_tokens else "stop", logprob, adapter)

    def vocabulary(self, prompt: list[int]) -> tuple[str, ...]:
        """What an answer is drawn from: function words and up to len(WORDS) of the prompt's own words (4 letters
        or more, spread over their sorted list). So an answer talks about its document, as a summary does, and
        passes the `off_topic` check; its words come in random order, so it neither loops nor copies."""
        found = sorted(set(_TOPIC.findall(self.codec.decode(prompt).lower())))
        return FILLER + tuple(found[:: max(1, math.ceil(len(found) / len(WORDS)))])

    def prefill(self, prompt: list[int], adapter: str | None) -> int:
        """Prompt tokens already in the prefix cache, as vLLM counts them: whole blocks, never the block holding
        the last prompt token (it is always computed), keyed by the adapter too. Caches the blocks it computed."""
        if not self.caching:
            return 0
        size, cached, hit = self.fake.prefix_block_tokens, 0, True
        h = xxhash.xxh3_64_intdigest((adapter or "").encode())
        for end in range(size, len(prompt), size):
            h = xxhash.xxh3_64_intdigest(array("q", prompt[end - size : end]).tobytes(), seed=h)
            if hit and h in self.blocks:
                cached = end
            else:
                hit = False
                self.blocks.add(h)
        self.queried += len(prompt)
        self.hits += cached
        return cached

    def completion(self, r: _Request) -> Completion:
        return Completion(
            text=self.codec.decode(r.token_ids, skip_special_tokens=True),
            prompt_tokens=len(r.prompt),
            cached_prompt_tokens=r.cached,
            output_tokens=len(r.token_ids),
            finish_reason=r.finish_reason,
            token_ids=tuple(r.token_ids),
            mean_logprob=r.mean_logprob if r.token_ids else None,
        )


class _Codec:
    """The tokenizer's encode and decode without special tokens added, through its Rust tokenizer where that gives
    the same ids and text (engine_api.plain_backend): on every prompt the engine reads and every answer it writes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.backend = tokenizer, plain_backend(tokenizer)

    def encode(self, text: str) -> list[int]:
        if self.backend is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if self.backend is None:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


def words(seed: int, n: int, vocabulary: tuple[str, ...] = WORDS) -> str:
    """`n` words of `vocabulary` drawn from `seed`: the same seed, the same words."""
    out, x = [], seed or 1
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) % 2**64  # a 64-bit LCG: cheap, portable, fixed
        out.append(vocabulary[(x >> 33) % len(vocabulary)])
    return " ".join(out)


def instance(schema: dict, seed: int, root: dict | None = None):
    """A small value that validates against `schema` for the keywords schemas of summaries use: types,
    required and `minProperties`, `$ref` to `$defs`, `anyOf`/`oneOf`/`allOf` (the first branch, merged),
    `const`/`enum`, numeric bounds, string and array lengths. Not `pattern` or `format`: such a schema
    gives outputs that fail validation, quarantined as `invalid_output` as a model's would be."""
    root = schema if root is None else root
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part] if part else target
        return instance({**target, **{k: v for k, v in schema.items() if k != "$ref"}}, seed, root)
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            rest = {k: v for k, v in schema.items() if k != key}
            return instance({**rest, **schema[key][0]}, seed, root)
    if schema.get("allOf"):
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            merged = {**merged, **part}
        return instance(merged, seed, root)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type", "object" if "properties" in schema else "string")
    kind = next((k for k in kind if k != "null"), "null") if isinstance(kind, list) else kind
    if kind == "object":
        props = schema.get("properties", {})
        names = list(schema.get("required", []))
        names += [k for k in props if k not in names][: max(0, schema.get("minProperties", 0) - len(names))]
        return {k: instance(props.get(k, {}), seed + i, root) for i, k in enumerate(names)}
    if kind == "array":
        return [instance(schema.get("items", {}), seed + i, root) for i in range(schema.get("minItems", 0))]
    if kind in ("integer", "number"):
        return _number(schema, kind == "integer")
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    n = max(3, math.ceil(schema.get("minLength", 0) / 4))
    text = words(seed, n)
    while len(text) < schema.get("minLength", 0):
        text += " " + words(seed + len(text), n)
    return text[: schema["maxLength"]] if "maxLength" in schema else text


def _number(schema: dict, integer: bool):
    """A value the bounds allow: 0 when they allow it, else the bound nearest to it (an exclusive bound
    moved inwards by one)."""
    exclusive_low, exclusive_high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    lows = [v for v in (schema.get("minimum"), None if exclusive_low is None else exclusive_low + 1) if v is not None]
    highs = [
        v for v in (schema.get("maximum"), None if exclusive_high is None else exclusive_high - 1) if v is not None
    ]
    value = max(lows) if lows and max(lows) > 0 else min(highs) if highs and min(highs) < 0 else 0
    if not integer:
        return value
    return math.ceil(value) if value >= 0 else math.floor(value)
