"""Content addresses: what makes two requests the same, so reruns and caches are exact.

Every stage may use this module (it imports only the config). A record's item key is the hash of
its recipe (model, prompt template, sampling parameters) and its content hash (tenant scope and
normalised text); a generation derived from another (escalation, chunk, retry, judge) is keyed from the
key it follows. Equal keys get the same output under greedy decoding, so one generation serves
every record, partition, rerun and later job that asks for that key.

Every key built from several parts hashes them length-prefixed (`key_bytes`), never joined with a
separator: a separator can occur inside a tenant name or a text, and then two different requests
(tenant `a\0b` with text `c`, tenant `a` with text `b\0c`) would share a key and an output.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import unicodedata
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import xxhash

from pipeline.config import PromptConfig, SamplingConfig, TokenmillConfig
from pipeline.schema import request_params

_ASCII_SPACE = "\t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"


def compile_boilerplate(patterns: list[str]) -> list[re.Pattern]:
    return [re.compile(p, re.MULTILINE) for p in patterns]


def clean_text(text: str, boilerplate: list[re.Pattern] = ()) -> str:
    """NFC, boilerplate removed, whitespace collapsed: what near/semantic matching and the guards compare."""
    if not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    for pattern in boilerplate:
        text = pattern.sub(" ", text)
    # Fast path (most documents): ASCII with single spaces only is already collapsed; split/join costs 4x more.
    if (
        text.isascii()
        and "  " not in text
        and text[:1] != " "
        and text[-1:] != " "
        and not any(c in text for c in _ASCII_SPACE)
    ):
        return text
    return " ".join(text.split())


def normalise_text(text: str, case_fold: bool = False, boilerplate: list[re.Pattern] = ()) -> str:
    text = clean_text(text, boilerplate)
    return text.casefold() if case_fold else text


def key_bytes(*parts: str) -> bytes:
    """The parts of a key as one unambiguous byte string: each part prefixed with its length.

    Different lists of parts always give different bytes, whatever characters the parts hold (NULs,
    separators, digits and colons included). Lone surrogates are kept (surrogatepass) rather than
    raising: the reader quarantines them, and a key must never be the thing that crashes a job."""
    return "".join(f"{len(p)}:{p}" for p in parts).encode("utf-8", "surrogatepass")


def tenant_scope(tenant: str, shared: set[str]) -> str:
    """The namespace a tenant's outputs live in: its own (`t=<tenant>`), or the opt-in shared one.

    Unambiguous: the shared scope is the only one without the `t=` prefix, so a tenant literally named
    `shared` gets `t=shared`, never the shared scope."""
    return "shared" if tenant in shared else f"t={tenant}"


def request_sampling(sampling: SamplingConfig, request: dict | None) -> SamplingConfig:
    """The sampling a record runs with: for a batch request, what it sets (checked on reading) over the config's
    defaults, but never the config's output schema or stop strings, which are for document records: a request
    gets JSON or a stop only when it asks for them."""
    if request is None:
        return sampling
    return sampling.model_copy(update={"json_schema": None, "stop": [], **request_params(request)})


def request_template(request: dict, sampling: SamplingConfig) -> dict:
    """What of a batch request (a `schema.REQUEST` value, ingest/batch.py) decides its answer besides the document: the
    endpoint, the messages around the document's slot and the sampling it runs with (effective: an explicit
    default and an unset one are the same). Not the model name (a tier answers for every name it serves) nor
    the format (OpenAI's or Anthropic's)."""
    template = {k: request[k] for k in ("endpoint", "messages", "document")}
    return {**template, "sampling": request_sampling(sampling, request).keyed()}


def request_scope(scope: str, request: dict, sampling: SamplingConfig) -> str:
    """A batch request's scope: its tenant's, narrowed to requests of the same template, so near and semantic
    reuse only ever pair requests that differ in their document alone. Unambiguous: tenant scopes begin with
    `t=` or are `shared`; these begin with `r=` and a fixed-length hash."""
    template = json.dumps(request_template(request, sampling), sort_keys=True, ensure_ascii=False)
    return f"r={xxhash.xxh3_64_hexdigest(template.encode('utf-8', 'surrogatepass'))}:{scope}"


def content_hash(scope: str, text: str, case_fold: bool = False, boilerplate: list[re.Pattern] = ()) -> str:
    """128-bit xxh3 of (scope, normalised text): fast, and collisions are negligible at corpus scale."""
    return xxhash.xxh3_128_hexdigest(key_bytes(scope, normalise_text(text, case_fold, boilerplate)))


def recipe_hash(model: str, prompt: PromptConfig, sampling: SamplingConfig, adapter_digest: str | None = None) -> str:
    """What, besides the text, decides an output: the model (and its LoRA adapter's digest), the prompt
    and the sampling parameters.

    JSON is an unambiguous encoding of the parts already (strings quoted and escaped). Without an
    adapter the parts are what they were before adapters existed, so those keys did not change."""
    parts = [model, prompt.template_version, prompt.system, prompt.user, sampling.keyed()]
    return xxhash.xxh3_64_hexdigest(
        json.dumps(parts + ([adapter_digest] if adapter_digest else []), sort_keys=True).encode()
    )


def request_recipe_hash(model: str, request: dict, sampling: SamplingConfig, adapter_digest: str | None) -> str:
    """A batch request's recipe: the model, its template (messages and endpoint) and the sampling it runs
    with (the config's, with the request's own parameters over them), and the adapter's digest."""
    parts = [model, "request", request_template(request, sampling), adapter_digest]
    return xxhash.xxh3_64_hexdigest(json.dumps(parts, sort_keys=True, ensure_ascii=False).encode())


@functools.lru_cache(maxsize=64)
def _digest(folder: str, stamp: tuple) -> str:
    h = xxhash.xxh3_128()
    for name in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
        f = Path(folder) / name
        if f.exists():
            h.update(key_bytes(name))
            h.update(f.read_bytes())
    return h.hexdigest()


def adapter_digest(folder: str | None) -> str | None:
    """Content address of a LoRA adapter (its config and weights, not its path): a retrained adapter
    in the same folder changes every key made with it; a copy elsewhere keeps them. None: no adapter."""
    if folder is None:
        return None
    path = Path(folder).expanduser()
    files = [path / n for n in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")]
    if not files[0].exists() or not (files[1].exists() or files[2].exists()):
        raise FileNotFoundError(
            f"LoRA adapter {folder}: no adapter_config.json and adapter_model.safetensors there "
            "(build a demo one: tokenmill models adapter)"
        )
    return _digest(str(path), tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files if f.exists()))


def _adapter_digests(config: TokenmillConfig) -> dict[str, str]:
    def digest(path: str) -> str:
        try:
            return adapter_digest(path)
        except OSError:  # not on this host: the checks before any work say so where it matters
            return "unreadable"

    return {n: digest(t.adapter) for n, t in config.tenants.items() if t.adapter}


def config_fingerprint(config: TokenmillConfig) -> str:
    """Hash of everything in `config` that changes outputs or costs (not where they are read from or
    written to), adapters' contents included: an adapter retrained in place changes outputs too."""
    data = config.model_dump(
        mode="json",
        exclude={
            "input": {"uri"},
            "output": {"uri"},
            "run": True,
            "state": True,
            "storage": True,
            "budget": True,
            "cache": True,
            "planning": True,
            "serve": True,
            "metrics": True,  # where a run is watched from changes no output
            "tenants": {"__all__": {"api_keys"}},  # who may call the API changes no output
        },
    )
    if any(t.adapter for t in config.tenants.values()):
        data["adapter_digests"] = _adapter_digests(config)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def isolation_fingerprint(config: TokenmillConfig) -> str:
    """Hash of what decides which tenants may share an output: `dedup.shared_tenants` and the tenants'
    adapters (a tenant with one keeps its own scope). Planning's scopes and reuse decisions depend on it."""
    data = {"shared_tenants": sorted(config.dedup.shared_tenants), "adapters": _adapter_digests(config)}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def derived_key(key: str, kind: str, detail: str | int) -> str:
    """Key of a generation derived from another: its escalation to a larger tier, or one chunk of it."""
    return xxhash.xxh3_128_hexdigest(key_bytes(key, kind, str(detail)))


def item_key(recipe: str, content: str) -> str:
    """The content address of a request: its recipe hash and its content hash."""
    return xxhash.xxh3_128_hexdigest(key_bytes(recipe, content))


AdapterOf = Callable[[str, str], str | None]  # (tenant, tier) -> the adapter folder its requests run with


def add_item_keys(
    records: pa.Table,
    prompt: PromptConfig,
    sampling: SamplingConfig,
    tiers: dict,
    adapter_of: AdapterOf = lambda tenant, tier: None,
) -> pa.Table:
    """Add `recipe` (hash of model, adapter, prompt and sampling) and `item_key`, the content address of a request.

    Two records with equal keys get the same output (greedy decoding), so one generation serves
    both, in this partition, another partition, or a rerun. Changing the template, the model, a
    tenant's adapter or the sampling parameters changes every key: nothing stale is reused.
    """
    tiers_of, tenants = records["tier"].to_pylist(), records["tenant"].to_pylist()
    requests = records["request"].to_pylist() if "request" in records.column_names else [None] * len(tenants)
    # A request is a dict (schema.REQUEST): its JSON text stands for it where a key must be hashable.
    texts = [None if r is None else json.dumps(r, sort_keys=True) for r in requests]
    request_of = dict(zip(texts, requests))
    recipe = {}
    for t, n, r in set(zip(tiers_of, tenants, texts)):
        digest = adapter_digest(adapter_of(n, t))
        recipe[t, n, r] = (
            recipe_hash(tiers[t].generator, prompt, sampling, digest)
            if r is None
            else request_recipe_hash(tiers[t].generator, request_of[r], sampling, digest)
        )
    recipes = [recipe[k] for k in zip(tiers_of, tenants, texts)]
    keys = [item_key(r, h) for r, h in zip(recipes, records["content_hash"].to_pylist())]
    return records.append_column("recipe", pa.array(recipes, pa.string())).append_column(
        "item_key", pa.array(keys, pa.string())
    )


def escalation_key(key: str, tier: str, adapter_digest: str | None = None) -> str:
    """Key of `key` generated again on `tier`, with the adapter its tenant runs there (its digest), if any."""
    key = derived_key(key, "escalate", tier)
    return derived_key(key, "adapter", adapter_digest) if adapter_digest else key


def chunk_keys(key: str, n: int) -> list[str]:
    return [derived_key(key, "chunk", i) for i in range(n)]


def retry_key(key: str) -> str:
    return derived_key(key, "retry", 1)


def judge_key(key: str, model: str, rubric: str, max_tokens: int) -> str:
    """Key of the LLM judge's verdict on the output stored under `key`: by the judge's model, rubric and answer
    budget, so another judge (or another rubric) asks again, and the same one is paid once."""
    return derived_key(key, "judge", xxhash.xxh3_128_hexdigest(key_bytes(model, rubric, str(max_tokens))))
