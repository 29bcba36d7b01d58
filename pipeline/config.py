"""The one typed configuration of a job, built once from YAML plus environment overrides.

Every model forbids unknown fields, so a typo in a YAML file is an error, not a silent default.
Overrides: `TOKENMILL_<SECTION>__<FIELD>[__<SUBFIELD>...]=value`, read by pydantic-settings (a list or
mapping field's value is JSON, `null` is None, any other value converts to its field's type). `${VAR}` in
string values expands from the environment, in the YAML, the overrides and the defaults alike;
`${TOKENMILL_HOME}` defaults to `./.tokenmill`, made absolute.
`load_run_section` reads the `run:` section alone (the Airflow DAG's shape) and expands nothing else, so parsing
the DAG needs no secret.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from pipeline.config_env import (  # noqa: F401  (re-exported: part of the config's interface)
    ENV_PREFIX,
    ConfigError,
    apply_env_overrides,
    expand,
    expand_defaults,
    redact_url,
    renamed_overrides,
    tokenmill_home,
    url_credentials,
)
from pipeline.config_tiers import (  # noqa: F401  (re-exported: part of the config's interface)
    Section,
    SpeculativeConfig,
    TenantConfig,
    TierConfig,
    VllmArgs,
)


def no_credentials(uri: str | None) -> str | None:
    """Refuse a storage URI that carries a password: it would be stored in the catalog, written into
    manifests and shown in every message naming the URI. Object storage takes credentials from the AWS
    chain instead (the message shows the URI redacted)."""
    if uri and url_credentials(uri) is not None:
        raise ValueError(
            f"credentials in a URI are not supported ({redact_url(uri)}); object storage takes "
            "them from the AWS chain (environment variables, profile, instance or pod role)"
        )
    return uri


class InputConfig(Section):
    uri: str = Field(
        "./data/input",
        description=(
            "Input folder or prefix (local path, `file://…` or `s3://bucket/prefix`) holding "
            ".jsonl, .jsonl.gz, .parquet, .txt and .md files."
        ),
    )
    default_tenant: str = Field(
        "default", description="Tenant for records that carry none, and for every .txt/.md file."
    )
    max_document_bytes: int = Field(
        200_000, gt=0, description="Documents whose text is larger (UTF-8 bytes) are quarantined as `too_large`."
    )
    records_per_partition: int = Field(
        10_000, gt=0, description="A file with more records is split into partitions of this many records."
    )
    excerpt_chars: int = Field(
        200, ge=0, description="Characters of the raw input kept in a quarantine row's `excerpt`."
    )

    _uri_has_no_credentials = field_validator("uri")(no_credentials)


class OutputConfig(Section):
    uri: str = Field(
        "./data/output",
        description=(
            "Output root (local path, `file://…` or `s3://bucket/prefix`): outputs/, ledger/, "
            "quarantine/ (Hive layout), jobs/<job_id>/manifest.json and _staging/."
        ),
    )
    compression: Literal["zstd", "snappy", "gzip", "none"] = Field("zstd", description="Parquet compression codec.")

    _uri_has_no_credentials = field_validator("uri")(no_credentials)


class StorageConfig(Section):
    """Object storage (s3:// URIs). Credentials come from the standard AWS chain (environment variables,
    shared profile, instance or pod role), never from this file."""

    s3_endpoint_url: str | None = Field(
        None, description="Endpoint of an S3-compatible store, e.g. `http://127.0.0.1:8333`; unset for AWS S3."
    )
    s3_region: str | None = Field(None, description="Bucket region; unset: from the environment / profile.")
    s3_max_attempts: int = Field(
        5,
        ge=1,
        description=(
            "Attempts per S3 request; throttling, 5xx and timeouts are retried with exponential backoff and jitter."
        ),
    )
    s3_connect_timeout_seconds: float = Field(5.0, gt=0, description="Connect timeout per S3 request.")
    s3_request_timeout_seconds: float = Field(60.0, gt=0, description="Timeout per S3 request.")

    _endpoint_has_no_credentials = field_validator("s3_endpoint_url")(no_credentials)


class DedupConfig(Section):
    """Reuse inside a job and against earlier jobs (through `cache`). Defaults come from
    `benchmarks/reuse_quality.py` on the labelled pair set; see docs/data-engineer.md."""

    exact: bool = Field(
        True,
        description="Generate once per (tenant scope, normalised text); the other copies reuse that output at no cost.",
    )
    case_fold: bool = Field(False, description="Also ignore letter case when comparing texts.")
    boilerplate_patterns: list[str] = Field(
        default_factory=list,
        description=(
            "Regular expressions (multiline) removed before texts are compared, e.g. `^(From|Sent|To|Subject):.*$` "
            "for mail headers."
        ),
    )
    near: bool = Field(True, description="Reuse near duplicates: MinHash LSH over word shingles.")
    near_threshold: float = Field(
        0.8,
        gt=0,
        le=1,
        description="Estimated Jaccard similarity of the shingle sets at or above which two texts are near duplicates.",
    )
    shingle_words: int = Field(5, ge=1, description="Words per shingle.")
    num_perm: int = Field(
        128,
        ge=16,
        le=1024,
        description=(
            "MinHash signature length (one-permutation hashing into this many bins); more is "
            "more precise: the Jaccard estimate's error shrinks as 1/sqrt(num_perm)."
        ),
    )
    semantic: bool = Field(
        False, description="Reuse semantic neighbours: static-embedding cosine similarity (needs `embedder`)."
    )
    semantic_threshold: float = Field(
        0.92, gt=0, le=1, description="Cosine similarity at or above which two texts are semantic neighbours."
    )
    embedder: str = Field(
        "${TOKENMILL_HOME}/models/static-minilm",
        description="Static embedding model folder (model2vec), built offline by `tokenmill models embedder`.",
    )
    guards: bool = Field(
        True,
        description=(
            "Refuse a near or semantic match whose numbers, negations or named entities differ, "
            "or whose lengths differ by more than `max_length_ratio`."
        ),
    )
    max_length_ratio: float = Field(
        1.5, ge=1, description="Longest / shortest text length a near or semantic match may have."
    )
    shadow_rate: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Share of near and semantic reuses generated anyway and compared, to measure the false-hit rate.",
    )
    shadow_min_f1: float = Field(
        0.5,
        ge=0,
        le=1,
        description=(
            "Token F1 between the reused and the generated output below which a shadow-verified "
            "reuse counts as a false hit."
        ),
    )
    shared_tenants: list[str] = Field(
        default_factory=list,
        description=(
            "Tenants that may reuse each other's outputs (e.g. public documents); every other "
            "tenant only reuses its own."
        ),
    )

    @field_validator("boilerplate_patterns")
    @classmethod
    def _patterns_compile(cls, patterns: list[str]) -> list[str]:
        for i, p in enumerate(patterns):
            try:
                re.compile(p, re.MULTILINE)
            except re.error as e:
                raise ValueError(f"pattern {i} {p!r} is not a regular expression: {e}") from None
        return patterns


class PlanningConfig(Section):
    """How the job's planning (read, validate, dedup, route, stage; pipeline/plan/streamed.py) uses the CPU."""

    workers: int | None = Field(
        None,
        ge=1,
        le=256,
        description=(
            "Processes that plan the job, one core each: input files are keyed in parallel and "
            "dedup runs per shard of tenant scopes. Unset: one per 32 MB of input, at most one "
            "per core this process may use. Outputs are the same for any number; memory is per "
            "process (docs/data-engineer.md)."
        ),
    )
    shard_rows: int = Field(
        200_000,
        ge=1,
        description=(
            "Records per dedup shard, about (a shard's memory grows with its records, about 7 "
            "KB each). A larger tenant scope is cut into parts of whole near-duplicate components, "
            "which can miss semantic matches across parts (docs/data-engineer.md)."
        ),
    )


class CacheConfig(Section):
    """Outputs kept across jobs, by content key, plus the near/semantic index of what they were made from."""

    enabled: bool = Field(True, description="Look outputs up in, and add them to, the cache.")
    store: Literal["local", "redis"] = Field(
        "local", description="`local`: an embedded SQLite file under `path`; `redis`: Redis at `redis_url`."
    )
    path: str = Field("${TOKENMILL_HOME}/cache", description="Folder of the local store.")
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis URL (`redis://[:password@]host:port/db`); put the password in the environment as `${VAR}`.",
    )
    namespace: str = Field("tokenmill", description="Key prefix; keys are `<namespace>:<tenant scope>:...`.")
    ttl_days: float | None = Field(30.0, gt=0, description="Entries expire after this many days; unset: never.")
    timeout_seconds: float = Field(
        2.0, gt=0, description="Redis connect and socket timeout; a slower store is bypassed for the rest of the job."
    )


class PromptConfig(Section):
    template_version: str = Field(
        "summarize-v1", description="Recorded in every output row; change it whenever `system` or `user` changes."
    )
    system: str = Field(
        "You are a careful analyst. Summarize documents faithfully and briefly.", description="System instruction."
    )
    user: str = Field(
        "Summarize the following document in a few sentences.\n\n{text}",
        description="User message; `{text}` is replaced by the document.",
    )

    @model_validator(mode="after")
    def _has_placeholder(self) -> "PromptConfig":
        if "{text}" not in self.user:
            raise ValueError("prompt.user must contain the placeholder {text}")
        return self


# The sampling knobs against loops and their neutral values (left out of item keys while neutral).
LOOP_KNOBS = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_tokens": 0, "stop": []}


class SamplingConfig(Section):
    max_tokens: int = Field(
        128, gt=0, description="Most output tokens per summary (capped by what the context leaves)."
    )
    temperature: float = Field(0.0, ge=0.0, description="0 is greedy: the reproducible choice for nightly batch work.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    seed: int | None = Field(0, description="Per-request sampling seed (used when temperature > 0).")
    json_schema: dict[str, Any] | None = Field(
        None,
        description=(
            "JSON schema every summary must follow, enforced by vLLM's guided decoding (compact "
            "JSON, no free whitespace). An output that still fails validation (cut off by max_tokens) "
            "is retried once with twice the token budget, then quarantined as `invalid_output`. "
            "Part of the item key: changing it regenerates."
        ),
    )
    # Against loops (vLLM's own names and meanings). Each is part of the item key only when it is set away from
    # its neutral value, so that keys made before these knobs existed stay valid.
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        description=(
            "Above 1 makes tokens already in the prompt or output less likely (vLLM's `repetition_penalty`); "
            "1: off. It penalises the document's own words too: on the demo's corpus 1.2 ended "
            "SmolLM2-135M's loops but sent 76% of its summaries off topic (`frequency_penalty` "
            "did not). Part of the item key when not 1."
        ),
    )
    frequency_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        description=(
            "Penalises a token by how often it already appears in the output (vLLM's `frequency_penalty`); 0: off."
        ),
    )
    presence_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        description="Penalises a token that already appears in the output (vLLM's `presence_penalty`); 0: off.",
    )
    min_tokens: int = Field(
        0,
        ge=0,
        description="Output tokens generated before an end of sequence may stop it (vLLM's `min_tokens`); 0: off.",
    )
    stop: list[str] = Field(
        default_factory=list,
        description=(
            "Strings that end the output where they appear, not included (vLLM's `stop`), e.g. "
            "a blank line after a one-paragraph summary."
        ),
    )

    @model_validator(mode="after")
    def _schema_is_valid(self) -> "SamplingConfig":
        if self.json_schema is not None:
            from jsonschema import Draft202012Validator
            from jsonschema.exceptions import SchemaError

            try:
                Draft202012Validator.check_schema(self.json_schema)
            except SchemaError as e:
                raise ValueError(f"json_schema is not a valid JSON schema: {e.message}") from None
        return self

    def keyed(self) -> dict[str, Any]:
        """The parameters that decide an output, as item keys take them: the loop knobs only when set."""
        return {k: v for k, v in self.model_dump(mode="json").items() if LOOP_KNOBS.get(k, object()) != v}


class RouteRule(Section):
    """A rule sends matching items to a tier; all the conditions given must hold. Rules are tried in order."""

    name: str = Field(description="Recorded as the item's `route_reason` (`rule:<name>`).")
    tier: str = Field(description="Tier the matching items go to.")
    min_chars: int | None = Field(None, ge=0, description="Text at least this many characters long.")
    max_chars: int | None = Field(None, ge=0, description="Text at most this many characters long.")
    tenants: list[str] = Field(default_factory=list, description="Tenant is one of these.")
    metadata: dict[str, Any] = Field(
        default_factory=dict, description="Every listed metadata field equals the value given."
    )
    regex: str | None = Field(None, description="Regular expression found in the text (Python syntax).")

    @model_validator(mode="after")
    def _regex_compiles(self) -> "RouteRule":
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as e:
                raise ValueError(f"route rule {self.name!r}: regex does not compile: {e}") from None
        return self


class EscalationConfig(Section):
    """Generate-then-verify: a low-confidence output of a smaller tier is generated again on `to_tier`."""

    enabled: bool = Field(False, description="Escalate low-confidence outputs.")
    to_tier: str | None = Field(None, description="Tier escalations go to; unset: the largest tier.")
    min_mean_logprob: float | None = Field(
        -2.5,
        description=(
            "Outputs whose mean token log-probability (from vLLM) is below this are escalated; "
            "null: this signal is off (`tokenmill eval` picks it)."
        ),
    )
    on_truncation: bool = Field(
        True, description="Also escalate outputs cut off by `max_tokens` (finish reason `length`)."
    )
    on_unfaithful: bool = Field(
        False,
        description=(
            "Also escalate outputs that state numbers, dates or capitalised names their document "
            "does not contain (on the escalation tier itself they are flagged: ledger column "
            "`unfaithful`)."
        ),
    )
    on_degenerate: bool = Field(
        True,
        description="Also escalate outputs that fail the `degenerate` check "
        "(a repetition loop: `checks.degenerate_below`).",
    )
    on_copied: bool = Field(
        True,
        description="Also escalate outputs that fail the `copied` check "
        "(the document given back: `checks.copied_above`).",
    )
    on_off_topic: bool = Field(
        True,
        description=(
            "Also escalate outputs that fail the `off_topic` check (about something else than "
            "their document: `checks.off_topic_below`)."
        ),
    )


class ChecksConfig(Section):
    """Output checks: the summaries a user would throw away, flagged per item (ledger columns `degenerate`,
    `copied`, `off_topic`), escalated when `route.escalation` is on, and quarantined if listed in `quarantine`.
    Defaults measured on this project's outputs (docs/data-engineer.md#output-checks)."""

    degenerate_below: float = Field(
        0.30,
        gt=0,
        le=1,
        description=(
            "An output whose zlib-compressed size (of the whole, or of its second half if lower) "
            "is under this share of its size is `degenerate` (a repetition loop); 339 standard-library "
            "docstrings of summary length measure 0.31 at the least, 0.60 at the median."
        ),
    )
    min_chars: int = Field(
        80, ge=1, description="Shorter outputs are never `degenerate` (short text compresses badly either way)."
    )
    copied_above: float = Field(
        0.50,
        ge=0,
        le=1,
        description=(
            "An output with more than this share of its 6-word runs found verbatim in its document "
            "is `copied` (the text given back, not summarised): the demo's copies of a document's "
            "opening measure 0.52-0.92."
        ),
    )
    min_words: int = Field(
        12, ge=6, description="Shorter outputs are never `copied` (a short summary may quote a title)."
    )
    off_topic_below: float = Field(
        0.25,
        ge=0,
        le=1,
        description=(
            "An output of which less than this share of its topic words (content words of 4 letters "
            "or more, stemmed) appear in its document is `off_topic`. Of the demo's 24 real outputs "
            "that neither loop nor copy, the two below 0.25 are the invented topic (0.00) and "
            "a vague one (0.12); the next measures 0.39; the same outputs set against other documents "
            "measure under 0.25 in 77% of pairs."
        ),
    )
    min_topic_words: int = Field(
        4, ge=1, description="Outputs with fewer topic words are never `off_topic` (too little to judge)."
    )
    quarantine: list[Literal["degenerate", "copied", "off_topic"]] = Field(
        default_factory=list,
        description=(
            "Checks whose failure quarantines the record (reason: the check's name; its generations "
            "stay in the ledger, `kind` invalid_output) when the served output still fails after "
            "escalation, or was not escalated. Empty: such outputs are served and flagged."
        ),
    )


class RouteConfig(Section):
    default_tier: str = Field(description="Tier for items no rule or router decides.")
    rules: list[RouteRule] = Field(
        default_factory=list, description="Rules tried first, in order; the first that matches decides."
    )
    router: str | None = Field(
        None, description="Learned router artifact (`tokenmill router train`); decides items no rule matched."
    )
    escalation: EscalationConfig = Field(
        default_factory=EscalationConfig, description="Generate-then-verify escalation."
    )


class RequestsConfig(Section):
    """Building engine requests: render, tokenise, fit the context, order."""

    @model_validator(mode="before")
    @classmethod
    def no_engine_calls(cls, data: Any) -> Any:
        """Engine calls were `tokenmill eval`'s own path until 0.2; evals now stream through the tier worker."""
        gone = sorted({"items_per_engine_call", "long_items_per_engine_call"} & set(data or {}))
        if gone:
            raise ValueError(
                f"requests.{gone[0]} was removed: evals stream requests through the tier worker as "
                "jobs do (2 x vllm.max_num_seqs in flight); delete the field"
            )
        return data

    prefix_ordering: bool = Field(
        True,
        description=(
            "Send requests sorted by their token ids, so prompts sharing a prefix (system prompt, "
            "template, few-shot examples) run back to back and hit vLLM's prefix cache. Off: "
            "input order (for comparison)."
        ),
    )
    long_prompt_tokens: int = Field(
        4096,
        gt=0,
        description=(
            "Prompts at least this long go to the engine after their unit's shorter ones, so "
            "a few long prompts do not crowd a batch's KV cache (vLLM's scheduler, `max_num_batched_tokens`, "
            "admits them)."
        ),
    )
    long_documents: Literal["chunk", "quarantine"] = Field(
        "chunk",
        description=(
            "A document whose prompt exceeds the tier's context: `chunk` summarises it map-reduce "
            "style (chunk summaries, then a summary of them); `quarantine` rejects it as `too_long`."
        ),
    )


class CostConfig(Section):
    prefill_token_weight: float = Field(
        1.0,
        ge=0,
        description="Weight of an uncached prompt token when sharing an engine call's seconds among its items.",
    )
    cached_token_weight: float = Field(0.0, ge=0, description="Weight of a prompt token served from the prefix cache.")
    decode_token_weight: float = Field(
        1.0, ge=0, description="Weight of an output token (decode is memory-bound: one step per token)."
    )


class BudgetConfig(Section):
    """Hard caps in USD. A job whose estimate exceeds a cap does not start; a running job stops admitting
    engine calls once spent + the call's estimate would cross a cap, and defers the partitions left."""

    max_job_usd: float | None = Field(None, ge=0, description="Cap on one job's generation cost; unset: no cap.")
    max_tenant_usd: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict, description="Cap per tenant within one job, e.g. `{acme: 20.0}`."
    )
    default_tenant_usd: float | None = Field(
        None, ge=0, description="Cap for every tenant not named in `max_tenant_usd`; unset: none."
    )

    def tenant_cap(self, tenant: str) -> float | None:
        return self.max_tenant_usd.get(tenant, self.default_tenant_usd)

    @property
    def active(self) -> bool:
        return self.max_job_usd is not None or bool(self.max_tenant_usd) or self.default_tenant_usd is not None


class StateConfig(Section):
    url: str = Field(
        "sqlite:///${TOKENMILL_HOME}/state.db",
        description=(
            "SQLAlchemy URL of the job-state catalog (SQLite locally, PostgreSQL in production, "
            "e.g. `postgresql+psycopg://user@host/db`; put the password in the environment, not "
            "here)."
        ),
    )
    lease_seconds: float = Field(
        300.0,
        gt=0,
        le=7 * 86400,
        description=(
            "A claimed partition is held this long without a heartbeat; a worker that dies loses "
            "it after this and another may take over."
        ),
    )
    wait_seconds: float = Field(
        1.0, gt=0, le=3600, description="How often a worker looks again at partitions other workers hold."
    )


class RunConfig(Section):
    schedule: str = Field(
        "0 2 * * *",
        description=(
            "Cron schedule of the Airflow DAG (`dags/nightly_summarization.py`); nightly at 02:00 UTC by default."
        ),
    )
    retries: int = Field(
        2, ge=0, description="Airflow retries of each task (a partition is retried alone), with exponential backoff."
    )
    retry_delay_seconds: float = Field(
        60.0, ge=0, description="First Airflow retry delay; doubles per retry, at most 15 minutes."
    )
    progress: Literal["auto", "bar", "log", "off"] = Field(
        "auto", description="`auto`: a bar on a terminal, plain log lines otherwise."
    )
    log_every_seconds: float = Field(10.0, gt=0, description="Interval of progress log lines when not on a terminal.")
    tier_workers: dict[str, Annotated[int, Field(ge=1, le=64)]] = Field(
        default_factory=dict,
        description=(
            "GPU worker tasks per tier in the Airflow DAG (`drain_<tier>`, each on queue and "
            "pool `gpu-<tier>`); a tier not named gets one. Each worker starts its tier's engine "
            "once and drains that tier's work units from every partition."
        ),
    )


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

    @model_validator(mode="before")
    @classmethod
    def no_plan_section(cls, data: Any) -> Any:
        """`plan:` was the name of `requests:` until 0.1 (a plan is planning's, one word one meaning)."""
        if isinstance(data, dict) and "plan" in data:
            raise ValueError("config section `plan:` is now `requests:` (the same fields): rename it")
        return data

    @model_validator(mode="after")
    def _tiers_known(self) -> "TokenmillConfig":
        if not self.tiers:
            raise ValueError("tiers: at least one tier is required")
        named = {
            "route.default_tier": self.route.default_tier,
            "route.escalation.to_tier": self.route.escalation.to_tier,
            **{f"route.rules[{r.name}].tier": r.tier for r in self.route.rules},
            **{f"tenants.{n}.adapter_tier": t.adapter_tier for n, t in self.tenants.items()},
        }
        for where, tier in named.items():
            if tier is not None and tier not in self.tiers:
                raise ValueError(f"{where} {tier!r} is not one of tiers {sorted(self.tiers)}")
        return self

    @property
    def escalation_tier(self) -> str | None:
        """Where low-confidence outputs are generated again; None when escalation is off."""
        e = self.route.escalation
        return (e.to_tier or self.largest_tier) if e.enabled else None

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


def load_config(path: str | Path | None, environ: dict[str, str] | None = None, **overrides: Any) -> TokenmillConfig:
    """Load YAML, apply environment overrides, expand ${VAR}s, validate, then expand the defaults. Raises
    ConfigError."""
    environ = dict(os.environ if environ is None else environ)
    renamed = renamed_overrides(environ)
    if renamed:
        raise ConfigError(renamed)
    raw = _read_yaml(path)
    try:
        raw = TokenmillConfig.no_plan_section(raw)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None
    raw = apply_env_overrides(raw, environ, TokenmillConfig)
    for dotted, value in overrides.items():
        if value is not None:
            section, field = dotted.split("__")
            raw.setdefault(section, {})[field] = value
    try:
        config = TokenmillConfig.model_validate(expand(raw, environ))
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


def load_run_section(path: str | Path | None, environ: dict[str, str] | None = None) -> RunConfig:
    """The `run:` section alone (with TOKENMILL_RUN__* overrides): what the Airflow DAG's shape needs. Nothing
    outside `run:` is validated or expanded, so parsing the DAG needs neither the secrets the rest of the
    config names (`${TOKENMILL_PG_DSN}`) nor the models it points to."""
    environ = dict(os.environ if environ is None else environ)
    run = _read_yaml(path).get("run") or {}
    if not isinstance(run, dict):
        raise ConfigError(f"{path}: run: must be a mapping")
    overrides = {k: v for k, v in environ.items() if k.startswith(f"{ENV_PREFIX}RUN__")}
    run = apply_env_overrides({"run": run}, overrides, TokenmillConfig)["run"]
    try:
        return RunConfig.model_validate(expand(run, environ))
    except ValidationError as e:
        raise _config_error(path, e, "run") from None
