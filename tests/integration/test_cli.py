"""The `tokenmill` command's wiring: every verb registered, `estimate`, and its old name `plan` refused."""

import json
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from pipeline.cli import app
from tests.conftest import ONE_TIER, REPO, TINY_CONFIG


def test_every_verb_is_registered():
    group = typer.main.get_command(app)
    assert {
        "run",
        "rerun",
        "estimate",
        "status",
        "report",
        "samples",
        "jobs",
        "ledger",
        "router",
        "models",
        "config",
        "cache",
        "migrate",
    } <= set(group.commands)
    assert "plan" not in group.commands
    listed = CliRunner().invoke(app, ["--help"]).output
    assert "estimate" in listed and "Pre-flight estimate" in listed


def test_estimate_counts_every_record(tiny_models, sample_corpus, tmp_path, monkeypatch):
    for key, value in {**ONE_TIER, "TOKENMILL_OUTPUT__URI": str(tmp_path / "output")}.items():
        monkeypatch.setenv(key, value)
    args = ["--config", str(TINY_CONFIG), "--input", str(sample_corpus[0]), "--format", "json"]
    runner = CliRunner()
    estimate = runner.invoke(app, ["estimate", *args])
    assert estimate.exit_code == 0, estimate.output
    assert json.loads(estimate.stdout)["records"] == sample_corpus[1]["documents"] + sample_corpus[1]["bad_records"]


def test_console_markup_in_data_is_printed_as_text(tiny_models, tmp_path, monkeypatch):
    """Reproducers (red team): an id, tenant or file name holding rich markup (`[/x]`) made `tokenmill run`
    print a traceback and exit 1 after the job committed (cron ran it again), and `ledger summary`, `status`
    crashed the same way; `[link=…]` drew a terminal hyperlink. `ledger sql` with two columns of one
    name raised a KeyError."""
    from tests.conftest import FAKE_ENGINE

    root = tmp_path / "in"
    root.mkdir()
    (root / "[bold]notes[red].jsonl").write_text(
        '{"id": "[/x]", "tenant": "[link=http://evil.example]acme", "text": "The harbour opens at nine."}\n'
        '{"id": "b[/]", "text": "The ferry leaves at noon from the north pier."}\n'
    )
    env = {
        **ONE_TIER,
        **FAKE_ENGINE,
        "TOKENMILL_HOME": str(tiny_models.parent),
        "TOKENMILL_RUN__PROGRESS": "off",
        "TOKENMILL_STATE__URL": f"sqlite:///{tmp_path}/s.db",
        "TOKENMILL_CACHE__PATH": str(tmp_path / "cache"),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "out"
    runner = CliRunner()
    run = runner.invoke(
        app, ["run", "--config", str(TINY_CONFIG), "--input", str(root), "--output", str(out), "--job-id", "markup"]
    )
    assert run.exit_code == 0, run.output
    assert "[/x] (small" in run.stdout and "\x1b]8;" not in run.stdout  # the id as written, no hyperlink
    for args in (
        ["status", "--config", str(TINY_CONFIG), "--job-id", "markup"],
        ["ledger", "summary", "--output", str(out), "--by", "tenant"],
    ):
        shown = runner.invoke(app, args)
        assert shown.exit_code == 0, shown.output
        assert "\x1b]8;" not in shown.stdout
    assert "[link=http://evil" in shown.stdout  # the tenant as text (a narrow cell may cut it short)
    both = runner.invoke(app, ["ledger", "sql", "SELECT 1 AS a, 2 AS a", "--output", str(out), "--format", "json"])
    assert both.exit_code == 0, both.output
    assert json.loads(both.stdout) == [{"a": 1, "a_2": 2}]
    table = runner.invoke(app, ["ledger", "sql", "SELECT 1 AS a, 2 AS a", "--output", str(out)])
    assert table.exit_code == 0 and "a_2" in table.stdout


@pytest.mark.parametrize(("argv", "code"), [(["--help"], 0), (["no-such-verb"], 2)])
def test_the_command_exits_with_its_code_after_the_exit_hooks_and_skips_finalization(argv, code):
    """Reproducer: `tokenmill estimate` printed its whole answer, then a native thread pool aborted the
    interpreter's finalization (`terminate called without an active exception`, exit -6). main() runs the
    exit hooks (the engines' shutdown is one), then leaves without finalizing: an object that would only be
    collected by finalization is never collected."""
    script = (
        "import atexit, sys\n"
        "class Finalized:\n"
        "    def __del__(self): print('finalized', flush=True)\n"
        "KEPT = Finalized()\n"
        "atexit.register(lambda: print('exit hook ran', flush=True))\n"
        f"sys.argv = ['tokenmill', *{argv!r}]\n"
        "from pipeline.cli import main\n"
        "main()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == code, done.stderr[-1500:]
    assert "exit hook ran" in done.stdout and "finalized" not in done.stdout


def test_api_key_prints_a_key_once_and_the_digest_the_config_takes():
    from pipeline.config import TenantConfig
    from pipeline.serve.access import key_digest

    out = CliRunner().invoke(app, ["api-key", "--tenant", "acme"]).output
    key = out.split("key (shown once): ", 1)[1].split()[0]
    digest = out.split("api_keys: [", 1)[1].split("]")[0]
    assert key.startswith("tm-") and digest == key_digest(key)
    assert TenantConfig(api_keys=[digest]).api_keys == [digest]
    with pytest.raises(ValueError, match="never keys"):
        TenantConfig(api_keys=[key])  # a key itself is refused: only its digest is stored


def test_serve_logs_formatted_lines_at_its_configured_level_with_credentials_redacted(tmp_path, monkeypatch):
    """`tokenmill serve` left the root logger unconfigured: its runner's lines (a batch failing, a retry) were
    dropped below WARNING and printed bare above it. It sets logging up once as it starts: one format, the
    level of serve.log_level, and no password of a URL in any line."""
    import logging
    import re
    import warnings

    import uvicorn

    redis = "redis://:hunter2@127.0.0.1:1/0"
    env = {
        "TOKENMILL_OUTPUT__URI": str(tmp_path / "out"),
        "TOKENMILL_STATE__URL": f"sqlite:///{tmp_path}/s.db",
        "TOKENMILL_CACHE__REDIS_URL": redis,
        "TOKENMILL_SERVE__LOG_LEVEL": "warning",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # serve sets up the process's logging: given back after the test
    monkeypatch.setattr(root, "level", root.level)
    # serve also routes warnings to logging (captureWarnings): given back too.
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setattr(logging, "_warnings_showwarning", logging._warnings_showwarning)

    def serving(server):
        log = logging.getLogger("pipeline.serve.runner")
        log.info("below the configured level")
        log.warning("batch_1: the cache at %s did not answer; trying again", redis)

    monkeypatch.setattr(uvicorn.Server, "run", serving)
    served = CliRunner().invoke(app, ["serve", "--config", str(TINY_CONFIG)])
    assert served.exit_code == 0, served.output
    lines = [line for line in served.stderr.splitlines() if "pipeline.serve.runner" in line]
    assert len(lines) == 1, served.stderr
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING pipeline\.serve\.runner: batch_1: the cache at "
        r"redis://\*\*\*@127\.0\.0\.1:1/0 did not answer; trying again",
        lines[0],
    ), lines
    assert "hunter2" not in served.stderr + served.stdout
