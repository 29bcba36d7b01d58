"""Every example of README.md and docs/*.md runs: each ```bash, ```sql and ```python block, against a job
this module has just run, except the blocks marked `<!-- illustrative: why -->` (with the reason).

The job is the data engineer's first command (docs/data-engineer.md), on the sample corpus and the tiny
models with the fake engine, in a folder laid out as the docs assume: `configs/local.yaml` (and
`configs/production.yaml`: the same tiny config, local stores), `data/sample`, `data/output`. Blocks run
in that folder, in the order of their file: a bash block as a bash script (`set -e`, this venv's
`tokenmill` first on PATH), a python block with this venv's python, an sql block statement by
statement, over the views of `tokenmill ledger sql` (ledger, outputs, quarantine), or in plain DuckDB
where it reads files itself. The harness fills the docs' placeholders (PLACEHOLDERS). A failure names the
file, the line of the block's fence and its first line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import duckdb
import pytest

from tests.conftest import FAKE_ENGINE, REPO, TINY_CONFIG
from tests.docs_examples import blocks

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
JOB = "nightly-2026-11-30"
# A file read in SQL (quoted path or a read_* function): plain DuckDB, not the ledger views (which no file reaches).
READS_FILES = ("read_parquet(", "read_text(", "read_csv(", "FROM '", "delta_scan(")


@pytest.fixture(scope="module")
def site(tmp_path_factory, tiny_models, static_embedder):
    """(folder, environment, placeholders) once the job ran there."""
    from pipeline.dev.samples import write_sample_corpus

    root = tmp_path_factory.mktemp("docs-site")
    (root / "configs").mkdir()
    for name in ("local.yaml", "production.yaml"):
        shutil.copy(TINY_CONFIG, root / "configs" / name)
    write_sample_corpus(root / "data" / "sample", documents=24)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_") or k == "TOKENMILL_HOME"}
    env.update(FAKE_ENGINE)
    env |= {"TOKENMILL_STATE__URL": f"sqlite:///{root}/state.db", "TOKENMILL_CACHE__PATH": str(root / "cache")}
    env["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{env['PATH']}"
    first = next(b for b in blocks(REPO / "docs" / "data-engineer.md", REPO) if "tokenmill run" in b.text)
    placeholders = {"/data/docs/2026-11-30": "data/sample", "/data/summaries": "data/output"}
    run_bash(fill(first.text, placeholders), root, env)
    return root, env, placeholders | job_placeholders(root)


def job_placeholders(root) -> dict[str, str]:
    """What the docs name by example or by `<...>`, as this job has it."""
    from pipeline.stores.catalog import StateStore

    (partition, *_) = sorted(p.partition for p in StateStore(f"sqlite:///{root}/state.db").partitions(JOB))
    return {
        "<output>": "data/output",
        "<job>": "*",  # the one job of the folder's batch files
        "/tmp/dry-run": "dry-run",
        "7579fade16-00000": partition,
        "--labels holdout.jsonl": "--labels labels.jsonl",  # the user's labelled hold-out: the synthetic set
        "<delta extension>": str(delta_extension()),
    }


def delta_extension():
    """DuckDB's Delta extension as the `duckdb-extension-delta` wheel ships it (installed from the file: offline)."""
    from pathlib import Path

    import duckdb_extension_delta

    return (
        Path(duckdb_extension_delta.__file__).parent
        / "extensions"
        / f"v{duckdb.__version__}"
        / "delta.duckdb_extension"
    )


def fill(text: str, placeholders: dict[str, str]) -> str:
    for placeholder, value in placeholders.items():
        text = text.replace(placeholder, value)
    return text


def run_bash(text: str, cwd, env) -> None:
    done = subprocess.run(["bash", "-e", "-c", text], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-2000:] or done.stdout[-2000:]}"


def run_python(text: str, cwd, env) -> None:
    done = subprocess.run([sys.executable, "-c", text], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def run_sql(text: str, cwd) -> None:
    from pipeline.output.ledger import connect, query

    if any(marker in text for marker in READS_FILES):
        # Extensions a block installs go to the site's own folder, never the user's ~/.duckdb.
        con = duckdb.connect(config={"extension_directory": str(cwd / ".duckdb-extensions")})
        os.chdir(cwd)  # DuckDB reads relative paths from the process's working directory
        for statement in duckdb.extract_statements(text):
            con.execute(statement)
        return
    con = connect(str(cwd / "data" / "output"))
    for statement in duckdb.extract_statements(text):
        query(con, str(statement.query))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_example_runs(doc, site, monkeypatch):
    root, env, placeholders = site
    monkeypatch.chdir(root)
    failures = []
    for block in blocks(doc, REPO):
        if block.illustrative is not None:
            assert block.illustrative, f"{block.where()}: say why it is illustrative"
            continue
        text = fill(block.text, placeholders)
        try:
            if block.language == "bash":
                run_bash(text, root, env)
            elif block.language == "python":
                run_python(text, root, env)
            else:
                run_sql(text, root)
        except Exception as e:  # every block reported, not the first only
            failures.append(f"{block.where()}:\n{str(e)[:1500]}")
    assert not failures, "\n\n".join(failures)
