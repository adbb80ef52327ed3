"""The FastAPI application: routes, health and metrics, behind the security middleware
(Host/Origin checks, API key, body limits: ``security.py``)."""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI, Query, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from mlx_engine import __version__
from mlx_engine.embeddings import EmbeddingModel
from mlx_engine.engine import Engine
from mlx_engine.sampling.constraints import GrammarFactory

from . import anthropic, anthropic_errors, errors, responses
from .anthropic_protocol import CountTokensRequest, MessagesRequest
from .chat import chat_completions
from .common import ServerState
from .completions import completions
from .embeddings import EmbeddingBatcher, EmbeddingRequest, embeddings
from .metrics import Metrics, ModelMetrics
from .model_routes import anthropic_error_frame, openai_error_frame, responses_error_frame, with_model
from .models_api import install_model_routes
from .ollama import install_ollama_routes
from .protocol import ChatCompletionRequest, CompletionRequest
from .registry import ModelRegistry, ServedModel, keep_alive_seconds
from .responses_protocol import ResponsesRequest
from .security import SecurityMiddleware, SecurityPolicy
from .tokenize import install_tokenize_routes


def server_state(
    engine: Engine,
    ids: tuple[str, ...],
    *,
    api_key: str | None = None,
    max_tokens: int | None = None,
    embedding_ids: tuple[str, ...] = (),
) -> ServerState:
    """One loaded model's state: its engine, metrics, grammar factory and the names it answers to."""
    ids = tuple(dict.fromkeys([i for i in ids if i])) or (engine.model_name,)
    state = ServerState(engine, Metrics(engine), GrammarFactory(engine.tokenizer), ids, api_key)
    state.max_tokens = max_tokens
    state.embedding_ids = embedding_ids
    state.fingerprint  # noqa: B018  (hash the weights now, not during the first response)
    return state


def create_app(
    engine: Engine | None = None,
    *,
    registry: ModelRegistry | None = None,
    api_key: str | None = None,
    aliases: tuple[str, ...] = (),
    security: SecurityPolicy | None = None,
    docs: bool = False,
    embedder: EmbeddingModel | None = None,
    embedding_aliases: tuple[str, ...] = (),
    max_tokens: int | None = None,
) -> FastAPI:
    """The server for ``engine`` (one model, loaded for the server's life) or for the models of
    ``registry`` (loaded on first use, unloaded when idle: ``registry.py``).

    ``aliases``: other names clients may use for ``engine``'s model (e.g. the --model path).
    ``security``: Host/Origin allowlists, API key and body limits (default: loopback only, no
    key, unless ``api_key`` is given). ``docs``: serve /docs, /redoc and /openapi.json.
    ``embedder``: an embedding model served at /v1/embeddings beside the chat models (its name,
    then ``embedding_aliases``, are the ids clients use). ``max_tokens``: the most tokens any reply
    may have, on every endpoint, whatever a request asks for (None: until the model stops or the
    context is full)."""
    policy = security if security is not None else SecurityPolicy.build(api_key=api_key)
    embedding_ids: tuple[str, ...] = ()
    if embedder is not None:
        embedding_ids = tuple(dict.fromkeys([embedder.name, *[a for a in embedding_aliases if a]]))
    pinned: ServerState | None = None
    if engine is not None:
        if registry is not None:
            raise ValueError("give an engine or a registry, not both")
        pinned = server_state(
            engine,
            (engine.model_name, *aliases),
            api_key=policy.api_key,
            max_tokens=max_tokens,
            embedding_ids=embedding_ids,
        )
        model = ServedModel(pinned.model_id, None, pinned.model_ids[1:], pinned=True)
        registry = ModelRegistry([model], _no_loader, max_loaded=1)
        registry.adopt(model, pinned)
    if registry is None:
        raise ValueError("create_app needs an engine or a registry")
    served: ModelRegistry = registry
    served.embedding_ids = embedding_ids
    if pinned is None:
        pinned = next((m.state for m in served.loaded() if m.model.pinned), None)
    embedding_name = embedding_ids[0] if embedding_ids else None
    metrics = ModelMetrics(served, Metrics(None) if embedding_ids else None, embedding_name)
    runner = pinned.engine.run_on_worker if pinned is not None else None
    batcher = EmbeddingBatcher(embedder, runner) if embedder is not None else None
    app = FastAPI(
        title="Duet",
        version=__version__,
        description="OpenAI-compatible API for local models",
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.duet = pinned  # the model loaded for the server's life, if there is one
    app.state.models = served
    app.state.embeddings = batcher
    errors.install(app)
    _anthropic_errors_on_messages_paths(app)
    # add_middleware puts the last one added outermost: the security checks run first, and the
    # CORS middleware (only for --allowed-origins) answers the preflights they let through
    if policy.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=["*"] if "*" in policy.allowed_origins else sorted(policy.allowed_origins),
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=[
                "authorization",
                "content-type",
                "x-api-key",
                "anthropic-version",
                "anthropic-beta",
            ],
            max_age=600,
        )
    app.add_middleware(SecurityMiddleware, policy=policy)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> PlainTextResponse:
        # what clients probe at start (Claude Code sends HEAD /), as Ollama's "Ollama is running";
        # open without the API key, so it names nothing (the model is /v1/models's)
        return PlainTextResponse("Duet is running\n")

    @app.get("/health")
    async def health() -> dict:
        running = waiting = 0
        for m in served.loaded():
            s = m.state.engine.stats()
            running, waiting = running + s.running, waiting + s.waiting
        model = pinned.model_id if pinned is not None else None
        loaded = [m.model.name for m in served.loaded()]
        return {"status": "ok", "model": model, "loaded": loaded, "running": running, "waiting": waiting}

    @app.get("/metrics")
    async def metrics_page() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def api(method: str, path: str, slash: bool = True):
        """Register an API route at ``/v1/...`` and, as clients differ on both, without the
        ``/v1`` prefix and with a trailing slash (instead of a redirect POST clients do not follow)."""
        paths = list(dict.fromkeys([path, path.removeprefix("/v1")]))
        if slash:
            paths += [p + "/" for p in paths]

        def register(endpoint):
            for i, p in enumerate(paths):
                app.add_api_route(p, endpoint, methods=[method], include_in_schema=i == 0)
            return endpoint

        return register

    install_model_routes(app, api, served, embedding_ids)
    install_ollama_routes(app, served, batcher, metrics, embedding_ids)
    install_tokenize_routes(api, served)

    @api("POST", "/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await with_model(
            served,
            body.model,
            lambda state: chat_completions(state, body, request),
            stream_errors=openai_error_frame if body.stream else None,
            keep_alive=_ttl(body),
        )

    @api("POST", "/v1/completions")
    async def complete(body: CompletionRequest, request: Request) -> Response:
        return await with_model(
            served,
            body.model,
            lambda state: completions(state, body, request),
            stream_errors=openai_error_frame if body.stream else None,
            keep_alive=_ttl(body),
        )

    @api("POST", "/v1/messages")
    async def anthropic_messages(body: MessagesRequest, request: Request) -> Response:
        return await with_model(
            served,
            body.model,
            lambda state: anthropic.messages(state, body, request),
            stream_errors=anthropic_error_frame if body.stream else None,
        )

    @api("POST", "/v1/messages/count_tokens")
    async def anthropic_count_tokens(body: CountTokensRequest, request: Request) -> Response:
        return await with_model(
            served, body.model, lambda state: anthropic.count_tokens(state, body, request)
        )

    @api("POST", "/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest) -> JSONResponse:
        return await embeddings(served, batcher, metrics.embedding, embedding_ids, body)

    # each key its own share: one key's responses never evict another's (with no key: one share)
    store = responses.ResponseStore(responses.MAX_ITEMS, responses.MAX_CHARS, shares=len(policy.api_keys))

    @api("POST", "/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        model = body.model or (pinned.model_id if pinned is not None else None)
        return await with_model(
            served,
            model,
            lambda state: responses.create(state, store, body, request),
            stream_errors=responses_error_frame if body.stream else None,
        )

    @api("GET", "/v1/responses/{response_id}", slash=False)
    async def get_response(response_id: str, request: Request) -> JSONResponse:
        stored = store.get(response_id, responses.owner_of(request))
        if stored is None:
            raise responses.not_found(response_id)
        return JSONResponse(stored.response)

    @api("DELETE", "/v1/responses/{response_id}", slash=False)
    async def delete_response(response_id: str, request: Request) -> JSONResponse:
        if not store.delete(response_id, responses.owner_of(request)):
            raise responses.not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @api("GET", "/v1/responses/{response_id}/input_items", slash=False)
    async def response_input_items(
        response_id: str,
        request: Request,
        limit: int = Query(20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> JSONResponse:
        stored = store.get(response_id, responses.owner_of(request))
        if stored is None:
            raise responses.not_found(response_id)
        return JSONResponse(responses.input_items_page(stored, limit, order, after))

    return app


def _no_loader(model: ServedModel) -> ServerState:
    raise AssertionError(f"{model.name} is loaded for the server's life; nothing loads here")


def _ttl(body: object) -> float | None | object:
    """LM Studio's per-request ``ttl`` (seconds idle before the model unloads); ``...`` when absent."""
    extra = getattr(body, "model_extra", None) or {}
    ttl = extra.get("ttl")
    if ttl is None:
        return ...
    return keep_alive_seconds(ttl, "ttl")


def _anthropic_errors_on_messages_paths(app: FastAPI) -> None:
    """The Messages routes answer errors in Anthropic's shape: wrap each error handler."""
    for exc_class, handler in list(app.exception_handlers.items()):

        async def wrapped(request: Request, exc: Exception, handler=handler) -> Response:
            response = await handler(request, exc)
            if anthropic_errors.is_anthropic_path(request.url.path):
                return anthropic_errors.reshape(response)
            return response

        app.exception_handlers[exc_class] = wrapped
