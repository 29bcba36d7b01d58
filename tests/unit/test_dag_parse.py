"""The nightly DAG parses without the config's secrets: only its `run:` section is read at parse time.

Parsed in a subprocess with its own AIRFLOW_HOME, so this test's Airflow settings never reach the
Airflow tests of the same session (Airflow reads its configuration once per process). A DagBag's
DAGs need no metadata database.
"""

import json
import os
import subprocess
import sys

import pytest

from pipeline.config import ConfigError, load_config
from tests.conftest import REPO

DAG_ID = "nightly_summarization"
CONFIG = """\
tiers: {small: {model: /models/not-here, price_per_gpu_hour: 1}}
route: {default_tier: small}
cache: {store: redis, redis_url: 'redis://:${TOKENMILL_REDIS_PASSWORD}@cache:6379/0'}
state: {url: '${TOKENMILL_PG_DSN}'}
run: {schedule: '15 3 * * *', retries: 4, retry_delay_seconds: 30}
"""
PARSE = f"""
import json
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder={str(REPO / "dags")!r})
dag = bag.dags.get({DAG_ID!r})
rollup = bag.dags.get("ledger_rollup")
print(json.dumps({{"errors": {{k: str(v) for k, v in bag.import_errors.items()}},
                  "schedule": dag.schedule if dag else None,
                  "retries": dag.default_args["retries"] if dag else None,
                  "retry_delay": dag.default_args["retry_delay"].total_seconds() if dag else None,
                  "config_param": dag.params["config"] if dag else None,
                  "assets": {{a.name: a.uri for a in dag.get_task("summary").outlets}} if dag else None,
                  "rollup_on": [a.uri for a in rollup.timetable.asset_condition.objects]
                               if rollup else None}}))
"""


def parse_dag(tmp_path, config_text: str = CONFIG) -> dict:
    config = tmp_path / "prod.yaml"
    config.write_text(config_text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENMILL_", "AIRFLOW_", "AIRFLOW__"))}
    env.update(
        {
            "AIRFLOW_HOME": str(tmp_path / "airflow-home"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "TOKENMILL_CONFIG": str(config),
            "TOKENMILL_HOME": str(tmp_path / "home"),
        }
    )
    r = subprocess.run([sys.executable, "-c", PARSE], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_config_needs_secrets_to_load(tmp_path):
    config = tmp_path / "prod.yaml"
    config.write_text(CONFIG)
    with pytest.raises(ConfigError, match="TOKENMILL_REDIS_PASSWORD|TOKENMILL_PG_DSN"):
        load_config(config, environ={"TOKENMILL_HOME": str(tmp_path)})


def test_dag_parses_without_secrets_and_takes_its_shape_from_the_config(tmp_path):
    parsed = parse_dag(tmp_path)
    assert parsed["errors"] == {}
    assert parsed["schedule"] == "15 3 * * *"
    assert (parsed["retries"], parsed["retry_delay"]) == (4, 30.0)
    assert parsed["config_param"] == str(tmp_path / "prod.yaml")


def test_assets_name_the_tables_under_a_dated_output_root(tmp_path):
    """An output root with `{date}` (each run's own folder) once broke parsing: the DAG parses, its Assets name
    the tables' physical URIs under the root as written, and the downstream DAG is scheduled on the same one."""
    parsed = parse_dag(tmp_path, CONFIG + "output: {uri: 's3://summaries/nightly/{date}/'}\n")
    assert parsed["errors"] == {}
    assert parsed["assets"] == {
        f"{DAG_ID}.{t}": f"s3://summaries/nightly/{{date}}/{t}" for t in ("outputs", "ledger", "quarantine")
    }
    assert parsed["rollup_on"] == ["s3://summaries/nightly/{date}/ledger"]
