"""A job as OpenLineage sees it: its input prefix in; its outputs, ledger and quarantine tables out, with
their row counts; the job's figures (cost, GPU-seconds, partitions) as a run facet.

The nightly DAG's `summary` task hands `summary_lineage(manifest)` to Airflow's OpenLineage provider
(dags/nightly_summarization.py), which emits it with the task's COMPLETE event through whatever transport
the deployment configures (`[openlineage] transport`): a Marquez or DataHub server, Kafka, a file. Without
the provider, or with no transport configured, nothing is built or sent (and this module, which needs the
`openlineage-python` client the provider installs, is never imported). Dataset names follow
OpenLineage's naming spec: a local path is namespace `file`, name the absolute path; `s3://bucket/key`
is namespace `s3://bucket`, name `key`.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import attr
from openlineage.client.event_v2 import InputDataset, OutputDataset
from openlineage.client.facet_v2 import output_statistics_output_dataset
from openlineage.client.generated.base import RunFacet

from pipeline.job.orchestrate import TABLES, table_asset_uri
from pipeline.output.manifest import Manifest

# The run facet's JSON schema, shipped in the repository (docs/schemas/): OpenLineage asks every custom
# facet for the URL of one, a JSON pointer to the facet's definition.
FACET_SCHEMA = (
    "https://raw.githubusercontent.com/tokenmill/tokenmill/main/docs/schemas/TokenmillJobRunFacet.json"
    "#/$defs/TokenmillJobRunFacet"
)


def dataset_name(uri: str) -> tuple[str, str]:
    """(namespace, name) of a local path or an object-store URI, by OpenLineage's naming spec."""
    parts = urlsplit(uri)
    if parts.scheme in ("", "file"):
        return "file", parts.path if parts.scheme else uri
    return f"{parts.scheme}://{parts.netloc}", parts.path.lstrip("/")


def summary_lineage(manifest: Manifest) -> dict:
    """OperatorLineage's fields (inputs, outputs, run_facets) for a job's manifest (job.manifest)."""
    rows = {"outputs": manifest.counts.outputs, "quarantine": manifest.counts.quarantined, "ledger": None}
    outputs = [
        OutputDataset(
            *dataset_name(table_asset_uri(manifest.output_uri, t)),  # as the DAG's Assets name them
            outputFacets={
                "outputStatistics": output_statistics_output_dataset.OutputStatisticsOutputDatasetFacet(rows[t])
            }
            if rows[t] is not None
            else {},
        )
        for t in TABLES
    ]
    return {
        "inputs": [InputDataset(*dataset_name(manifest.input_uri))],
        "outputs": outputs,
        "run_facets": {"tokenmill_job": job_facet(manifest)},
    }


@attr.define
class TokenmillJobRunFacet(RunFacet):
    """The run facet `tokenmill_job`: what the job committed and what it cost."""

    jobId: str  # noqa: N815 (OpenLineage's field names are camelCase)
    status: str
    partitions: int
    partitionsCommitted: int  # noqa: N815
    records: int
    outputs: int
    quarantined: int
    costUsd: float  # noqa: N815
    gpuSeconds: float  # noqa: N815

    @staticmethod
    def _get_schema() -> str:
        return FACET_SCHEMA


def job_facet(manifest: Manifest) -> TokenmillJobRunFacet:
    return TokenmillJobRunFacet(
        jobId=manifest.job_id,
        status=manifest.status,
        partitions=len(manifest.partitions),
        partitionsCommitted=len(manifest.committed()),
        records=manifest.counts.records,
        outputs=manifest.counts.outputs,
        quarantined=manifest.counts.quarantined,
        costUsd=manifest.cost.cost_usd,
        gpuSeconds=manifest.cost.gpu_seconds,
    )
