"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mlx_engine import defaults
from mlx_engine.request import GenerationRequest, RequestError
from mlx_engine.sampling.constraints import json_schema_grammar
from mlx_engine.sampling.tool_grammars import forced_call_grammar
from mlx_engine.tokenization.reply_parser import ToolParsing
from mlx_engine.tokenization.tool_calls import ParsedToolCall

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
from .protocol import ChatCompletionRequest, Message, NamedCustomToolChoice, NamedFunction, NamedToolChoice
from .security import effective_cache_salt

log = logging.getLogger("duet.server")

TOOLS_SYSTEM_PROMPT = (
    "You may call one or more functions to assist with the user query. The functions, as JSON schemas, "
    "are listed inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with a JSON object holding its name and arguments inside "
    '<tool_call></tool_call> tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)


def _text(m: Message, i: int) -> str:
    """A message's text: its string content, or its text and refusal parts joined."""
    content = m.content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if p.type not in ("text", "refusal"):
                raise bad_request(
                    f"content parts of type {p.type!r} are not supported: this model reads text only",
                    f"messages[{i}].content[{j}].type",
                )
            parts.append((p.text if p.type == "text" else p.refusal) or "")
        content = "".join(parts)
    if not content and m.role == "assistant" and m.refusal:
        content = m.refusal  # an earlier refusal is what the assistant said
    return content or ""


def _calls(m: Message, i: int) -> list[dict]:
    """An assistant message's tool calls (legacy ``function_call`` and custom calls included),
    with the arguments decoded where they are JSON."""
    raw = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or [] if c.function]
    raw += [(c.id, c.custom.name, c.custom.input) for c in m.tool_calls or [] if c.custom and not c.function]
    if m.function_call is not None:
        raw.append((f"call_{i}", m.function_call.name, m.function_call.arguments))
    calls = []
    for id_, name, arguments in raw:
        try:
            args = json.loads(arguments)
        except ValueError:
            args = arguments
        calls.append({"id": id_, "type": "function", "function": {"name": name, "arguments": args}})
    return calls


def _message_dicts(body: ChatCompletionRequest, template_knows_tools: bool) -> list[dict]:
    out = []
    legacy_ids: dict[str, str] = {}  # a legacy function result answers the last call of that name
    for i, m in enumerate(body.messages):
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        d: dict = {"role": role, "content": _text(m, i)}
        if m.name:
            d["name"] = m.name
        thought = m.reasoning_content or m.reasoning
        if m.role == "assistant" and thought:  # Qwen3's templates read the one, gpt-oss's the other
            d["reasoning_content"] = d["thinking"] = thought
        calls = _calls(m, i) if m.role == "assistant" else []  # other roles' calls mean nothing
        if m.role == "assistant" and m.function_call is not None:
            legacy_ids[m.function_call.name] = calls[-1]["id"]
        if calls:
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
        if role == "tool":
            call_id = m.tool_call_id or (legacy_ids.get(m.name) if m.name else None)
            if call_id:
                d["tool_call_id"] = call_id
            if not template_knows_tools:
                d["content"] = f"<tool_response>\n{d['content']}\n</tool_response>"
        out.append(d)
    return out


@dataclass
class ToolPlan:
    """What a request's tools, tool_choice (or legacy functions, function_call) ask for."""

    offered: list[dict] | None  # the tools shown to the model (None: no tools)
    forced: list[dict] | None  # the model must call one of these (a grammar), or None
    parallel: bool  # a forced call may be followed by more
    legacy: bool  # answer in the legacy function_call shape


def _tool_plan(body: ChatCompletionRequest) -> ToolPlan:
    for i, t in enumerate(body.tools or []):
        if t.type == "custom":
            raise bad_request(
                "custom (free-form) tools are not supported by this server: declare a function tool "
                "with JSON parameters",
                f"tools[{i}]",
            )
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    functions = [
        {"type": "function", "function": f.model_dump(exclude_none=True)} for f in body.functions or []
    ]
    legacy = bool(functions) and not tools
    tools += functions
    by_name = {t["function"]["name"]: t for t in tools}

    param = "tool_choice" if body.tool_choice is not None or body.function_call is None else "function_call"
    choice = body.tool_choice if body.tool_choice is not None else body.function_call
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise bad_request(f"{param} is set but no tools were given", param)

    def pick(names: list[str]) -> list[dict]:
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise bad_request(f"{param} names {unknown[0]!r}, which is not among the tools", param)
        return [by_name[n] for n in names]

    if choice == "none":
        return ToolPlan(None, None, False, legacy)
    if choice == "auto":
        return ToolPlan(tools, None, False, legacy)
    parallel = body.parallel_tool_calls is True and not legacy
    if choice == "required":
        return ToolPlan(tools, tools, parallel, legacy)
    if isinstance(choice, NamedFunction):  # legacy {"name": ...}
        return ToolPlan(tools, pick([choice.name]), False, legacy)
    if isinstance(choice, NamedToolChoice):
        return ToolPlan(tools, pick([choice.function.name]), False, legacy)
    if isinstance(choice, NamedCustomToolChoice):
        raise bad_request("custom (free-form) tools are not supported by this server", param)
    names = []
    for entry in choice.allowed_tools.tools:
        fn = entry.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if entry.get("type", "function") != "function" or not isinstance(name, str):
            raise bad_request(
                "allowed_tools.tools must name function tools: {'type': 'function', 'function': {'name': ...}}",
                "tool_choice.allowed_tools.tools",
            )
        names.append(name)
    allowed = pick(names)
    if choice.allowed_tools.mode == "auto":
        return ToolPlan(allowed, None, False, legacy)
    return ToolPlan(allowed, allowed, parallel, legacy)


def _with_tools_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    prompt = TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


class ChatCall:
    """One validated chat request, ready to generate."""

    def __init__(
        self, state: ServerState, body: ChatCompletionRequest, cache_salt: str | None, endpoint: str = "chat"
    ):
        """``cache_salt``: the request's effective prefix-cache salt (``effective_cache_salt``);
        ``endpoint``: the API it came in through, for the metrics (the Messages and Responses
        adapters build a chat request and call through here too)."""
        self.state, self.body, self.cache_salt, self.endpoint = state, body, cache_salt, endpoint
        engine = state.engine
        state.check_model(body.model)
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        self.n = body.n or 1
        self.stream = bool(body.stream)
        if body.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        self.include_usage = bool(self.stream and body.stream_options and body.stream_options.include_usage)

        if body.modalities and any(m != "text" for m in body.modalities):
            raise bad_request("this model produces text only: modalities can only be ['text']", "modalities")
        ignored = body.ignored_fields()
        if ignored:
            log.debug("chat request: ignoring %s", ", ".join(ignored))

        plan = _tool_plan(body)
        forced = plan.forced
        self.tools = plan.offered
        self.legacy = plan.legacy
        self.parse_tools = self.tools is not None
        self.forced = forced is not None
        # the names a call may have (to complete one cut short by max_tokens)
        self.tool_names = [t["function"]["name"] for t in forced or self.tools or []]

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
            fmt = engine.tokenizer.reply_format
            grammar = forced_call_grammar(
                forced,
                plan.parallel,
                fmt.tools if knows_tools else None,
                fmt.harmony and knows_tools,
                engine.tokenizer.added_id,
                template,
            )
            self.grammar = ("tool_choice", grammar)
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

        self.messages, self.template_tools = messages, self.tools if knows_tools else None
        fmt = engine.tokenizer.reply_format
        self.template_kwargs = {
            **fmt.thinking_kwargs(body.reasoning_effort),
            **(body.chat_template_kwargs or {}),
        }
        self.thinking_budget = body.thinking_budget
        self.tool_parsing = (
            ToolParsing(tuple(self.tool_names), self.tools, self.forced) if self.parse_tools else None
        )
        probe = GenerationRequest(
            messages=messages, tools=self.template_tools, max_tokens=1, template_kwargs=self.template_kwargs
        )
        self.prompt = prompt_ids(engine, probe, "messages")  # once: the requests carry these ids
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if requested is None:
            requested = defaults.MAX_TOKENS  # None: until EOS, a stop, or the context is full
        self.max_tokens = max_new_tokens(
            requested, len(self.prompt), engine.context_length, server_cap=state.max_tokens
        )
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
                messages=self.messages,  # a chat: the reply is remembered for the next turn's prefix hit
                tools=self.template_tools,
                max_tokens=self.max_tokens,
                sampling=self.samplings[i],
                stop=self.stop,
                ignore_eos=bool(self.body.ignore_eos),
                constraint=constraints[i],
                request_id=f"{self.id}-{i}",
                cache_salt=self.cache_salt,
                tool_parsing=self.tool_parsing,
                template_kwargs=self.template_kwargs,
                thinking_budget=self.thinking_budget,
            )
            for i in range(self.n)
        ]

    def prompt_ids(self) -> list[list[int]]:
        """Each request's prompt ids, made once in ``__init__``."""
        return [self.prompt] * self.n

    def _cancelled(self, n: int) -> None:
        self.state.metrics.requests.labels(self.endpoint, "cancelled").inc(n)

    def _finish_reason(self, reason: str | None, called: bool) -> str | None:
        if called and reason == "stop":
            return "function_call" if self.legacy else "tool_calls"
        return reason

    def _call_deltas(self, k: int, call: ParsedToolCall) -> list[dict]:
        """The deltas that stream call number ``k``: its name, then its arguments."""
        if self.legacy:
            if k:  # the legacy API carries one call
                return []
            return [
                {"function_call": {"name": call.name, "arguments": ""}},
                {"function_call": {"arguments": call.arguments}},
            ]
        head = {
            "index": k,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        return [
            {"tool_calls": [head]},
            {"tool_calls": [{"index": k, "function": {"arguments": call.arguments}}]},
        ]

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
        gen = Generation(self.state.engine, await self.requests(), self._cancelled, self.prompt_ids())
        await gen.start(self.n)
        choices = await collect_choices(gen, request, self.state.metrics, self.n)
        if choices is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        out = []
        for i, c in enumerate(choices):
            text = "".join(c.text)
            calls = c.tool_calls
            content: str | None = None if calls and not text.strip() else text
            reason = self._finish_reason(c.finish_reason, bool(calls))
            self.state.metrics.requests.labels("chat", reason).inc()
            message: dict = {"role": "assistant", "content": content, "refusal": None}
            if c.reasoning:  # the name llama.cpp, vLLM, DeepSeek and LiteLLM read
                message["reasoning_content"] = "".join(c.reasoning)
            if calls and self.legacy:  # the legacy API has one call, as function_call
                message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
            elif calls:
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
        gen = Generation(self.state.engine, await self.requests(), self._cancelled, self.prompt_ids())
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
        n_calls = [0] * self.n
        try:
            for i in range(self.n):
                yield self._chunk(i, {"role": "assistant", "content": "", "refusal": None})
            async for i, ev, err in gen.events():
                if ev is not None:
                    choices[i].add(ev, self.state.metrics, t0)
                problem = failure([choices[i]], err)
                if problem is not None:
                    yield sse(problem.body())
                    break
                assert ev is not None  # no error: an event
                logprobs = None
                if self.body.logprobs and ev.logprobs:
                    logprobs = {"content": [chat_logprob(lp) for lp in ev.logprobs], "refusal": None}
                if ev.reasoning:
                    yield self._chunk(i, {"reasoning_content": ev.reasoning}, logprobs=logprobs)
                    logprobs = None
                items: list[str | ParsedToolCall] = [ev.text] if ev.text else []
                items += ev.tool_calls
                sent_logprobs = False
                for x in items:
                    if isinstance(x, str):
                        yield self._chunk(i, {"content": x}, logprobs=None if sent_logprobs else logprobs)
                        sent_logprobs = True
                    else:
                        k = n_calls[i]
                        n_calls[i] += 1
                        for delta in self._call_deltas(k, x):
                            yield self._chunk(i, delta)
                if logprobs is not None and not sent_logprobs:
                    yield self._chunk(i, {"content": ""}, logprobs=logprobs)
                if ev.finished:
                    reason = self._finish_reason(ev.finish_reason, n_calls[i] > 0)
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
    salt = effective_cache_salt(request.scope, body.cache_salt)
    call = await asyncio.to_thread(ChatCall, state, body, salt)  # template + tokenizer: off the loop
    if call.stream:
        return await call.stream_response(request)
    return await call.respond(request)
