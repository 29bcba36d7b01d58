"""vLLM's own option types (KV-cache dtypes, quantisation and speculative methods, what its CPU attention
supports), read from the installed vLLM's source instead of copied by hand, so the lever checks
(levers.py) follow the vLLM that will run.

They are read with `ast`, not imported: importing vLLM loads torch (about 10 s here), and the checks run
at every job start and estimate, in processes that never start an engine. Where vLLM is not installed,
or one option's source no longer has the shape read here, that option is unknown (None) and the check
that needs it is skipped: the engine then refuses a bad value itself when it starts.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmOptions:
    """Each None when that one could not be read (its check is then skipped)."""

    kv_cache_dtypes: tuple[str, ...] | None  # vllm/config/cache.py CacheDType
    quantization_methods: tuple[str, ...] | None  # vllm/model_executor/layers/quantization QuantizationMethods
    speculative_methods: tuple[str, ...] | None  # vllm/config/speculative.py SpeculativeMethod
    cpu_kv_cache_dtypes: tuple[str, ...] | None  # the CPU attention backend's supported_kv_cache_dtypes
    cpu_head_sizes: tuple[int, ...] | None  # ... and get_supported_head_sizes()


def _module(root: Path, name: str) -> ast.Module:
    path = root.joinpath(*name.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    return ast.parse(path.read_text(encoding="utf-8"))


def literal(tree: ast.Module, name: str) -> tuple:
    """The values of the `name = Literal[...]` alias in `tree`, nested aliases of the module flattened."""
    aliases = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            aliases[node.targets[0].id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            aliases[node.target.id] = node.value

    def values(expr: ast.expr) -> list:
        if isinstance(expr, ast.Constant):
            return [expr.value]
        if isinstance(expr, ast.Name):
            return values(aliases[expr.id])
        if isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Name) and expr.value.id == "Literal":
            parts = expr.slice.elts if isinstance(expr.slice, ast.Tuple) else [expr.slice]
            return [v for part in parts for v in values(part)]
        raise ValueError(f"{ast.dump(expr)[:80]} is not a Literal")

    return tuple(dict.fromkeys(values(aliases[name])))


def _class_attribute(tree: ast.Module, cls: str, attribute: str) -> tuple:
    """The list constant assigned to `attribute` in class `cls`."""
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    for n in node.body:
        target = n.target if isinstance(n, ast.AnnAssign) else n.targets[0] if isinstance(n, ast.Assign) else None
        if isinstance(target, ast.Name) and target.id == attribute and n.value is not None:
            return tuple(ast.literal_eval(n.value))
    raise KeyError(f"{cls}.{attribute}")


def _class_returns(tree: ast.Module, cls: str, method: str) -> tuple:
    """The list constant `method` of class `cls` returns."""
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    function = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == method)
    return tuple(ast.literal_eval(next(r.value for r in ast.walk(function) if isinstance(r, ast.Return))))


def _read(what: str, read) -> tuple | None:
    try:
        return read()
    except (OSError, SyntaxError, ValueError, KeyError, StopIteration, TypeError, AttributeError) as e:
        log.warning("vLLM's %s could not be read from its source (%s); the engine checks them itself", what, e)
        return None


@functools.lru_cache(maxsize=1)
def vllm_options() -> VllmOptions | None:
    """The installed vLLM's options (each None where it cannot be read), or None without vLLM."""
    spec = importlib.util.find_spec("vllm")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    cpu = "v1.attention.backends.cpu_attn"
    return VllmOptions(
        kv_cache_dtypes=_read("KV-cache dtypes", lambda: literal(_module(root, "config.cache"), "CacheDType")),
        quantization_methods=_read(
            "quantisation methods",
            lambda: literal(_module(root, "model_executor.layers.quantization"), "QuantizationMethods"),
        ),
        speculative_methods=_read(
            "speculative methods", lambda: literal(_module(root, "config.speculative"), "SpeculativeMethod")
        ),
        cpu_kv_cache_dtypes=_read(
            "CPU KV-cache dtypes",
            lambda: _class_attribute(_module(root, cpu), "CPUAttentionBackend", "supported_kv_cache_dtypes"),
        ),
        cpu_head_sizes=_read(
            "CPU head sizes",
            lambda: _class_returns(_module(root, cpu), "CPUAttentionBackend", "get_supported_head_sizes"),
        ),
    )
