"""What-if pricing: tonight's staged job projected on hardware this deployment does not have (`tokenmill estimate
--hardware H100-SXM:8 --tier large=Llama-3.1-70B:fp8 --price-per-gpu-hour 2.5`).

Every figure here is a projection (plan/hardware.py: a roofline with efficiency factors calibrated on published
results, docs/estimate.md), never a measurement: keys and titles say so. Per tier: busy engine-hours, GPU-hours
with start-up, USD; each lever's projected effect (FP8 or INT4 weights, FP8 KV cache, speculative decoding at a
stated acceptance), the routing share (the same items all on the largest tier) and the reuse share (duplicates
generated too), beside the same tokens through OpenAI's and Anthropic's batch APIs at list prices (api_prices.json,
dated; `--api-prices FILE` replaces it). The break-even against those offers: plan/breakeven.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.plan import breakeven, hardware

PRICE_FILE = Path(__file__).with_name("api_prices.json")


def load_prices(path: Path | None = None) -> tuple[dict[str, dict], str]:
    """(offer -> {input, cached_input, output} USD per 1M tokens through its batch API, the prices' date) from
    `path` (`--api-prices FILE`) or PRICE_FILE, the dated list prices docs/estimate.md cites. A file may be the
    bare {offer: prices} object too (dated "as given"); cached_input defaults to input."""
    where = path or PRICE_FILE
    raw = json.loads(where.read_text())
    table = raw.get("prices", raw) if isinstance(raw, dict) else None
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{where}: expected {{'prices': {{offer: {{input, output[, cached_input]}}}}}}")
    out = {}
    for name, p in table.items():
        numbers = isinstance(p, dict) and all(isinstance(p.get(k), (int, float)) for k in ("input", "output"))
        if not numbers or not isinstance(p.get("cached_input", 0), (int, float)):
            raise ValueError(f"{where}: offer {name!r} needs numbers input and output (USD per 1M tokens)")
        out[name] = {"input": p["input"], "cached_input": p.get("cached_input", p["input"]), "output": p["output"]}
    return out, str(raw.get("date", "as given")) if "prices" in raw else "as given"


API_PRICES, API_PRICES_DATE = load_prices()


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


def busy_seconds(
    spec: TierSpec, device: hardware.Device, items: float, prompt: float, output: float, seqs: int
) -> float:
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
    base = busy_seconds(spec, device, items, prompt, output, seqs)
    effects = {}
    for lever in hardware.LEVERS:
        other = set(spec.levers) ^ {lever}
        if lever in ("fp8", "int4") and lever not in spec.levers:
            other -= {"int4", "fp8"} - {lever}
        raw = replace(spec.shape, weight_bits=16, kv_bits=16)
        alt = busy_seconds(
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
    busy = busy_seconds(spec, device, items, prompt, output, seqs)
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


def tier_volumes(est: dict) -> dict[str, dict]:
    """Per tier of an estimate: its requests, prompt and output tokens, escalations into it counted on it (their
    prompt again, at the mean of the tier they came from) as the run sends them."""
    out = {
        n: {"items": e["items"], "prompt_tokens": e["prompt_tokens"], "est_output_tokens": e["est_output_tokens"]}
        for n, e in est["tiers"].items()
    }
    for e in est["tiers"].values():
        up = e.get("escalation")
        if up and up["items"] and up["to"] in out:
            out[up["to"]]["items"] += up["items"]
            out[up["to"]]["prompt_tokens"] += up["items"] * e["prompt_tokens"] / max(e["items"], 1)
    return out


def resolved_specs(est: dict, config, specs: dict[str, TierSpec]) -> dict[str, TierSpec]:
    """`specs` and, for each other tier of the estimate, its configured model and levers."""
    out = dict(specs)
    for name in est["tiers"]:
        if name not in out:
            own = hardware.tier_shape(config.tiers[name])
            if own is None:
                raise ValueError(f"tier {name}: its model's config.json is not readable; give --tier {name}=MODEL")
            out[name] = TierSpec(_applied(own[0], own[1]), frozenset(own[1]), label=config.tiers[name].model)
    return out


def _seqs(config, name: str) -> int:
    return config.tiers[name].vllm.max_num_seqs or hardware.DEFAULT_MAX_NUM_SEQS


def project_job(
    est: dict,
    config,
    hardware_name: str,
    gpus: int,
    specs: dict[str, TierSpec],
    price_per_gpu_hour: float | dict[str, float],
    api_table: dict | None = None,
    api_date: str = "as given",
) -> dict:
    """The `projection` of an estimate (`estimate_job`'s answer: its tiers' items and tokens) on `gpus` GPUs of
    `hardware_name` per tier at `price_per_gpu_hour` (one for all, or per tier), each tier's model from `specs` or
    the tier's own config."""
    device = hardware.gpu(hardware_name, gpus)
    prices = (
        price_per_gpu_hour if isinstance(price_per_gpu_hour, dict) else dict.fromkeys(est["tiers"], price_per_gpu_hour)
    )
    specs, volumes = resolved_specs(est, config, specs), tier_volumes(est)
    tiers = {n: _tier_figures(specs[n], device, volumes[n], _seqs(config, n), gpus, prices[n]) for n in est["tiers"]}
    total = sum(t["usd"] for t in tiers.values())
    prompt = sum(t["prompt_tokens"] for t in tiers.values())
    output = sum(t["output_tokens"] for t in tiers.values())
    shares = {}
    if len([t for t in tiers.values() if t["items"]]) > 1:  # the same items, all on the largest tier's model
        largest = max(tiers, key=lambda n: specs[n].shape.params)
        alone = _tier_figures(
            specs[largest], device, _merged(est["tiers"]), _seqs(config, largest), gpus, prices[largest]
        )
        shares["routing"] = {
            "all_on": largest,
            "usd_without": alone["usd"],
            "saving": 1 - total / alone["usd"] if alone["usd"] else 0.0,
        }
    generated, duplicates = est.get("to_generate", 0), est.get("duplicates", 0)
    if generated and duplicates:
        without = total * (generated + duplicates) / generated
        shares["reuse"] = {"duplicates": duplicates, "usd_without": without, "saving": 1 - total / without}
    return {
        "projection": {
            "label": "projection (not measured): roofline calibrated on published results, docs/estimate.md",
            "hardware": f"{hardware_name} ×{gpus} per tier",
            "gpu": hardware_name,
            "gpus_per_tier": gpus,
            "price_per_gpu_hour": prices,
            "tiers": tiers,
            "usd": total,
            "shares": shares,
            "api_batch_usd": api_prices(prompt, output, api_table),
            "api_prices_date": API_PRICES_DATE if api_table is None else api_date,
            "prompt_tokens": prompt,
            "output_tokens": output,
        }
    }


def _merged(entries: dict[str, dict]) -> dict:
    """The estimate's tiers as one: every routed item on a single tier (no escalations)."""
    return {k: sum(v[k] for v in entries.values()) for k in ("items", "prompt_tokens", "est_output_tokens")}


def _loads(volumes: dict[str, dict], specs, device, config, prices, utilisation, docs: float, billed: float) -> list:
    loads = []
    for name, v in volumes.items():
        spec, items, seqs = specs[name], max(v["items"], 1e-9), _seqs(config, name)
        prompt, output = v["prompt_tokens"] / items, v["est_output_tokens"] / items

        def busy(n, spec=spec, prompt=prompt, output=output, seqs=seqs):
            return busy_seconds(spec, device, n, prompt, output, seqs)

        loads.append(
            breakeven.TierLoad(
                name,
                v["items"] / docs,
                prompt,
                output,
                busy,
                hardware.startup_seconds(spec.shape, device),
                utilisation.get(name, (1.0, 0))[0],
                device.count,
                prices[name],
                billed * 3600,
            )
        )
    return loads


def break_even(
    est: dict,
    config,
    projection: dict,
    specs,
    volume: int,
    api: tuple[dict, str],
    measured: dict,
    cached: float = 0.0,
    billed_hours: float = 0.0,
) -> dict:
    """Per tier mix (as planned; all on the largest tier), $/1k documents at the job's volume and at `volume` a
    night, and the break-even volume and ratio against each offer of `api` ((table, date): load_prices), with
    `cached` of prompt tokens at the offers' cached price, each GPU paid at least `billed_hours` a night (0: by the
    second it runs). `measured`: per tier (utilisation, jobs) from the
    user's ledger (breakeven.measured_utilisation); `sources` says which figures are measured, which projected."""
    device = hardware.gpu(projection["gpu"], projection["gpus_per_tier"])
    docs = max(est["records"] - est["quarantined"], 1)
    specs, prices = resolved_specs(est, config, specs), projection["price_per_gpu_hour"]
    mixes = {"as planned": _loads(tier_volumes(est), specs, device, config, prices, measured, docs, billed_hours)}
    if "routing" in projection["shares"]:
        largest = projection["shares"]["routing"]["all_on"]
        mixes[f"all on {largest}"] = _loads(
            {largest: _merged(est["tiers"])}, specs, device, config, prices, measured, docs, billed_hours
        )
    figures, curves = {}, {}
    for name, loads in mixes.items():
        figures[name] = breakeven.mix_figures(loads, docs, volume, api[0], cached)
        offers = figures[name]["api"].values()
        top = max([volume, *(f["break_even_documents"] or 0 for f in offers)]) * 10
        api_per_doc = {a: f["usd_per_1k_documents"] / 1000 for a, f in figures[name]["api"].items()}
        curves[name] = breakeven.curve(loads, api_per_doc, min(docs, volume), top)
    return {
        "volume_documents_per_night": volume,
        "job_documents": docs,
        "mixes": figures,
        "curve": curves,
        "sources": {
            **_sources(est, projection, measured, docs, api[1], cached),
            "billing": f"each GPU paid at least {billed_hours:g} h a night (reserved)"
            if billed_hours
            else "by the second: start-up and work only (on demand)",
        },
    }


def _sources(est: dict, projection: dict, measured: dict, docs: int, date: str, cached: float) -> dict[str, str]:
    """Which of the break-even's figures are measured and which projected, and from what."""
    use = {t: f"{u:.0%} over {n} job{'s' * (n != 1)}" for t, (u, n) in measured.items() if t in est["tiers"]}
    tokens = "; ".join(f"{t}: {s}" for t, s in est.get("token_counts", {}).items()) or "the tiers' own tokenizers"
    return {
        "throughput": "projected: " + projection["label"].split(": ", 1)[-1],
        "engine start-up": "projected, once per tier per night: 60 s, the weights at 2 GB/s, 5 s shutdown (declared)",
        "utilisation": (
            "measured in the ledger, busy ÷ (busy + idle): " + ", ".join(f"{t} {v}" for t, v in use.items())
            if use
            else "projected: 100% (no ledger yet; idle besides start-up not counted)"
        ),
        "gpus": f"as given: {projection['hardware']} (ideal scaling)",
        "reuse share": f"measured on this job: {est.get('duplicates', 0)} of {docs} documents answered by a duplicate",
        "prompt tokens": f"counted on this job's documents: {tokens}",
        "output tokens": "the estimate's: " + "; ".join(f"{t}: {e['method']}" for t, e in est["tiers"].items()),
        "api prices": f"list prices of {date}, {cached:.0%} of prompt tokens at the cached price",
        "volume": "scaled from this job: the same tier shares, tokens per request and reuse share per document",
    }
