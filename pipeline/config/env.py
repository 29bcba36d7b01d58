"""The environment's part in a config: `${VAR}` expansion and `TOKENMILL_<SECTION>__<FIELD>` overrides,
and the redaction of the secrets it brings in (`redact_url`, `scrub`, `url_error`).

The config package's base (imports nothing of ours), so that the other modules hold only the typed
sections and loading, and every module that shows a URL (CLI, logs, errors, manifests) can redact it
the same way.
"""

from __future__ import annotations

import os
import re
from contextvars import ContextVar
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from pydantic import BaseModel
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

ENV_PREFIX = "TOKENMILL_"
DEFAULT_HOME = "./.tokenmill"


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
        nested = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
        models = [v for v in nested if isinstance(v, BaseModel)]
        if models:
            for child in models:
                expand_defaults(child, environ)
        elif name not in model.model_fields_set:
            expanded = expand(value, environ)
            if expanded != value:
                setattr(model, name, expanded)


def unknown_sections(model: type[BaseModel], environ: dict[str, str]) -> None:
    """Refuse an override naming no section of `model` (a misspelt field inside a section is kept, so that
    validation names it). Raises ConfigError."""
    unknown = sorted(
        n for n in overrides(environ) if n[len(ENV_PREFIX) :].split("__")[0].lower() not in model.model_fields
    )
    if unknown:
        raise ConfigError(
            f"environment override {unknown[0]} names no config section ({', '.join(model.model_fields)})"
        )


def overrides(environ: dict[str, str]) -> dict[str, str]:
    """The overrides in `environ`: `TOKENMILL_<SECTION>__<FIELD>...` names (TOKENMILL_HOME has no `__`: none)."""
    return {n: v for n, v in environ.items() if n.upper().startswith(ENV_PREFIX) and "__" in n[len(ENV_PREFIX) :]}


class Environment(EnvSettingsSource):
    """pydantic-settings' environment source over a given environment (a test's, a DAG task's), its overrides
    alone: `TOKENMILL_A__B__C=v` as {a: {b: {c: v}}}; a list or mapping field reads its value as JSON, every
    other field as its own type (pydantic converts `512`, `false`); `null` is None."""

    def __init__(self, settings_cls: type[BaseSettings], environ: dict[str, str]):
        self.environ = environ  # read by _load_env_vars, which the source's constructor calls
        super().__init__(settings_cls)

    def _load_env_vars(self) -> dict[str, str | None]:
        # Names lowered, as the source keeps them. `null` read here: pydantic-settings parses its none-string
        # only for top-level fields, not for nested ones (`TOKENMILL_TIERS__SMALL__VLLM__MAX_NUM_SEQS=null`).
        return {n.lower(): None if v == "null" else v for n, v in overrides(self.environ).items()}


class Expanded(PydanticBaseSettingsSource):
    """`source`'s values with their `${VAR}`s expanded from `environ`."""

    def __init__(self, source: PydanticBaseSettingsSource, environ: dict[str, str]):
        super().__init__(source.settings_cls)
        self.source, self.environ = source, environ

    def get_field_value(self, field, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # never asked: __call__ gives the whole mapping

    def __call__(self) -> dict[str, Any]:
        return expand(self.source(), self.environ)


# What a load reads (its environment, the config file's mapping), for the sources of the settings it builds.
_LOADING: ContextVar[tuple[dict[str, str], dict]] = ContextVar("config_sources")


class FromEnvironment(BaseSettings):
    """The base of a config section loaded with its environment (`load_settings`): its sources, first wins,
    are the values given in code (CLI options), the environment's overrides, then the config file; each
    `${VAR}` expanded from the same environment. Nothing else is read (no .env, no secrets folder)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        case_sensitive=False,
        env_parse_none_str="null",
        validate_default=False,  # as a Section: defaults hold `${VAR}`s that `expand_defaults` expands
        extra="forbid",
    )

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        environ, file = _LOADING.get()
        return (
            Expanded(init_settings, environ),
            Expanded(Environment(settings_cls, environ), environ),
            Expanded(InitSettingsSource(settings_cls, init_kwargs=file), environ),
        )


def load_settings(settings_cls: type[FromEnvironment], file: dict, environ: dict[str, str], **given: Any):
    """`settings_cls` (FromEnvironment and one config model) from the config file's mapping `file`, the
    overrides in `environ` and `given`, as an instance of its config model (equal to one validated from the
    same values). Raises ConfigError (a list or mapping override that is not JSON, an unset `${VAR}`) or
    pydantic's ValidationError."""
    model = next(b for b in settings_cls.__bases__ if not issubclass(b, FromEnvironment))
    token = _LOADING.set((environ, file))
    try:
        loaded = settings_cls(**given)
    except SettingsError as e:
        raise ConfigError(f"environment override: {e}") from None
    finally:
        _LOADING.reset(token)
    return model.model_construct(
        loaded.model_fields_set, **{name: getattr(loaded, name) for name in model.model_fields}
    )


# -- secrets out ---------------------------------------------------------------------------------------
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*://)(.*)$", re.DOTALL)
_SECRET_PARAM = re.compile(r"(?i)([?&;][^=&#;]*(?:pass|secret|token|signature|credential|key)[^=&#;]*=)[^&#;]*")
_URL_DELIMITERS = re.compile(r"[/?#@:]")


def url_credentials(url: str) -> tuple[str, str, str, str] | None:
    """(`scheme://`, user, password, what follows the `@`) when `url` carries a password, else None.

    The userinfo ends at the LAST `@`: a password that was not percent-encoded may hold `/`, `#`, `?`,
    `@` or `:`, which cut a standard parser's host short and spill the rest of the password into the
    host, path or query (and from there into error messages). Erring this way can only hide too much."""
    m = _SCHEME.match(url)
    if m is None:
        return None
    head, rest = m.groups()
    at = rest.rfind("@")
    if at < 0 or ":" not in rest[:at]:
        return None  # no userinfo, or a user name alone (shown, as database tools do)
    user, password = rest[:at].split(":", 1)
    return head, user, password, rest[at + 1 :]


def redact_url(url: str) -> str:
    """`url` with its password (and secret query parameters: password=, token=, ...) replaced by `***`.

    The one redaction every place that shows a URL uses: config show, logs, errors, manifests."""
    parts = url_credentials(url)
    if parts is not None:
        head, user, _, rest = parts
        shown = f"{user}:" if user and not any(c in user for c in "/?#@") else ""
        url = f"{head}{shown}***@{rest}"
    return _SECRET_PARAM.sub(r"\1***", url)


def redact_strings(value: Any) -> Any:
    """Every string inside `value` (a dumped config: dicts, lists) passed through `redact_url`."""
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, dict):
        return {k: redact_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_strings(v) for v in value]
    return value


def scrub(text: str, *urls: str | None) -> str:
    """`text` (an error message) with the credentials of `urls` taken out: each URL as a whole, its
    password (as written and percent-decoded) and the pieces of it that a misparse may echo."""
    for url in urls:
        if not url:
            continue
        text = text.replace(url, redact_url(url))
        parts = url_credentials(url)
        if parts is None:
            continue
        secret = parts[2]
        pieces = {secret, unquote(secret), *(p for p in _URL_DELIMITERS.split(secret) if len(p) >= 3)}
        for piece in sorted(pieces - {""}, key=len, reverse=True):
            text = text.replace(piece, "***")
    return text


def url_error(e: BaseException, url: str | None) -> str:
    """One line saying what `e` (raised while parsing or connecting to `url`) was, showing no credential.

    A parse error's own message quotes the piece of the URL it could not read, which may be part of a
    password: it is replaced by what to do about it."""
    if url and isinstance(e, ValueError):
        return (
            f"{type(e).__name__}: the URL cannot be parsed (percent-encode '/', '?', '#', '@' and '%' "
            f"in a user name or password: %2F, %3F, %23, %40, %25)"
        )
    message = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {scrub(message, url)}" if message else type(e).__name__
