"""Generations that follow others in a partition: escalation of low-confidence outputs, and map-reduce
of documents longer than the tier's context.

Both are keyed from the item key they follow (`plan.derived_key`), so they are stored, reused and
cached like any generation, and a rerun finds them instead of paying again:
  escalation   item K on a smaller tier whose mean token log-probability is below the threshold (or
               that is empty, or was cut off by max_tokens) is generated again on the escalation tier;
               the record gets K>esc's output and pays for both attempts;
  map-reduce   a document whose prompt does not fit is cut into chunks that do (K>chunk>i), each
               summarised, then the chunk summaries are summarised as K itself; the record pays for
               every call and is marked with its chunk count.
"""

from __future__ import annotations

from pipeline.config import TokenmillConfig
from pipeline.plan import derived_key, render_messages


def escalation_key(key: str, tier: str) -> str:
    return derived_key(key, "escalate", tier)


def chunk_keys(key: str, n: int) -> list[str]:
    return [derived_key(key, "chunk", i) for i in range(n)]


def needs_escalation(item: dict, config: TokenmillConfig) -> bool:
    e, to = config.route.escalation, config.escalation_tier
    if to is None or item["tier"] == to or item.get("chunks"):
        return False
    low = item.get("mean_logprob") is not None and item["mean_logprob"] < e.min_mean_logprob
    empty = not (item.get("summary") or "").strip()  # an output check no log-probability catches
    return low or empty or (e.on_truncation and item["finish_reason"] == "length")


def final_output(key: str, items: dict[str, dict], config: TokenmillConfig) -> tuple[dict | None, list[dict], bool]:
    """(the item whose output a record with `key` gets, every item paid to make it, escalated?).

    An escalation that failed (its tier could not take the prompt, or the engine failed) leaves the
    first attempt's output in place: the record is still served, and pays for what ran.
    """
    item = items.get(key)
    if item is None:
        return None, [], False
    paid = [item] + [items[k] for k in chunk_keys(key, item.get("chunks") or 0) if k in items]
    if needs_escalation(item, config):
        second = items.get(escalation_key(key, config.escalation_tier))
        if second is not None:
            return second, paid + [second], True
    return item, paid, False


def related_keys(keys: list[str], items: dict[str, dict], config: TokenmillConfig) -> list[str]:
    """Keys whose items complete the picture of `keys`: their chunks and their escalations."""
    out = []
    for key in keys:
        item = items.get(key)
        if item is None:
            continue
        out.extend(chunk_keys(key, item.get("chunks") or 0))
        if needs_escalation(item, config):
            out.append(escalation_key(key, config.escalation_tier))
    return out


def split_for_context(text: str, tokenizer, prompt, context: int, max_tokens: int) -> list[str]:
    """Cut `text` into pieces whose rendered prompts leave `max_tokens` of room in `context`."""
    overhead = len(tokenizer(
        [tokenizer.apply_chat_template(render_messages("", prompt), tokenize=False, add_generation_prompt=True)],
        add_special_tokens=False)["input_ids"][0])
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


def chunk_units(unit: dict, pieces: list[str]) -> list[dict]:
    return [{**unit, "id": f"{unit['id']}#chunk{i}", "text": piece, "item_key": key}
            for i, (piece, key) in enumerate(zip(pieces, chunk_keys(unit["item_key"], len(pieces))))]


def reduce_unit(unit: dict, summaries: list[str]) -> dict:
    """The summary of the summaries: the original key, its text replaced by the chunk summaries in order."""
    text = "\n\n".join(f"Part {i + 1} of {len(summaries)}: {s.strip()}" for i, s in enumerate(summaries))
    return {**unit, "text": text, "chunks": len(summaries)}
