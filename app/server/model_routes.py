"""Running one request on the model it names: hold the model (``ModelRegistry.acquire``, which
loads it on first use), run the endpoint's handler with that model's ``ServerState``, let go.

A streamed request for a model that is not loaded yet gets its response headers at once and, while
the model loads, an SSE comment every second (``: loading model NAME``, which SSE clients skip), so
a client with a read timeout sees a live stream instead of timing out on a multi-second load. Once
loaded, the endpoint's own stream follows; an error after the headers went out (the load failed, the
request was bad for this model) is sent in the endpoint's own error framing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.responses import Response, StreamingResponse

from .anthropic_errors import error_event
from .common import SSE_DONE, SSE_HEADERS, ServerState, sse
from .errors import APIError, internal_error
from .registry import Lease, ModelRegistry

Handler = Callable[[ServerState], Awaitable[Response]]
ErrorFrame = Callable[[APIError], str]
LOADING_TICK = 1.0  # seconds between the comments of a loading stream


def openai_error_frame(e: APIError) -> str:
    return sse(e.body()) + SSE_DONE


def anthropic_error_frame(e: APIError) -> str:
    return error_event(e.status, e.message)


def responses_error_frame(e: APIError) -> str:
    # the stream's first event: sequence number 0, as responses.py numbers its events
    body = {
        "type": "error",
        "sequence_number": 0,
        "code": e.code or e.type,
        "message": e.message,
        "param": e.param,
    }
    return f"event: error\ndata: {json.dumps(body)}\n\n"


async def with_model(
    registry: ModelRegistry,
    name: str | None,
    handler: Handler,
    *,
    stream_errors: ErrorFrame | None = None,
    keep_alive: float | None | object = ...,
) -> Response:
    """``handler``'s response for the model ``name`` (a 404 listing the models when there is none).
    ``stream_errors``: the request is streamed, and this frames an error inside the stream (a
    loading model then streams its loading state)."""
    await registry.refresh()  # a model pulled while the server runs
    registry.require(name)
    if stream_errors is not None and registry.get_loaded(name) is None:
        return StreamingResponse(
            _loading_stream(registry, name, handler, stream_errors, keep_alive),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    lease = await registry.acquire(name, keep_alive)
    try:
        return await handler(lease.state)
    finally:
        lease.release()  # a stream's request is in the engine by now: that keeps the model busy


async def _loading_stream(
    registry: ModelRegistry,
    name: str | None,
    handler: Handler,
    frame: ErrorFrame,
    keep_alive: float | None | object,
) -> AsyncIterator[Any]:
    acquiring: asyncio.Task[Lease] = asyncio.ensure_future(registry.acquire(name, keep_alive))
    try:
        while not acquiring.done():
            done, _ = await asyncio.wait({acquiring}, timeout=LOADING_TICK)
            if not done:
                yield f": loading model {name}\n\n"
    finally:
        if not acquiring.done():  # the client left while it loaded: the load goes on for others
            acquiring.add_done_callback(_release_when_done)
    try:
        lease = acquiring.result()
    except APIError as e:
        yield frame(e)
        return
    try:
        try:
            response = await handler(lease.state)
        except APIError as e:
            yield frame(e)
            return
        except Exception:
            yield frame(internal_error())
            raise
    finally:
        lease.release()
    if isinstance(response, StreamingResponse):
        async for chunk in response.body_iterator:
            yield chunk
    elif response.status_code >= 400:
        try:
            message = json.loads(bytes(response.body))["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = bytes(response.body).decode(errors="replace")
        yield frame(APIError(response.status_code, str(message)))


def _release_when_done(task: asyncio.Task[Lease]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().release()
