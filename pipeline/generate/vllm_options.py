"""vLLM's own option types (KV-cache dtypes, quantisation and speculative methods, what its CPU attention
supports), read from the installed vLLM's source instead of copied by hand, so the lever checks
(levers.py) follow the vLLM that will run.

They are read with `ast`, not imported: importing vLLM loads torch (about 10 s here), and the checks run
at every job start and estimate, in processes that never start an engine. Where vLLM is not installed,
or its source no longer has the shape read here, the options are unknown (None) and the checks that
need them are skipped: the engine then refuses a bad value itself when it starts.
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
    kv_cache_dtypes: tuple[str, ...]  # vllm/config/cache.py CacheDType
    quantization_methods: tuple[str, ...]  # vllm/model_executor/layers/quantization QuantizationMethods
    speculative_methods: tuple[str, ...]  # vllm/config/speculative.py SpeculativeMethod
    cpu_kv_cache_dtypes: tuple[str, ...]  # the CPU attention backend's supported_kv_cache_dtypes
    cpu_head_sizes: tuple[int, ...]  # ... and get_supported_head_sizes()


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


def _class_constants(tree: ast.Module, cls: str, attribute: str, method: str) -> tuple[tuple, tuple]:
    """(the list constant assigned to `attribute`, the list constant `method` returns) in class `cls`."""
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    assigned = next(
        n.value for n in node.body if isinstance(n, (ast.AnnAssign, ast.Assign)) and attribute in ast.unparse(n)
    )
    returned = next(
        r.value
        for n in node.body
        if isinstance(n, ast.FunctionDef) and n.name == method
        for r in ast.walk(n)
        if isinstance(r, ast.Return)
    )
    return tuple(ast.literal_eval(assigned)), tuple(ast.literal_eval(returned))


@functools.lru_cache(maxsize=1)
def vllm_options() -> VllmOptions | None:
    """The installed vLLM's options, or None when they cannot be read (see the module's docstring)."""
    try:
        spec = importlib.util.find_spec("vllm")  # finds the package without running it
        if spec is None or not spec.submodule_search_locations:
            return None
        root = Path(next(iter(spec.submodule_search_locations)))
        cpu_kv, cpu_heads = _class_constants(
            _module(root, "v1.attention.backends.cpu_attn"),
            "CPUAttentionBackend",
            "supported_kv_cache_dtypes",
            "get_supported_head_sizes",
        )
        return VllmOptions(
            kv_cache_dtypes=literal(_module(root, "config.cache"), "CacheDType"),
            quantization_methods=literal(_module(root, "model_executor.layers.quantization"), "QuantizationMethods"),
            speculative_methods=literal(_module(root, "config.speculative"), "SpeculativeMethod"),
            cpu_kv_cache_dtypes=cpu_kv,
            cpu_head_sizes=cpu_heads,
        )
    except (OSError, SyntaxError, ValueError, KeyError, StopIteration, TypeError) as e:
        log.warning("vLLM's option types could not be read from its source (%s); the engine checks them itself", e)
        return None
