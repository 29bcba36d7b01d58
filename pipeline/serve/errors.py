"""The Batch API's errors, in the shape the caller's SDK reads: OpenAI's error object, or Anthropic's under
/v1/messages/ (its Message Batches API). Every error the server answers goes through `error_response`, the
framework's own too (an unknown route, a wrong method, a body too large, a field of the wrong type)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

ANTHROPIC_PATHS = "/v1/messages/"
# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors); 5xx: api_error.
ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def error_body(path: str, status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    if path.startswith(ANTHROPIC_PATHS):
        default = "api_error" if status >= 500 else "invalid_request_error"
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, default), "message": message}}
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(path: str, status: int, message: str, code: str | None = None, param: str | None = None):
    return JSONResponse(error_body(path, status, message, code, param), status_code=status)
