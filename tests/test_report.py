"""The HTML cost report, rendered in headless Chromium: every chart must draw."""

import os
import re
import shutil
import subprocess

import pytest

from pipeline import run_job
from pipeline.output.report import build_report
from tests.conftest import REPO

pytestmark = pytest.mark.engine
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def chromium():
    if CHROMIUM is None:
        if os.environ.get("TOKENMILL_REQUIRE_CHROMIUM") == "1":
            pytest.fail("chromium is required here (apt-get install chromium)")
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    return CHROMIUM


def test_report_renders_offline_with_every_chart_drawn(make_config, sample_corpus, tmp_path, chromium):
    config = make_config()
    run_job(config, job_id="report")
    page = build_report(config.output.uri, "report")
    assert "http://" not in page and "https://" not in page  # nothing fetched from a network
    html_file = tmp_path / "report.html"
    html_file.write_text(page)

    base = [chromium, *FLAGS, f"--user-data-dir={tmp_path / 'chromium'}"]
    dom = subprocess.run([*base, "--dump-dom", html_file.as_uri()], capture_output=True, text=True, timeout=120).stdout
    drawn = dict(re.findall(r'<svg class="chart" id="([\w-]+)"[^>]*data-drawn="(\d+)"', dom))
    assert set(drawn) == {"cost-by-tenant", "cost-by-tier", "savings", "tokens-per-second", "reuse",
                          "slowest-partitions"}
    assert int(drawn["cost-by-tenant"]) == 4  # acme, globex, initech and the default tenant of .txt/.md
    assert int(drawn["savings"]) >= 3 and all(int(n) > 0 for n in drawn.values())

    artifacts = REPO / "build" / "test-artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / "report.png"
    subprocess.run([*base, "--window-size=900,1400", f"--screenshot={shot}", html_file.as_uri()],
                   capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000


def test_report_for_unknown_job_is_a_clear_error(tmp_path):
    from pipeline.stores.storage import StorageError

    with pytest.raises(StorageError, match="no manifest for job nope"):
        build_report(str(tmp_path), "nope")
