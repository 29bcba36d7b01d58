"""Building engine requests, the first step of the generate stage: turn representatives into engine
requests, ordered for the engine (configured by the `requests:` section).

Prompts are rendered with the tier's chat template and tokenised here, once: the engine gets token
ids, so the lengths checked here are exactly what the engine sees. A prompt that does not fit the
tier's context is not sent (`too_long`). Within a tier, requests are ordered by their token ids so
prompts sharing a prefix (system prompt, template) run back to back and hit vLLM's prefix cache.
"""

from __future__ import annotations

from typing import Protocol

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import PromptConfig, RequestsConfig, SamplingConfig
from pipeline.generate.engine_api import plain_backend
from pipeline.ingest.batch import messages_for

REQUESTS = pa.schema(
    [
        ("id", pa.string()),
        ("tier", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("max_tokens", pa.int64()),
        (
            "shareable_tokens",
            pa.int64(),
        ),  # prompt tokens shared with its neighbour in sorted order: what prefix caching can skip
    ]
)
# Rows that cannot be sent: their prompt does not fit (`too_long`), or a batch request's messages are refused by
# the model's chat template (`invalid_request`: e.g. roles that do not alternate).
TOO_LONG = pa.schema([("id", pa.string()), ("detail", pa.string()), ("reason", pa.string())])


class Tokenizer(Protocol):
    def apply_chat_template(self, messages: list[dict], tokenize: bool, add_generation_prompt: bool) -> str: ...
    def __call__(self, texts: list[str], add_special_tokens: bool) -> dict: ...


def render_messages(text: str, prompt: PromptConfig) -> list[dict]:
    return [
        {"role": "system", "content": prompt.system},
        {"role": "user", "content": prompt.user.replace("{text}", text)},
    ]


def render_prompts(tokenizer: Tokenizer, texts: list[str], prompt: PromptConfig) -> list[str]:
    """Each text in the tier's chat template.

    The template is rendered once around a marker and each text put in its place (a Jinja render
    per document costs about 15 µs, seven times the concatenation). Templates may trim the content,
    so this is used only when no text has surrounding whitespace (validated texts have none) and
    the first and last texts render to the same strings in full; otherwise each is rendered alone.
    """

    def render(text: str) -> str:
        return tokenizer.apply_chat_template(render_messages(text, prompt), tokenize=False, add_generation_prompt=True)

    if not texts:
        return []
    marker = "\x00tokenmill:text\x00"
    around = render(marker)
    if around.count(marker) == 1 and all(t == t.strip() for t in texts):
        head, tail = around.split(marker)
        if all(head + t + tail == render(t) for t in {texts[0], texts[-1]}):
            return [head + t + tail for t in texts]
    return [render(t) for t in texts]


def render_rows(
    tokenizer: Tokenizer, texts: list[str], requests: list[dict | None], prompt: PromptConfig
) -> tuple[list[str | None], dict[int, str]]:
    """(each row's prompt, why a row has none). A document goes in the prompt template (render_prompts); a batch
    request's own messages take the text in the document's slot, or a completion request's prompt is given
    as is. A request whose messages the model's chat template refuses gets no prompt, only the reason."""
    out: list[str | None] = [None] * len(texts)
    refused: dict[int, str] = {}
    documents = [i for i, r in enumerate(requests) if r is None]
    for i, rendered in zip(documents, render_prompts(tokenizer, [texts[i] for i in documents], prompt)):
        out[i] = rendered
    for i, request in enumerate(requests):
        if request is None:
            continue
        if request["messages"] is None:
            out[i] = texts[i]
            continue
        try:
            out[i] = tokenizer.apply_chat_template(
                messages_for(request, texts[i]), tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # Jinja's raise_exception, or a template's own checks: this request only
            refused[i] = f"the model's chat template refused the messages: {e}"[:500]
    return out, refused


def requested_max_tokens(request: dict | None, default: int) -> int:
    """The output budget a batch request asks for, else the config's."""
    asked = request["params"]["max_tokens"] if request is not None and request["params"] else None
    return asked if asked is not None else default


def build_requests(
    records: pa.Table,
    prompt: PromptConfig,
    sampling: SamplingConfig,
    config: RequestsConfig,
    tokenizers: dict[str, Tokenizer],
    context_lengths: dict[str, int],
) -> tuple[pa.Table, pa.Table]:
    """(requests, too_long) for the representatives in `records` (rows with `duplicate_of` null)."""
    reps = records.filter(pc.is_null(records["duplicate_of"]))
    requests: list[pa.Table] = []
    unfit: list[tuple[str, str, str]] = []  # (id, detail, reason)
    for tier in sorted(set(reps["tier"].to_pylist())):
        tier_reps = reps.filter(pc.equal(reps["tier"], tier))
        tok, context = tokenizers[tier], context_lengths[tier]
        n = tier_reps.num_rows
        asks = tier_reps["request"].to_pylist() if "request" in tier_reps.column_names else [None] * n
        rendered, refused = render_rows(tok, tier_reps["text"].to_pylist(), asks, prompt)
        ids_of = tier_reps["id"].to_pylist()
        for i, why in refused.items():
            unfit.append((ids_of[i], why, "invalid_request"))
        rendered = [r if r is not None else "" for r in rendered]
        # A generation may ask for its own output budget (a schema retry asks for twice the usual), else
        # its batch request's, else the config's.
        own = tier_reps["max_tokens"].to_pylist() if "max_tokens" in tier_reps.column_names else [None] * n
        wanted = [m if m is not None else requested_max_tokens(r, sampling.max_tokens) for m, r in zip(own, asks)]
        budget = dict(zip(tier_reps["id"].to_pylist(), wanted))
        token_ids = tokenize(tok, rendered)
        kept = []
        for n_row, (id_, ids) in enumerate(zip(ids_of, token_ids)):
            if n_row in refused:
                continue
            if len(ids) >= context:  # at least one output token must fit
                unfit.append((id_, f"{len(ids)} prompt tokens; tier {tier} context is {context}", "too_long"))
            else:
                kept.append((ids, id_))
        # What prefix sharing allows in theory: each prompt's common prefix with its neighbour in sorted order.
        ordered = sorted(kept)
        shareable = {k[1]: common_prefix(ordered[i - 1][0], k[0]) if i else 0 for i, k in enumerate(ordered)}
        if config.prefix_ordering:
            kept = ordered  # shared prefixes adjacent: vLLM's prefix cache hits when they run back to back
        # Length-aware admission: long prompts after the short ones.
        group = [k for k in kept if len(k[0]) < config.long_prompt_tokens] + [
            k for k in kept if len(k[0]) >= config.long_prompt_tokens
        ]
        requests.append(
            pa.table(
                {
                    "id": [k[1] for k in group],
                    "tier": [tier] * len(group),
                    "prompt_token_ids": [k[0] for k in group],
                    "max_tokens": [min(budget[k[1]], context - len(k[0])) for k in group],
                    "shareable_tokens": [shareable[k[1]] for k in group],
                },
                schema=REQUESTS,
            )
        )
    table = pa.concat_tables(requests) if requests else REQUESTS.empty_table()
    return table, pa.Table.from_pylist([dict(zip(TOO_LONG.names, u)) for u in unfit], schema=TOO_LONG)


def tokenize(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of already-rendered prompts (no special tokens added: the template has them)."""
    if not texts:
        return []
    backend = plain_backend(tokenizer)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        # The Rust tokenizer without offsets: the same ids, about 30% faster than the Python wrapper.
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def common_prefix(a: list[int], b: list[int]) -> int:
    n, i, step = min(len(a), len(b)), 0, 64
    while i + step <= n and a[i : i + step] == b[i : i + step]:  # slices compare in C: skip shared blocks fast
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i
