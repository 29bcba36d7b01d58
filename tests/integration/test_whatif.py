"""`tokenmill estimate --hardware ...`: tonight's staged job projected on hardware it does not have, labelled a
projection in the table and the JSON alike."""

import json

from typer.testing import CliRunner

from pipeline.cli import app
from tests.conftest import FAKE_ENGINE, ONE_TIER, REPO, TINY_CONFIG


def test_what_if_prices_the_staged_job_on_other_gpus_as_a_projection(tiny_models, sample_corpus, tmp_path, monkeypatch):
    for key, value in {**ONE_TIER, **FAKE_ENGINE, "TOKENMILL_OUTPUT__URI": str(tmp_path / "output")}.items():
        monkeypatch.setenv(key, value)
    base = ["estimate", "--config", str(TINY_CONFIG), "--input", str(sample_corpus[0])]
    what_if = ["--hardware", "H100-SXM:8", "--tier", "small=Llama-3.1-70B:fp8", "--price-per-gpu-hour", "2.5"]
    runner = CliRunner()
    out = runner.invoke(app, [*base, *what_if, "--format", "json"])
    assert out.exit_code == 0, out.output
    est = json.loads(out.stdout)
    p = est["projection"]
    assert p["label"].startswith("projection") and p["hardware"] == "H100-SXM ×8 per tier"
    small = p["tiers"]["small"]
    assert small["model"] == "Llama-3.1-70B:fp8" and small["levers"] == ["fp8"]
    assert small["items"] == est["tiers"]["small"]["items"] and small["engine_hours"] > 0
    assert small["usd"] == small["gpu_hours"] * 2.5 and p["usd"] == small["usd"]
    effects = small["levers_effect"]
    assert effects["fp8"]["on"] and effects["fp8"]["saving"] > 0  # FP8 weights: less to read and faster matmuls
    assert not effects["kv-fp8"]["on"] and effects["spec"]["acceptance"] == 0.7
    assert p["shares"]["reuse"]["duplicates"] == est["duplicates"] > 0
    assert set(p["api_batch_usd"]) >= {"openai gpt-4o-mini (batch)", "anthropic claude-haiku-4.5 (batch)"}
    assert all(v > 0 for v in p["api_batch_usd"].values()) and p["api_prices_date"]

    table = runner.invoke(app, [*base, *what_if])
    assert table.exit_code == 0, table.output
    assert "projection (not measured) on H100-SXM ×8" in table.stdout and "same tokens" in table.stdout

    bad = runner.invoke(app, [*base, "--hardware", "TPU:4"])
    assert bad.exit_code == 2 and "unknown hardware" in bad.stderr
    orphan = runner.invoke(app, [*base, "--tier", "small=Llama-3.1-8B"])
    assert orphan.exit_code == 2 and "give --hardware too" in orphan.stderr


def test_what_if_in_a_fresh_home_needs_no_model_files_and_warns_once(sample_corpus, tmp_path, monkeypatch, caplog):
    # A new user's machine: no models, no embedder, no ledger. The named model is projected; tokens are counted
    # by the approximation, said once for the job (the corpus has several files), as is semantic reuse being off.
    from pipeline.plan import tokens

    home = tmp_path / "fresh-home"
    home.mkdir()
    monkeypatch.setattr(tokens, "HUB_IDS", {})  # whatever this machine's Hugging Face cache holds
    monkeypatch.setenv("TOKENMILL_HOME", str(home))
    monkeypatch.setenv("TOKENMILL_OUTPUT__URI", str(tmp_path / "output"))
    monkeypatch.setenv("TOKENMILL_STATE__URL", f"sqlite:///{tmp_path}/state.db")
    args = ["estimate", "--config", str(REPO / "configs" / "local.yaml"), "--input", str(sample_corpus[0])]
    args += ["--hardware", "H100-SXM:1", "--tier", "large=Llama-3.1-8B:fp8", "--tier", "small=Llama-3.1-8B:fp8"]
    args += ["--price-per-gpu-hour", "2.5", "--volume", "100k", "--html", str(tmp_path / "what-if.html")]
    out = CliRunner().invoke(app, [*args, "--format", "json"])
    assert out.exit_code == 0, out.output
    assert len(list(sample_corpus[0].iterdir())) > 2
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert sum("semantic reuse off for this job" in w for w in warned) == 1, warned
    # once per tier the job uses (configs/local.yaml routes to both), not once per file
    approximated = [
        sum(w.startswith(f"tier {t}:") and "token counts approximated" in w for w in warned)
        for t in "small large".split()
    ]
    assert max(approximated) == 1 and sum(approximated) == len(
        [w for w in warned if "token counts approximated" in w]
    ), warned
    est = json.loads(out.stdout)
    assert est["token_counts"]["large"].startswith("approximated: 3.7 characters per token")
    large = est["projection"]["tiers"]["large"]
    assert large["model"] == "Llama-3.1-8B:fp8" and large["prompt_tokens"] > 0 and large["usd"] > 0
    b = est["break_even"]
    assert b["volume_documents_per_night"] == 100_000 and "approximated" in b["sources"]["prompt tokens"]
    assert b["sources"]["utilisation"].startswith("projected")  # no ledger yet
    mini = b["mixes"]["as planned"]["api"]["openai gpt-4o-mini (batch)"]
    assert mini["break_even_documents"] > 0 and mini["ratio_at_volume"] > 0
    page = (tmp_path / "what-if.html").read_text()
    # per mix (as planned, and all on the largest tier where the config routes between tiers): self-hosted,
    # then each offer
    assert page.count('class="line"') == sum(1 + len(mix["api"]) for mix in b["mixes"].values())
    assert "gpt-4o-mini" in page and "break-even volume" in page and "projected" in page
