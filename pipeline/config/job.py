"""The whole configuration (TokenmillConfig) and loading it: YAML without aliases, environment overrides,
${VAR} expansion."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator
from pydantic_settings import SettingsConfigDict

from pipeline.config.base import Section
from pipeline.config.control import BudgetConfig, MetricsConfig, RunConfig, StateConfig
from pipeline.config.data import InputConfig, OutputConfig, StorageConfig
from pipeline.config.dedup import CacheConfig, DedupConfig, PlanningConfig
from pipeline.config.env import (
    ENV_PREFIX,
    ConfigError,
    FromEnvironment,
    expand,
    expand_defaults,
    load_settings,
    unknown_sections,
)
from pipeline.config.generation import CostConfig, PromptConfig, RequestsConfig, SamplingConfig
from pipeline.config.route import ChecksConfig, RouteConfig
from pipeline.config.serve import ServeConfig
from pipeline.config.tiers import TenantConfig, TierConfig


class TokenmillConfig(Section):
    input: InputConfig = Field(default_factory=InputConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    dedup: DedupConfig = Field(default_factory=DedupConfig)
    planning: PlanningConfig = Field(default_factory=PlanningConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    prompt: PromptConfig = Field(default_factory=PromptConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    checks: ChecksConfig = Field(default_factory=ChecksConfig)
    tiers: dict[str, TierConfig]
    route: RouteConfig
    requests: RequestsConfig = Field(default_factory=RequestsConfig)
    cost: CostConfig = Field(default_factory=CostConfig)
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    state: StateConfig = Field(default_factory=StateConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    tenants: dict[str, TenantConfig] = Field(default_factory=dict, description="Per-tenant settings, by tenant name.")
    serve: ServeConfig = Field(default_factory=ServeConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @model_validator(mode="after")
    def _tiers_known(self) -> "TokenmillConfig":
        if not self.tiers:
            raise ValueError("tiers: at least one tier is required")
        named = {
            "route.default_tier": self.route.default_tier,
            "route.escalation.to_tier": self.route.escalation.to_tier,
            **{f"route.rules[{r.name}].tier": r.tier for r in self.route.rules},
            **{f"tenants.{n}.adapter_tier": t.adapter_tier for n, t in self.tenants.items()},
            "checks.judge.tier": self.checks.judge.tier if self.checks.judge else None,
        }
        owners: dict[str, str] = {}
        for name, t in self.tenants.items():
            for digest in t.api_keys:
                if owners.setdefault(digest, name) != name:
                    raise ValueError(
                        f"an API key (sha256 {digest[:12]}…) belongs to tenants {owners[digest]} and {name}"
                    )
        for where, tier in named.items():
            if tier is not None and tier not in self.tiers:
                raise ValueError(f"{where} {tier!r} is not one of tiers {sorted(self.tiers)}")
        judge, escalation = named["checks.judge.tier"], self.escalation_tier
        if judge is not None and escalation is not None and judge != escalation:
            # Each would wait on the other's units: escalations into one, judgements of its outputs into the other.
            raise ValueError(
                f"checks.judge.tier {judge!r} is not the escalation tier {escalation!r}: with route.escalation "
                "on, the judge runs on the escalation tier (the strongest model, fed last)"
            )
        claimed: dict[str, str] = {}
        for name, t in self.tiers.items():
            for served in t.served_model_names:
                if claimed.setdefault(served, name) != name:
                    raise ValueError(f"served model name {served!r} is claimed by tiers {claimed[served]} and {name}")
        return self

    @property
    def escalation_tier(self) -> str | None:
        """Where low-confidence outputs are generated again; None when escalation is off."""
        e = self.route.escalation
        return (e.to_tier or self.largest_tier) if e.enabled else None

    @property
    def fed_tiers(self) -> set[str]:
        """Tiers other tiers' outputs feed: the escalation tier and the LLM judge's (one tier when both are on)."""
        return {t for t in (self.escalation_tier, self.checks.judge.tier if self.checks.judge else None) if t}

    def adapter(self, tenant: str, tier: str) -> str | None:
        """The LoRA adapter folder `tenant`'s requests on `tier` run with, or None (the base model)."""
        t = self.tenants.get(tenant)
        if t is None or t.adapter is None:
            return None
        return t.adapter if (t.adapter_tier or self.route.default_tier) == tier else None

    def tier_adapters(self) -> dict[str, list[str]]:
        """Per tier, the adapter folders its engine serves (sorted, each once)."""
        out: dict[str, set[str]] = {}
        for t in self.tenants.values():
            if t.adapter is not None:
                out.setdefault(t.adapter_tier or self.route.default_tier, set()).add(t.adapter)
        return {tier: sorted(paths) for tier, paths in out.items()}

    @property
    def served_models(self) -> dict[str, str]:
        """Model name a batch request may ask for -> the tier that serves it."""
        out: dict[str, str] = {}
        for name, t in self.tiers.items():
            for served in (name, t.model, *t.served_model_names):
                out.setdefault(served, name)
        return out

    @property
    def tier_prices(self) -> dict[str, float]:
        """USD per hour of each tier's engine (price per GPU-hour x GPUs): how tiers rank."""
        return {name: t.price_per_gpu_hour * t.gpus for name, t in self.tiers.items()}

    @property
    def largest_tier(self) -> str:
        """The baseline tier: the one with the highest price per hour of its engine."""
        prices = self.tier_prices
        return max(prices, key=prices.get)


class _NoAliases(yaml.SafeLoader):
    """YAML without aliases: `*name` shares one node many times over, so 400 bytes can stand for a tree of
    a billion leaves that `${VAR}` expansion would walk. A config has no need of them."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.YAMLError(
                f"YAML aliases (*name) are not allowed in a tokenmill config (line {mark.line + 1}, "
                f"column {mark.column + 1}): write the value out"
            )
        return super().compose_node(parent, index)


def _read_yaml(path: str | Path | None) -> dict:
    if path is None:
        return {}
    p = Path(path)
    try:
        raw = yaml.load(p.read_text(encoding="utf-8"), Loader=_NoAliases) or {}  # noqa: S506 (a SafeLoader)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections")
    return raw


def _config_error(path: str | Path | None, e: ValidationError, where: str = "") -> ConfigError:
    problems = "; ".join(
        f"{'.'.join(str(x) for x in (where, *err['loc']) if x != '') or '<root>'}: {err['msg']}" for err in e.errors()
    )
    return ConfigError(f"{path or '<defaults>'}: {problems}")


class _LoadedConfig(FromEnvironment, TokenmillConfig):
    """TokenmillConfig as `load_config` builds it: from the file, the environment and the CLI's options."""


class _LoadedRun(FromEnvironment, RunConfig):
    """The `run:` section alone, with its TOKENMILL_RUN__* overrides (`load_run_section`)."""

    model_config = SettingsConfigDict(env_prefix=f"{ENV_PREFIX}RUN__")


def load_config(path: str | Path | None, environ: dict[str, str] | None = None, **overrides: Any) -> TokenmillConfig:
    """Load YAML, lay the environment's overrides and `overrides` (`section__field`: a CLI option; None is
    unset) over it, expand ${VAR}s, validate, then expand the defaults. Raises ConfigError."""
    environ = dict(os.environ if environ is None else environ)
    unknown_sections(TokenmillConfig, environ)
    given: dict[str, dict] = {}
    for dotted, value in overrides.items():
        if value is not None:
            section, field = dotted.split("__")
            given.setdefault(section, {})[field] = value
    try:
        config = load_settings(_LoadedConfig, _read_yaml(path), environ, **given)
        expand_defaults(config, environ)
    except ValidationError as e:
        raise _config_error(path, e) from None
    return config


def load_tier_workers(path: str | Path | None, environ: dict[str, str] | None = None) -> dict[str, int]:
    """Tier name -> GPU worker tasks, from the names under `tiers:` and `run.tier_workers` alone (the DAG's
    shape at parse time: nothing else of the tiers is read)."""
    tiers = _read_yaml(path).get("tiers") or {}
    if not isinstance(tiers, dict) or not tiers:
        raise ConfigError(f"{path}: tiers: must name at least one tier")
    run = load_run_section(path, environ)
    unknown = sorted(set(run.tier_workers) - set(tiers))
    if unknown:
        raise ConfigError(f"{path}: run.tier_workers names tiers that do not exist: {', '.join(unknown)}")
    return {str(name): run.tier_workers.get(str(name), 1) for name in tiers}


def load_output_uri(path: str | Path | None, environ: dict[str, str] | None = None) -> str:
    """`output.uri` alone (TOKENMILL_OUTPUT__URI overrides it; its `${VAR}`s expanded): what the Airflow DAG names
    its Assets by at parse time. A `{date}` in it stays: each run puts its own date there."""
    environ = dict(os.environ if environ is None else environ)
    output = _read_yaml(path).get("output") or {}
    if not isinstance(output, dict):
        raise ConfigError(f"{path}: output: must be a mapping")
    uri = environ.get(f"{ENV_PREFIX}OUTPUT__URI") or output.get("uri") or OutputConfig.model_fields["uri"].default
    return expand(str(uri), environ)


def load_run_section(path: str | Path | None, environ: dict[str, str] | None = None) -> RunConfig:
    """The `run:` section alone (with TOKENMILL_RUN__* overrides): what the Airflow DAG's shape needs. Nothing
    outside `run:` is validated or expanded, so parsing the DAG needs neither the secrets the rest of the
    config names (`${TOKENMILL_PG_DSN}`) nor the models it points to."""
    environ = dict(os.environ if environ is None else environ)
    run = _read_yaml(path).get("run") or {}
    if not isinstance(run, dict):
        raise ConfigError(f"{path}: run: must be a mapping")
    try:
        return load_settings(_LoadedRun, run, environ)
    except ValidationError as e:
        raise _config_error(path, e, "run") from None
