"""The code's style holds in CI: `ruff format` (lines of at most 120 characters) and `ruff check` (pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = ["pipeline", "tests", "dags", "benchmarks"]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args, *TREES], cwd=ROOT, capture_output=True, text=True)


def test_the_code_is_formatted():
    result = ruff("format", "--check")
    assert result.returncode == 0, f"run: ruff format {' '.join(TREES)}\n{result.stdout}{result.stderr}"


def test_the_code_passes_the_linter():
    result = ruff("check", "--output-format", "concise")
    assert result.returncode == 0, f"{result.stdout}{result.stderr}"
