import subprocess
import sys

import pytest
import yaml

from pipeline.config import ConfigError, TokenmillConfig, apply_env_overrides, load_config
from tests.conftest import LOCAL_CONFIG, REPO


def test_local_config_loads_and_expands_home(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "elsewhere"))
    cfg = load_config(LOCAL_CONFIG, environ={"TOKENMILL_HOME": str(tmp_path / "elsewhere")})
    assert cfg.tiers["small"].model == str(tmp_path / "elsewhere" / "models" / "tiny-small")
    assert cfg.state.url == f"sqlite:///{tmp_path / 'elsewhere' / 'state.db'}"


def test_production_example_is_valid(monkeypatch):
    monkeypatch.setenv("TOKENMILL_HOME", "/tmp/x")
    cfg = load_config(REPO / "configs" / "production.example.yaml", environ={"TOKENMILL_PG_DSN": "postgresql://db/t", "TOKENMILL_REDIS_PASSWORD": "pw"})
    assert set(cfg.tiers) >= {"small"}
    assert cfg.tiers["small"].vllm.engine_kwargs()["max_num_seqs"] >= 256


def test_unknown_field_is_an_error_naming_it(tmp_path):
    bad = yaml.safe_load(LOCAL_CONFIG.read_text())
    bad["sampling"]["max_tokenz"] = 5
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match=r"sampling\.max_tokenz"):
        load_config(path, environ={})


def test_env_overrides_nested_fields_with_yaml_types():
    raw = apply_env_overrides({"tiers": {"small": {"vllm": {}}}}, {
        "TOKENMILL_TIERS__SMALL__VLLM__MAX_NUM_SEQS": "512",
        "TOKENMILL_DEDUP__EXACT": "false",
        "TOKENMILL_HOME": "/ignored",
        "OTHER__X": "1",
    })
    assert raw == {"tiers": {"small": {"vllm": {"max_num_seqs": 512}}}, "dedup": {"exact": False}}


def test_env_override_applies_through_load(tmp_path):
    cfg = load_config(LOCAL_CONFIG, environ={"TOKENMILL_HOME": str(tmp_path), "TOKENMILL_SAMPLING__MAX_TOKENS": "7"})
    assert cfg.sampling.max_tokens == 7


def test_default_tier_must_exist():
    with pytest.raises(ValueError, match="default_tier"):
        TokenmillConfig.model_validate({"tiers": {"a": {"model": "m", "price_per_gpu_hour": 1}},
                                        "route": {"default_tier": "b"}})


def test_prompt_needs_text_placeholder():
    with pytest.raises(ValueError, match=r"\{text\}"):
        TokenmillConfig.model_validate({"tiers": {"a": {"model": "m", "price_per_gpu_hour": 1}},
                                        "route": {"default_tier": "a"}, "prompt": {"user": "no placeholder"}})


def test_missing_env_var_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("tiers: {a: {model: '${NOPE_NOT_SET}', price_per_gpu_hour: 1}}\nroute: {default_tier: a}\n")
    with pytest.raises(ConfigError, match="NOPE_NOT_SET"):
        load_config(path, environ={})


def test_fingerprint_ignores_locations_but_not_prompt(tmp_path):
    a = load_config(LOCAL_CONFIG, environ={"TOKENMILL_HOME": str(tmp_path)})
    b = load_config(LOCAL_CONFIG, environ={"TOKENMILL_HOME": str(tmp_path), "TOKENMILL_OUTPUT__URI": "/elsewhere"})
    c = load_config(LOCAL_CONFIG, environ={"TOKENMILL_HOME": str(tmp_path), "TOKENMILL_PROMPT__SYSTEM": "Be terse."})
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()


def test_config_show_prints_effective_config(tmp_path):
    env = {"TOKENMILL_HOME": str(tmp_path), "TOKENMILL_SAMPLING__MAX_TOKENS": "9", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "config", "show", "--config", str(LOCAL_CONFIG)],
                         capture_output=True, text=True, env=env, cwd=REPO, check=True).stdout
    shown = yaml.safe_load(out)
    assert shown["sampling"]["max_tokens"] == 9
    assert shown["tiers"]["small"]["model"] == f"{tmp_path}/models/tiny-small"


def test_config_show_bad_file_is_one_line_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "config", "show", "--config", str(tmp_path / "none.yaml")],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: config file not found") and "Traceback" not in r.stderr


def test_config_reference_doc_is_current():
    from pipeline.config import reference_markdown

    assert (REPO / "docs" / "config.md").read_text() == reference_markdown(), "run: tokenmill config docs > docs/config.md"
