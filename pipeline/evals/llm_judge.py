"""An LLM judge of outputs (`checks.judge`, generate/judge.py) set beside a reader's labels: `run_judge` asks the
judge tier's model about each labelled (document, summary), with the prompt and sampling a job's judge wave uses,
and `tokenmill checks calibrate --judge` reports its agreement like any other check's flags."""

from __future__ import annotations

from pipeline.config import TokenmillConfig
from pipeline.generate.judge import fitted_prompt, judge_sampling, verdict


def run_judge(config: TokenmillConfig, rows: list[dict]) -> list[dict]:
    """The judge's answer and verdict for each row (`document`, `summary`), greedy, on its tier's engine: one
    generate call for all. Raises EngineStartError when the tier's engine cannot start."""
    from pipeline.generate.engine import EnginePool

    judge = config.checks.judge
    if judge is None:
        raise ValueError("checks.judge is not set: no judge to run")
    pool = EnginePool(config.tiers)
    tokenizer, context = pool.tokenizer(judge.tier), pool.context_length(judge.tier)
    prompts = [fitted_prompt(judge, tokenizer, context, r["document"], r["summary"])[1] for r in rows]
    done = pool.engine(judge.tier).generate(prompts, [judge.max_tokens] * len(prompts), judge_sampling(judge))
    return [{"answer": c.text, "verdict": verdict(c.text)} for c in done]
