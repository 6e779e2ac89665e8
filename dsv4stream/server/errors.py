"""Error bodies in the shape of the API a path belongs to.

OpenAI: `{"error": {"message", "type", "param", "code"}}`. Anthropic (`/v1/messages...`):
`{"type": "error", "error": {"type", "message"}}`, with Anthropic's type names for the
statuses its clients map to exceptions. Every refusal, from a route or the `security`
guard or an unknown path, goes through `error_json`.
"""

from __future__ import annotations

from typing import Any

# Anthropic's error type for each status its API documents
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def openai_error(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_json(
    path: str, message: str, kind: str, code: str | None = None, status: int = 400, param: str | None = None
) -> dict[str, Any]:
    if is_anthropic(path):
        return anthropic_error(status, message)
    return openai_error(message, kind, code, param)
