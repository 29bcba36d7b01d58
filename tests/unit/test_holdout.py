"""The hold-out set (pipeline/dev/holdout.py): real text from this machine, deterministic, labelled variants."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.dev.holdout import (
    FORBIDDEN,
    MAX_BYTES,
    MIN_BYTES,
    MUST_NOT_REUSE,
    SHOULD_REUSE,
    build_holdout,
    cut,
    normalise,
)

REPO = Path(__file__).resolve().parents[2]
BUILD = (
    "import sys; from pathlib import Path; from pipeline.dev.holdout import build_holdout; "
    "build_holdout(Path(sys.argv[1]), documents=40, variants=32)"
)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("holdout") / "set.jsonl"
    counts = build_holdout(out, documents=40, variants=32)
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    return out, counts, rows


def test_same_bytes_twice_whatever_the_hash_seed(built, tmp_path):
    """Built again in an interpreter with another hash seed than this one's: no hash randomisation (0)
    where this one has it, else seed 1."""
    out, _, _ = built
    again = tmp_path / "again.jsonl"
    hash_seed = "1" if os.environ.get("PYTHONHASHSEED") == "0" else "0"
    subprocess.run(
        [sys.executable, "-c", BUILD, str(again)], cwd=REPO, check=True, env={**os.environ, "PYTHONHASHSEED": hash_seed}
    )
    assert again.read_bytes() == out.read_bytes()


def test_documents_and_variants(built):
    _, counts, rows = built
    docs = [r for r in rows if "source" in r]
    variants = [r for r in rows if "variant_of" in r]
    assert len(docs) + len(variants) == len(rows)
    assert counts["documents"] == len(docs) == 40 and counts["variants"] == len(variants) == 32
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == len(ids)
    assert len({d["text"] for d in docs}) == len(docs)
    for d in docs:
        assert MIN_BYTES <= len(d["text"].encode()) <= MAX_BYTES
        assert d["text"] == normalise(d["text"])
    by_id = {d["id"]: d for d in docs}
    for v in variants:
        assert v["variant_of"] in by_id and v["text"] != by_id[v["variant_of"]]["text"]
        assert v["variant"] in SHOULD_REUSE + MUST_NOT_REUSE
        assert v["should_reuse"] == (v["variant"] in SHOULD_REUSE)
        assert MIN_BYTES <= len(v["text"].encode()) <= MAX_BYTES
    assert set(counts["by_variant"]) == set(SHOULD_REUSE + MUST_NOT_REUSE)  # 32 slots: every kind 4 times
    assert counts["should_reuse"] == counts["must_not_reuse"] == 16


def test_nothing_from_work_or_the_repo(built):
    _, counts, rows = built
    assert sum(counts["by_source"].values()) == counts["documents"]
    for d in (r for r in rows if "source" in r):
        if d["source"].startswith("/"):
            real = Path(d["source"]).resolve()
            assert not any(real.is_relative_to(root) for root in FORBIDDEN), d["source"]
        else:  # a stdlib module or class: its file is the interpreter's, not this project's
            assert d["source"].split(".")[0] in sys.stdlib_module_names
    assert Path("/work") in FORBIDDEN and REPO in FORBIDDEN
    assert "tokenmill" not in "".join(d["text"] for d in rows).lower()


def test_missing_sources_give_fewer_documents_and_say_so(tmp_path):
    para = "The quick brown fox jumps over the lazy dog near the river bank in early spring. " * 16
    texts = [
        f"Notes number {i} from Oslo.\n\n" + para.replace("fox", f"fox {i}") + "\n\n" + para[: 100 + i]
        for i in range(3)
    ]
    sources = {"readme": iter([(f"/usr/share/doc/pkg{i}/README", t) for i, t in enumerate(texts)]), "man": iter([])}
    counts = build_holdout(tmp_path / "small.jsonl", documents=10, variants=4, sources=sources)
    assert counts["documents"] == 1  # the three are near-identical: one is kept
    assert counts["by_source"] == {"readme": 1}
    assert "man" in counts["missing_sources"] and "stdlib" in counts["missing_sources"]
    assert "fewer than asked" in counts["note"]


def test_cut_ends_at_a_paragraph_boundary():
    paragraphs = [f"Paragraph {i} says something long enough to matter here." * 6 for i in range(30)]
    text = cut("\n\n".join(paragraphs))
    assert text is not None and MIN_BYTES <= len(text.encode()) <= MAX_BYTES
    assert all(p in paragraphs for p in text.split("\n\n"))
    assert cut("too short") is None


def test_eval_set_script(tmp_path):
    out = tmp_path / "eval.jsonl"
    done = subprocess.run(
        [sys.executable, "benchmarks/eval_set.py", str(out), "--documents", "12", "--variants", "8"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    )
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["benchmark"] == "eval_set" and line["documents"] == 12 and line["variants"] == 8
    assert len(out.read_text(encoding="utf-8").splitlines()) == 20
