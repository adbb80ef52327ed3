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
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses_protocol import ResponsesRequest
from .security import SecurityMiddleware, SecurityPolicy


def create_app(
    engine: Engine,
    *,
    api_key: str | None = None,
    aliases: tuple[str, ...] = (),
    security: SecurityPolicy | None = None,
    docs: bool = False,
    embedder: EmbeddingModel | None = None,
    embedding_aliases: tuple[str, ...] = (),
    max_tokens: int | None = None,
) -> FastAPI:
    """``aliases``: other names clients may use for the served model (e.g. the --model path).
    ``security``: Host/Origin allowlists, API key and body limits (default: loopback only, no
    key, unless ``api_key`` is given). ``docs``: serve /docs, /redoc and /openapi.json.
    ``embedder``: an embedding model served at /v1/embeddings beside the chat model (its name,
    then ``embedding_aliases``, are the ids clients use). ``max_tokens``: the most tokens any reply
    may have, on every endpoint, whatever a request asks for (None: until the model stops or the
    context is full)."""
    policy = security if security is not None else SecurityPolicy.build(api_key=api_key)
    ids = tuple(dict.fromkeys([engine.model_name, *[a for a in aliases if a]]))
    state = ServerState(engine, Metrics(engine), GrammarFactory(engine.tokenizer), ids, policy.api_key)
    state.max_tokens = max_tokens
    if embedder is not None:
        state.embedding_ids = tuple(dict.fromkeys([embedder.name, *[a for a in embedding_aliases if a]]))
    batcher = EmbeddingBatcher(engine, embedder) if embedder is not None else None
    state.fingerprint  # noqa: B018  (hash the weights now, not during the first response)
    app = FastAPI(
        title="Duet",
        version=__version__,
        description="OpenAI-compatible API for a local model",
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.duet = state
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

    def model_card(embedding: bool = False) -> dict:
        """A model and what it can do: chat (chat completions, completions, messages, responses)
        or embeddings."""
        return {
            "id": state.embedding_ids[0] if embedding else state.model_id,
            "object": "model",
            "created": state.created,
            "owned_by": "duet",
            "capabilities": ["embeddings"] if embedding else ["chat", "completions", "tools"],
        }

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> PlainTextResponse:
        # what clients probe at start (Claude Code sends HEAD /), as Ollama's "Ollama is running";
        # open without the API key, so it names nothing (the model is /v1/models's)
        return PlainTextResponse("Duet is running\n")

    @app.get("/health")
    async def health() -> dict:
        s = engine.stats()
        return {"status": "ok", "model": state.model_id, "running": s.running, "waiting": s.waiting}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def api(method: str, path: str, slash: bool = True):
        """Register an API route at ``/v1/...`` and, as clients differ on both, without the
        ``/v1`` prefix and with a trailing slash (instead of a redirect POST clients do not follow)."""
        paths = [path, path.removeprefix("/v1")]
        if slash:
            paths += [p + "/" for p in paths]

        def register(endpoint):
            for i, p in enumerate(paths):
                app.add_api_route(p, endpoint, methods=[method], include_in_schema=i == 0)
            return endpoint

        return register

    @api("GET", "/v1/models")  # before /v1/models/{model}, which "/v1/models/" would match
    async def list_models() -> dict:
        return {
            "object": "list",
            "data": [model_card(), *([model_card(True)] if state.embedding_ids else [])],
        }

    @api("GET", "/v1/models/{model:path}", slash=False)  # the path parameter takes any slash
    async def get_model(model: str) -> JSONResponse:
        model = model.removesuffix("/")
        if model in state.embedding_ids and model not in state.model_ids:
            return JSONResponse(model_card(True))
        state.check_model(model)
        return JSONResponse(model_card())

    @api("POST", "/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat_completions(state, body, request)

    @api("POST", "/v1/completions")
    async def complete(body: CompletionRequest, request: Request) -> Response:
        return await completions(state, body, request)

    @api("POST", "/v1/messages")
    async def anthropic_messages(body: MessagesRequest, request: Request) -> Response:
        return await anthropic.messages(state, body, request)

    @api("POST", "/v1/messages/count_tokens")
    async def anthropic_count_tokens(body: CountTokensRequest, request: Request) -> Response:
        return await anthropic.count_tokens(state, body, request)

    @api("POST", "/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest) -> JSONResponse:
        return await embeddings(state, batcher, body)

    # each key its own share: one key's responses never evict another's (with no key: one share)
    store = responses.ResponseStore(responses.MAX_ITEMS, responses.MAX_CHARS, shares=len(policy.api_keys))

    @api("POST", "/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await responses.create(state, store, body, request)

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


def _anthropic_errors_on_messages_paths(app: FastAPI) -> None:
    """The Messages routes answer errors in Anthropic's shape: wrap each error handler."""
    for exc_class, handler in list(app.exception_handlers.items()):

        async def wrapped(request: Request, exc: Exception, handler=handler) -> Response:
            response = await handler(request, exc)
            if anthropic_errors.is_anthropic_path(request.url.path):
                return anthropic_errors.reshape(response)
            return response

        app.exception_handlers[exc_class] = wrapped
