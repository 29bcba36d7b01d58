"""A small synthetic corpus: the demo's input, the tiny tokenizer's training text and the tests' fixtures.

Everything here is generated from a fixed seed, so two machines build the same corpus and the
same tokenizer. The documents read like reports but are clearly synthetic.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

WORDS = """
the a of to and in for on with by from at as is was are were be been has have had will would
can could may might should must report quarterly revenue growth customer support ticket order
shipment delay invoice payment refund contract renewal meeting agenda minutes decision action
item owner deadline budget forecast risk issue incident outage service latency error rate
deployment release feature request bug fix test coverage review approval policy compliance
audit security access account user team manager engineer analyst director board member vendor
supplier warehouse inventory stock price market share competitor product launch campaign
marketing sales pipeline lead region north south east west europe asia america office remote
hybrid hiring training onboarding survey feedback score satisfaction retention churn cost
saving efficiency throughput capacity demand supply energy carbon emission target progress
milestone project plan phase scope change delivery quality defect claim insurance patient
clinic treatment trial result study data model analysis summary note letter email call
chat document page section table figure chart increase decrease stable strong weak high low
new old first last next previous early late monthly weekly daily annual total average median
percent million thousand dollars euros units hours days weeks months years not no never always
because however therefore although while after before during until unless despite since
""".split()

TOKENIZER_EXTRA_TEXT = (
    "0 1 2 3 4 5 6 7 8 9 10 25 50 100 2024 2025 2026 . , ; : ! ? ' \" ( ) [ ] { } - _ / \\ # % & * + = < > @ $ ^ ~ `\n"
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz\n"
    "Summarize the following document in a few sentences. Summary: You are a careful analyst.\n"
)


def synthetic_document(rng: random.Random, sentences: int) -> str:
    """One report-like document of `sentences` sentences drawn from WORDS."""
    out = []
    for _ in range(sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 18))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(1, 5000)))
        sentence = " ".join(words)
        out.append(sentence[0].upper() + sentence[1:] + ".")
    return " ".join(out)


def tokenizer_training_text(lines: int = 4000, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [synthetic_document(rng, 2) for _ in range(lines)] + [TOKENIZER_EXTRA_TEXT] * 20


def write_sample_corpus(
    root: Path, documents: int = 60, seed: int = 11, with_bad_input: bool = True, texts: list[str] | None = None
) -> dict:
    """Write a mixed input folder: JSONL, gzipped JSONL, Parquet, .txt and .md.

    `texts`: real documents to use, in turn (the demo takes them from this machine's docs, see
    holdout.py); None: synthetic report-like ones (the tests' fixtures, the same on every machine).

    About one document in six repeats an earlier one: exactly, with other whitespace, or as a
    mirror copy with a forwarding header (a near duplicate). With `with_bad_input` every kind of bad
    record the validate stage quarantines is present once.
    Returns counts the caller can check against the job summary.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    tenants = ["acme", "globex", "initech"]
    docs: list[dict] = []
    for i in range(documents):
        if docs and rng.random() < 0.17:
            src = rng.choice(docs)
            kind = rng.random()
            if kind < 0.35:
                text = src["text"]
            elif kind < 0.7 or len(src["text"].split()) < 40:  # short texts: a header would change too much
                text = "  " + src["text"].replace(" ", "  ", 3) + "\n"
            else:
                text = "Fwd: " + src["text"]
            docs.append({"id": f"doc-{i:05d}", "text": text, "tenant": src["tenant"]})
        else:
            text = synthetic_document(rng, rng.randint(2, 8))  # drawn either way: the same rng sequence
            if texts:
                text = texts[sum(1 for d in docs if "metadata" in d) % len(texts)]
            docs.append(
                {
                    "id": f"doc-{i:05d}",
                    "text": text,
                    "tenant": rng.choice(tenants),
                    "metadata": {"kind": rng.choice(["memo", "ticket", "report"])},
                }
            )

    third = len(docs) // 3
    with open(root / "batch-a.jsonl", "w", encoding="utf-8") as f:
        for d in docs[:third]:
            f.write(json.dumps(d) + "\n")
    with gzip.open(root / "batch-b.jsonl.gz", "wt", encoding="utf-8") as f:
        for d in docs[third : 2 * third]:
            f.write(json.dumps(d) + "\n")
    rest = docs[2 * third : -2]
    pq.write_table(
        pa.table(
            {
                "id": [d["id"] for d in rest],
                "text": [d["text"] for d in rest],
                "tenant": [d["tenant"] for d in rest],
            }
        ),
        root / "batch-c.parquet",
    )
    notes = root / "notes"
    notes.mkdir(exist_ok=True)
    (notes / "memo-1.txt").write_text(docs[-2]["text"], encoding="utf-8")
    (notes / "memo-2.md").write_text("# Memo\n\n" + docs[-1]["text"], encoding="utf-8")

    bad = 0
    if with_bad_input:
        lines = [
            b'{"id": "bad-json", "text": "unterminated',  # malformed_json
            b'{"id": "no-text"}',  # missing_text
            b'{"id": "blank", "text": "   \\n\\t "}',  # empty_text
            b'{"id": "num", "text": 42}',  # non_string_text
            b'{"text": "a document without an id"}',  # missing_id
            json.dumps({"id": docs[0]["id"], "text": "second use of an id"}).encode(),  # duplicate_id
            b'{"id": "latin1", "text": "caf\xe9 au lait"}',  # invalid_utf8
            json.dumps({"id": "huge", "text": "word " * 300_000}).encode(),  # too_large
            b'["not", "an", "object"]',  # not_an_object
        ]
        (root / "bad.jsonl").write_bytes(b"\n".join(lines) + b"\n")
        (root / "broken.parquet").write_bytes(b"PAR1 this is not a parquet file")  # unreadable_file
        bad = len(lines) + 1
    # ids: the good documents' record ids (a .txt/.md file's id is its path), for exactly-once checks
    return {
        "documents": len(docs),
        "bad_records": bad,
        "ids": [d["id"] for d in docs[:-2]] + ["notes/memo-1.txt", "notes/memo-2.md"],
    }
