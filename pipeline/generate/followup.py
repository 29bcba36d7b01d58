"""Generations that follow others in a partition: escalation of low-confidence outputs, and map-reduce
of documents longer than the tier's context.

Both are keyed from the item key they follow (`keys.derived_key`), so they are stored, reused and
cached like any generation, and a rerun finds them instead of paying again:
  escalation   item K on a smaller tier whose output is empty, states numbers, dates or names its
               document lacks (`on_unfaithful`), was cut off by max_tokens (`on_truncation`) or has a
               mean token log-probability below the threshold is generated again on the escalation tier;
               the record gets K>esc's output and pays for both attempts;
  map-reduce   a document whose prompt does not fit is cut into chunks that do (K>chunk>i), each
               summarised, then the chunk summaries are summarised as K itself; the record pays for
               every call and is marked with its chunk count;
  retry        with `sampling.json_schema`, an output that does not validate (guided decoding keeps
               it on the schema, but max_tokens can cut it off) is generated once more with twice
               the token budget (K>retry>1); still invalid, the record is quarantined as
               `invalid_output` and its ledger row keeps what both attempts cost.

  judge        with `checks.judge`, the final output, once it passed every cheap check, is judged on the
               judge's tier (K'>judge, K' the key of the output served: generate/judge.py); its verdict is
               the output's `judge` flag, its cost a ledger row of its own.

Order per key: retry an invalid output first, then escalate a valid low-confidence one, then judge what stands.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache

from pipeline.config import TokenmillConfig
from pipeline.generate.judge import judged_key, verdict_name
from pipeline.generate.quality import acceptable, failed_checks, flags
from pipeline.generate.requests import render_messages
from pipeline.keys import adapter_digest, chunk_keys, escalation_key, retry_key


@lru_cache(maxsize=8)
def _validator(schema_json: str):
    from jsonschema import Draft202012Validator

    return Draft202012Validator(json.loads(schema_json))


def output_problem(item: dict, config: TokenmillConfig) -> str | None:
    """Why an item's output breaks `sampling.json_schema` (None: valid, or no schema configured)."""
    schema = config.sampling.json_schema
    if schema is None:
        return None
    text = item.get("summary") or ""
    try:
        value = json.loads(text)
    except ValueError as e:
        cut = " (cut off by max_tokens)" if item.get("finish_reason") == "length" else ""
        return f"not JSON{cut}: {e}"
    error = next(iter(_validator(json.dumps(schema, sort_keys=True)).iter_errors(value)), None)
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        return f"schema violation at {where}: {error.message}"[:500]
    return None


def escalation_reason(item: dict, config: TokenmillConfig) -> str | None:
    """Why a smaller tier's output is generated again on the escalation tier (None: it is kept).
    The first reason that holds, in this order: empty, degenerate, copied, off_topic, unfaithful, truncated,
    low_logprob."""
    e, to = config.route.escalation, config.escalation_tier
    if to is None or item["tier"] == to or item.get("chunks"):
        return None
    if not (item.get("summary") or "").strip():  # an output check no log-probability catches
        return "empty"
    failed = failed_checks(item, config.checks)  # in CHECKS' order
    if reason := next((check for check in failed if getattr(e, f"on_{check}")), None):
        return reason
    if e.on_unfaithful and flags(item, config.checks)["unfaithful"]:
        return "unfaithful"
    if e.on_truncation and item["finish_reason"] == "length":
        return "truncated"
    if (
        e.min_mean_logprob is not None
        and item.get("mean_logprob") is not None
        and item["mean_logprob"] < e.min_mean_logprob
    ):
        return "low_logprob"
    return None


def needs_escalation(item: dict, config: TokenmillConfig) -> bool:
    return escalation_reason(item, config) is not None


@dataclass
class Outcome:
    """What a record with item key K ends with: the output it gets (`item`), every item paid to make
    it, and how it got there. `problem` is set when the output still breaks the JSON schema; `rejected`
    names the output check (`checks.quarantine`) the final output still fails: both quarantine the record."""

    item: dict | None
    paid: list[dict] = field(default_factory=list)
    escalated: bool = False
    escalation_reason: str | None = None  # why the escalated attempt replaced the first one
    retried: bool = False
    problem: str | None = None
    rejected: str | None = None
    chunks: int = 0  # chunk summaries among `paid`
    # With `checks.judge`, for an output that passed every cheap check: where the judge's verdict lives, and the
    # judge's item once it is in (not among `paid`: it is charged in a ledger row of its own, kind `judge`).
    judge_key: str | None = None
    judge: dict | None = None

    @property
    def verdict(self) -> str | None:
        """The judge's verdict on the served output (generate/judge.py VERDICTS); None: it was not asked."""
        return None if self.judge_key is None else verdict_name(self.judge)

    @property
    def refusal(self) -> tuple[str, str] | None:
        """(quarantine reason, detail) when the record is quarantined although it has an output, else None."""
        if self.problem:
            return "invalid_output", self.problem
        if self.rejected:
            after = f" after escalation to {self.item['tier']}" if self.escalated else ""
            return self.rejected, f"the output fails the {self.rejected} check{after} (checks.quarantine)"
        return None

    @property
    def attempts(self) -> int:
        """Generations of the document paid for here (chunks aside): a failed escalation counts too, a retry
        or an escalation the reuse cache served does not (it cost this job nothing)."""
        attempts = [self.paid[0], *self.paid[1 + self.chunks :]]  # final_output puts chunks right after the first
        return sum(1 for p in attempts if p.get("origin") is None)


def escalated_key(key: str, item: dict, config: TokenmillConfig) -> str:
    """Where `key`'s escalation lives: on the escalation tier, with the adapter its tenant runs there."""
    tier = config.escalation_tier
    return escalation_key(key, tier, adapter_digest(config.adapter(item.get("tenant"), tier)))


def final_output(key: str, items: dict[str, dict], config: TokenmillConfig) -> Outcome:
    """The outcome of `key` from the items at hand (missing follow-ups: the attempt so far stands).

    An escalation that failed (its tier could not take the prompt, or the engine failed) or whose
    output breaks the schema leaves the earlier output in place: the record is still served, and
    pays for what ran, unless that output fails a check listed in `checks.quarantine`.
    """
    item = items.get(key)
    if item is None:
        return Outcome(None)
    chunks = [items[k] for k in chunk_keys(key, item.get("chunks") or 0) if k in items]
    out = Outcome(item, [item] + chunks, chunks=len(chunks))
    served = key  # the key of the output served
    out.problem = output_problem(item, config)
    if out.problem and retry_key(key) in items:
        served = retry_key(key)
        out.item = items[served]
        out.paid.append(out.item)
        out.retried, out.problem = True, output_problem(out.item, config)
    reason = escalation_reason(out.item, config) if out.problem is None else None
    if reason is not None:
        escalated = escalated_key(key, item, config)
        second = items.get(escalated)
        if second is not None:
            out.paid.append(second)
            if output_problem(second, config) is None:
                served = escalated
                out.item, out.escalated, out.escalation_reason = second, True, reason
    if out.problem is None and config.checks.quarantine:
        out.rejected = next((c for c in failed_checks(out.item, config.checks) if c in config.checks.quarantine), None)
    # Judged only once every cheap check passed: an output a check failed is not acceptable whatever the judge
    # says, so asking about it would be money spent for nothing.
    if config.checks.judge is not None and out.problem is None and not out.rejected:
        if acceptable(flags(out.item, config.checks)):
            out.judge_key = judged_key(served, config)
            out.judge = items.get(out.judge_key)
    return out


def next_attempt(
    key: str, items: dict[str, dict], config: TokenmillConfig, gone: frozenset[str] = frozenset()
) -> tuple[str, dict] | None:
    """(key, changes to the generation) of what `key` needs next, or None when it is complete: the
    step `final_output` would take next, had its item been made. `gone`: follow-ups asked for that will not come
    (failed, or too long for their tier): the output before them stands, and is judged. A judge's changes
    carry the summary it judges (`judge`: generate/judge.py makes its generation)."""
    out = final_output(key, items, config)
    if out.item is None:
        return None
    if out.problem:  # retried once and still invalid: quarantined
        return None if out.retried else (retry_key(key), {"max_tokens": 2 * config.sampling.max_tokens, "retry": True})
    escalation = escalated_key(key, out.item, config) if needs_escalation(out.item, config) else None
    if escalation is not None and escalation not in items and escalation not in gone:
        return escalation, {"tier": config.escalation_tier, "escalation": True}
    if out.judge_key is not None and out.judge is None:
        return out.judge_key, {"judge": True, "summary": out.item["summary"]}
    return None


def related_keys(keys: list[str], items: dict[str, dict], config: TokenmillConfig) -> list[str]:
    """Keys whose items complete the picture of `keys`: their chunks, retries and escalations."""
    out = []
    for key in keys:
        item = items.get(key)
        if item is None:
            continue
        out.extend(chunk_keys(key, item.get("chunks") or 0))
        if output_problem(item, config):
            out.append(retry_key(key))
        served = [key, retry_key(key)]
        if config.escalation_tier and item["tier"] != config.escalation_tier and not item.get("chunks"):
            out.append(escalated_key(key, item, config))  # needed when this or its retry escalated
            served.append(out[-1])
        if config.checks.judge is not None:  # the verdict on whichever of them is served
            out.extend(judged_key(k, config) for k in served)
    return out


def split_for_context(text: str, tokenizer, prompt, context: int, max_tokens: int) -> list[str]:
    """Cut `text` into pieces whose rendered prompts leave `max_tokens` of room in `context`."""
    overhead = len(
        tokenizer(
            [tokenizer.apply_chat_template(render_messages("", prompt), tokenize=False, add_generation_prompt=True)],
            add_special_tokens=False,
        )["input_ids"][0]
    )
    room = max(context - max_tokens - overhead - 8, 16)  # 8: slack for tokens merging across a cut
    words, pieces, current, used = text.split(" "), [], [], 0
    lengths = [len(ids) + 1 for ids in tokenizer(words, add_special_tokens=False)["input_ids"]]
    for word, n in zip(words, lengths):
        if current and used + n > room:
            pieces.append(" ".join(current))
            current, used = [], 0
        current.append(word)
        used += n
    if current:
        pieces.append(" ".join(current))
    return pieces


def record_id(gen: dict) -> str:
    """The record a generation belongs to (a chunk carries it; its own id names the request)."""
    return gen.get("record_id", gen["id"])


def is_chunk(gen: dict) -> bool:
    return "record_id" in gen


def chunk_generations(gen: dict, pieces: list[str]) -> list[dict]:
    # The request id only has to be unique within a round: record ids never contain NUL (validate
    # quarantines them), so `<id>\0chunk<i>` cannot meet another record's id. Nothing parses it back.
    return [
        {**gen, "id": f"{gen['id']}\x00chunk{i}", "record_id": gen["id"], "text": piece, "item_key": key}
        for i, (piece, key) in enumerate(zip(pieces, chunk_keys(gen["item_key"], len(pieces))))
    ]


def reduce_generation(gen: dict, summaries: list[str]) -> dict:
    """The summary of the summaries: the original key, its text replaced by the chunk summaries in order."""
    text = "\n\n".join(f"Part {i + 1} of {len(summaries)}: {s.strip()}" for i, s in enumerate(summaries))
    # `document`: what the final summary must be faithful to is the document, not its chunk summaries
    return {**gen, "text": text, "chunks": len(summaries), "document": gen.get("document", gen["text"])}
