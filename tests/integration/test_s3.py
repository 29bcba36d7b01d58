"""Jobs reading from and writing to a real S3-compatible HTTP server, including throttling and outages."""

import json
import uuid

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
from typer.testing import CliRunner

from pipeline import JobError, run_job
from pipeline.cli import app
from pipeline.config import StorageConfig
from pipeline.dev.samples import write_sample_corpus
from pipeline.ingest.read import partition_id
from pipeline.output.tables import KINDS, commit_rows, old_layout, open_table, read
from pipeline.stores import storage
from pipeline.stores.catalog import StateStore
from pipeline.stores.storage import list_files, resolve
from tests.conftest import ONE_TIER, S3_SECRET, TINY_CONFIG
from tests.integration.test_tables import FIXTURE, WANT, counts


def upload_corpus(s3_client, tmp_path, bucket: str, prefix: str, documents: int = 30) -> dict:
    counts = write_sample_corpus(tmp_path / "corpus", documents=documents)
    for path in sorted((tmp_path / "corpus").rglob("*")):
        if path.is_file():
            s3_client.put_object(
                Bucket=bucket, Key=f"{prefix}/{path.relative_to(tmp_path / 'corpus')}", Body=path.read_bytes()
            )
    return counts


def read_s3_kind(s3_client, bucket: str, prefix: str, kind: str, job_id: str) -> pa.Table:
    """A job's rows of one kind, from its table's latest snapshot on the S3 server."""
    config = StorageConfig(s3_endpoint_url=s3_client.meta.endpoint_url, s3_region="us-east-1")
    return read(storage.resolve(f"s3://{bucket}/{prefix}", config), kind, filter=ds.field("job_id") == job_id)


@pytest.fixture
def buckets(s3_client):
    name = f"tm-{uuid.uuid4().hex[:8]}"
    s3_client.create_bucket(Bucket=f"{name}-in")
    s3_client.create_bucket(Bucket=f"{name}-out")
    return f"{name}-in", f"{name}-out"


def s3_config(make_config, endpoint: str, buckets, **overrides):
    return make_config(
        input_dir=f"s3://{buckets[0]}/corpus",
        output__uri=f"s3://{buckets[1]}/tokenmill",
        storage__s3_endpoint_url=endpoint,
        storage__s3_max_attempts=overrides.pop("attempts", 3),
        **overrides,
    )


def test_job_reads_and_writes_s3(make_config, s3_server, s3_client, buckets, tmp_path):
    counts = upload_corpus(s3_client, tmp_path, buckets[0], "corpus")
    m = run_job(s3_config(make_config, s3_server, buckets), job_id="s3-job").manifest.as_json()
    outputs = read_s3_kind(s3_client, buckets[1], "tokenmill", "outputs", "s3-job")
    quarantine = read_s3_kind(s3_client, buckets[1], "tokenmill", "quarantine", "s3-job")
    ledger = read_s3_kind(s3_client, buckets[1], "tokenmill", "ledger", "s3-job")
    assert (
        outputs.num_rows + quarantine.num_rows == counts["documents"] + counts["bad_records"] == m["counts"]["records"]
    )
    assert ledger.num_rows == outputs.num_rows
    manifest = (
        s3_client.get_object(Bucket=buckets[1], Key="tokenmill/jobs/s3-job/manifest.json")["Body"].read().decode()
    )
    assert json.loads(manifest)["status"] == "succeeded"
    assert S3_SECRET not in manifest


def test_listing_pages_through_a_large_prefix(s3_server, s3_client, buckets):
    for i in range(1105):  # S3 lists 1,000 keys a page
        s3_client.put_object(Bucket=buckets[0], Key=f"many/{i:05d}.txt", Body=b"x")
    from pipeline.config import StorageConfig

    files = list_files(resolve(f"s3://{buckets[0]}/many", StorageConfig(s3_endpoint_url=s3_server)))
    assert len(files) == 1105 and files[0] == ("00000.txt", f"{buckets[0]}/many/00000.txt", 1)


def test_missing_bucket_is_a_clear_error_without_credentials(make_config, s3_server, buckets):
    config = make_config(input_dir="s3://no-such-bucket-here/x", storage__s3_endpoint_url=s3_server)
    with pytest.raises(JobError) as e:
        run_job(config, job_id="nobucket")
    assert "s3://no-such-bucket-here/x" in str(e.value) and S3_SECRET not in str(e.value)


def test_throttling_is_retried_transparently(make_config, s3_proxy, s3_client, buckets, tmp_path):
    counts = upload_corpus(s3_client, tmp_path, buckets[0], "corpus", documents=10)
    s3_proxy.fail("/ledger/", times=2)  # two SlowDown answers, then the store recovers
    m = run_job(s3_config(make_config, s3_proxy.url, buckets, attempts=4), job_id="throttled").manifest.as_json()
    assert s3_proxy.failed == 2
    assert m["counts"]["records"] == counts["documents"] + counts["bad_records"] and m["status"] == "succeeded"


def test_store_outage_fails_only_that_partition_and_the_rerun_pays_nothing_twice(
    make_config, s3_proxy, s3_client, buckets, tmp_path
):
    counts = upload_corpus(s3_client, tmp_path, buckets[0], "corpus", documents=24)
    config = s3_config(make_config, s3_proxy.url, buckets, attempts=2)
    victim = partition_id("batch-a.jsonl", 0)
    s3_proxy.fail(f"/outputs/job_id=outage/partition={victim}/")  # this partition's commit fails, every time
    with pytest.raises(JobError) as e:
        run_job(config, job_id="outage")
    assert "1 of" in str(e.value) and victim in str(e.value)
    state = StateStore(config.state.url)
    parts = {p.partition: p for p in state.partitions("outage")}
    assert parts[victim].status == "failed"
    assert f"s3://{buckets[1]}/tokenmill/outputs/job_id=outage/partition={victim}/part-" in parts[victim].last_error
    assert S3_SECRET not in parts[victim].last_error
    assert all(p.status == "succeeded" for name, p in parts.items() if name != victim)
    with state.db_session() as s:
        items_before = s.execute(
            __import__("sqlalchemy").text("select count(*), sum(gpu_seconds) from items where job_id='outage'")
        ).one()

    s3_proxy.fail(None)  # the store is back
    m = run_job(config, job_id="outage").manifest.as_json()
    with state.db_session() as s:
        items_after = s.execute(
            __import__("sqlalchemy").text("select count(*), sum(gpu_seconds) from items where job_id='outage'")
        ).one()
    assert items_after == items_before  # nothing generated (or paid) again
    outputs = read_s3_kind(s3_client, buckets[1], "tokenmill", "outputs", "outage")
    ledger = read_s3_kind(s3_client, buckets[1], "tokenmill", "ledger", "outage")
    assert len(set(outputs["id"].to_pylist())) == outputs.num_rows == ledger.num_rows
    assert outputs.num_rows + m["counts"]["quarantined"] == counts["documents"] + counts["bad_records"]
    assert sum(ledger["busy_gpu_seconds"].to_pylist()) == pytest.approx(items_before[1])


def test_large_objects_go_up_as_multipart(s3_server, s3_client, buckets):
    from pipeline.config import StorageConfig
    from pipeline.stores import storage

    root = resolve(f"s3://{buckets[1]}/big", StorageConfig(s3_endpoint_url=s3_server))
    data = bytes(range(256)) * (20 * 1024 * 4)  # 20 MiB: boto3 uploads parts of 8 MiB above 8 MiB
    storage.write_bytes_atomic(root, root.join("blob.bin"), data)
    head = s3_client.head_object(Bucket=buckets[1], Key="big/blob.bin")
    assert head["ContentLength"] == len(data)
    assert "-" in head["ETag"]  # S3's multipart ETag: md5-of-parts-N
    assert storage.read_bytes(root, root.join("blob.bin")) == data


# -- standard AWS configuration (item 14): what boto3 and the AWS CLI honour, tokenmill honours ---------------
@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    """No endpoint, region or profile from the environment unless the test sets it."""
    for var in (
        "AWS_ENDPOINT_URL_S3",
        "AWS_ENDPOINT_URL",
        "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_REGION",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    return monkeypatch


@pytest.mark.parametrize("var", ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"])
def test_the_aws_endpoint_variables_are_honoured(aws_env, s3_server, s3_client, buckets, var):
    from pipeline.config import StorageConfig
    from pipeline.stores import storage

    aws_env.setenv(var, s3_server)
    root = resolve(f"s3://{buckets[0]}/env", StorageConfig())  # storage.s3_endpoint_url unset
    storage.write_bytes_atomic(root, root.join("a.txt"), b"hello")
    assert list_files(root) == [("a.txt", f"{buckets[0]}/env/a.txt", 5)]
    assert storage.read_bytes(root, root.join("a.txt")) == b"hello"
    assert s3_client.get_object(Bucket=buckets[0], Key="env/a.txt")["Body"].read() == b"hello"


def test_endpoint_precedence_is_the_sdks(aws_env, s3_server, buckets):
    from pipeline.config import StorageConfig
    from pipeline.stores.storage import aws_storage_config

    nowhere = "http://127.0.0.1:9"
    aws_env.setenv("AWS_ENDPOINT_URL", nowhere)
    aws_env.setenv("AWS_ENDPOINT_URL_S3", s3_server)
    assert aws_storage_config(StorageConfig()).s3_endpoint_url == s3_server  # the S3-specific variable first
    assert list_files(resolve(f"s3://{buckets[0]}", StorageConfig())) == []
    aws_env.setenv("AWS_ENDPOINT_URL_S3", nowhere)
    assert aws_storage_config(StorageConfig(s3_endpoint_url=s3_server)).s3_endpoint_url == s3_server  # config wins
    aws_env.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
    assert aws_storage_config(StorageConfig()).s3_endpoint_url is None


def test_region_comes_from_the_environment_then_the_profile(aws_env, tmp_path):
    from pipeline.config import StorageConfig
    from pipeline.stores.storage import aws_storage_config

    (tmp_path / "aws-config").write_text("[default]\nregion = ap-south-1\n[profile other]\nregion = eu-west-3\n")
    aws_env.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    aws_env.delenv("AWS_DEFAULT_REGION", raising=False)
    assert aws_storage_config(StorageConfig()).s3_region == "ap-south-1"
    aws_env.setenv("AWS_PROFILE", "other")
    assert aws_storage_config(StorageConfig()).s3_region == "eu-west-3"
    aws_env.setenv("AWS_DEFAULT_REGION", "us-west-2")
    assert aws_storage_config(StorageConfig()).s3_region == "us-west-2"
    aws_env.setenv("AWS_REGION", "ca-central-1")
    assert aws_storage_config(StorageConfig()).s3_region == "ca-central-1"
    assert aws_storage_config(StorageConfig(s3_region="sa-east-1")).s3_region == "sa-east-1"


def test_a_profile_gives_endpoint_region_and_credentials(aws_env, s3_proxy, buckets, tmp_path):
    import http.client

    from pipeline.config import StorageConfig

    (tmp_path / "aws-config").write_text(f"[profile tm]\nregion = eu-west-3\nendpoint_url = {s3_proxy.url}\n")
    (tmp_path / "aws-credentials").write_text("[tm]\naws_access_key_id = AKIDPROFILE\naws_secret_access_key = s\n")
    aws_env.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    aws_env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    aws_env.setenv("AWS_PROFILE", "tm")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        aws_env.delenv(var, raising=False)
    seen = []
    forward = http.client.HTTPConnection.request

    def record(self, method, url, body=None, headers=None, **kw):  # what the proxy forwards to the server
        seen.append(next((v for k, v in (headers or {}).items() if k.lower() == "authorization"), ""))
        return forward(self, method, url, body=body, headers=headers or {}, **kw)

    aws_env.setattr(http.client.HTTPConnection, "request", record)
    assert list_files(resolve(f"s3://{buckets[0]}", StorageConfig())) == []
    assert seen and all("Credential=AKIDPROFILE/" in a and "/eu-west-3/s3/" in a for a in seen), seen


def test_a_missing_profile_is_a_clear_error(aws_env):
    from pipeline.config import StorageConfig
    from pipeline.stores.storage import StorageError

    aws_env.setenv("AWS_PROFILE", "no-such-profile")
    with pytest.raises(StorageError, match="no-such-profile"):
        resolve("s3://bucket/x", StorageConfig())


def test_job_with_only_the_endpoint_variable(aws_env, make_config, s3_server, s3_client, buckets, tmp_path):
    """`tokenmill run --input s3://...` as a new user tries it: the endpoint in AWS_ENDPOINT_URL_S3 only."""
    counts = upload_corpus(s3_client, tmp_path, buckets[0], "corpus", documents=6)
    aws_env.setenv("AWS_ENDPOINT_URL_S3", s3_server)
    config = make_config(input_dir=f"s3://{buckets[0]}/corpus", output__uri=f"s3://{buckets[1]}/tokenmill")
    assert config.storage.s3_endpoint_url is None
    m = run_job(config, job_id="env-endpoint").manifest.as_json()
    assert m["status"] == "succeeded" and m["counts"]["records"] == counts["documents"] + counts["bad_records"]
    assert read_s3_kind(s3_client, buckets[1], "tokenmill", "outputs", "env-endpoint").num_rows > 0


@pytest.mark.parametrize("uri", ["s3://AKIAEXAMPLE:{}@bucket/x", "file://u:{}@host/x"])
def test_credentials_in_a_storage_uri_are_refused_without_showing_them(uri, tmp_path):
    from pipeline.cli import app
    from pipeline.stores.storage import StorageError
    from tests.unit.test_config import PASSWORD, assert_hidden

    uri = uri.format(PASSWORD)
    with pytest.raises(StorageError, match="credentials in a URI are not supported") as e:
        resolve(uri)
    assert_hidden(str(e.value))
    r = CliRunner(env={"TOKENMILL_HOME": str(tmp_path)}).invoke(app, ["ledger", "summary", "--output", uri])
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert_hidden(r.output)


def test_tables_migrate_and_maintain_on_an_s3_root(aws_env, s3_server, s3_client, buckets, tmp_path, monkeypatch):
    """`tokenmill tables migrate` converts an s3:// root the layout before Delta tables wrote, once; `tokenmill
    tables maintain` compacts and vacuums its tables in the bucket: a forced rerun's replaced files are deleted
    and every partition still reads whole, once."""
    bucket, uri = buckets[1], f"s3://{buckets[1]}/tokenmill"
    for path in sorted(FIXTURE.rglob("*")):
        if path.is_file():
            s3_client.put_object(Bucket=bucket, Key=f"tokenmill/{path.relative_to(FIXTURE)}", Body=path.read_bytes())
    settings = {
        **ONE_TIER,
        "TOKENMILL_OUTPUT__URI": uri,
        "TOKENMILL_OUTPUT__VACUUM_RETENTION_HOURS": "0",
        "TOKENMILL_STATE__URL": f"sqlite:///{tmp_path}/state.db",
        "TOKENMILL_STORAGE__S3_ENDPOINT_URL": s3_server,
        "TOKENMILL_STORAGE__S3_REGION": "us-east-1",
    }
    for key, value in settings.items():
        monkeypatch.setenv(key, value)
    config = StorageConfig(s3_endpoint_url=s3_server, s3_region="us-east-1")
    root = storage.resolve(uri, config)
    tokenmill = CliRunner()

    migrated = tokenmill.invoke(app, ["tables", "migrate", "--output", uri, "--config", str(TINY_CONFIG)])
    assert migrated.exit_code == 0, migrated.output
    assert "converted 4 partitions" in migrated.output
    assert counts(uri, config) == WANT and not old_layout(root)
    again = tokenmill.invoke(app, ["tables", "migrate", "--output", uri, "--config", str(TINY_CONFIG)])
    assert again.exit_code == 0 and "converted 0 partitions" in again.output

    # A forced rerun of nightly-a/p1 (its rows again, a newer epoch) replaces its file in every table.
    rerun = ds.field("job_id") == "nightly-a"
    rows = {kind: read(root, kind, filter=rerun & (ds.field("partition") == "p1")) for kind in KINDS}
    epoch = open_table(root, "ledger").transaction_version("nightly-a/p1") + 1
    files = {kind: set(open_table(root, kind).file_uris()) for kind in KINDS}
    assert commit_rows(root, "nightly-a", "p1", rows, epoch=epoch)
    replaced = {kind: files[kind] - set(open_table(root, kind).file_uris()) for kind in KINDS}
    assert len(replaced["ledger"]) == 1

    def objects() -> set[str]:
        pages = s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="tokenmill/")
        return {f"s3://{bucket}/{o['Key']}" for page in pages for o in page.get("Contents", [])}

    assert replaced["ledger"] <= objects()  # time travel still reads them
    maintained = tokenmill.invoke(app, ["tables", "maintain", "--config", str(TINY_CONFIG)])
    assert maintained.exit_code == 0, maintained.output
    assert "ledger: compacted" in maintained.output
    assert not any(replaced[kind] & objects() for kind in KINDS)  # vacuumed from the bucket
    assert counts(uri, config) == WANT
