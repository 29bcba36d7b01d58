"""The lineage the `summary` task hands Airflow's OpenLineage provider, as the event it becomes, validated
against OpenLineage's published schemas (tests/schemas/openlineage/, SOURCE.md says where from): the
RunEvent (2-0-2), each facet against its own schema, the custom `tokenmill_job` facet against the schema its
`_schemaURL` names, which is shipped in this repository (docs/schemas/)."""

from __future__ import annotations

import json
import uuid
from urllib.parse import urlsplit

import jsonschema
import pytest
from referencing import Registry, Resource

from pipeline.output.manifest import Manifest
from tests.conftest import REPO

pytest.importorskip("openlineage.client")

OPENLINEAGE = REPO / "tests" / "schemas" / "openlineage"
REPO_URL = "https://raw.githubusercontent.com/tokenmill/tokenmill/main/"


def schemas() -> Registry:
    resources = []
    for path in [*OPENLINEAGE.glob("*.json"), *(REPO / "docs" / "schemas").glob("*.json")]:
        contents = json.loads(path.read_text())
        resources.append((contents["$id"], Resource.from_contents(contents)))
    return Registry().with_resources(resources)


def manifest(input_uri: str, output_uri: str) -> Manifest:
    return Manifest.parse(
        {
            "job_id": "nightly_summarization-2026-12-01",
            "status": "incomplete",
            "input_uri": input_uri,
            "output_uri": output_uri,
            "counts": {"records": 10, "outputs": 7, "quarantined": 3},
            "cost": {"cost_usd": 0.5, "gpu_seconds": 60.0},
            "partitions": {"a": {"status": "succeeded"}, "b": {"status": "failed"}},
        }
    )


def complete_event(lineage: dict) -> dict:
    """The COMPLETE RunEvent the provider emits with the task's lineage, serialised as it is sent."""
    from openlineage.client.event_v2 import Job, Run, RunEvent, RunState
    from openlineage.client.serde import Serde

    event = RunEvent(
        eventType=RunState.COMPLETE,
        eventTime="2026-12-01T03:00:00Z",
        run=Run(runId=str(uuid.uuid4()), facets=lineage["run_facets"]),
        job=Job(namespace="airflow", name="nightly_summarization.summary"),
        inputs=lineage["inputs"],
        outputs=lineage["outputs"],
        producer="https://github.com/apache/airflow/tree/providers-openlineage/2.20.3",
    )
    return json.loads(Serde.to_json(event))


def validate(instance: dict, uri: str, registry: Registry) -> None:
    jsonschema.Draft202012Validator({"$ref": uri}, registry=registry).validate(instance)


@pytest.mark.parametrize(
    ("input_uri", "output_uri"),
    [("s3://incoming/2026-12-01/", "s3://summaries/tokenmill/"), ("/data/in/2026-12-01", "/data/summaries")],
)
def test_the_summary_event_validates_against_openlineage_and_its_facets_schemas(input_uri, output_uri):
    from pipeline.job.lineage import summary_lineage

    registry = schemas()
    event = complete_event(summary_lineage(manifest(input_uri, output_uri)))
    validate(event, "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent", registry)
    facets = [(name, f) for d in event["outputs"] for name, f in (d.get("outputFacets") or {}).items()]
    facets += list(event["run"]["facets"].items())
    assert {name for name, _ in facets} == {"outputStatistics", "tokenmill_job"}
    for _, facet in facets:
        # each facet against the schema its own _schemaURL names (ours: a file of this repository)
        url = facet["_schemaURL"]
        if url.startswith(REPO_URL):
            assert (REPO / urlsplit(url).path.removeprefix("/tokenmill/tokenmill/main/")).is_file(), url
        validate(facet, url, registry)


def test_the_custom_facet_schema_rejects_what_the_facet_must_not_carry():
    registry = schemas()
    url = "https://raw.githubusercontent.com/tokenmill/tokenmill/main/docs/schemas/TokenmillJobRunFacet.json"
    facet = {"_producer": "p", "_schemaURL": url, "jobId": "j", "status": "ok", "partitions": 1}
    with pytest.raises(jsonschema.ValidationError):  # required figures missing
        validate(facet, url + "#/$defs/TokenmillJobRunFacet", registry)


@pytest.mark.parametrize(
    "output_uri", ["s3://summaries/tokenmill/", "/data/summaries", "file:///data/summaries", "out"]
)
def test_the_dags_assets_are_the_datasets_the_complete_event_names(output_uri, monkeypatch, tmp_path):
    """Airflow links an Asset to an OpenLineage dataset by its URI (the provider's converter for its scheme): the
    DAG's Assets, named by `table_asset_uri` of the output root, translate to exactly the datasets `summary`'s
    COMPLETE event names for the job's tables."""
    from airflow.providers.common.io.assets.file import convert_asset_to_openlineage
    from airflow.sdk import Asset

    from pipeline.job.lineage import dataset_name, summary_lineage
    from pipeline.job.orchestrate import TABLES, table_asset_uri

    monkeypatch.chdir(tmp_path)  # `out`: a relative root, resolved where the job runs
    lineage = summary_lineage(manifest("s3://incoming/2026-12-01/", output_uri))
    named = [(d.namespace, d.name) for d in lineage["outputs"]]
    assets = [Asset(name=f"nightly_summarization.{t}", uri=table_asset_uri(output_uri, t)) for t in TABLES]
    if output_uri.startswith("s3://"):  # the Amazon provider's converter: namespace s3://bucket, name the key
        assert [dataset_name(a.uri) for a in assets] == named
    else:
        converted = [convert_asset_to_openlineage(a, None) for a in assets]
        assert [(d.namespace, d.name) for d in converted] == named
        assert all(name.startswith("/") for _, name in named)  # absolute, wherever the root was written relative
