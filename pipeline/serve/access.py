"""Who may call the Batch API and what a call may send: the caller's key names its tenant (`tenant`, a
`Security` dependency every route has first), and a body is capped (`BodyCap` as it streams in,
`declared_length` by its `content-length`) and read only after the key was checked (`json_body`)."""

from __future__ import annotations

import hashlib

from fastapi import Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ValidationError

from pipeline.config import ServeConfig
from pipeline.serve.errors import ApiError, error_response


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class _TooLarge(Exception):
    pass


MAX_BODY = 1 << 20  # any body but an upload's


def body_cap(method: str, path: str, limits: ServeConfig) -> int:
    """The most bytes a request's body may carry: an upload `serve.max_file_bytes` plus the multipart
    envelope, any other body MAX_BODY."""
    return limits.max_file_bytes + 65536 if method == "POST" and path == "/v1/files" else MAX_BODY


def too_large(path: str, cap: int):
    return error_response(path, 413, too_large_message(cap), "too_large")


def too_large_message(cap: int) -> str:
    return f"request body over {cap} bytes (serve.max_file_bytes for uploads)"


class BodyCap:
    """A body may not exceed its cap (`body_cap`, 413), counted as it streams in, whatever `content-length`
    says (a chunked upload has none). Nothing is read here: a route reads its body only after the caller's key
    was checked (`tenant`), and what it reads past the cap ends the request."""

    def __init__(self, app, limits: ServeConfig):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        cap = body_cap(scope["method"], scope["path"], self.limits)
        received, started = 0, False

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > cap:
                raise _TooLarge
            return message

        async def sending(message):
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except _TooLarge:
            if not started:
                await too_large(scope["path"], cap)(scope, receive, send)


bearer = HTTPBearer(auto_error=False)  # OpenAI's header: `Authorization: Bearer <key>`
api_key = APIKeyHeader(name="x-api-key", auto_error=False)  # Anthropic's


def tenant(
    request: Request,
    token: HTTPAuthorizationCredentials | None = Security(bearer),
    key: str | None = Security(api_key),
) -> str:
    """The caller's tenant, named by its key's SHA-256 (`x-api-key`, else the bearer token); 401 for no key
    or an unknown one. Every route depends on it first: a body is read only once its key is known."""
    given = (key or "").strip() or (token.credentials.strip() if token is not None else "")
    name = request.app.state.tenants.get(key_digest(given)) if given else None
    if name is None:
        message = "no API key, or an unknown one: send `Authorization: Bearer <key>` or `x-api-key: <key>`"
        raise ApiError(401, message, "invalid_api_key")
    return name


def declared_length(request: Request, who: str = Security(tenant)) -> None:
    """A body that declares more than its cap (`content-length`) is refused (413) without reading it."""
    cap = body_cap(request.method, request.url.path, request.app.state.limits)
    if int(request.headers.get("content-length") or 0) > cap:
        raise ApiError(413, too_large_message(cap), "too_large")


def json_body(model: type[BaseModel]):
    """A dependency giving the request's JSON body as `model`, read after the key was checked (a body parameter
    would be read by the framework before any dependency); a body that is not `model` is a 400 as the
    framework's own validation answers it."""

    async def parsed(request: Request, who: str = Security(tenant)) -> BaseModel:
        try:
            return model.model_validate_json(await request.body())
        except ValidationError as e:
            errors = e.errors(include_url=False, include_context=False, include_input=False)
            raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in errors]) from None

    return parsed
