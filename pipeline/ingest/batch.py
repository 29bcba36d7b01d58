"""Ingest, batch requests: the lines of an OpenAI batch file or an Anthropic Message Batches file as records.

OpenAI batch JSONL (what `vllm run-batch`, SGLang, LiteLLM and OpenAI's Batch API read):
  {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": ..., "messages": [...]}}
  (`/v1/completions` takes `body.prompt`, a string, instead of messages)
Anthropic Message Batches requests:
  {"custom_id": "r1", "params": {"model": ..., "max_tokens": 256, "system": ..., "messages": [...]}}

A request becomes a record: `id` is its `custom_id`; `text` is the document, the text of its last user
message (or the completion prompt), so that dedup, routing and the cache work on it as on any document;
`request` is the rest (`REQUEST_FIELDS`, the Arrow struct `schema.REQUEST`): the messages with the document's
slot empty, the model asked for and the sampling parameters. This is the one place a request's JSON is read:
every later step reads the struct. The prompt template is for document records; a request's
messages are used as given. Whatever a request asks that tokenmill does not do is refused by name (the
record is quarantined with `unsupported_request` and a detail naming the field), never ignored, except the
fields that do not change an answer (`IGNORED`).
"""

from __future__ import annotations

import json
import math

# What a parsed request keeps (the record's `request` column, a `schema.REQUEST` struct).
REQUEST_FIELDS = ("format", "endpoint", "model", "messages", "document", "params")
OPENAI_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
ANTHROPIC_ENDPOINT = "/v1/messages"
# Body fields that change nothing in the answer: accepted, not used (`metadata.tenant` names the tenant).
IGNORED = {"user", "metadata", "store", "service_tier"}
# Fields refused by name: features tokenmill does not implement. A request asking for one is quarantined.
REFUSED = {
    "tools": "tool calling",
    "tool_choice": "tool calling",
    "functions": "function calling",
    "function_call": "function calling",
    "parallel_tool_calls": "tool calling",
    "logprobs": "log-probabilities in the answer",
    "top_logprobs": "log-probabilities in the answer",
    "logit_bias": "logit bias",
    "audio": "audio output",
    "modalities": "output modalities",
    "prediction": "predicted outputs",
    "web_search_options": "web search",
    "reasoning_effort": "reasoning effort",
    "echo": "echoing the prompt",
    "best_of": "best-of sampling",
    "suffix": "suffix completion",
    "thinking": "extended thinking",
    "top_k": "top-k sampling",
    "tool_use": "tool use",
    "mcp_servers": "MCP servers",
    "container": "code execution containers",
}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_TOKENS = 2**31 - 1  # a request's max_tokens at most (far past any context; its column is int64)


class RequestError(ValueError):
    """A batch line that is not a request tokenmill runs: `reason` is its quarantine reason code."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def batch_format(obj: object) -> str | None:
    """ "openai" or "anthropic" when `obj` (a parsed JSONL line) is a batch request line, else None."""
    if isinstance(obj, dict) and "custom_id" in obj:
        if "params" in obj and "body" not in obj:
            return "anthropic"
        return "openai"
    return None


def parse_request(obj: dict, fmt: str) -> dict:
    """(id, text, tenant, request) of one batch line, the request a `schema.REQUEST` value; RequestError when it
    cannot run as given."""
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise RequestError("missing_id", "`custom_id` is missing, empty or not a string")
    if fmt == "anthropic":
        body, endpoint = obj.get("params"), ANTHROPIC_ENDPOINT
        unknown = set(obj) - {"custom_id", "params"}
    else:
        body, endpoint = obj.get("body"), obj.get("url")
        unknown = set(obj) - {"custom_id", "method", "url", "body"}
        if obj.get("method", "POST") != "POST":
            raise RequestError("unsupported_request", f"`method` is {obj.get('method')!r}; batch requests are POST")
        if endpoint not in OPENAI_ENDPOINTS:
            raise RequestError("unsupported_request", f"`url` {endpoint!r} is not one of {', '.join(OPENAI_ENDPOINTS)}")
    if unknown:
        raise RequestError("unsupported_request", f"unknown line fields {sorted(unknown)}")
    if not isinstance(body, dict):
        raise RequestError("invalid_request", f"`{'params' if fmt == 'anthropic' else 'body'}` is not an object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("invalid_request", "`model` is missing or not a string")
    for name, what in REFUSED.items():
        if name in body and body[name] not in (None, False):
            raise RequestError("unsupported_request", f"`{name}` ({what}) is not supported")
    if fmt == "openai" and body.get("stream"):
        raise RequestError("unsupported_request", "`stream` is not supported in a batch")
    if body.get("n", 1) != 1:
        raise RequestError("unsupported_request", f"`n` is {body.get('n')!r}; only one answer per request (n = 1)")
    if endpoint == "/v1/completions":
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError("invalid_request", "`prompt` must be one string (lists of prompts are not supported)")
        messages, document, text = None, None, prompt
    else:
        messages, document, text = _messages(body, fmt)
    own = {"system", "stop_sequences"} if fmt == "anthropic" else {"prompt", "stream", "n", "stop"}
    known = {"model", "messages", *own, *IGNORED, *PARAMS}
    extra = sorted(set(body) - known - set(REFUSED))
    if extra:
        raise RequestError("unsupported_request", f"unsupported fields {extra}")
    request = {
        "format": fmt,
        "endpoint": endpoint,
        "model": model,
        "messages": messages,
        "document": document,
        "params": _params(body, fmt),
    }
    metadata = body.get("metadata")
    tenant = metadata.get("tenant") if isinstance(metadata, dict) else None
    if tenant is not None and not isinstance(tenant, str):
        raise RequestError("invalid_tenant", "`metadata.tenant` is not a string")
    return {"id": custom_id, "text": text, "tenant": tenant, "request": request}


def canonical(value: dict) -> str:
    """A JSON object as one text for equal objects (a response format's schema)."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _content(content, where: str) -> str:
    """A message's text: a string, or a list of text parts (joined); images, audio and files are refused."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise RequestError("unsupported_request", f"{where}: a content part of type {kind!r} (text only)")
            texts.append(part["text"])
        return "\n".join(texts)
    raise RequestError("invalid_request", f"{where}: `content` is not a string or a list of text parts")


def _messages(body: dict, fmt: str) -> tuple[list[dict], int, str]:
    """(messages with the document's content None, the document's index, the document)."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("invalid_request", "`messages` is missing or empty")
    messages = []
    if fmt == "anthropic" and body.get("system") is not None:
        messages.append({"role": "system", "content": _content(body["system"], "`system`")})
    for i, m in enumerate(raw):
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str) or role not in ROLES:
            raise RequestError("unsupported_request", f"message {i}: role {role!r} (system, user, assistant only)")
        if fmt == "anthropic" and ROLES[m["role"]] == "system":
            raise RequestError("invalid_request", f"message {i}: Anthropic requests put the system prompt in `system`")
        messages.append({"role": ROLES[m["role"]], "content": _content(m.get("content"), f"message {i}")})
    if messages[-1]["role"] == "assistant":
        raise RequestError("unsupported_request", "a final assistant message (a prefill to continue)")
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise RequestError("invalid_request", "no user message")
    document = users[-1]
    text = messages[document]["content"]
    messages[document] = {"role": "user", "content": None}
    return messages, document, text


# The sampling fields a request may set (`stop` is `stop_sequences` in Anthropic's format).
PARAMS = (
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "response_format",
    "presence_penalty",
    "frequency_penalty",
)


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError("invalid_request", f"`{name}` is not a number")
    if (
        isinstance(value, int)
        and not -(2**53) <= value <= 2**53
        or isinstance(value, float)
        and not math.isfinite(value)
    ):
        raise RequestError("invalid_request", f"`{name}` is out of range")
    if not low <= value <= high:
        raise RequestError("invalid_request", f"`{name}` is {value}; it must be within [{low}, {high}]")
    return value


def _params(body: dict, fmt: str) -> dict:
    """The sampling parameters a request sets (unset ones are left out: the config's apply)."""
    out: dict = {}
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(name)
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_TOKENS:
            raise RequestError("invalid_request", f"`{name}` is {max_tokens!r}; an integer within [1, {MAX_TOKENS}]")
        out["max_tokens"] = max_tokens
    elif fmt == "anthropic":
        raise RequestError("invalid_request", "`max_tokens` is required in Anthropic requests")
    for name, low, high in (
        ("temperature", 0.0, 2.0),
        ("top_p", 1e-9, 1.0),
        ("presence_penalty", -2.0, 2.0),
        ("frequency_penalty", -2.0, 2.0),
    ):
        value = _number(body, name, low, high)
        if value is not None:
            out[name] = float(value)
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**63:
            raise RequestError("invalid_request", "`seed` is not a 64-bit integer")
        out["seed"] = seed
    stop = body.get("stop_sequences" if fmt == "anthropic" else "stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
            raise RequestError("invalid_request", f"`stop` must be a string or up to {MAX_STOP} non-empty strings")
        if stop:
            out["stop"] = stop
    schema = _response_format(body.get("response_format"))
    if schema is not None:
        out["json_schema"] = canonical(schema)
    return out


def _response_format(value) -> dict | None:
    """The JSON schema a `response_format` asks for (None: free text)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        inner = value.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("invalid_request", "`response_format.json_schema.schema` is not an object")
        return schema
    raise RequestError("unsupported_request", f"`response_format` of type {kind!r} (text, json_object, json_schema)")


def messages_for(request: dict, text: str) -> list[dict]:
    """The chat messages of a parsed request with `text` in the document's slot."""
    messages = [dict(m) for m in request["messages"]]
    messages[request["document"]]["content"] = text
    return messages
