"""Every component's effective command line, run through the image's entrypoint and accepted by the CLI.

For each Airflow component of the compose file and of the cluster (the official chart's components with
infra/cluster/values.yaml's overrides, and the GPU worker Deployments), the command line the container
starts is the image's ENTRYPOINT (parsed from infra/docker/Dockerfile) with the component's command or
args, as Docker and Kubernetes join them. The entrypoint script itself runs, with real bash and sh, on
stub `airflow` and `python` executables that record what they were called with; Airflow's own argument
parser, built once in one process with the components' executor, then parses each recorded `airflow`
command line (a wrong subcommand or option fails as `airflow <sub> --help` would), and each `python -m
celery --app` names an app that imports.

The chart's defaults are not in this repository: CHART is what the official chart (helm-chart 1.18 and
later, for Airflow 3: apache/airflow chart/values.yaml and its templates' probes) runs where values.yaml
does not override it. Its values schema is not checked here (it is not on this machine, see infra/README.md).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

INFRA = REPO / "infra"
ENTRYPOINT_SCRIPT = INFRA / "docker" / "entrypoint.sh"
# The probes' `sh -c "... exec /entrypoint ..."`: the chart's templates call the image's entrypoint by path.
_PROBE = "CONNECTION_CHECK_MAX_COUNT=0 AIRFLOW__LOGGING__LOGGING_LEVEL=ERROR exec /entrypoint \\\n"
CHART = {
    "scheduler": ["bash", "-c", "exec airflow scheduler"],
    "apiServer": ["bash", "-c", "exec airflow api-server"],
    "dagProcessor": ["bash", "-c", "exec airflow dag-processor"],
    "triggerer": ["bash", "-c", "exec airflow triggerer"],
    "workers": ["bash", "-c", "exec \\\nairflow celery worker"],
    "migrateDatabaseJob": ["bash", "-c", "exec \\\nairflow db migrate"],
    # every component's init container
    "waitForMigrations": ["airflow", "db", "check-migrations", "--migration-wait-timeout=60"],
    # liveness probes
    "scheduler.livenessProbe": ["sh", "-c", _PROBE + "airflow jobs check --job-type SchedulerJob --local"],
    "triggerer.livenessProbe": ["sh", "-c", _PROBE + "airflow jobs check --job-type TriggererJob --local"],
    "dagProcessor.livenessProbe": ["sh", "-c", _PROBE + "airflow jobs check --job-type DagProcessorJob --local"],
    "workers.livenessProbe": [
        "sh",
        "-c",
        "CONNECTION_CHECK_MAX_COUNT=0 exec /entrypoint python -m celery --app "
        "airflow.providers.celery.executors.celery_executor.app inspect ping -d celery@$(hostname)",
    ],
}
# Airflow's CLI as the components configure it: the Celery commands exist under the CeleryExecutor only.
CLI_ENV = {
    "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
    "AIRFLOW__CORE__AUTH_MANAGER": "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
}
_PARSE = r"""
import importlib, io, json, sys, contextlib
from airflow.cli import cli_parser
parser, out = cli_parser.get_parser(), []
for argv in json.load(sys.stdin):
    if argv[0] == "python":
        module, _, attr = argv[argv.index("--app") + 1].rpartition(".")
        ok = argv[1:3] == ["-m", "celery"] and hasattr(importlib.import_module(module), attr)
        out.append({"ok": ok, "error": "" if ok else "not a celery app"})
        continue
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = parser.parse_args(argv[1:])
        out.append({"ok": True, "queues": getattr(args, "queues", None)})
    except SystemExit:
        out.append({"ok": False, "error": err.getvalue()[-600:]})
print(json.dumps(out))
"""


def image_entrypoint() -> list[str]:
    for line in (INFRA / "docker" / "Dockerfile").read_text().splitlines():
        if line.startswith("ENTRYPOINT "):
            return json.loads(line.removeprefix("ENTRYPOINT "))
    raise AssertionError("the Dockerfile has no ENTRYPOINT")


def compose_command_lines() -> dict[str, list[str]]:
    """Each service of the image: its entrypoint (the image's unless it names one) + its command."""
    services = yaml.safe_load((INFRA / "single-host" / "docker-compose.yaml").read_text())["services"]
    return {
        f"compose:{name}": (svc.get("entrypoint") or image_entrypoint()) + svc.get("command", [])
        for name, svc in services.items()
        if svc.get("image", "").startswith("tokenmill-")
    }


def cluster_command_lines() -> dict[str, list[str]]:
    """The chart's components (values.yaml's args over the chart's) and the GPU worker Deployments'
    containers, each behind the image's entrypoint (none sets a command, which would replace it)."""
    values = yaml.safe_load((INFRA / "cluster" / "values.yaml").read_text())
    lines = {}
    for component, args in CHART.items():
        name, _, probe = component.partition(".")
        overridden = (values.get(name) or {}).get("args") if not probe else None
        assert not (values.get(name) or {}).get("command"), f"values.yaml: {name}.command replaces the entrypoint"
        lines[f"cluster:{component}"] = image_entrypoint() + (overridden or args)
    for path in sorted((INFRA / "cluster").glob("gpu-worker-*.yaml")):
        (container,) = yaml.safe_load(path.read_text())["spec"]["template"]["spec"]["containers"]
        lines[f"cluster:{path.stem}"] = (container.get("command") or image_entrypoint()) + container["args"]
    return lines


def run_entrypoint(command_line: list[str], stubs: Path, record: Path) -> list[str]:
    """What the container would exec in the end: the entrypoint script run for real (tini only execs its
    arguments), on stubs that record their argv."""
    assert command_line[:2] == ["tini", "--"], command_line
    argv = [a.replace("/entrypoint", str(ENTRYPOINT_SCRIPT)) for a in command_line[2:]]
    assert argv[0] == str(ENTRYPOINT_SCRIPT), (
        f"{command_line}: the image's entrypoint is /entrypoint (the chart's probes)"
    )
    record.unlink(missing_ok=True)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "RECORD": str(record)}
    done = subprocess.run(["sh", *argv], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and record.exists(), f"{command_line}: {done.stderr}"
    return record.read_text().split("\0")[:-1]


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> dict[str, tuple[list[str], dict]]:
    """component -> (what its container execs, the CLI's verdict on it)."""
    stubs = tmp_path_factory.mktemp("stubs")
    for name in ("airflow", "python"):
        (stubs / name).write_text(f'#!/bin/sh\nprintf "%s\\0" {name} "$@" > "$RECORD"\n')
        (stubs / name).chmod(0o755)
    lines = {**compose_command_lines(), **cluster_command_lines()}
    execs = {c: run_entrypoint(line, stubs, stubs / "argv") for c, line in lines.items()}
    env = {**os.environ, **CLI_ENV, "AIRFLOW_HOME": str(tmp_path_factory.mktemp("airflow-home"))}
    done = subprocess.run(
        [sys.executable, "-c", _PARSE], input=json.dumps(list(execs.values())), env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    verdicts = json.loads(done.stdout.splitlines()[-1])
    return {c: (argv, v) for (c, argv), v in zip(execs.items(), verdicts)}


def test_every_component_command_line_is_accepted_by_the_cli(executed):
    rejected = {c: (shlex.join(argv), v["error"]) for c, (argv, v) in executed.items() if not v["ok"]}
    assert not rejected, rejected
    assert {c for c in executed if c.startswith("compose:")} >= {
        "compose:airflow-init",
        "compose:airflow-apiserver",
        "compose:airflow-scheduler",
        "compose:airflow-worker-gpu-small",
    }


def test_each_worker_listens_to_its_queues(executed):
    queues = {c: v["queues"] for c, (argv, v) in executed.items() if argv[1:3] == ["celery", "worker"]}
    assert queues == {
        "compose:airflow-worker-cpu": "default",
        "compose:airflow-worker-gpu-small": "gpu-small",
        "compose:airflow-worker-gpu-large": "gpu-large",
        "cluster:workers": "default",
        "cluster:gpu-worker-small": "gpu-small",
        "cluster:gpu-worker-large": "gpu-large",
    }


def test_the_entrypoint_keeps_the_official_images_convention(executed):
    # `airflow <sub>` and `<sub>` both run airflow; bash runs its -c string, which execs airflow
    assert executed["compose:airflow-scheduler"][0] == ["airflow", "scheduler"]
    assert executed["cluster:scheduler"][0] == ["airflow", "scheduler"]
    assert executed["cluster:waitForMigrations"][0][:3] == ["airflow", "db", "check-migrations"]
    assert executed["cluster:workers.livenessProbe"][0][:3] == ["python", "-m", "celery"]


def test_the_chart_runs_nothing_the_image_lacks():
    # the official image's /clean-logs (log groomer sidecars) and FAB's `airflow users create` (create-user job)
    values = yaml.safe_load((INFRA / "cluster" / "values.yaml").read_text())
    for component in ("scheduler", "triggerer", "dagProcessor", "workers"):
        assert values[component]["logGroomerSidecar"] == {"enabled": False}, component
    assert values["webserver"]["defaultUser"] == {"enabled": False}
    assert values["config"]["core"]["auth_manager"] == CLI_ENV["AIRFLOW__CORE__AUTH_MANAGER"]
