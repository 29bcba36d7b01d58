import re
import subprocess
import sys
from urllib.parse import quote

import pytest
import yaml

from pipeline.config import ConfigError, TokenmillConfig, load_config, load_run_section
from pipeline.keys import config_fingerprint
from tests.conftest import REPO, TINY_CONFIG


def test_local_config_loads_and_expands_home(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "elsewhere"))
    cfg = load_config(TINY_CONFIG, environ={"TOKENMILL_HOME": str(tmp_path / "elsewhere")})
    assert cfg.tiers["small"].model == str(tmp_path / "elsewhere" / "models" / "tiny-small")
    assert cfg.state.url == f"sqlite:///{tmp_path / 'elsewhere' / 'state.db'}"


def test_production_example_is_valid(monkeypatch):
    monkeypatch.setenv("TOKENMILL_HOME", "/tmp/x")
    cfg = load_config(
        REPO / "configs" / "production.example.yaml",
        environ={"TOKENMILL_PG_DSN": "postgresql://db/t", "TOKENMILL_REDIS_PASSWORD": "pw"},
    )
    assert set(cfg.tiers) >= {"small"}
    assert cfg.tiers["small"].vllm.engine_kwargs()["max_num_seqs"] >= 256


def test_unknown_field_is_an_error_naming_it(tmp_path):
    bad = yaml.safe_load(TINY_CONFIG.read_text())
    bad["sampling"]["max_tokenz"] = 5
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match=r"sampling\.max_tokenz"):
        load_config(path, environ={})


def test_env_overrides_nested_fields_typed_by_the_field(tmp_path):
    environ = {
        "TOKENMILL_HOME": str(tmp_path),
        "TOKENMILL_TIERS__SMALL__VLLM__MAX_NUM_SEQS": "512",  # an int field
        "TOKENMILL_DEDUP__EXACT": "false",  # a bool field
        "TOKENMILL_TENANTS__ACME__ADAPTER_TIER": "small",  # a new key of a mapping of sections
        "TOKENMILL_INPUT__DEFAULT_TENANT": "007",  # a string field stays a string (JSON would make it 7)
        "TOKENMILL_RUN__TIER_WORKERS": '{"small": 2}',  # a mapping field: JSON
    }
    cfg = load_config(TINY_CONFIG, environ=environ)
    assert cfg.tiers["small"].vllm.max_num_seqs == 512 and cfg.dedup.exact is False
    assert cfg.tenants["acme"].adapter_tier == "small" and cfg.input.default_tenant == "007"
    assert cfg.run.tier_workers == {"small": 2}
    with pytest.raises(ConfigError, match=r"sampling\.max_tokenz"):
        load_config(TINY_CONFIG, environ={"TOKENMILL_HOME": str(tmp_path), "TOKENMILL_SAMPLING__MAX_TOKENZ": "3"})


@pytest.mark.parametrize(
    "name, value, error",
    [
        ("TOKENMILL_SAMPLNG__MAX_TOKENS", "64", r"TOKENMILL_SAMPLNG__MAX_TOKENS names no config section"),
        ("TOKENMILL_RUN__TIER_WORKERS", "{bad", r"environment override: .*run"),
    ],
)
def test_a_bad_environment_override_is_a_named_config_error(tmp_path, name, value, error):
    """Reproducer: a misspelt section was ignored (the job ran on the YAML's value) and bad JSON in a
    mapping override escaped as pydantic-settings' own exception, a traceback in the CLI."""
    with pytest.raises(ConfigError, match=error):
        load_config(TINY_CONFIG, environ={"TOKENMILL_HOME": str(tmp_path), name: value})


def test_a_variable_without_a_field_path_is_no_override(tmp_path):
    """TOKENMILL_CACHE=... (no `__`) is not the whole `cache` section; TOKENMILL_HOME and the like are not overrides."""
    cfg = load_config(TINY_CONFIG, environ={"TOKENMILL_HOME": str(tmp_path), "TOKENMILL_CACHE": "/tmp/x"})
    assert cfg.cache == load_config(TINY_CONFIG, environ={"TOKENMILL_HOME": str(tmp_path)}).cache


def test_env_override_applies_through_load(tmp_path):
    cfg = load_config(TINY_CONFIG, environ={"TOKENMILL_HOME": str(tmp_path), "TOKENMILL_SAMPLING__MAX_TOKENS": "7"})
    assert cfg.sampling.max_tokens == 7


def test_default_tier_must_exist():
    with pytest.raises(ValueError, match="default_tier"):
        TokenmillConfig.model_validate(
            {"tiers": {"a": {"model": "m", "price_per_gpu_hour": 1}}, "route": {"default_tier": "b"}}
        )


def test_prompt_needs_text_placeholder():
    with pytest.raises(ValueError, match=r"\{text\}"):
        TokenmillConfig.model_validate(
            {
                "tiers": {"a": {"model": "m", "price_per_gpu_hour": 1}},
                "route": {"default_tier": "a"},
                "prompt": {"user": "no placeholder"},
            }
        )


def test_missing_env_var_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("tiers: {a: {model: '${NOPE_NOT_SET}', price_per_gpu_hour: 1}}\nroute: {default_tier: a}\n")
    with pytest.raises(ConfigError, match="NOPE_NOT_SET"):
        load_config(path, environ={})


def test_fingerprint_ignores_locations_but_not_prompt(tmp_path):
    a = load_config(TINY_CONFIG, environ={"TOKENMILL_HOME": str(tmp_path)})
    b = load_config(TINY_CONFIG, environ={"TOKENMILL_HOME": str(tmp_path), "TOKENMILL_OUTPUT__URI": "/elsewhere"})
    c = load_config(TINY_CONFIG, environ={"TOKENMILL_HOME": str(tmp_path), "TOKENMILL_PROMPT__SYSTEM": "Be terse."})
    assert config_fingerprint(a) == config_fingerprint(b) != config_fingerprint(c)


def test_config_show_prints_effective_config(tmp_path):
    env = {"TOKENMILL_HOME": str(tmp_path), "TOKENMILL_SAMPLING__MAX_TOKENS": "9", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "config", "show", "--config", str(TINY_CONFIG)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        check=True,
    ).stdout
    shown = yaml.safe_load(out)
    assert shown["sampling"]["max_tokens"] == 9
    assert shown["tiers"]["small"]["model"] == f"{tmp_path}/models/tiny-small"


def test_config_show_bad_file_is_one_line_error(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "config", "show", "--config", str(tmp_path / "none.yaml")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: config file not found") and "Traceback" not in r.stderr


def test_config_reference_doc_is_current():
    from pipeline.cli.reference import reference_markdown

    assert (REPO / "docs" / "config.md").read_text() == reference_markdown(), (
        "run: tokenmill config docs > docs/config.md"
    )


MINIMAL = "tiers: {a: {model: m, price_per_gpu_hour: 1}}\nroute: {default_tier: a}\n"


def _strings(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)
    elif isinstance(node, str):
        yield node


def test_defaults_expand_tokenmill_home(tmp_path):
    path = tmp_path / "minimal.yaml"
    path.write_text(MINIMAL)
    home = tmp_path / "home"
    cfg = load_config(path, environ={"TOKENMILL_HOME": str(home)})
    assert not [s for s in _strings(cfg.model_dump(mode="json")) if "${" in s]
    assert cfg.cache.path == str(home / "cache")
    assert cfg.state.url == f"sqlite:///{home / 'state.db'}"
    assert cfg.dedup.embedder == str(home / "models" / "static-minilm")


def test_defaults_expand_next_to_explicit_fields_of_the_same_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(MINIMAL + "cache: {ttl_days: 3}\nstate: {lease_seconds: 9}\n")
    cfg = load_config(path, environ={"TOKENMILL_HOME": str(tmp_path), "TOKENMILL_DEDUP__NEAR": "false"})
    assert (cfg.cache.ttl_days, cfg.cache.path) == (3, str(tmp_path / "cache"))
    assert cfg.state.url == f"sqlite:///{tmp_path / 'state.db'}" and cfg.dedup.embedder.startswith(str(tmp_path))


def test_explicit_values_are_expanded_once(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(MINIMAL + "state: {url: '${DSN}'}\n")
    cfg = load_config(path, environ={"TOKENMILL_HOME": str(tmp_path), "DSN": "postgresql://u:p${x}@db/t"})
    assert cfg.state.url == "postgresql://u:p${x}@db/t"  # a secret's own `${` is not expanded again


def test_requests_overrides_apply_and_a_plan_section_is_unknown(tmp_path):
    """The section is `requests:`; `plan:` (in YAML or the environment) names nothing."""
    path = tmp_path / "c.yaml"
    path.write_text(MINIMAL + "plan: {prefix_ordering: false}\n")
    with pytest.raises(ConfigError, match=r"plan: Extra inputs are not permitted"):
        load_config(path, environ={"TOKENMILL_HOME": str(tmp_path)})
    path.write_text(MINIMAL + "requests: {prefix_ordering: false}\n")
    with pytest.raises(ConfigError, match="TOKENMILL_PLAN__PREFIX_ORDERING names no config section"):
        load_config(path, environ={"TOKENMILL_HOME": str(tmp_path), "TOKENMILL_PLAN__PREFIX_ORDERING": "false"})
    cfg = load_config(path, environ={"TOKENMILL_HOME": str(tmp_path), "TOKENMILL_REQUESTS__LONG_PROMPT_TOKENS": "3"})
    assert cfg.requests.long_prompt_tokens == 3 and cfg.requests.prefix_ordering is False


def test_removed_engine_call_fields_are_refused_by_name(tmp_path):
    """`tokenmill eval`'s own engine calls are gone (one generation path): their fields fail, named."""
    path = tmp_path / "c.yaml"
    path.write_text(MINIMAL + "requests: {items_per_engine_call: 7}\n")
    with pytest.raises(ConfigError, match=r"requests.items_per_engine_call was removed"):
        load_config(path, environ={"TOKENMILL_HOME": str(tmp_path)})


def test_load_run_section_reads_run_alone_with_env_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "state: {url: '${TOKENMILL_PG_DSN}'}\ntiers: {a: {model: '${NOT_SET}'}}\n"
        "run: {schedule: '30 4 * * *', retries: 5}\n"
    )
    run = load_run_section(path, environ={"TOKENMILL_RUN__RETRY_DELAY_SECONDS": "7", "TOKENMILL_STATE__URL": "x"})
    assert (run.schedule, run.retries, run.retry_delay_seconds) == ("30 4 * * *", 5, 7.0)
    assert load_run_section(path, environ={"TOKENMILL_RUN__RETRIES": "0"}).retries == 0
    with pytest.raises(ConfigError, match=r"run\.retries"):
        load_run_section(path, environ={"TOKENMILL_RUN__RETRIES": "-1"})


def test_load_run_section_without_run_gives_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(MINIMAL)
    assert load_run_section(path, environ={}) == load_config(path, environ={"TOKENMILL_HOME": str(tmp_path)}).run


# -- secrets never show ------------------------------------------------------------------------------
PASSWORD = "Xq7/Zk9#Wm3?Pp5@Rr1:Ss2%Tt4"  # every character that breaks a URL parser, each between distinct pieces
PIECES = ("Xq7", "Zk9", "Wm3", "Pp5", "Rr1", "Ss2", "Tt4")


def assert_hidden(text: str) -> None:
    shown = [p for p in PIECES if p in text]
    assert not shown, f"password pieces {shown} shown in: {text}"


SECRET_URLS = {
    f"postgresql+psycopg://tokenmill:{PASSWORD}@db.internal:5432/tokenmill": "postgresql+psycopg://tokenmill:***@db.internal:5432/tokenmill",
    f"redis://:{PASSWORD}@cache.internal:6379/0": "redis://***@cache.internal:6379/0",
    f"rediss://default:{PASSWORD}@cache.internal:6380/1": "rediss://default:***@cache.internal:6380/1",
    f"s3://AKIAEXAMPLE:{PASSWORD}@bucket/prefix": "s3://AKIAEXAMPLE:***@bucket/prefix",
    f"http://minio:{PASSWORD}@127.0.0.1:9000": "http://minio:***@127.0.0.1:9000",
    "postgresql://db/t?user=u&password=Xq7Zk9&sslmode=require": "postgresql://db/t?user=u&password=***&sslmode=require",
    "redis://cache:6379/0": "redis://cache:6379/0",
    "postgresql+psycopg://tokenmill@db/t": "postgresql+psycopg://tokenmill@db/t",
    "s3://bucket/a@b/c": "s3://bucket/a@b/c",
    "/data/in@2026": "/data/in@2026",
}


@pytest.mark.parametrize("url", SECRET_URLS)
def test_redact_url_hides_every_password(url):
    from pipeline.config.env import redact_url

    assert redact_url(url) == SECRET_URLS[url]
    assert_hidden(redact_url(url))
    assert_hidden(redact_url(url.replace(PASSWORD, quote(PASSWORD, safe=""))))  # percent-encoded, as RFC 3986 wants


def test_config_show_hides_passwords(tmp_path):
    env = {
        "TOKENMILL_HOME": str(tmp_path),
        "PATH": "/usr/bin:/bin",
        "TOKENMILL_PG_DSN": f"postgresql+psycopg://tokenmill:{PASSWORD}@db:5432/tokenmill",
        "TOKENMILL_REDIS_PASSWORD": PASSWORD,
    }
    for fmt in ("yaml", "json"):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pipeline.cli",
                "config",
                "show",
                "--format",
                fmt,
                "--config",
                str(REPO / "configs" / "production.example.yaml"),
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
        )
        assert r.returncode == 0, r.stderr
        assert_hidden(r.stdout + r.stderr)
        shown = yaml.safe_load(r.stdout)
        assert shown["state"]["url"] == "postgresql+psycopg://tokenmill:***@db:5432/tokenmill"
        assert shown["cache"]["redis_url"] == "redis://***@cache.internal:6379/0"


@pytest.mark.parametrize(
    "field", ["TOKENMILL_INPUT__URI", "TOKENMILL_OUTPUT__URI", "TOKENMILL_STORAGE__S3_ENDPOINT_URL"]
)
def test_storage_uris_with_credentials_are_refused_without_showing_them(tmp_path, field):
    uri = (
        f"s3://AKIAEXAMPLE:{PASSWORD}@bucket/x"
        if "URI" in field.rsplit("__")[-1]
        else f"http://u:{PASSWORD}@minio:9000"
    )
    with pytest.raises(ConfigError, match="credentials in a URI are not supported") as e:
        load_config(TINY_CONFIG, environ={"TOKENMILL_HOME": str(tmp_path), field: uri})
    assert_hidden(str(e.value))


def test_run_with_credentials_in_the_input_uri_is_one_line_without_them(tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli import app

    r = CliRunner(env={"TOKENMILL_HOME": str(tmp_path)}).invoke(
        app, ["run", "--config", str(TINY_CONFIG), "--input", f"s3://AKIAEXAMPLE:{PASSWORD}@bucket/in"]
    )
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert "s3://AKIAEXAMPLE:***@bucket/in" in r.stderr
    assert_hidden(r.output)


@pytest.mark.parametrize("password", [PASSWORD, "Xq7@Zk9:Wm3%Pp5", "Xq7/Zk9", "Xq7#Zk9?Wm3"])
def test_state_database_errors_hide_the_password(password, tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli import app
    from pipeline.stores.catalog import StateError, StateStore
    from tests.conftest import free_port

    url = f"postgresql+psycopg://tokenmill:{password}@127.0.0.1:{free_port()}/tokenmill"
    with pytest.raises(StateError) as e:
        StateStore(url)
    assert_hidden(str(e.value) + StateStore.safe_url(url))
    assert "127.0.0.1" in str(e.value) or "cannot be parsed" in str(e.value)
    r = CliRunner(env={"TOKENMILL_HOME": str(tmp_path), "TOKENMILL_STATE__URL": url}).invoke(
        app, ["jobs", "list", "--config", str(TINY_CONFIG)]
    )
    assert r.exit_code == 2 and r.stderr.startswith("error: state database")
    assert_hidden(r.output)


def test_yaml_aliases_are_refused_before_anything_expands(tmp_path):
    """Reproducer (red team): a 400-byte alias bomb kept every command busy for over a minute (`${VAR}`
    expansion walked the expanded tree), and one under `run:` would hang the DAG's parse."""
    from pipeline.config import load_run_section, load_tier_workers

    small = tmp_path / "alias.yaml"
    small.write_text(MINIMAL + "requests: &r {long_prompt_tokens: 7}\nbudget: *r\n")
    with pytest.raises(ConfigError, match="YAML aliases"):
        load_config(small, environ={"TOKENMILL_HOME": str(tmp_path)})
    bomb = tmp_path / "bomb.yaml"
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    bomb.write_text("run:\n  tier_workers: {small: 1}\n  bomb:\n" + "".join(f"    {line}\n" for line in levels))
    for load in (load_config, load_run_section, load_tier_workers):
        with pytest.raises(ConfigError, match="YAML aliases"):
            load(bomb, environ={"TOKENMILL_HOME": str(tmp_path)})


@pytest.mark.parametrize(
    "section, value, field",
    [
        ("dedup", {"boilerplate_patterns": ["^(From|To:.*$"]}, "dedup.boilerplate_patterns"),
        ("state", {"lease_seconds": ".inf"}, "state.lease_seconds"),
        ("state", {"lease_seconds": 1e300}, "state.lease_seconds"),
        ("budget", {"max_tenant_usd": {"acme": -1.0}}, "budget.max_tenant_usd.acme"),
        ("budget", {"max_job_usd": ".nan"}, "budget.max_job_usd"),
        ("sampling", {"temperature": ".inf"}, "sampling.temperature"),
    ],
)
def test_values_that_would_fail_late_are_refused_at_load_naming_the_field(tmp_path, section, value, field):
    """Reproducers (red team): a bad boilerplate regex gave a traceback in `estimate`, an infinite lease an
    OverflowError after generation; a negative tenant cap and an infinite temperature were accepted."""
    path = tmp_path / "c.yaml"
    path.write_text(MINIMAL + yaml.safe_dump({section: value}).replace("'.inf'", ".inf").replace("'.nan'", ".nan"))
    with pytest.raises(ConfigError, match=re.escape(field)):
        load_config(path, environ={"TOKENMILL_HOME": str(tmp_path)})


def test_a_nested_override_of_null_unsets_the_field(tmp_path):
    """`TOKENMILL_A__B__C=null` sets a nested field to None (vLLM then picks it), as it does a top-level one."""
    environ = {"TOKENMILL_HOME": str(tmp_path), "TOKENMILL_TIERS__SMALL__VLLM__MAX_NUM_SEQS": "null"}
    assert load_config(TINY_CONFIG, environ={"TOKENMILL_HOME": str(tmp_path)}).tiers["small"].vllm.max_num_seqs
    assert load_config(TINY_CONFIG, environ=environ).tiers["small"].vllm.max_num_seqs is None
