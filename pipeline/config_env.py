"""The environment's part in a config: `${VAR}` expansion and `TOKENMILL_<SECTION>__<FIELD>` overrides.

A base module (imports nothing of ours), so that config.py holds only the typed sections and their loading.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel

ENV_PREFIX = "TOKENMILL_"
DEFAULT_HOME = "./.tokenmill"
log = logging.getLogger("pipeline.config")


class ConfigError(ValueError):
    """A configuration that cannot be loaded; the message names the file and the field."""


def tokenmill_home(environ: dict[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    return Path(environ.get("TOKENMILL_HOME", DEFAULT_HOME)).expanduser().resolve()


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand(value: Any, environ: dict[str, str]) -> Any:
    if isinstance(value, str):
        def sub(m: re.Match) -> str:
            name = m.group(1)
            if name == "TOKENMILL_HOME":
                return str(tokenmill_home(environ))
            if name not in environ:
                raise ConfigError(f"${{{name}}} is used in the config but not set in the environment")
            return environ[name]
        return _VAR.sub(sub, value)
    if isinstance(value, dict):
        return {k: expand(v, environ) for k, v in value.items()}
    if isinstance(value, list):
        return [expand(v, environ) for v in value]
    return value


def expand_defaults(model: BaseModel, environ: dict[str, str]) -> None:
    """Expand ${VAR}s in the fields left at their defaults (explicit values were expanded from the YAML already).

    Each nested model knows which of its fields were given; a section left out entirely is all defaults.
    Assignment re-validates each field changed."""
    for name in type(model).model_fields:
        value = getattr(model, name)
        nested = (value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value])
        models = [v for v in nested if isinstance(v, BaseModel)]
        if models:
            for child in models:
                expand_defaults(child, environ)
        elif name not in model.model_fields_set:
            expanded = expand(value, environ)
            if expanded != value:
                setattr(model, name, expanded)


def env_value(value: str) -> Any:
    """JSON where the value is JSON (`64`, `true`, `[1, 2]`, `{"a": 1}`), else the string itself.

    Not YAML: YAML 1.1 reads `off`, `no` and `on` as booleans, which would corrupt string fields."""
    try:
        return json.loads(value)
    except ValueError:
        return value


def apply_env_overrides(raw: dict, environ: dict[str, str]) -> dict:
    """Set `TOKENMILL_A__B__C=v` as raw[a][b][c] = v. TOKENMILL_HOME is not an override."""
    for name, value in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX):].split("__")]
        node = raw
        for key in path[:-1]:
            child = node.get(key)
            if not isinstance(child, dict):
                child = node[key] = {}
            node = child
        node[path[-1]] = env_value(value)
    return raw


def plan_env_alias(environ: dict[str, str]) -> dict[str, str]:
    """TOKENMILL_PLAN__* is the deprecated name of TOKENMILL_REQUESTS__*; renamed before the overrides apply,
    so that they merge with a YAML `requests:` section."""
    old = f"{ENV_PREFIX}PLAN__"
    for name in sorted(n for n in environ if n.startswith(old)):
        new = f"{ENV_PREFIX}REQUESTS__{name[len(old):]}"
        log.warning("environment override %s is deprecated: use %s", name, new)
        environ.setdefault(new, environ[name])
        del environ[name]
    return environ
