"""An LLM judge of outputs (`checks.judge`): a tier's model asked, per (document, summary), whether a reader
would keep it, its verdicts set beside a reader's labels by `tokenmill checks calibrate --judge` like any other
check's flags. It runs on the labels, not in jobs: what it agrees with decides whether it is worth its price."""

from __future__ import annotations

import re

from pipeline.config import SamplingConfig, TokenmillConfig

_FIRST_WORD = re.compile(r"[A-Za-z]+")
_PLACEHOLDER = re.compile(r"\{document\}|\{summary\}")
KEEP, BAD = {"keep", "good", "yes", "acceptable"}, {"bad", "no", "discard", "reject"}


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


def run_judge(config: TokenmillConfig, rows: list[dict]) -> list[dict]:
    """The judge's answer and verdict for each row (`document`, `summary`), greedy, on its tier's engine: one
    generate call for all. Raises EngineStartError when the tier's engine cannot start."""
    from pipeline.generate.engine import EnginePool

    judge = config.checks.judge
    if judge is None:
        raise ValueError("checks.judge is not set: no judge to run")
    pool = EnginePool(config.tiers)
    tokenizer = pool.tokenizer(judge.tier)
    room = pool.context_length(judge.tier) - judge.max_tokens

    def prompt(document: str, summary: str) -> list[int]:
        """The rendered chat's token ids; a document too long for the judge's context is cut (its opening kept)."""
        while True:
            messages = judge_messages(judge.rubric, document, summary)
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = list(tokenizer([text], add_special_tokens=False)["input_ids"][0])
            if len(ids) <= room or not document:
                return ids[-room:]
            document = document[: int(len(document) * room / len(ids) * 0.9)]

    prompts = [prompt(r["document"], r["summary"]) for r in rows]
    done = pool.engine(judge.tier).generate(prompts, [judge.max_tokens] * len(prompts), SamplingConfig(temperature=0.0))
    return [{"answer": c.text, "verdict": verdict(c.text)} for c in done]
