"""Build small DEMO LoRA adapters offline with peft: one per tenant on a shared base model.

These are demo weights, not fine-tuned on anything: random-initialised LoRA deltas, so a tenant's
outputs differ from the base model's and from other tenants' and the multi-LoRA path of the engine
(vLLM `enable_lora`, a `LoRARequest` per request) does real work. They teach the model nothing.

Deterministic: the random weights are drawn from `seed`, or from a hash of the adapter's name, so the
same name on the same base model gives a byte-identical adapter (and the same `adapter_digest`); the
base model's absolute path is part of adapter_config.json (base_model_name_or_path), so it is too.

Scale: peft's `init_lora_weights=False` keeps nn.Linear's default init for both A and B, which makes
the delta B·A·(alpha/r) about as large as the weights of a trained model (and several times those of
the tiny random models): the real model's outputs would turn to noise. So each module's B is scaled
so that the delta's Frobenius norm is DELTA_FRACTION of the base weight's: outputs change (different
greedy tokens within a few dozen) yet the real model stays fluent-ish. Only the saved values change;
adapter_config.json holds exactly the fields and values peft writes (which vLLM's loader reads), with
target_modules sorted: peft writes that set in PYTHONHASHSEED order.
"""

from __future__ import annotations

from pathlib import Path

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
DELTA_FRACTION = 0.1  # |B·A·alpha/r| / |W| per module (Frobenius norms)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
LABEL_FILE = "DEMO_ADAPTER.md"
SET_FIELDS = ("target_modules", "exclude_modules")  # LoraConfig fields peft holds as sets


class AdapterError(RuntimeError):
    """The adapter cannot be built or read; the message says why."""


def name_seed(name: str) -> int:
    """The seed an adapter named `name` gets when none is given: stable across processes and machines."""
    import xxhash

    return xxhash.xxh3_64_intdigest(name.encode("utf-8")) % 2**32


def build_demo_adapter(
    base_model: str | Path,
    out: str | Path,
    name: str,
    rank: int = 8,
    seed: int | None = None,
    target_modules: list[str] | None = None,
) -> Path:
    """Write a random (untrained) demo LoRA adapter for the local checkpoint `base_model` into `out`.

    `target_modules`: module names to adapt (default: those of q_proj, k_proj, v_proj, o_proj the model
    has). Returns `out`, which holds adapter_config.json, adapter_model.safetensors and DEMO_ADAPTER.md."""
    import torch
    from peft import LoraConfig, get_peft_model

    if rank < 1:
        raise AdapterError(f"rank must be at least 1, not {rank}")
    if not name:
        raise AdapterError("an adapter needs a name")
    base = Path(base_model).expanduser().resolve()
    out = Path(out).expanduser()
    seed = name_seed(name) if seed is None else seed
    model = load_base_model(base)
    targets = list(target_modules) if target_modules else default_targets(model)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        init_lora_weights=False,
        target_modules=targets,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    scale_deltas(peft_model, DELTA_FRACTION)
    out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(out, safe_serialization=True)
    _sort_set_fields(out / CONFIG_FILE)
    (out / "README.md").unlink(missing_ok=True)  # peft's empty model-card template; DEMO_ADAPTER.md says what this is
    _write_label(out, name=name, base=base, rank=rank, seed=seed, targets=targets)
    return out


def load_base_model(base: Path):
    """The base checkpoint in float32 on the CPU, from the local folder only (never the hub)."""
    import torch
    from transformers import AutoModelForCausalLM

    if not (base / "config.json").is_file():
        raise AdapterError(f"{base} is not a local checkpoint folder (no config.json)")
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, device_map=None, local_files_only=True)
    except Exception as e:  # quantised variants and other checkpoints transformers cannot load for training
        raise AdapterError(
            f"cannot load {base} as a float32 base model ({type(e).__name__}: {e}); "
            "build adapters on the float32 checkpoint (e.g. smollm2-f32)"
        ) from e
    return model.to("cpu").eval()


def default_targets(model) -> list[str]:
    """The attention projections (q_proj, k_proj, v_proj, o_proj) that `model` has, in that order."""
    import torch

    present = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    found = [t for t in ATTENTION_PROJECTIONS if t in present]
    if not found:
        raise AdapterError("the model has none of q_proj, k_proj, v_proj, o_proj: pass target_modules")
    return found


def scale_deltas(peft_model, fraction: float) -> None:
    """Scale each LoRA module's B so that |B·A·scaling| is `fraction` of |W| (Frobenius norms)."""
    import torch
    from peft.tuners.lora import LoraLayer

    with torch.no_grad():
        for module in peft_model.modules():
            if not isinstance(module, LoraLayer):
                continue
            weight = module.get_base_layer().weight
            for adapter, lora_a in module.lora_A.items():
                lora_b = module.lora_B[adapter]
                delta = (lora_b.weight @ lora_a.weight) * module.scaling[adapter]
                norm = delta.norm()
                if norm > 0:
                    lora_b.weight.mul_(fraction * weight.norm() / norm)


def _sort_set_fields(config_file: Path) -> None:
    """peft writes set-valued fields (target_modules) as list(set), whose order follows PYTHONHASHSEED: sort
    them, so the same adapter is the same bytes in every process. Same fields, values and layout as peft's."""
    import json

    data = json.loads(config_file.read_text())
    for key in SET_FIELDS:
        if isinstance(data.get(key), list):
            data[key] = sorted(data[key])
    config_file.write_text(json.dumps(data, indent=2, sort_keys=True))  # peft's own json.dumps arguments


def _write_label(out: Path, *, name: str, base: Path, rank: int, seed: int, targets: list[str]) -> None:
    (out / LABEL_FILE).write_text(
        f"# Demo LoRA adapter `{name}`\n\n"
        "**Demo weights: random LoRA deltas, not trained or fine-tuned on anything.** They exist so that one\n"
        "adapter per tenant on a shared base model exercises vLLM's multi-LoRA path with outputs that differ\n"
        "from the base model's. Do not use them for quality.\n\n"
        f"- base model: `{base}`\n"
        f"- rank: {rank} (lora_alpha {2 * rank})\n"
        f"- seed: {seed}\n"
        f"- target modules: {', '.join(targets)}\n"
        f"- delta scale: each module's B scaled so |B·A·alpha/r| = {DELTA_FRACTION} × |W| (Frobenius)\n"
        "- built by `tokenmill models adapter` (pipeline/dev/adapters.py) with peft, offline\n"
    )


def adapter_rank(path: str | Path) -> int:
    """The LoRA rank `r` of the adapter folder `path` (generate/adapters.adapter_rank, as the engine reads it)."""
    from pipeline.generate.adapters import adapter_rank as rank

    try:
        return rank(str(path))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise AdapterError(f"cannot read the LoRA rank from {Path(path) / CONFIG_FILE}: {e}") from e


def adapter_digest(path: str | Path) -> str:
    """The adapter's content address, as item keys use it (keys.adapter_digest)."""
    from pipeline.keys import adapter_digest as digest

    try:
        return digest(str(path))
    except (FileNotFoundError, OSError) as e:
        raise AdapterError(f"cannot read the adapter at {path}: {e}") from e
