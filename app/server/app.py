"""The FastAPI application: routes, API-key check, health and metrics."""

from __future__ import annotations

import hmac

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mlx_engine import __version__
from mlx_engine.constraints import GrammarFactory
from mlx_engine.engine import Engine

from . import errors
from .chat import chat_completions
from .common import ServerState
from .completions import completions
from .errors import APIError
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest


def create_app(engine: Engine, *, api_key: str | None = None, aliases: tuple[str, ...] = ()) -> FastAPI:
    """``aliases``: other names clients may use for the served model (e.g. the --model path)."""
    ids = tuple(dict.fromkeys([engine.model_name, *[a for a in aliases if a]]))
    state = ServerState(engine, Metrics(engine), GrammarFactory(engine.tokenizer), ids, api_key)
    app = FastAPI(title="Duet", version=__version__, description="OpenAI-compatible API for a local model")
    app.state.duet = state
    errors.install(app)

    async def check_key(request: Request) -> None:
        if state.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), state.api_key.encode()
        ):
            raise APIError(
                401,
                "Incorrect API key provided." if auth else "Missing API key: send Authorization: Bearer KEY.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    auth = [Depends(check_key)]

    def model_card() -> dict:
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "duet"}

    @app.get("/health")
    async def health() -> dict:
        s = engine.stats()
        return {"status": "ok", "model": state.model_id, "running": s.running, "waiting": s.waiting}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=auth)
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", dependencies=auth)
    async def get_model(model: str) -> JSONResponse:
        state.check_model(model)
        return JSONResponse(model_card())

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat_completions(state, body, request)

    @app.post("/v1/completions", dependencies=auth)
    async def complete(body: CompletionRequest, request: Request) -> Response:
        return await completions(state, body, request)

    return app
