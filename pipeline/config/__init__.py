"""The one typed configuration of a job, built once from YAML plus environment overrides.

Every model forbids unknown fields, so a typo in a YAML file is an error, not a silent default.
Overrides: `TOKENMILL_<SECTION>__<FIELD>[__<SUBFIELD>...]=value`, read by pydantic-settings (a list or
mapping field's value is JSON, `null` is None, any other value converts to its field's type). `${VAR}` in
string values expands from the environment, in the YAML, the overrides and the defaults alike;
`${TOKENMILL_HOME}` defaults to `./.tokenmill`, made absolute.
`load_run_section` reads the `run:` section alone (the Airflow DAG's shape) and expands nothing else, so parsing
the DAG needs no secret.

A package per domain, each section's fields documented beside them (`tokenmill config docs` renders
docs/config.md from them): `data` (input, output, storage), `dedup` (dedup, planning, cache), `generation`
(prompt, sampling, requests, cost), `route` (routing, escalation, output checks), `tiers` (tiers, vLLM
arguments, tenants), `control` (budget, state, run, metrics), `job` (TokenmillConfig and loading it), `env` (the
environment's part: overrides, `${VAR}` expansion, redaction of the secrets it brings), `serve` (the Batch
API server: limits, retention, the Airflow trigger), `base` (Section).
Modules import one another directly, never this package's face, which only re-exports them.
"""

from pipeline.config.base import Section, no_credentials
from pipeline.config.control import BudgetConfig, MetricsConfig, RunConfig, StateConfig
from pipeline.config.data import InputConfig, OutputConfig, StorageConfig
from pipeline.config.dedup import CacheConfig, DedupConfig, PlanningConfig
from pipeline.config.env import (
    DEFAULT_HOME,
    ENV_PREFIX,
    ConfigError,
    expand,
    expand_defaults,
    redact_url,
    tokenmill_home,
    url_credentials,
)
from pipeline.config.generation import LOOP_KNOBS, CostConfig, PromptConfig, RequestsConfig, SamplingConfig
from pipeline.config.job import TokenmillConfig, load_config, load_output_uri, load_run_section, load_tier_workers
from pipeline.config.route import ChecksConfig, EscalationConfig, RouteConfig, RouteRule
from pipeline.config.serve import AirflowTriggerConfig, ServeConfig
from pipeline.config.tiers import FakeEngineArgs, SpeculativeConfig, TenantConfig, TierConfig, VllmArgs

__all__ = [
    "AirflowTriggerConfig",
    "DEFAULT_HOME",
    "ENV_PREFIX",
    "LOOP_KNOBS",
    "BudgetConfig",
    "CacheConfig",
    "ChecksConfig",
    "ConfigError",
    "CostConfig",
    "DedupConfig",
    "EscalationConfig",
    "FakeEngineArgs",
    "InputConfig",
    "MetricsConfig",
    "OutputConfig",
    "PlanningConfig",
    "PromptConfig",
    "RequestsConfig",
    "RouteConfig",
    "RouteRule",
    "ServeConfig",
    "RunConfig",
    "SamplingConfig",
    "Section",
    "SpeculativeConfig",
    "StateConfig",
    "StorageConfig",
    "TenantConfig",
    "TierConfig",
    "TokenmillConfig",
    "VllmArgs",
    "expand",
    "expand_defaults",
    "load_config",
    "load_output_uri",
    "load_run_section",
    "load_tier_workers",
    "no_credentials",
    "redact_url",
    "tokenmill_home",
    "url_credentials",
]
