"""One assistant reply streaming into the chat (``stream_reply``): the backend's events into the
message's view, the live context and tok/s figures of the status bar, and at the end the reply's
usage line and the conversation saved. It runs as the app's "generate" worker on the app's loop."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from typing import TYPE_CHECKING

from mlx_engine.request import RequestError

from .store import Message
from .widgets import MessageView, usage_line

if TYPE_CHECKING:
    from .app import ChatApp
    from .backends import Backend


async def stream_reply(app: ChatApp, backend: Backend, view: MessageView, prompt_tokens: int | None) -> None:
    """Stream the reply to ``app.conv`` as it is now; ``prompt_tokens``: its prompt's length, when
    known (the context figure counts on from it)."""
    conv = app.conv
    messages = conv.chat_messages()
    msg = Message("assistant", "")
    conv.messages.append(msg)
    final, meta = None, ""
    n_tokens, t_first = 0, None
    try:
        # aclosing: a cancelled worker closes the stream now (the backend stops the request),
        # not whenever the abandoned generator is collected
        async with aclosing(backend.stream(messages, conv.sampling, app.think)) as events:
            async for ev in events:
                if ev.reasoning:
                    await view.append_reasoning(ev.reasoning)
                if ev.text:
                    await view.append(ev.text)  # buffered: rendered at most every FLUSH_S
                    msg.content = view.content
                n_tokens += len(ev.token_ids) or (
                    1 if ev.text or ev.reasoning else 0
                )  # remote chunks carry no ids
                if prompt_tokens is not None:
                    app.context_used = prompt_tokens + n_tokens
                if n_tokens and t_first is None:
                    t_first = time.perf_counter()
                elif t_first is not None and n_tokens > 1:
                    app.live_tps = (n_tokens - 1) / max(time.perf_counter() - t_first, 1e-9)
                if ev.finished:
                    final = ev
                # Hand the loop back after every event: when the backend is ahead of the UI its
                # queue never blocks, and a key press (Esc) must not wait for the backlog.
                await asyncio.sleep(0)
    except RequestError as e:
        meta = f"error: {e}"
    except asyncio.CancelledError:
        meta = "stopped"
        raise
    finally:
        if final is not None:
            app.last_usage = final.usage
            app.last_prefill = backend.prefill_report(final.usage, final.request_id) if final.usage else {}
            meta = usage_line(final.usage) if final.usage else ""
            if final.finish_reason == "error":
                meta = f"error: {final.error or 'generation failed'}"
            elif final.finish_reason == "length":
                meta += " · hit max tokens" if conv.sampling.max_tokens else " · context full"
            elif final.finish_reason == "cancelled":
                meta = "stopped"
            if final.usage:
                app.context_used = final.usage.total_tokens
        msg.content, msg.meta = view.content, meta
        await view.finish(meta)
        app.generating = False
        app.live_tps = None
        app.refresh_status()
        if conv is app.conv:
            app.save_conversation(quiet=True)
