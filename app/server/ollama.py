"""Ollama's native API (``/api/chat``, ``/api/generate`` and the model routes of ``ollama_models``), as
an adapter onto the chat call, so Ollama's clients (the ``ollama`` libraries, Open WebUI, editors with
an Ollama provider) can use ``duet serve``.

A chat or a templated generate becomes a chat-completions request (``ollama_protocol``) and runs through
``turns``: templating, tools, grammars (``format``), sampling and stop strings are the chat endpoint's.
``raw: true`` generate is the completions endpoint's call (no template). Replies are Ollama's: streamed
(Ollama's default) as NDJSON lines ``{"model", "created_at", "message": {...}, "done": false}`` (generate:
``"response"``), then a last line with ``done: true``, ``done_reason`` (stop, length) and the counts
and durations (nanoseconds); ``stream: false`` gives that last object with the whole reply. Thinking is
``message.thinking`` (generate: ``thinking``), tool calls ``message.tool_calls`` with their arguments
as objects.

Errors are Ollama's ``{"error": "message"}`` with the HTTP status; after a stream has begun, a line
``{"error": "..."}``. A request with no messages (generate: no prompt) loads the model and answers
``done_reason: "load"`` (with ``keep_alive: 0``: unloads it, ``"unload"``), as Ollama does.
Models are loaded through the registry before the response begins (as Ollama does), so a stream
never carries loading comments.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from mlx_engine.errors import DuetError
from mlx_engine.request import Usage
from mlx_engine.tokenization.tool_calls import ParsedToolCall

from . import ollama_models
from .chat import ChatCall
from .common import ServerState
from .completions import CompletionCall
from .embeddings import EmbeddingBatcher
from .errors import APIError, _loc, _validation_message, bad_request, from_duet_error, internal_error
from .generation import Generation
from .metrics import ModelMetrics
from .model_routes import with_model
from .ollama_protocol import (
    ChatRequest,
    GenerateRequest,
    chat_fields,
    check_generate,
    check_num_ctx,
    generate_fields,
    now_rfc3339,
    ns,
    option_fields,
    parse,
    tool_call_out,
)
from .protocol import CompletionRequest
from .registry import ModelRegistry, keep_alive_seconds
from .security import effective_cache_salt
from .turns import Thinking, TurnEnd, TurnItem, collect, prepare, start, turn_items

log = logging.getLogger("duet.server")
NDJSON = "application/x-ndjson"
Route = Callable[[Request], Awaitable[Response]]


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)


def ollama_errors(route: Route, registry: ModelRegistry | None = None) -> Route:
    """``route`` with its errors in Ollama's shape (the app's handlers answer OpenAI's); with
    ``registry``, the models pulled while the server runs found first (``refresh``)."""

    @functools.wraps(route)
    async def wrapped(request: Request) -> Response:
        try:
            if registry is not None:
                await registry.refresh()
            return await route(request)
        except APIError as e:
            return error_response(e)
        except DuetError as e:
            return error_response(from_duet_error(e))
        except Exception:
            log.exception("unexpected error while serving %s %s", request.method, request.url.path)
            return error_response(internal_error())

    return wrapped


def resolve(registry: ModelRegistry, name: str | None) -> str:
    """The served model ``name`` names (Ollama clients add ``:latest`` to names without a tag); a 404
    in Ollama's words otherwise."""
    if not name:
        raise bad_request("model is required")
    if registry.lookup(name) is not None:
        return name
    if name.endswith(":latest") and registry.lookup(name.removesuffix(":latest")) is not None:
        return name.removesuffix(":latest")
    if name in registry.embedding_ids or name.removesuffix(":latest") in registry.embedding_ids:
        raise bad_request(f"`{name}` is an embedding model: it serves /api/embed, not chat or generate")
    names = ", ".join(m.name for m in registry.available()) or "none"
    raise APIError(404, f"model '{name}' not found (this server has: {names})", code="model_not_found")


def keep_alive_of(value: float | str | None) -> float | None | object:
    """A request's ``keep_alive`` for the registry (``...``: not given)."""
    return ... if value is None else keep_alive_seconds(value)


def validated(cls: type[BaseModel], fields: dict[str, Any]) -> Any:
    try:
        return cls.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        where = _loc(tuple(first.get("loc", ())))
        raise bad_request(_validation_message(dict(first)), where) from None


@dataclass
class _RawCall:
    """What ``turns.turn_items`` reads of a call (its state and metrics label), for a raw generate:
    the completions call has no thinking or tool calls to split, so its events are plain text."""

    state: ServerState
    endpoint: str


class Turn:
    """One Ollama reply, streamed or whole: ``kind`` chat (``message``) or generate (``response``)."""

    def __init__(self, model: str, kind: str, t0: float, load_s: float):
        self.model, self.kind, self.t0, self.load_s = model, kind, t0, load_s
        self.t_submit = t0

    def piece(self, text: str = "", thinking: str = "", calls: list[dict] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": now_rfc3339()}
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            out["message"] = message
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        out["done"] = False
        return out

    def final(
        self, end: TurnEnd, text: str = "", thinking: str = "", calls: list[dict] | None = None
    ) -> dict:
        now, u = time.perf_counter(), end.usage or Usage()
        out = self.piece(text, thinking, calls)
        out.update(
            done=True,
            done_reason=end.finish_reason,
            total_duration=ns(now - self.t0),
            load_duration=ns(self.load_s),
            prompt_eval_count=u.prompt_tokens,
            prompt_eval_duration=ns(u.ttft_s),
            eval_count=u.completion_tokens,
            eval_duration=ns(now - self.t_submit - u.ttft_s),
        )
        return out

    async def whole(self, turn: Awaitable[tuple[str, list[ParsedToolCall], TurnEnd] | None]) -> Response:
        """The reply as one object (``turn``: ``turns.collect``'s result)."""
        got = await turn
        if got is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        text, calls, end = got
        shaped = [tool_call_out(k, c.id, c.name, c.arguments) for k, c in enumerate(calls)]
        return JSONResponse(self.final(end, text, end.reasoning, shaped))

    def stream(self, items: AsyncIterator[TurnItem]) -> Response:
        """The reply as NDJSON lines."""
        return StreamingResponse(self._lines(items), media_type=NDJSON)

    async def _lines(self, items: AsyncIterator[TurnItem]) -> AsyncIterator[str]:
        k = 0
        try:
            async for x in items:
                if isinstance(x, Thinking):
                    yield _line(self.piece(thinking=x.text))
                elif isinstance(x, str):
                    yield _line(self.piece(text=x))
                elif isinstance(x, ParsedToolCall):
                    yield _line(self.piece(calls=[tool_call_out(k, x.id, x.name, x.arguments)]))
                    k += 1
                else:
                    yield _line(self.final(x))
                    return
        except APIError as e:
            yield _line({"error": e.message})


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


async def _chat_turn(
    state: ServerState, fields: dict, request: Request, turn: Turn, stream: bool, endpoint: str
) -> Response:
    call = await prepare(state, fields, request, endpoint)
    gen = await start(call)
    turn.t_submit = time.perf_counter()
    if stream:
        return turn.stream(turn_items(call, gen, request))
    return await turn.whole(collect(call, gen, request))


async def _raw_turn(state: ServerState, body: GenerateRequest, request: Request, turn: Turn) -> Response:
    """``raw: true``: the prompt as given, no template (the completions endpoint's call)."""
    fields = {"model": state.model_id, "prompt": body.prompt or "", **option_fields(body.options)}
    completion = validated(CompletionRequest, fields)
    salt = effective_cache_salt(request.scope, None)
    call = await asyncio.to_thread(CompletionCall, state, completion, salt)
    gen = Generation(state.engine, call.requests(), call._cancelled, call.prompt_ids())
    await gen.start(1)
    turn.t_submit = time.perf_counter()
    raw = cast(ChatCall, _RawCall(state, "ollama_generate"))
    if body.stream:
        return turn.stream(turn_items(raw, gen, request))
    return await turn.whole(collect(raw, gen, request))


async def _load_only(
    registry: ModelRegistry, name: str, requested: str, keep: float | None | object, kind: str
) -> JSONResponse:
    """No messages (no prompt): load the model, or with ``keep_alive: 0`` unload it, as Ollama does."""
    if keep == 0:
        await registry.unload(name)
        reason = "unload"
    else:
        await registry.load(name, keep)
        reason = "load"
    body: dict[str, Any] = {"model": requested, "created_at": now_rfc3339()}
    if kind == "chat":
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    return JSONResponse({**body, "done_reason": reason, "done": True})


def install_ollama_routes(
    app: FastAPI,
    registry: ModelRegistry,
    batcher: EmbeddingBatcher | None,
    metrics: ModelMetrics,
    embedding_ids: tuple[str, ...],
) -> None:
    """Add Ollama's API under ``/api/...`` (behind the app's security middleware, as /v1 is)."""

    async def turn(
        body: ChatRequest | GenerateRequest,
        endpoint: str,
        has_input: bool,
        t0: float,
        respond: Callable[[ServerState, Turn], Awaitable[Response]],
        check: Callable[[], None] | None = None,
    ) -> Response:
        """One chat or generate request (``check``: its own fields, once the model is known): an
        empty one loads (or, with keep_alive 0, unloads) the model; else ``respond`` on the model,
        held for the request."""
        name = resolve(registry, body.model)
        if check is not None:
            check()
        keep = keep_alive_of(body.keep_alive)
        if not has_input:
            return await _load_only(registry, name, body.model, keep, endpoint)
        was_loaded = registry.get_loaded(name) is not None

        async def handler(state: ServerState) -> Response:
            check_num_ctx(body.options, state.engine.context_length)
            load_s = 0.0 if was_loaded else time.perf_counter() - t0
            return await respond(state, Turn(body.model, endpoint, t0, load_s))

        return await with_model(registry, name, handler, keep_alive=keep)

    async def chat(request: Request) -> Response:
        t0 = time.perf_counter()
        body: ChatRequest = parse(ChatRequest, await request.body())

        async def respond(state: ServerState, t: Turn) -> Response:
            fields = chat_fields(body, state.model_id)
            return await _chat_turn(state, fields, request, t, body.stream, "ollama_chat")

        return await turn(body, "chat", bool(body.messages), t0, respond)

    async def generate(request: Request) -> Response:
        t0 = time.perf_counter()
        body: GenerateRequest = parse(GenerateRequest, await request.body())

        async def respond(state: ServerState, t: Turn) -> Response:
            if body.raw:
                return await _raw_turn(state, body, request, t)
            fields = generate_fields(body, state.model_id)
            return await _chat_turn(state, fields, request, t, body.stream, "ollama_generate")

        return await turn(body, "generate", bool(body.prompt), t0, respond, lambda: check_generate(body))

    models = ollama_models.OllamaModels(registry, batcher, metrics, embedding_ids, resolve)
    routes: list[tuple[str, str, Route]] = [
        ("POST", "/api/chat", chat),
        ("POST", "/api/generate", generate),
        ("GET", "/api/tags", models.tags),
        ("POST", "/api/show", models.show),
        ("GET", "/api/ps", models.ps),
        ("POST", "/api/pull", models.pull),
        ("DELETE", "/api/delete", models.delete),
        ("POST", "/api/embed", models.embed),
        ("POST", "/api/embeddings", models.embeddings),
        ("GET", "/api/version", models.version),
    ]
    for method, path, route in routes:
        app.add_api_route(path, ollama_errors(route, registry), methods=[method], include_in_schema=False)
