"""Shared fixtures: a throwaway $TOKENMILL_HOME with the tiny models, and configs pointing at tmp folders.

The real vLLM engine is created once per test session: the engine pool caches one engine per
tier configuration per process, and every engine test uses the same tiny-model tier.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LOCAL_CONFIG = REPO / "configs" / "local.yaml"


@pytest.fixture(scope="session")
def tokenmill_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("tokenmill-home")
    os.environ["TOKENMILL_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def tiny_models(tokenmill_home) -> Path:
    from pipeline.tiny_model import build_tiny_model

    models = tokenmill_home / "models"
    build_tiny_model(models / "tiny-small", "small")
    return models


@pytest.fixture
def make_config(tmp_path, tiny_models):
    """Build the local config with input/output/state in this test's tmp folder; kwargs override fields."""
    from pipeline.config import load_config

    def make(input_dir: Path | None = None, **overrides):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_") or k == "TOKENMILL_HOME"}
        env["TOKENMILL_INPUT__URI"] = str(input_dir or tmp_path / "input")
        env["TOKENMILL_OUTPUT__URI"] = str(tmp_path / "output")
        env["TOKENMILL_STATE__URL"] = f"sqlite:///{tmp_path}/state.db"
        env["TOKENMILL_RUN__PROGRESS"] = "off"
        for key, value in overrides.items():
            env[f"TOKENMILL_{key.upper()}"] = str(value)
        return load_config(LOCAL_CONFIG, environ=env)

    return make


@pytest.fixture
def sample_corpus(tmp_path) -> tuple[Path, dict]:
    from pipeline.samples import write_sample_corpus

    root = tmp_path / "input"
    return root, write_sample_corpus(root, documents=40)


@pytest.fixture(scope="session", autouse=True)
def _stop_engines_at_session_end():
    """Stop vLLM engines while pytest's output capture is still open (at exit it is closed)."""
    yield
    from pipeline.infer import shutdown_engines

    shutdown_engines()
