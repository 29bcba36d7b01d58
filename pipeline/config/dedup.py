"""Reuse: exact, near and semantic dedup, planning's sharding of it, and the cross-job cache."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from pipeline.config.base import Section


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
