"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, as an adapter.

A Messages request becomes a chat request (``turns``): the system prompt (a string or text
blocks) the system message, ``tool_use`` blocks assistant tool calls, ``tool_result`` blocks
tool messages, ``tools`` function tools (``input_schema`` their parameters), ``tool_choice``
auto / any / tool / none the chat's auto / required / named / none, ``stop_sequences`` stop
strings, ``temperature`` / ``top_p`` / ``top_k`` the sampling (today's SDKs no longer
have them: send them in ``extra_body``), ``output_config.format`` (a JSON schema) the chat's
``response_format``, enforced by the same grammar engine. ``max_tokens`` (required) is a
cap: a reply stops there or when the context is full. The reply comes back as a ``message``
with text and ``tool_use`` blocks, or as Anthropic's SSE events (``message_start``, ``ping``,
``content_block_start`` / ``_delta`` (``text_delta``, ``input_json_delta``) / ``_stop``,
``message_delta`` with the ``stop_reason`` and usage, ``message_stop``).

Usage: ``input_tokens`` are the prompt tokens computed, ``cache_read_input_tokens`` those the
prefix cache served. Image and document blocks are a 400: the served model reads text only.
Thinking blocks from an earlier turn are dropped. A final assistant message is a prefill the
reply continues. ``system`` messages inside ``messages`` are system turns where they were sent,
or join the system prompt where the template cannot take one there (``system_turns``).

What Claude Code sends beyond that is accepted, never a 400: server and Anthropic-defined tools
(``web_search_*``, ``bash_*``, ...; nothing here runs them) are left out of what the model sees,
with a warning the first time; ``context_management``, ``metadata``, ``cache_control``, the
``anthropic-beta`` header and unknown fields are ignored, at debug level in the log. ``thinking``
(disabled, or enabled with ``budget_tokens``) and ``output_config.effort`` are the chat call's
thinking controls; an earlier turn's thinking blocks go back to the template, which keeps or drops
them as its family does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mlx_engine.request import Usage

from .anthropic_errors import error_event
from .anthropic_protocol import ContentBlock, CountTokensRequest, MessagesRequest
from .chat import ChatCall
from .common import SSE_HEADERS, ServerState, fewest, warn_once
from .errors import APIError, bad_request
from .turns import Thinking, TurnEnd, collect, prepare, start, turn_items

log = logging.getLogger("duet.server")
_VERSION = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_TEXT_ONLY = ("image", "document", "search_result", "container_upload")


def check_version(request: Request) -> None:
    """``anthropic-version`` is optional here (curl users leave it out), but must be a date."""
    v = request.headers.get("anthropic-version")
    if v is not None and not _VERSION.match(v.strip()):
        raise bad_request(f"anthropic-version: {v!r} is not a version date such as 2023-06-01")


def _result_text(block: ContentBlock) -> str:
    c = block.content
    if c is None:
        text = ""
    elif isinstance(c, str):
        text = c
    else:
        parts = []
        for part in c:
            if part.get("type") == "text":
                parts.append(str(part.get("text") or ""))
            else:
                raise bad_request(
                    f"tool_result content of type {part.get('type')!r} is not supported: this model reads text only"
                )
        text = "\n".join(parts)
    return f"Error: {text}" if block.is_error else text


def _messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "\n".join(b.text for b in body.system)
        out.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        if m.role == "system":  # a system message mid-conversation: text blocks only
            for j, b in enumerate(m.content):
                if b.type != "text":
                    raise bad_request(
                        f"a system message holds text blocks, not {b.type}",
                        f"messages[{i}].content[{j}].type",
                    )
            out.append({"role": "system", "content": "\n".join(b.text or "" for b in m.content)})
            continue
        texts: list[str] = []
        calls: list[dict] = []
        thoughts: list[str] = []
        results: list[dict] = []
        for j, b in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if b.type in _TEXT_ONLY:
                raise bad_request(
                    f"{b.type} content blocks are not supported: the served model reads text only",
                    f"{where}.type",
                )
            if b.type == "text":
                texts.append(b.text or "")
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.name:
                    raise bad_request("a tool_use block needs a name", f"{where}.name")
                calls.append(
                    {
                        "id": b.id or f"toolu_{i}_{j}",
                        "type": "function",
                        "function": {
                            "name": b.name,
                            "arguments": json.dumps(b.input or {}, ensure_ascii=False),
                        },
                    }
                )
            elif b.type == "tool_result" and m.role == "user":
                if not b.tool_use_id:
                    raise bad_request("a tool_result block needs a tool_use_id", f"{where}.tool_use_id")
                results.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b)})
            elif b.type == "thinking" and m.role == "assistant":
                thoughts.append((b.model_extra or {}).get("thinking") or "")  # the template keeps or drops it
            elif b.type == "redacted_thinking":
                continue  # encrypted by Anthropic: nothing a local model can read
            else:
                raise bad_request(f"{b.type} blocks are not supported in a {m.role} message", f"{where}.type")
        out.extend(results)  # tool results answer the previous turn's calls, before any new text
        text = "".join(texts)
        if m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            if any(thoughts):
                msg["reasoning_content"] = "".join(thoughts)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif texts or not results:
            out.append({"role": "user", "content": text})
    return out


def _tool_fields(body: CountTokensRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    tools = []
    for t in body.tools or []:
        if t.type not in (None, "custom"):
            # a server tool (web_search_..., code_execution_...) or an Anthropic-defined one (bash_...,
            # text_editor_..., computer_...): nothing here runs it and its schema is not sent, so the
            # model is not offered it (as a client's default configuration sends them, never a 400)
            warn_once(
                f"messages-tool:{t.type}", f"messages: {t.type} tools are not offered to the local model"
            )
            continue
        fn: dict[str, Any] = {
            "name": t.name,
            "parameters": t.input_schema or {"type": "object", "properties": {}},
        }
        if t.description:
            fn["description"] = t.description
        tools.append({"type": "function", "function": fn})
    choice = body.tool_choice
    if tools:
        fields["tools"] = tools
    if choice is None:
        return fields
    if choice.type == "tool" and not choice.name:
        raise bad_request("tool_choice of type tool needs a name", "tool_choice.name")
    if choice.type == "none" or (choice.type == "auto" and not tools):
        fields["tool_choice"] = "none" if tools else None
    elif choice.type == "auto":
        fields["tool_choice"] = "auto"
    elif choice.type == "any":
        fields["tool_choice"] = "required"
    else:
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    if choice.disable_parallel_tool_use is not None and tools:
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return {k: v for k, v in fields.items() if v is not None}


def _log_ignored(body: CountTokensRequest, request: Request) -> None:
    """What a request asks for that a local model has no use for, at debug level."""
    if not log.isEnabledFor(logging.DEBUG):
        return
    ignored = sorted(k for k in (body.model_extra or {}))
    if isinstance(body, MessagesRequest):
        for name in ("context_management", "metadata", "service_tier"):
            if getattr(body, name) is not None:
                ignored.append(name)
    beta = request.headers.get("anthropic-beta")
    if beta:
        ignored.append(f"anthropic-beta ({beta})")
    if ignored:
        log.debug("messages: ignoring %s", ", ".join(ignored))


def chat_fields(body: CountTokensRequest) -> dict[str, Any]:
    """The chat request a Messages (or count_tokens) request is."""
    fields: dict[str, Any] = {"model": body.model, "messages": _messages(body), **_tool_fields(body)}
    if isinstance(body, MessagesRequest):
        for name in ("temperature", "top_p", "top_k", "ignore_eos"):
            value = getattr(body, name)
            if value is not None:
                fields[name] = value
        if body.stop_sequences:
            fields["stop"] = body.stop_sequences
        fields.update(_thinking_fields(body))
        fmt = body.output_config.format if body.output_config is not None else None
        if fmt is not None:
            schema = {"name": "output", "schema": fmt.schema_}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    return fields


def _thinking_fields(body: MessagesRequest) -> dict[str, Any]:
    """``thinking`` and ``output_config.effort`` as the chat call's thinking controls: disabled turns
    thinking off where the family can, ``budget_tokens`` caps it, the effort levels go to templates
    that read them (``max`` as high)."""
    out: dict[str, Any] = {}
    effort = body.output_config.effort if body.output_config is not None else None
    if effort in ("low", "medium", "high", "max"):
        out["reasoning_effort"] = "high" if effort == "max" else effort
    t = body.thinking
    if t is not None and t.type == "disabled":
        out["reasoning_effort"] = "none"
    elif t is not None and t.type == "enabled" and t.budget_tokens is not None:
        out["thinking_budget"] = t.budget_tokens
    return out


def _usage(u: Usage) -> dict[str, int]:
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    }


def _stop_reason(end: TurnEnd) -> str:
    if end.finish_reason == "length":  # a call cut short too, as the chat endpoint's "length"
        return "max_tokens"
    if end.called:
        return "tool_use"
    return "stop_sequence" if end.stop_sequence is not None else "end_turn"


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:  # cut short by max_tokens
        return {}
    return value if isinstance(value, dict) else {}


class MessagesCall:
    def __init__(self, state: ServerState, body: MessagesRequest, call: ChatCall):
        self.state, self.body, self.call = state, body, call
        self.id = "msg_" + secrets.token_hex(12)

    def _message(self, content: list[dict], end: TurnEnd | None, usage: dict[str, int]) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.state.model_id,
            "content": content,
            "stop_reason": _stop_reason(end) if end else None,
            "stop_sequence": end.stop_sequence if end and not end.called else None,
            "usage": usage,
        }

    async def respond(self, request: Request) -> Response:
        gen = await start(self.call)
        turn = await collect(self.call, gen, request)
        if turn is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        text, calls, end = turn
        content: list[dict] = []
        if end.reasoning:  # a thinking block first, as Claude's extended thinking gives it (unsigned)
            content.append({"type": "thinking", "thinking": end.reasoning, "signature": ""})
        if text or not calls:
            content.append({"type": "text", "text": text})
        for c in calls:
            content.append(
                {"type": "tool_use", "id": _tool_id(c.id), "name": c.name, "input": _tool_input(c.arguments)}
            )
        return JSONResponse(self._message(content, end, _usage(end.usage)), headers=_headers())

    async def stream(self, request: Request) -> Response:
        gen = await start(self.call)

        def event(kind: str, data: dict) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"

        async def events() -> AsyncIterator[str]:
            start_usage = {"input_tokens": len(self.call.prompt), "output_tokens": 0}
            yield event("message_start", {"message": self._message([], None, start_usage)})
            yield event("ping", {})
            index = -1
            open_text = open_thinking = False
            try:
                async for x in turn_items(self.call, gen, request):
                    if isinstance(x, Thinking):
                        if not open_thinking:
                            index += 1
                            open_thinking = True
                            block = {"type": "thinking", "thinking": "", "signature": ""}
                            yield event("content_block_start", {"index": index, "content_block": block})
                        yield event(
                            "content_block_delta",
                            {"index": index, "delta": {"type": "thinking_delta", "thinking": x.text}},
                        )
                        continue
                    if open_thinking:
                        yield event("content_block_stop", {"index": index})
                        open_thinking = False
                    if isinstance(x, str):
                        if not open_text:
                            index += 1
                            open_text = True
                            block = {"type": "text", "text": ""}
                            yield event("content_block_start", {"index": index, "content_block": block})
                        yield event(
                            "content_block_delta",
                            {"index": index, "delta": {"type": "text_delta", "text": x}},
                        )
                        continue
                    if open_text:
                        yield event("content_block_stop", {"index": index})
                        open_text = False
                    if isinstance(x, TurnEnd):
                        delta = {
                            "stop_reason": _stop_reason(x),
                            "stop_sequence": None if x.called else x.stop_sequence,
                        }
                        yield event("message_delta", {"delta": delta, "usage": _usage(x.usage)})
                        yield event("message_stop", {})
                        return
                    index += 1
                    tool: dict[str, Any] = {
                        "type": "tool_use",
                        "id": _tool_id(x.id),
                        "name": x.name,
                        "input": {},
                    }
                    yield event("content_block_start", {"index": index, "content_block": tool})
                    args = {"type": "input_json_delta", "partial_json": x.arguments}
                    yield event("content_block_delta", {"index": index, "delta": args})
                    yield event("content_block_stop", {"index": index})
            except APIError as e:
                yield error_event(e.status, e.message)

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={**SSE_HEADERS, **_headers()}
        )


def _headers() -> dict[str, str]:
    return {"request-id": "req_" + secrets.token_hex(12)}


def prefill_text(body: CountTokensRequest) -> str | None:
    """The text of a final assistant message (a prefill, which the reply continues), or None."""
    last = body.messages[-1]
    if last.role != "assistant":
        return None
    if isinstance(last.content, str):
        return last.content
    if any(b.type == "tool_use" for b in last.content):
        return None
    return "".join(b.text or "" for b in last.content if b.type == "text")


async def build_call(
    state: ServerState,
    body: CountTokensRequest,
    request: Request,
    endpoint: str,
    max_tokens: int | None = None,
) -> ChatCall:
    """The chat call of a Messages request. A final assistant message is a prefill: the prompt
    is the conversation before it with the assistant turn opened, then its text, which the reply
    continues (the reply holds only the new text, as at Anthropic)."""
    fields = chat_fields(body)
    prefill = prefill_text(body)
    if prefill is None:
        return await prepare(state, fields, request, endpoint, max_tokens=max_tokens)
    fields["messages"] = fields["messages"][:-1]
    if not fields["messages"]:
        raise bad_request("messages: a conversation cannot begin with an assistant message", "messages")
    call = await prepare(state, fields, request, endpoint, max_tokens=max_tokens)
    if call.grammar is not None:
        raise bad_request(
            "an assistant prefill cannot be combined with output_config.format or a forced tool call",
            "messages",
        )
    ids = await asyncio.to_thread(state.engine.tokenizer.encode, prefill, False, False)
    call.prompt = call.prompt + ids
    room = state.engine.context_length - len(call.prompt)
    if room <= 0:
        raise bad_request(
            f"The prompt has {len(call.prompt)} tokens, which fills this model's context of "
            f"{state.engine.context_length} tokens. Please reduce the prompt.",
            "messages",
            "context_length_exceeded",
        )
    if max_tokens is not None:
        call.max_tokens = fewest(max_tokens, room, state.max_tokens)
    return call


async def messages(state: ServerState, body: MessagesRequest, request: Request) -> Response:
    check_version(request)
    _log_ignored(body, request)
    call = await build_call(state, body, request, "messages", max_tokens=body.max_tokens)
    m = MessagesCall(state, body, call)
    return await (m.stream(request) if body.stream else m.respond(request))


async def count_tokens(state: ServerState, body: CountTokensRequest, request: Request) -> Response:
    check_version(request)
    _log_ignored(body, request)
    call = await build_call(state, body, request, "count_tokens")
    return JSONResponse({"input_tokens": len(call.prompt)}, headers=_headers())
