"""The LLM judge (`checks.judge`): a tier's model asked, per (document, summary), whether a reader would keep it.

In a job it is a follow-up like an escalation (followup.py asks for it, waves.py derives its wave, the judge
tier's worker runs it): a generation keyed from the output it judges (`keys.judge_key`), its answer an item that
the catalog stores and the cache keeps, so a rerun or a later job pays for a verdict once. Only an output that
passed every cheap check is judged: a failed one is not acceptable whatever the judge says, so judging it would be
money spent for nothing. `tokenmill checks calibrate --judge` (evals/llm_judge.py) measures the same judge, with
the same prompt and sampling, against a reader's labels.
"""

from __future__ import annotations

import re

from pipeline.config import SamplingConfig, TokenmillConfig
from pipeline.config.route import JudgeConfig
from pipeline.keys import judge_key

_FIRST_WORD = re.compile(r"[A-Za-z]+")
_PLACEHOLDER = re.compile(r"\{document\}|\{summary\}")
KEEP, BAD = {"keep", "good", "yes", "acceptable"}, {"bad", "no", "discard", "reject"}
# What the ledger (column `judge`) and the manifest say of a judged output: kept; bad; an answer with no verdict in
# it; or no answer at all (its request failed on the judge's engine, or did not fit the judge's context).
VERDICTS = ("keep", "bad", "no_verdict", "unjudged")


def judge_messages(rubric: str, document: str, summary: str) -> list[dict]:
    """The judge's chat: the rubric with the document and the summary in it, in one pass (not str.format, nor
    one replace after the other: a document's braces, "{summary}" included, are text)."""
    values = {"{document}": document, "{summary}": summary}
    return [{"role": "user", "content": _PLACEHOLDER.sub(lambda m: values[m.group(0)], rubric)}]


def verdict(answer: str) -> bool | None:
    """The judge's answer read: True (keep), False (bad), None (no verdict: its first word is neither)."""
    m = _FIRST_WORD.search(answer)
    word = m.group(0).lower() if m else ""
    return True if word in KEEP else False if word in BAD else None


def verdict_name(judged: dict | None) -> str:
    """One of VERDICTS for the judge's item (None: no answer came)."""
    if judged is None:
        return "unjudged"
    return {True: "keep", False: "bad", None: "no_verdict"}[verdict(judged.get("summary") or "")]


def judge_sampling(judge: JudgeConfig) -> SamplingConfig:
    """Greedy, the engine's defaults otherwise: a verdict that does not depend on how summaries are sampled."""
    return SamplingConfig(temperature=0.0, max_tokens=judge.max_tokens)


def judge_request(judge: JudgeConfig) -> dict:
    """The judge's request as a batch request (a `schema.REQUEST` value, as ingest/batch.py makes): one user
    message, the generation's `text` (`fitted_prompt`'s message), judge_sampling's parameters; so a wave renders and
    samples it as it does any batch request."""
    params = {k: v for k, v in judge_sampling(judge).model_dump().items() if k not in ("json_schema", "stop")}
    return {
        "format": "openai",
        "endpoint": "/v1/chat/completions",
        "model": None,
        "messages": [{"role": "user", "content": None}],
        "document": 0,
        "params": params,
    }


def fitted_prompt(judge: JudgeConfig, tokenizer, context: int, document: str, summary: str) -> tuple[str, list[int]]:
    """(the judge's message, its rendered chat's token ids); a document too long for the judge's context is cut
    (its opening kept) until the chat leaves `max_tokens` of room."""
    room = context - judge.max_tokens
    while True:
        (message,) = judge_messages(judge.rubric, document, summary)
        text = tokenizer.apply_chat_template([message], tokenize=False, add_generation_prompt=True)
        ids = list(tokenizer([text], add_special_tokens=False)["input_ids"][0])
        if len(ids) <= room or not document:
            return message["content"], ids[-room:]
        document = document[: int(len(document) * room / len(ids) * 0.9)]


def judged_key(key: str, config: TokenmillConfig) -> str | None:
    """Where the judge's verdict on the output stored under `key` lives (None: no judge configured)."""
    judge = config.checks.judge
    if judge is None:
        return None
    return judge_key(key, config.tiers[judge.tier].generator, judge.rubric, judge.max_tokens)


def judge_generation(gen: dict, key: str, summary: str, config: TokenmillConfig, pool) -> dict:
    """The generation that asks the judge about `summary`, the output of `gen`'s record: on the judge's tier, as
    a batch request whose text is the rubric with the document (cut to fit the judge's context) and summary."""
    judge = config.checks.judge
    document = gen.get("document", gen["text"])  # a reduce's text is its chunk summaries: judged on the document
    text, _ = fitted_prompt(judge, pool.tokenizer(judge.tier), pool.context_length(judge.tier), document, summary)
    return {
        **{k: gen[k] for k in ("id", "tenant", "scope")},
        "tier": judge.tier,
        "item_key": key,
        "text": text,
        "request": judge_request(judge),
        "max_tokens": judge.max_tokens,
        "judge": True,
    }
