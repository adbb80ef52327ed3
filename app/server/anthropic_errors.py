"""Errors in Anthropic's shape for the Messages routes:
``{"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}``.

The server raises one kind of error (``errors.APIError``, OpenAI-shaped); on the Messages paths
the app's handlers and the security middleware re-spell it with these helpers.
"""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse, Response

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_MESSAGES_PATHS = frozenset({"/messages", "/messages/count_tokens"})


def is_anthropic_path(path: str) -> bool:
    """``/v1/messages`` and ``/v1/messages/count_tokens``, with or without ``/v1`` and a
    trailing slash, as the routes answer."""
    p = path.removeprefix("/v1").rstrip("/")
    return p in _MESSAGES_PATHS


def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def error_event(status: int, message: str) -> str:
    """The error as a Messages stream's SSE event (after the response headers went out)."""
    return f"event: error\ndata: {json.dumps(error_body(status, message))}\n\n"


def reshape(response: Response) -> Response:
    """An OpenAI-shaped JSON error response, re-spelled in Anthropic's shape (same status and headers)."""
    try:
        body = json.loads(bytes(response.body))
        message = str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response
    headers = {
        k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")
    }
    return JSONResponse(error_body(response.status_code, message), response.status_code, headers=headers)
