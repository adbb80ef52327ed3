"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mlx_engine.constraints import json_schema_grammar, tool_call_grammar
from mlx_engine.request import GenerationRequest, RequestError

from .common import (
    SSE_DONE,
    SSE_HEADERS,
    ChoiceState,
    ServerState,
    chat_logprob,
    collect_choices,
    failure,
    max_new_tokens,
    new_id,
    prompt_ids,
    sampling_params,
    sse,
    stop_list,
    total_usage,
    wait_disconnect,
)
from .errors import bad_request
from .generation import Generation
from .protocol import ChatCompletionRequest
from .tool_calls import ToolCallStream, parse_tool_calls

TOOLS_SYSTEM_PROMPT = (
    "You may call one or more functions to assist with the user query. The functions, as JSON schemas, "
    "are listed inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with a JSON object holding its name and arguments inside "
    '<tool_call></tool_call> tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)


def _message_dicts(body: ChatCompletionRequest, template_knows_tools: bool) -> list[dict]:
    out = []
    for i, m in enumerate(body.messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if p.type not in ("text", "refusal"):
                    raise bad_request(
                        f"content parts of type {p.type!r} are not supported: this model reads text only",
                        f"messages[{i}].content[{j}].type",
                    )
                parts.append(p.text or "")
            content = "".join(parts)
        d: dict = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                try:
                    args = json.loads(c.function.arguments)
                except ValueError:
                    args = c.function.arguments
                calls.append(
                    {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}}
                )
            if template_knows_tools:
                d["tool_calls"] = calls
            else:  # spell the calls the way the model is asked to write them
                blocks = [
                    json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                    for c in calls
                ]
                d["content"] = (d["content"] + "\n" if d["content"] else "") + "\n".join(
                    f"<tool_call>\n{b}\n</tool_call>" for b in blocks
                )
        if m.role == "tool":
            if m.tool_call_id:
                d["tool_call_id"] = m.tool_call_id
            if not template_knows_tools:
                d["content"] = f"<tool_response>\n{d['content']}\n</tool_response>"
        out.append(d)
    return out


def _with_tools_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    prompt = TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


class ChatCall:
    """One validated chat request, ready to generate."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest):
        self.state, self.body = state, body
        engine = state.engine
        state.check_model(body.model)
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        self.n = body.n or 1
        self.stream = bool(body.stream)
        if body.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        self.include_usage = bool(self.stream and body.stream_options and body.stream_options.include_usage)

        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
        if choice != "none" and not tools:
            raise bad_request("tool_choice is set but no tools were given", "tool_choice")
        forced = None
        if choice == "required":
            forced = tools
        elif not isinstance(choice, str):
            forced = [t for t in tools if t["function"]["name"] == choice.function.name]
            if not forced:
                raise bad_request(
                    f"tool_choice names {choice.function.name!r}, which is not among the tools", "tool_choice"
                )
        self.tools = tools if choice != "none" else None
        self.parse_tools = self.tools is not None

        template = engine.tokenizer.chat_template or ""
        knows_tools = "tools" in template
        messages = _message_dicts(body, knows_tools)
        if self.tools and not knows_tools:
            messages = _with_tools_prompt(messages, self.tools)

        self.grammar = None
        rf = body.response_format
        if forced is not None:
            if rf is not None and rf.type != "text":
                raise bad_request(
                    "response_format cannot be combined with a required tool call", "response_format"
                )
            # one call unless asked for more: a forced grammar that allows another call after each
            # one lets weak models repeat the same call until max_tokens
            parallel = body.parallel_tool_calls is True and choice == "required"
            self.grammar = ("tool_choice", tool_call_grammar(forced, parallel=parallel))
        elif rf is not None and rf.type == "json_object":
            self.grammar = ("response_format", json_schema_grammar({"type": "object"}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise bad_request(
                    "response_format of type json_schema needs a json_schema", "response_format.json_schema"
                )
            try:
                grammar = json_schema_grammar(
                    rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
                )
            except RequestError as e:
                raise bad_request(str(e), "response_format.json_schema.schema") from None
            self.grammar = ("response_format.json_schema.schema", grammar)

        probe = GenerationRequest(messages=messages, tools=self.tools if knows_tools else None, max_tokens=1)
        self.prompt = prompt_ids(engine, probe, "messages")
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        self.max_tokens = max_new_tokens(requested, len(self.prompt), engine.context_length, param)
        vocab = engine.tokenizer.vocab_size
        self.samplings = [
            sampling_params(body, vocab, bool(body.logprobs), body.top_logprobs or 0, i)
            for i in range(self.n)
        ]
        self.stop = stop_list(body.stop)
        self.id = new_id("chatcmpl")
        self.created = int(time.time())

    async def requests(self) -> list[GenerationRequest]:
        constraints: list = [None] * self.n
        if self.grammar is not None:
            param, grammar = self.grammar
            try:
                first = await asyncio.to_thread(self.state.grammars.constraint, grammar, param)
            except RequestError as e:
                raise bad_request(str(e), param) from None
            constraints = [first] + [first.copy() for _ in range(self.n - 1)]
        return [
            GenerationRequest(
                prompt=list(self.prompt),
                max_tokens=self.max_tokens,
                sampling=self.samplings[i],
                stop=self.stop,
                ignore_eos=bool(self.body.ignore_eos),
                constraint=constraints[i],
                request_id=f"{self.id}-{i}",
            )
            for i in range(self.n)
        ]

    def _cancelled(self, n: int) -> None:
        self.state.metrics.requests.labels("chat", "cancelled").inc(n)

    def _envelope(self, obj: str) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.state.model_id,
            "system_fingerprint": self.state.fingerprint,
        }

    # --- non-streamed ---------------------------------------------------------------
    async def respond(self, request: Request) -> Response:
        gen = Generation(self.state.engine, await self.requests(), self._cancelled)
        await gen.start(self.n)
        choices = await collect_choices(gen, request, self.state.metrics, self.n)
        if choices is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        out = []
        for i, c in enumerate(choices):
            text = "".join(c.text)
            content, calls = (text, [])
            if self.parse_tools:
                content, calls = parse_tool_calls(text)
            reason = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
            self.state.metrics.requests.labels("chat", reason).inc()
            message: dict = {"role": "assistant", "content": content, "refusal": None}
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
            logprobs = None
            if self.body.logprobs:
                logprobs = {"content": [chat_logprob(lp) for lp in c.logprobs], "refusal": None}
            out.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
        return JSONResponse(
            {**self._envelope("chat.completion"), "choices": out, "usage": total_usage(choices, self.n)}
        )

    # --- streamed -------------------------------------------------------------------
    async def stream_response(self, request: Request) -> Response:
        gen = Generation(self.state.engine, await self.requests(), self._cancelled)
        await gen.start(self.n)
        return StreamingResponse(self._sse(gen, request), media_type="text/event-stream", headers=SSE_HEADERS)

    def _chunk(self, index: int, delta: dict, finish_reason: str | None = None, logprobs=None) -> str:
        c = {
            **self._envelope("chat.completion.chunk"),
            "choices": [
                {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            ],
        }
        if self.include_usage:
            c["usage"] = None
        return sse(c)

    async def _sse(self, gen: Generation, request: Request) -> AsyncIterator[str]:
        t0 = time.perf_counter()
        watcher = asyncio.create_task(wait_disconnect(request))
        watcher.add_done_callback(lambda _: gen.cancel())
        choices = [ChoiceState() for _ in range(self.n)]
        parsers = [ToolCallStream() if self.parse_tools else None for _ in range(self.n)]
        n_calls = [0] * self.n
        try:
            for i in range(self.n):
                yield self._chunk(i, {"role": "assistant", "content": "", "refusal": None})
            async for i, ev, err in gen.events():
                if err is None:
                    choices[i].add(ev, self.state.metrics, t0)
                problem = failure([choices[i]], err)
                if problem is not None:
                    yield sse(problem.body())
                    break
                logprobs = None
                if self.body.logprobs and ev.logprobs:
                    logprobs = {"content": [chat_logprob(lp) for lp in ev.logprobs], "refusal": None}
                items = [("content", ev.text)] if ev.text else []
                if parsers[i] is not None:
                    items = parsers[i].feed(ev.text) + (parsers[i].finish() if ev.finished else [])
                sent_logprobs = False
                for kind, x in items:
                    if kind == "content":
                        yield self._chunk(i, {"content": x}, logprobs=None if sent_logprobs else logprobs)
                        sent_logprobs = True
                    else:
                        k = n_calls[i]
                        n_calls[i] += 1
                        yield self._chunk(
                            i,
                            {
                                "tool_calls": [
                                    {
                                        "index": k,
                                        "id": x.id,
                                        "type": "function",
                                        "function": {"name": x.name, "arguments": ""},
                                    }
                                ]
                            },
                        )
                        yield self._chunk(
                            i, {"tool_calls": [{"index": k, "function": {"arguments": x.arguments}}]}
                        )
                if logprobs is not None and not sent_logprobs:
                    yield self._chunk(i, {"content": ""}, logprobs=logprobs)
                if ev.finished:
                    reason = "tool_calls" if n_calls[i] and ev.finish_reason == "stop" else ev.finish_reason
                    self.state.metrics.requests.labels("chat", reason).inc()
                    yield self._chunk(i, {}, reason)
            else:
                if gen.cancelled:  # the client went away
                    return
                if self.include_usage:
                    yield sse(
                        {
                            **self._envelope("chat.completion.chunk"),
                            "choices": [],
                            "usage": total_usage(choices, self.n),
                        }
                    )
            yield SSE_DONE
        finally:
            watcher.cancel()
            await gen.aclose()


async def chat_completions(state: ServerState, body: ChatCompletionRequest, request: Request) -> Response:
    try:
        call = ChatCall(state, body)
    except RequestError as e:
        raise bad_request(str(e), e.param) from None
    if call.stream:
        return await call.stream_response(request)
    return await call.respond(request)
