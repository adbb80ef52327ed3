"""POST /v1/responses, GET/DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items:
OpenAI's Responses API, as an adapter onto the chat call (``turns``).

``input`` (a string, or message / ``function_call`` / ``function_call_output`` items) and
``instructions`` become chat messages; ``previous_response_id`` puts the stored conversation
(its inputs and outputs, not its instructions, as at OpenAI) before them, so the continued
prompt begins with the earlier one and its KV comes from the prefix cache (``usage.
input_tokens_details.cached_tokens``). Function ``tools`` and ``tool_choice`` are the chat's,
``text.format`` (json_object / json_schema) the chat's ``response_format``, enforced by the
same grammar engine; ``max_output_tokens`` is a cap. ``namespace`` tools are flattened into
function tools and hosted tools (web search, file search, computer use...) left out of what the
model sees (``responses_tools``); image, file and audio inputs are a 400. ``reasoning``,
``include``, ``prompt_cache_key``, ``client_metadata`` and other fields that do not apply to a
local model are accepted and ignored (logged at debug level).

Responses are kept in memory (``ResponseStore``: the most recent ones, bounded by count and
size; ``store: false`` keeps none) for retrieval, deletion, ``input_items`` and continuation,
each visible only to the API key that created it. Each key has its own share of the store (an
equal part of it), so one key storing many responses evicts only its own oldest ones, never
another key's (which would break that key's ``previous_response_id``).
Streaming sends Responses events (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
/ ``.done``, ``response.function_call_arguments.delta`` / ``.done``, ``response.output_item.done``,
``response.completed`` or ``response.incomplete``), each with its ``sequence_number``.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mlx_engine.request import Usage
from mlx_engine.tokenization.tool_calls import ParsedToolCall

from .chat import ChatCall
from .common import SSE_HEADERS, ServerState
from .errors import APIError, bad_request
from .responses_protocol import InputItem, ResponsesRequest
from .responses_tools import ResponseTools
from .security import KEY_ID_STATE
from .turns import Thinking, TurnEnd, collect, prepare, start, turn_items

log = logging.getLogger("duet.server")
_UNSUPPORTED_PARTS = {"input_image": "image", "input_file": "file", "input_audio": "audio"}


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass
class Stored:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]  # this request's input, as items with ids
    conversation: list[dict[str, Any]]  # chat messages: earlier turns, this input and the output
    size: int
    owner: str | None  # the API key (its id) that created it: only that key sees it


def owner_of(request: Request) -> str | None:
    """The id of the API key that authenticated the request (None: the server has no keys)."""
    state = request.scope.get("state") or {}
    return state.get(KEY_ID_STATE)


MAX_ITEMS = 512  # the server's store: responses, all keys together (create_app)
MAX_CHARS = 64 * 2**20  # and their JSON text


@dataclass
class _Share:
    """One owner's responses, least recently used first."""

    items: OrderedDict[str, Stored]
    chars: int = 0


class ResponseStore:
    """The most recent responses, kept per owner (the id of the API key that created them, or None
    on a server without keys). Each owner has a share of ``max_items`` responses and ``max_chars``
    of JSON text, ``1 / shares`` of each (``shares``: how many owners there can be, the server's
    number of keys, so that all of them together stay within the totals); when an owner's responses
    pass its share, its own least recently used go first, never another owner's. An owner sees
    only its own responses."""

    def __init__(self, max_items: int = MAX_ITEMS, max_chars: int = MAX_CHARS, shares: int = 1):
        self.max_items, self.max_chars = max_items, max_chars
        self.shares = max(1, shares)
        self.items_per_owner = max(1, max_items // self.shares)
        self.chars_per_owner = max(1, max_chars // self.shares)
        self._owners: dict[str | None, _Share] = {}

    def put(
        self, response: dict, input_items: list[dict], conversation: list[dict], owner: str | None = None
    ) -> None:
        size = sum(len(json.dumps(x, ensure_ascii=False)) for x in (response, input_items, conversation))
        if size > self.chars_per_owner:
            return
        self.delete(response["id"], owner)
        share = self._owners.setdefault(owner, _Share(OrderedDict()))
        share.items[response["id"]] = Stored(response, input_items, conversation, size, owner)
        share.chars += size
        while len(share.items) > self.items_per_owner or share.chars > self.chars_per_owner:
            _, old = share.items.popitem(last=False)
            share.chars -= old.size

    def get(self, response_id: str, owner: str | None = None) -> Stored | None:
        """The stored response, if ``owner`` (the caller's key id) created it."""
        share = self._owners.get(owner)
        if share is None or (s := share.items.get(response_id)) is None or s.owner != owner:
            return None
        share.items.move_to_end(response_id)
        return s

    def delete(self, response_id: str, owner: str | None = None) -> bool:
        share = self._owners.get(owner)
        if share is None or response_id not in share.items:
            return False
        s = share.items.pop(response_id)
        share.chars -= s.size
        if not share.items:
            del self._owners[owner]
        return True

    def __len__(self) -> int:
        return sum(len(share.items) for share in self._owners.values())


def not_found(response_id: str) -> APIError:
    return APIError(
        404, f"No response found with id {response_id!r}.", type="invalid_request_error", code="not_found"
    )


# --- input -> chat messages -----------------------------------------------------------------


def _parts_text(content: str | list | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, p in enumerate(content):
        kind = _UNSUPPORTED_PARTS.get(p.type)
        if kind is not None:
            raise bad_request(
                f"{kind} input ({p.type}) is not supported: the served model reads text only",
                f"{where}.content[{j}].type",
            )
        texts.append((p.refusal if p.type == "refusal" else p.text) or "")
    return "".join(texts)


def _output_text(output: str | list | None) -> str:
    if output is None or isinstance(output, str):
        return output or ""
    return "".join(str(p.get("text") or "") for p in output if p.get("type") in ("input_text", "output_text"))


def input_items(body: ResponsesRequest) -> list[InputItem]:
    if body.input is None:
        return []
    if isinstance(body.input, str):
        return [InputItem(type="message", role="user", content=body.input)]
    return body.input


def _reasoning_text(item: InputItem) -> str:
    """A reasoning item's text (its ``reasoning_text`` parts, as this server returns them)."""
    parts = item.content if isinstance(item.content, list) else []
    texts = []
    for p in parts:
        d = p if isinstance(p, dict) else p.model_dump() if hasattr(p, "model_dump") else {}
        if d.get("type") == "reasoning_text" and isinstance(d.get("text"), str):
            texts.append(d["text"])
    return "".join(texts)


def to_messages(items: list[InputItem], tools: ResponseTools) -> list[dict[str, Any]]:
    """Chat messages for input items; consecutive function calls join the assistant message
    before them, as one turn's calls. A call to a function in a ``namespace`` takes the name the
    model sees for it (``tools``)."""
    out: list[dict[str, Any]] = []
    pending_thought = ""  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.type or "message"
        if kind == "message":
            if item.role is None:
                raise bad_request("a message item needs a role", f"{where}.role")
            out.append({"role": item.role, "content": _parts_text(item.content, where)})
            if item.role == "assistant" and pending_thought:
                out[-1]["reasoning_content"], pending_thought = pending_thought, ""
        elif kind == "function_call":
            if not item.name or item.call_id is None:
                raise bad_request("a function_call item needs a name and a call_id", where)
            namespace = (item.model_extra or {}).get("namespace")
            name = item.name
            if isinstance(namespace, str) and namespace:
                name = tools.flat_name(item.name, namespace)
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": name, "arguments": item.arguments or "{}"},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            if pending_thought:
                out[-1]["reasoning_content"], pending_thought = pending_thought, ""
        elif kind == "function_call_output":
            if item.call_id is None:
                raise bad_request("a function_call_output item needs a call_id", f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _output_text(item.output)})
        elif kind == "reasoning":  # the next assistant turn's thinking, for templates that keep it
            pending_thought = _reasoning_text(item)
        else:
            raise bad_request(
                f"input items of type {kind!r} are not supported by this server", f"{where}.type"
            )
    return out


def _item_record(item: InputItem) -> dict[str, Any]:
    """An input item as ``input_items`` lists it."""
    d = item.model_dump(exclude_none=True, by_alias=True)
    kind = d.setdefault("type", "message")
    if kind == "message":
        if isinstance(d.get("content"), str):
            part = "output_text" if d.get("role") == "assistant" else "input_text"
            d["content"] = [{"type": part, "text": d["content"]}]
        d.setdefault("status", "completed")
    d.setdefault("id", _id({"message": "msg", "function_call": "fc"}.get(kind, "item")))
    return d


# --- request -> chat fields -------------------------------------------------------------------


def chat_fields(
    body: ResponsesRequest, earlier: list[dict[str, Any]], tools: ResponseTools
) -> dict[str, Any]:
    messages = [*earlier, *to_messages(input_items(body), tools)]
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    if not messages:
        raise bad_request("input is required (or a previous_response_id to continue)", "input")
    fields: dict[str, Any] = {"model": body.model, "messages": messages}
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "ignore_eos",
        "parallel_tool_calls",
        "chat_template_kwargs",
    ):
        value = getattr(body, name)
        if value is not None:
            fields[name] = value
    if body.reasoning is not None and body.reasoning.effort is not None:
        fields["reasoning_effort"] = body.reasoning.effort
    if tools.chat_tools:
        fields["tools"] = tools.chat_tools
    choice = body.tool_choice
    if isinstance(choice, str):
        if tools.chat_tools or choice != "auto":
            fields["tool_choice"] = choice
    elif choice is not None:
        if choice.type != "function" or not choice.name:
            raise bad_request(
                "tool_choice must be none, auto, required or {'type': 'function', 'name': ...}", "tool_choice"
            )
        namespace = (choice.model_extra or {}).get("namespace")
        name = tools.flat_name(choice.name, namespace if isinstance(namespace, str) else None)
        fields["tool_choice"] = {"type": "function", "function": {"name": name}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise bad_request("text.format of type json_schema needs a schema", "text.format.schema")
        spec: dict[str, Any] = {"name": fmt.name or "output", "schema": fmt.schema_}
        fields["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    return fields


# --- output -------------------------------------------------------------------------------------


def _usage(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [], "content": content}


def _call_item(
    item_id: str, call: ParsedToolCall, tools: ResponseTools, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        **tools.call_fields(call.name),
        "arguments": call.arguments if status == "completed" else "",
        "status": status,
    }


class ResponseCall:
    def __init__(
        self,
        state: ServerState,
        store: ResponseStore,
        body: ResponsesRequest,
        call: ChatCall,
        earlier: list,
        owner: str | None,
        tools: ResponseTools,
    ):
        self.state, self.store, self.body, self.call = state, store, body, call
        self.earlier, self.owner, self.tools = earlier, owner, tools
        self.id = _id("resp")
        self.created = int(time.time())

    def envelope(self, status: str, output: list[dict], end: TurnEnd | None) -> dict[str, Any]:
        b = self.body
        fmt = b.text.format.model_dump(exclude_none=True, by_alias=True) if b.text and b.text.format else None
        incomplete = end is not None and end.finish_reason == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.state.model_id,
            "output": output,
            "parallel_tool_calls": b.parallel_tool_calls if b.parallel_tool_calls is not None else True,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": b.store is not False,
            "temperature": b.temperature,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": b.tool_choice.model_dump()
            if b.tool_choice is not None and not isinstance(b.tool_choice, str)
            else (b.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "top_p": b.top_p,
            "truncation": "disabled",
            "usage": _usage(end.usage) if end is not None else None,
            "metadata": b.metadata or {},
            "user": None,
        }

    def _finish(self, output: list[dict], text: str, calls: list[ParsedToolCall], end: TurnEnd) -> dict:
        status = "incomplete" if end.finish_reason == "length" else "completed"
        response = self.envelope(status, output, end)
        if self.body.store is not False:
            reply: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                reply["tool_calls"] = [c.to_openai() for c in calls]
            conversation = [*self.earlier, *to_messages(input_items(self.body), self.tools), reply]
            records = [_item_record(x) for x in input_items(self.body)]
            self.store.put(response, records, conversation, self.owner)
        return response

    async def respond(self, request: Request) -> Response:
        gen = await start(self.call)
        turn = await collect(self.call, gen, request)
        if turn is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        text, calls, end = turn
        output: list[dict] = [_reasoning_item(_id("rs"), end.reasoning)] if end.reasoning else []
        if text.strip() or not calls:
            output.append(_message_item(_id("msg"), text))
        output += [_call_item(_id("fc"), c, self.tools) for c in calls]
        return JSONResponse(self._finish(output, text, calls, end))

    async def stream(self, request: Request) -> Response:
        gen = await start(self.call)
        seq = 0

        def event(kind: str, **data: Any) -> str:
            nonlocal seq
            payload = {"type": kind, "sequence_number": seq, **data}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

        async def events() -> AsyncIterator[str]:
            yield event("response.created", response=self.envelope("in_progress", [], None))
            yield event("response.in_progress", response=self.envelope("in_progress", [], None))
            output: list[dict] = []
            texts: list[str] = []
            calls: list[ParsedToolCall] = []
            msg: tuple[int, str] | None = None  # (output index, id) of the open message item
            msg_text: list[str] = []

            def close_message() -> list[str]:
                nonlocal msg
                if msg is None:
                    return []
                index, item_id = msg
                msg = None
                whole = "".join(msg_text)
                msg_text.clear()
                part = {"type": "output_text", "text": whole, "annotations": [], "logprobs": []}
                item = _message_item(item_id, whole)
                output.append(item)
                at = {"item_id": item_id, "output_index": index, "content_index": 0}
                return [
                    event("response.output_text.done", **at, text=whole, logprobs=[]),
                    event("response.content_part.done", **at, part=part),
                    event("response.output_item.done", output_index=index, item=item),
                ]

            thought: tuple[int, str] | None = None  # (output index, id) of the open reasoning item
            thought_text: list[str] = []

            def close_reasoning() -> list[str]:
                nonlocal thought
                if thought is None:
                    return []
                (index, item_id), thought = thought, None
                item = _reasoning_item(item_id, "".join(thought_text))
                output.append(item)
                at = {"item_id": item_id, "output_index": index, "content_index": 0}
                return [
                    event("response.reasoning_text.done", **at, text=item["content"][0]["text"]),
                    event("response.output_item.done", output_index=index, item=item),
                ]

            try:
                async for x in turn_items(self.call, gen, request):
                    if isinstance(x, Thinking):
                        if thought is None:
                            thought = (len(output), _id("rs"))
                            item = _reasoning_item(thought[1], "", "in_progress")
                            yield event("response.output_item.added", output_index=thought[0], item=item)
                        thought_text.append(x.text)
                        yield event(
                            "response.reasoning_text.delta",
                            item_id=thought[1],
                            output_index=thought[0],
                            content_index=0,
                            delta=x.text,
                        )
                        continue
                    for e in close_reasoning():
                        yield e
                    if isinstance(x, str):
                        texts.append(x)
                        if msg is None:
                            if not x.strip() and calls:
                                continue  # whitespace between calls
                            msg = (len(output), _id("msg"))
                            index, item_id = msg
                            yield event(
                                "response.output_item.added",
                                output_index=index,
                                item=_message_item(item_id, "", "in_progress") | {"content": []},
                            )
                            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                            yield event(
                                "response.content_part.added",
                                item_id=item_id,
                                output_index=index,
                                content_index=0,
                                part=part,
                            )
                        msg_text.append(x)
                        yield event(
                            "response.output_text.delta",
                            item_id=msg[1],
                            output_index=msg[0],
                            content_index=0,
                            delta=x,
                            logprobs=[],
                        )
                        continue
                    for e in close_message():
                        yield e
                    if isinstance(x, TurnEnd):
                        if not output:  # nothing at all was generated: an empty message, as create answers
                            item = _message_item(_id("msg"), "")
                            output.append(item)
                            yield event("response.output_item.added", output_index=0, item=item)
                            yield event("response.output_item.done", output_index=0, item=item)
                        response = self._finish(output, "".join(texts), calls, x)
                        kind = (
                            "response.incomplete"
                            if response["status"] == "incomplete"
                            else "response.completed"
                        )
                        yield event(kind, response=response)
                        return
                    calls.append(x)
                    index, item_id = len(output), _id("fc")
                    yield event(
                        "response.output_item.added",
                        output_index=index,
                        item=_call_item(item_id, x, self.tools, "in_progress"),
                    )
                    yield event(
                        "response.function_call_arguments.delta",
                        item_id=item_id,
                        output_index=index,
                        delta=x.arguments,
                    )
                    yield event(
                        "response.function_call_arguments.done",
                        item_id=item_id,
                        output_index=index,
                        name=self.tools.call_fields(x.name)["name"],
                        arguments=x.arguments,
                    )
                    item = _call_item(item_id, x, self.tools)
                    output.append(item)
                    yield event("response.output_item.done", output_index=index, item=item)
            except APIError as e:
                yield event("error", code=e.code or e.type, message=e.message, param=e.param)

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


async def create(
    state: ServerState, store: ResponseStore, body: ResponsesRequest, request: Request
) -> Response:
    if body.background:
        raise bad_request("background responses are not supported by this server", "background")
    earlier: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        prev = store.get(body.previous_response_id, owner_of(request))
        if prev is None:
            raise bad_request(
                f"Previous response with id {body.previous_response_id!r} not found.", "previous_response_id"
            )
        earlier = prev.conversation
    if body.model_extra and log.isEnabledFor(logging.DEBUG):
        log.debug("responses: ignoring %s", ", ".join(sorted(body.model_extra)))
    tools = ResponseTools.of(body.tools)
    call = await prepare(
        state, chat_fields(body, earlier, tools), request, "responses", max_tokens=body.max_output_tokens
    )
    rc = ResponseCall(state, store, body, call, earlier, owner_of(request), tools)
    return await (rc.stream(request) if body.stream else rc.respond(request))


def input_items_page(stored: Stored, limit: int, order: str, after: str | None) -> dict[str, Any]:
    items = list(stored.input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [x["id"] for x in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > len(page),
    }
