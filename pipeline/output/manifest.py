"""The job manifest's shape (jobs/<job>/manifest.json) and a committed partition's counts, as types.

`Manifest` builds and parses the manifest: job/manifest.py fills it from the catalog, `Manifest.as_json` is what
manifest.json, the CLI's `--json` and an orchestrator's task hand on, and every reader (the CLI, the cost report,
the break-even, the DAG's lineage and assets, the Batch API's runner) parses it once with `Manifest.parse` and
reads attributes. `PartitionCounts` is what one partition stores in the catalog when it commits (job/commit.py);
the manifest adds them up. `JobCounts` is what the job's catalog row keeps: the manifest's counts and its staging.

The JSON keeps its keys: a model dumps the fields it was given (`exclude_unset`), so a key the builder leaves out
(`staging` with nothing staged, an engine's figures that were not measured) stays out, and a manifest written by
an older version, which lacks some sections, reads with those sections empty.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from pipeline.status import PartitionStatus
from pipeline.stores import storage
from pipeline.stores.paths import OutputPath


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow")  # a key a newer version adds is carried, not refused

    def as_json(self) -> dict:
        return self.model_dump(exclude_unset=True)  # a null key stays None, which json.dumps writes "null"


class Tokens(_Part):
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    # The prompt tokens each request shares with the one before it (what prefix caching could reach).
    shareable_prompt_tokens: int = 0


class Routing(_Part):
    by_reason: dict[str, int] = {}
    escalated: int = 0
    chunked: int = 0
    escalated_by: dict[str, int] = {}


class Unfaithful(_Part):
    outputs: dict[str, int] = {}  # per tier


class EngineFigures(_Part):
    """One tier's engine in a job: what its committed items asked of it, the time its sessions held, and the
    figures derived from them (job/manifest.py's `engine_figures`). None: not measured."""

    items: int = 0
    output_tokens: int = 0
    uncached_prompt_tokens: int = 0
    busy_gpu_seconds: float = 0.0
    decode_steps_estimate: int = 0
    failed_attempts: int = 0
    workers: int = 0
    starts: int = 0
    startup_seconds: float = 0.0
    busy_seconds: float = 0.0
    idle_seconds: float = 0.0
    held_seconds: float | None = None
    held_gpu_seconds: float = 0.0
    spec_drafted: int | None = None
    spec_accepted: int | None = None
    prefix_queries: int | None = None
    prefix_hits: int | None = None
    utilisation: float | None = None
    engine_seconds: float = 0.0
    gpu_seconds: float = 0.0
    model: str | None = None
    output_tokens_per_second: float | None = None
    spec_acceptance: float | None = None
    prefix_cache_hit_rate: float | None = None
    efficiency: dict[str, Any] = {}
    levers: dict[str, Any] = {}


class JudgeCounts(_Part):
    """The LLM judge's part (checks.judge): outputs it was asked about, by verdict (generate/judge.py VERDICTS),
    and the verdicts paid for (ledger rows of kind `judge`) with their GPU-seconds and cost."""

    judged: int = 0
    verdicts: dict[str, int] = {}
    paid: int = 0
    gpu_seconds: float = 0.0
    cost_usd: float = 0.0


class CommitRecord(_Part):
    """Which claim committed a partition and the files it staged (output/tables.py publishes them): the
    partition's catalog columns `commit_id`, `commit_epoch`, `commit_files`."""

    id: str
    epoch: int | None = None  # None: committed before claims had epochs
    files: dict[str, Any] = {}


class PartitionCounts(_Part):
    """What a committed partition contributes to the job's totals, stored with it in the catalog."""

    records: int = 0
    outputs: int = 0
    quarantined: int = 0
    by_source: dict[str, int] = {}
    by_reason: dict[str, int] = {}
    by_tier: dict[str, int] = {}
    tokens: Tokens = Tokens()
    cost_usd: float = 0.0
    baseline_cost_usd: float = 0.0
    gpu_seconds: float = 0.0
    engines: dict[str, EngineFigures] = {}
    gpu_seconds_by_kind: dict[str, float] = {}
    overhead_gpu_seconds: float = 0.0
    saved_by_source: dict[str, float] = {}
    cache_status: dict[str, int] = {}
    routing: Routing = Routing()
    unfaithful: Unfaithful = Unfaithful()
    checks: dict[str, dict[str, int]] = {}
    acceptable: dict[str, int] = {}
    judge: JudgeCounts = JudgeCounts()
    verification: dict[str, Any] = {}
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> PartitionCounts | None:
        """A catalog row's `counts` (JSON), or None when it has none (not committed)."""
        return cls.model_validate_json(text) if text else None


class ManifestCounts(_Part):
    records: int = 0
    outputs: int = 0
    quarantined: int = 0
    deferred_records: int = 0
    by_source: dict[str, int] = {}
    by_reason: dict[str, int] = {}
    by_tier: dict[str, int] = {}


class JobCounts(ManifestCounts):
    """A job's catalog row `counts`: its manifest's counts and planning's figures (`staging`). What planning
    decided under (its tenant isolation, the batch files it read) is in columns of the row of its own."""

    staging: dict[str, Any] = {}

    @classmethod
    def parse(cls, text: str | None) -> JobCounts:
        return cls.model_validate_json(text) if text else cls()


class ManifestCost(_Part):
    cost_usd: float = 0.0
    baseline_cost_usd: float = 0.0
    saved_usd: float = 0.0
    gpu_seconds: float = 0.0
    overhead_gpu_seconds: float = 0.0
    gpu_seconds_by_kind: dict[str, float] = {}


class PrefixCache(_Part):
    hit_ratio: float | None = None
    shareable_ratio: float | None = None
    of_shareable: float | None = None


class ReusedBy(_Part):
    items: int = 0
    rate: float = 0.0
    saved_usd: float = 0.0


class Reuse(_Part):
    by_source: dict[str, ReusedBy] = {}
    saved_usd: float = 0.0
    cache_status: dict[str, int] = {}
    verification: dict[str, Any] = {}  # generate/shadow.py's summarise_verification


class PartitionEntry(_Part):
    file: str = ""
    records: int = 0
    status: PartitionStatus
    attempts: int = 0
    seconds: float | None = None  # wall seconds of its commit; None: not committed


class Manifest(_Part):
    job_id: str
    status: Literal["incomplete", "succeeded"]  # incomplete: a partition has not committed
    config_fingerprint: str | None = None
    input_uri: str | None = None
    output_uri: str | None = None
    template_version: str | None = None
    largest_tier: str | None = None  # the baseline tier
    created_at: str | None = None
    updated_at: str | None = None
    counts: ManifestCounts = ManifestCounts()
    tokens: Tokens = Tokens()
    prefix_cache: PrefixCache = PrefixCache()
    routing: Routing = Routing()
    unfaithful: Unfaithful = Unfaithful()
    checks: dict[str, dict[str, int]] = {}
    acceptable: dict[str, int] = {}
    judge: JudgeCounts = JudgeCounts()
    cost: ManifestCost = ManifestCost()
    reuse: Reuse = Reuse()
    engines: dict[str, EngineFigures] = {}
    partitions: dict[str, PartitionEntry] = {}
    staging: dict[str, Any] | None = None  # what planning staged; absent when nothing was
    batches: dict[str, Any] | None = None  # batch file -> its answers' files (output/batch.py)

    @classmethod
    def parse(cls, data: bytes | str | dict) -> Manifest:
        """A manifest as written (manifest.json's bytes, or the object an orchestrator's task handed on)."""
        return cls.model_validate(data) if isinstance(data, dict) else cls.model_validate_json(data)

    def committed(self) -> list[str]:
        return sorted(p for p, v in self.partitions.items() if v.status == "succeeded")

    def job_counts(self) -> JobCounts:
        """What the job's catalog row keeps of it."""
        return JobCounts(**self.counts.as_json(), staging=self.staging or {})


def read_manifest(root: storage.Location, job_id: str) -> Manifest:
    """The manifest a job wrote under the output root (raises storage.StorageError when there is none)."""
    return Manifest.parse(storage.read_bytes(root, OutputPath.manifest(job_id).full(root)))
