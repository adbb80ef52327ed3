"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

An unexpected exception (a bug, not a bad request) answers 500 ``internal error`` and nothing
more: its text and traceback go to the server log, once, never to the client.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlx_engine.errors import ContextLengthError, DuetError, EngineShutDownError, QueueFullError, RequestError

log = logging.getLogger("duet.server")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def queue_full(message: str) -> APIError:
    return APIError(
        429, message, type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"}
    )


def internal_error() -> APIError:
    return APIError(500, "internal error", type="server_error")


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error", code="service_unavailable")


def from_duet_error(e: BaseException) -> APIError:
    """The one mapping of the engine's errors onto HTTP: a bad request 400 (a prompt past the context
    ``context_length_exceeded``), a full queue 429, shutting down 503, anything else 500 (logged)."""
    if isinstance(e, RequestError):
        code = "context_length_exceeded" if isinstance(e, ContextLengthError) else None
        return bad_request(str(e), e.param, code)
    if isinstance(e, QueueFullError):
        return queue_full(str(e))
    if isinstance(e, EngineShutDownError):
        return shutting_down()
    log.error("a request failed", exc_info=e)
    return internal_error()


def _loc(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or None


def _validation_message(err: dict) -> str:
    if err.get("type") == "json_invalid":
        return "We could not parse the JSON body of your request: " + str(
            err.get("ctx", {}).get("error", "invalid JSON")
        )
    if err.get("type") == "model_attributes_type" and tuple(err.get("loc", ())) == ("body",):
        return "The request body must be a JSON object"
    if err.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {_loc(tuple(err.get('loc', ())))}"
    where = _loc(tuple(err.get("loc", ())))
    return f"{where}: {err.get('msg')}" if where else str(err.get("msg"))


class GuardedRoute(APIRoute):
    """A route whose unexpected exceptions become a 500 ``internal error``, logged here once with
    the traceback. (An exception handler for ``Exception`` cannot do that: Starlette re-raises the
    exception after it answers, so the server logs the traceback a second time.) Exceptions with
    a handler of their own (APIError, validation, HTTP errors) pass through to it."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def guarded(request: Request):
            try:
                return await handler(request)
            except Exception as e:
                handlers = request.app.exception_handlers
                if any(cls in handlers for cls in type(e).__mro__ if cls is not Exception):
                    raise
                log.exception("unexpected error while serving %s %s", request.method, request.url.path)
                return internal_error().response()

        return guarded


def install(app: FastAPI) -> None:
    """Error handlers, and ``GuardedRoute`` for every route added from now on."""
    app.router.route_class = GuardedRoute

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(DuetError)  # raised anywhere below a route: one mapping, no re-raising by hand
    async def _duet_error(request: Request, exc: DuetError):
        return from_duet_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        # a body that is not a JSON object at all reports one error at ("body",)
        first = errors[0] if errors else {"msg": "invalid request"}
        msg = _validation_message(first)
        if len(errors) > 1:
            msg += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        param = None if first.get("type") == "json_invalid" else _loc(tuple(first.get("loc", ())))
        if first.get("type") in ("invalid_unicode", "too_deep"):  # found walking the body: it names the field
            ctx = first.get("ctx")
            param = ctx.get("param") if isinstance(ctx, dict) else None
        return bad_request(msg, param, first.get("type")).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(
            exc.status_code, str(exc.detail), type=kind, headers=getattr(exc, "headers", None)
        ).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # outside a route (in a middleware): Starlette re-raises after this answer and the server
        # logs the traceback, so it is not logged here too
        return internal_error().response()
