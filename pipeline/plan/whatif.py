"""What-if pricing: tonight's staged job projected on hardware this deployment does not have (`tokenmill estimate
--hardware H100-SXM:8 --tier large=Llama-3.1-70B:fp8 --price-per-gpu-hour 2.5`).

Every figure here is a projection (plan/hardware.py: a roofline with efficiency factors calibrated on published
results, docs/estimate.md), never a measurement: keys and titles say so. Per tier: busy engine-hours, GPU-hours
with start-up, USD; each lever's projected effect (FP8 or INT4 weights, FP8 KV cache, speculative decoding at a
stated acceptance), the routing share (the same items all on the largest tier) and the reuse share (duplicates
generated too), beside the same tokens through OpenAI's and Anthropic's batch APIs at list prices (API_PRICES).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeline.plan import hardware

# USD per million tokens (input, output) through the providers' batch APIs, which bill 50% of the standard price.
# Read 2026-12-04; replace with `--api-prices FILE` (a JSON object of the same form) when they change.
API_PRICES_DATE = "2026-12-04"
API_PRICES = {
    # OpenAI: standard $0.15 / $0.60 per 1M (openai.com/api/pricing, as the `openai-models` crate copies it); the
    # Batch API bills half (platform.openai.com/docs/guides/batch).
    "openai gpt-4o-mini (batch)": {"input": 0.075, "output": 0.30, "source": "https://openai.com/api/pricing/"},
    # GPT-5.4 mini: standard $0.75 / $4.50 per 1M (March 2026 list, as adk-model's pricing table copies it), halved.
    "openai gpt-5.4-mini (batch)": {"input": 0.375, "output": 2.25, "source": "https://openai.com/api/pricing/"},
    # Anthropic's batch prices as its batch-processing page lists them (Message Batches API: 50% of standard).
    "anthropic claude-haiku-4.5 (batch)": {
        "input": 0.50,
        "output": 2.50,
        "source": "https://platform.claude.com/docs/en/build-with-claude/batch-processing",
    },
    "anthropic claude-sonnet-4.6 (batch)": {
        "input": 1.50,
        "output": 7.50,
        "source": "https://platform.claude.com/docs/en/build-with-claude/batch-processing",
    },
}


@dataclass(frozen=True)
class TierSpec:
    """A tier as the what-if runs it: its model's shape and the levers on (`fp8`, `int4`, `kv-fp8`, `spec`)."""

    shape: hardware.ModelShape
    levers: frozenset[str]
    acceptance: float = hardware.DEFAULT_ACCEPTANCE
    label: str = ""


def parse_hardware(text: str) -> tuple[str, int]:
    """`H100-SXM:8` -> ("H100-SXM", 8); the name as GPU_PEAKS spells it (case-insensitive)."""
    name, _, count = text.partition(":")
    match = next((n for n in hardware.GPU_PEAKS if n.lower() == name.strip().lower()), None)
    if match is None:
        raise ValueError(f"unknown hardware {name!r}: one of {', '.join(hardware.GPU_PEAKS)}")
    if count and (not count.isdigit() or int(count) < 1):
        raise ValueError(f"--hardware {text!r}: the count after ':' is a number of devices, at least 1")
    return match, int(count or 1)


def parse_tier(text: str) -> tuple[str, TierSpec]:
    """`large=Llama-3.1-70B:fp8:kv-fp8:spec=0.7` (a preset or a model folder / config.json path, then levers)."""
    name, eq, rest = text.partition("=")
    if not eq or not rest:
        raise ValueError(f"--tier {text!r}: expected NAME=MODEL[:LEVER...]")
    model, *levers = rest.split(":")
    shape = hardware.read_shape(model)
    if shape is None:
        raise ValueError(f"--tier {text!r}: no config.json at {model!r} and no preset ({', '.join(hardware.PRESETS)})")
    on, acceptance = set(), hardware.DEFAULT_ACCEPTANCE
    for lever in levers:
        key, _, value = lever.partition("=")
        if key not in hardware.LEVERS:
            raise ValueError(f"--tier {text!r}: unknown lever {key!r} (one of {', '.join(hardware.LEVERS)})")
        on.add(key)
        acceptance = float(value) if key == "spec" and value else acceptance
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"--tier {text!r}: spec acceptance {acceptance} is a share, between 0 and 1")
    return name.strip(), TierSpec(_applied(shape, on), frozenset(on), acceptance, rest)


def _applied(shape: hardware.ModelShape, levers: set[str]) -> hardware.ModelShape:
    if shape.weight_bits > 16:
        shape = replace(shape, weight_bits=16, kv_bits=16)  # a GPU runs float32 checkpoints in 16 bits
    for lever in ("fp8", "int4", "kv-fp8"):
        shape = hardware.with_lever(shape, lever) if lever in levers else shape
    return shape


def _busy(spec: TierSpec, device: hardware.Device, items: float, prompt: float, output: float, seqs: int) -> float:
    """Projected busy engine seconds of `items` requests (`prompt`, `output`: mean tokens) on `device`."""
    if items <= 0:
        return 0.0
    w = hardware.Workload(
        items,
        prompt,
        output,
        seqs,
        hardware.compute_bits_for(spec.shape, set(spec.levers)),
        spec.acceptance if "spec" in spec.levers else 0.0,
    )
    lever = "int4" if "int4" in spec.levers else None
    return hardware.project(spec.shape, device, w, lever).seconds


def lever_effects(spec: TierSpec, device, items, prompt, output, seqs) -> dict[str, dict]:
    """Each lever's projected effect on the tier's busy seconds: toggled against the tier as specified."""
    base = _busy(spec, device, items, prompt, output, seqs)
    effects = {}
    for lever in hardware.LEVERS:
        other = set(spec.levers) ^ {lever}
        if lever in ("fp8", "int4") and lever not in spec.levers:
            other -= {"int4", "fp8"} - {lever}
        raw = replace(spec.shape, weight_bits=16, kv_bits=16)
        alt = _busy(
            replace(spec, shape=_applied(raw, other), levers=frozenset(other)), device, items, prompt, output, seqs
        )
        on, off = (base, alt) if lever in spec.levers else (alt, base)
        effects[lever] = {
            "on": lever in spec.levers,
            "busy_seconds_with": on,
            "busy_seconds_without": off,
            "saving": 1 - on / off if off else 0.0,
            **({"acceptance": spec.acceptance} if lever == "spec" else {}),
        }
    return effects


def api_prices(prompt_tokens: float, output_tokens: float, table: dict | None = None) -> dict[str, float]:
    """USD of the same tokens through each batch API of `table` (default API_PRICES)."""
    table = table or API_PRICES
    return {name: (prompt_tokens * p["input"] + output_tokens * p["output"]) / 1e6 for name, p in sorted(table.items())}


def _tier_figures(spec, device, entry: dict, seqs: int, gpus: int, price: float) -> dict:
    items, prompt_total = entry["items"], entry["prompt_tokens"]
    prompt, output = prompt_total / max(items, 1), entry["est_output_tokens"] / max(items, 1)
    busy = _busy(spec, device, items, prompt, output, seqs)
    start = hardware.startup_seconds(spec.shape, device) if items else 0.0
    gpu_hours = (busy + start) * gpus / 3600
    return {
        "model": spec.label,
        "parameters": spec.shape.params,
        "levers": sorted(spec.levers),
        "items": items,
        "prompt_tokens": prompt_total,
        "output_tokens": entry["est_output_tokens"],
        "engine_hours": busy / 3600,
        "start_up_hours": start / 3600,
        "gpu_hours": gpu_hours,
        "usd": gpu_hours * price,
        "output_tokens_per_second": items * output / busy if busy else None,
        "levers_effect": lever_effects(spec, device, items, prompt, output, seqs),
    }


def project_job(
    est: dict,
    config,
    hardware_name: str,
    gpus: int,
    specs: dict[str, TierSpec],
    price_per_gpu_hour: float | dict[str, float],
    api_table: dict | None = None,
) -> dict:
    """The `projection` of an estimate (`estimate_job`'s answer: its tiers' items and tokens) on `gpus` GPUs of
    `hardware_name` per tier at `price_per_gpu_hour` (one for all, or per tier), each tier's model from `specs` or
    the tier's own config."""
    device = hardware.gpu(hardware_name, gpus)
    prices = (
        price_per_gpu_hour if isinstance(price_per_gpu_hour, dict) else dict.fromkeys(est["tiers"], price_per_gpu_hour)
    )
    tiers, specs = {}, dict(specs)
    for name, entry in est["tiers"].items():
        if name not in specs:
            own = hardware.tier_shape(config.tiers[name])
            if own is None:
                raise ValueError(f"tier {name}: its model's config.json is not readable; give --tier {name}=MODEL")
            specs[name] = TierSpec(_applied(own[0], own[1]), frozenset(own[1]), label=config.tiers[name].model)
        seqs = config.tiers[name].vllm.max_num_seqs or hardware.DEFAULT_MAX_NUM_SEQS
        tiers[name] = _tier_figures(specs[name], device, entry, seqs, gpus, prices[name])
    total = sum(t["usd"] for t in tiers.values())
    prompt = sum(t["prompt_tokens"] for t in tiers.values())
    output = sum(t["output_tokens"] for t in tiers.values())
    shares = {}
    if len([t for t in tiers.values() if t["items"]]) > 1:  # the same items, all on the largest tier's model
        largest = max(tiers, key=lambda n: specs[n].shape.params)
        merged = {
            "items": sum(t["items"] for t in tiers.values()),
            "prompt_tokens": prompt,
            "est_output_tokens": output,
        }
        seqs = config.tiers[largest].vllm.max_num_seqs or hardware.DEFAULT_MAX_NUM_SEQS
        alone = _tier_figures(specs[largest], device, merged, seqs, gpus, prices[largest])["usd"]
        shares["routing"] = {"all_on": largest, "usd_without": alone, "saving": 1 - total / alone if alone else 0.0}
    generated, duplicates = est.get("to_generate", 0), est.get("duplicates", 0)
    if generated and duplicates:
        without = total * (generated + duplicates) / generated
        shares["reuse"] = {"duplicates": duplicates, "usd_without": without, "saving": 1 - total / without}
    return {
        "projection": {
            "label": "projection (not measured): roofline calibrated on published results, docs/estimate.md",
            "hardware": f"{hardware_name} ×{gpus} per tier",
            "price_per_gpu_hour": prices,
            "tiers": tiers,
            "usd": total,
            "shares": shares,
            "api_batch_usd": api_prices(prompt, output, api_table),
            "api_prices_date": API_PRICES_DATE if api_table is None else "as given",
            "prompt_tokens": prompt,
            "output_tokens": output,
        }
    }
