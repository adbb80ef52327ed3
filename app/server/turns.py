"""One assistant turn for the APIs that are adapters onto the chat endpoint (Anthropic Messages,
OpenAI Responses).

Each adapter translates its request into a chat-completions body (``ChatCompletionRequest``)
and builds a ``ChatCall`` from it: validation, the chat template, tools, grammars (JSON schema,
forced tool calls), sampling, stop strings and the prefix-cache salt are the chat endpoint's,
not a copy. ``turn_items`` runs the call's one engine request and yields what it produced in
order, text deltas and parsed tool calls, then a ``TurnEnd``; the adapter only renders them in
its API's shape.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from mlx_engine.request import Usage
from mlx_engine.tokenization.tool_calls import ParsedToolCall

from .chat import ChatCall
from .common import ChoiceState, ServerState, failure, fewest, wait_disconnect
from .errors import _loc, _validation_message, bad_request
from .generation import Generation
from .protocol import ChatCompletionRequest
from .security import effective_cache_salt


@dataclass
class TurnEnd:
    """The turn's end: the engine's finish reason (``stop`` or ``length``), the stop string
    that ended it (None: EOS, or a tool call's end), whether it called tools, and usage."""

    finish_reason: str
    stop_sequence: str | None
    called: bool
    usage: Usage
    reasoning: str = ""  # the turn's thinking, whole (streamed before as ``Thinking`` items)


@dataclass
class Thinking:
    """A piece of the turn's thinking (the engine splits it from the answer)."""

    text: str


TurnItem = str | Thinking | ParsedToolCall | TurnEnd


def chat_body(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request an adapter's translated fields make; a 400 if they do not validate
    (values the adapter's own schema let through but the chat schema refuses, e.g. a tool name)."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        raise bad_request(_validation_message(dict(first)), _loc(tuple(first.get("loc", ())))) from None


async def prepare(
    state: ServerState,
    fields: dict[str, Any],
    request: Request,
    endpoint: str,
    max_tokens: int | None = None,
) -> ChatCall:
    """The validated call (template and tokenizer run off the event loop). ``max_tokens`` is a
    cap, as in the Messages and Responses APIs: a reply stops there or when the context is full,
    whichever comes first (clients such as Claude Code send caps far above a local model's context)."""
    body = chat_body(fields)
    salt = effective_cache_salt(request.scope, None)
    call = await asyncio.to_thread(ChatCall, state, body, salt, endpoint)  # RequestError: a 400
    if max_tokens is not None:
        room = state.engine.context_length - len(call.prompt)
        if room <= 0:
            raise bad_request(
                f"The prompt has {len(call.prompt)} tokens, which fills this model's context of "
                f"{state.engine.context_length} tokens. Please reduce the prompt.",
                "messages",
                "context_length_exceeded",
            )
        call.max_tokens = fewest(max_tokens, room, call.max_tokens)
    return call


async def start(call: ChatCall) -> Generation:
    """Submit the call's engine request; refusals (full queue, shutdown) raise APIError here,
    before any response header is sent."""
    gen = Generation(call.state.engine, await call.requests(), call._cancelled, call.prompt_ids())
    await gen.start(1)
    return gen


async def turn_items(call: ChatCall, gen: Generation, request: Request) -> AsyncIterator[TurnItem]:
    """Text deltas and tool calls as they are generated, then one ``TurnEnd``. A failed
    generation raises APIError; a client that hangs up cancels the request and the items end
    without a ``TurnEnd``."""
    metrics = call.state.metrics
    t0 = time.perf_counter()
    watcher = asyncio.create_task(wait_disconnect(request))
    watcher.add_done_callback(lambda _: gen.cancel())
    choice = ChoiceState()
    called = False
    try:
        async for _, ev, err in gen.events():
            if ev is not None:
                choice.add(ev, metrics, t0)
            problem = failure([choice], err)
            if problem is not None:
                raise problem
            assert ev is not None  # no error: an event
            if ev.reasoning:
                yield Thinking(ev.reasoning)
            items: list[str | ParsedToolCall] = [ev.text] if ev.text else []
            for x in [*items, *ev.tool_calls]:
                called = called or isinstance(x, ParsedToolCall)
                yield x
            if ev.finished:
                reason = ev.finish_reason or "stop"
                metrics.requests.labels(
                    call.endpoint, "tool_calls" if called and reason == "stop" else reason
                ).inc()
                stop = ev.stop_reason if isinstance(ev.stop_reason, str) else None
                yield TurnEnd(reason, stop, called, ev.usage or Usage(), "".join(choice.reasoning))
                return
    finally:
        watcher.cancel()
        await gen.aclose()


async def collect(
    call: ChatCall, gen: Generation, request: Request
) -> tuple[str, list[ParsedToolCall], TurnEnd] | None:
    """The whole turn: (text, tool calls, end), or None when the client left first."""
    text: list[str] = []
    calls: list[ParsedToolCall] = []
    async for x in turn_items(call, gen, request):
        if isinstance(x, TurnEnd):
            return "".join(text), calls, x
        if isinstance(x, str):
            text.append(x)
        elif isinstance(x, ParsedToolCall):
            calls.append(x)
    return None
