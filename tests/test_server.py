"""`duet serve` on loopback with a tiny random model, driven by the official openai SDK.

One server for the module (a tiny llama whose chat template renders tools); a second, small
one with an API key, a one-slot queue and a tiny KV cache for auth, 429 and shutdown.
A random model writes garbage, so wherever output must be valid JSON, only the grammar can
have made it so.
"""

from __future__ import annotations

import asyncio
import collections.abc
import json
import logging
import signal
import time
import types
from typing import Annotated, Literal, Union, get_args, get_origin, get_type_hints

import httpx
import jsonschema
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from openai.types import completion_create_params
from openai.types.chat import ChatCompletionMessageParam
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.chat.chat_completion_content_part_text_param import ChatCompletionContentPartTextParam
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import is_typeddict

from app.server import errors
from tests.test_server_harness import ServerProcess, tiny_model, unlabelled

MODEL = "tiny-tools"
USER = [{"role": "user", "content": "Tell me a long story about the quick brown fox and the lazy dog."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    path = tiny_model(root / MODEL, tools_template=True)
    srv = ServerProcess(path, root / "server.log", "--cache-gb", "0.05")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient_factory(server):
    return lambda: openai.AsyncOpenAI(
        base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=120
    )


def post(server, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, str | bytes):
        return httpx.post(
            server.base + path, content=body, headers={"content-type": "application/json"}, timeout=60, **kw
        )
    return httpx.post(server.base + path, json=body, timeout=60, **kw)


# --- models, health, basic shapes -----------------------------------------------------


def test_models_health_and_aliases(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "duet"
    assert httpx.get(server.base + "/health").json()["status"] == "ok"
    # the path given to --model is an alias for the served model
    r = post(server, "/v1/completions", {"model": str(server.proc.args[-1]), "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == MODEL


def test_chat_non_streamed_shape_determinism_and_prefix_cache(client):
    kw = dict(model=MODEL, messages=USER, max_tokens=8, temperature=0)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.id.startswith("chatcmpl-") and a.id != b.id and a.object == "chat.completion"
    assert isinstance(a.created, int) and abs(a.created - time.time()) < 600
    assert a.system_fingerprint and a.system_fingerprint == b.system_fingerprint
    assert a.model == MODEL
    (ch,) = a.choices
    assert ch.index == 0 and ch.message.role == "assistant" and ch.finish_reason == "length"
    assert ch.message.content == b.choices[0].message.content  # greedy
    u = a.usage
    assert u.completion_tokens == 8 and u.total_tokens == u.prompt_tokens + 8 and u.prompt_tokens > 16
    # the second identical prompt reuses the first one's KV: all but the last token, which is
    # computed for its logits
    assert b.usage.prompt_tokens_details.cached_tokens == b.usage.prompt_tokens - 1


def test_chat_streamed_matches_non_streamed_with_usage(client):
    kw = dict(model=MODEL, messages=USER, max_tokens=10, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    # without include_usage there is no usage chunk
    plain = list(client.chat.completions.create(**kw, stream=True))
    assert all(c.choices for c in plain)


def test_async_client_streaming_and_not(aclient_factory):
    async def run():
        async with aclient_factory() as ac:
            r = await ac.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0)
            s = await ac.chat.completions.create(
                model=MODEL, messages=USER, max_tokens=6, temperature=0, stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in s])
            c = await ac.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
            return r, text, c

    r, text, c = asyncio.run(run())
    assert text == r.choices[0].message.content and r.usage.completion_tokens == 6
    assert c.object == "text_completion" and c.usage.completion_tokens == 4


def test_max_completion_tokens_and_ignore_eos_extension(client):
    r = client.chat.completions.create(
        model=MODEL, messages=USER, max_completion_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_stop_strings(client):
    base = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=24, temperature=0)
    text = base.choices[0].text
    stop = text[6:8]
    assert stop and len(stop) == 2
    first = text.index(stop)
    r = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=24, temperature=0, stop=[stop, "\u2603never"]
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:first]
    s = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=24, temperature=0, stop=stop, stream=True
    )
    chunks = list(s)
    assert "".join(c.choices[0].text for c in chunks) == text[:first]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_and_n(client):
    kw = dict(model=MODEL, messages=USER, max_tokens=8, temperature=1.0, seed=1234, n=3)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in b.choices]  # same seed, same outputs
    assert len(set(texts)) > 1  # each choice has its own stream of randomness
    assert a.usage.completion_tokens == 24
    one = client.chat.completions.create(**{**kw, "n": 1})
    assert a.usage.prompt_tokens == one.usage.prompt_tokens  # the shared prompt counts once
    # streamed n: every choice gets its role chunk, its text and its finish reason
    chunks = list(client.chat.completions.create(**kw, stream=True))
    got = {
        i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
        for i in range(3)
    }
    assert [got[i] for i in range(3)] == texts
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1, 2]


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        lps = [x.logprob for x in t.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert t.token == t.top_logprobs[0].token and t.logprob == pytest.approx(
            lps[0]
        )  # greedy takes the best
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    s = list(
        client.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=6,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            stream=True,
        )
    )
    streamed = [t.token for c in s if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == [t.token for t in content]


def test_completions_prompts_n_echo_logprobs(client):
    r = client.completions.create(
        model=MODEL, prompt=["Hello world", "def add(a, b):"], n=2, max_tokens=5, temperature=0.8, seed=7
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and all(
        c.finish_reason == "length" for c in r.choices
    )
    assert r.usage.completion_tokens == 20
    ids = client.completions.create(model=MODEL, prompt=[72, 101, 108], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3
    e = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, temperature=0, echo=True)
    assert e.choices[0].text.startswith("Hello world")
    lp = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=4, temperature=0, logprobs=2)
    L = lp.choices[0].logprobs
    assert len(L.tokens) == len(L.token_logprobs) == len(L.top_logprobs) == len(L.text_offset) == 4
    assert "".join(L.tokens) == lp.choices[0].text
    assert all(len(t) <= 2 for t in L.top_logprobs)
    assert L.text_offset[0] == 0 and L.text_offset[1] == len(L.tokens[0])


def test_logit_bias_forces_a_token(client):
    r = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logit_bias={"70": 100}, logprobs=0
    )
    toks = r.choices[0].logprobs.tokens
    assert len(toks) == 5 and len(set(toks)) == 1


def test_penalties_and_sampling_extensions_accepted(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=6,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=-3,
        user="someone",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True},
    )
    assert r.usage.completion_tokens == 6
    # a strong frequency penalty changes what greedy decoding repeats
    kw = dict(model=MODEL, prompt="Hello", max_tokens=40, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    penalised = client.completions.create(**kw, frequency_penalty=2.0).choices[0].text
    assert plain != penalised


# --- errors --------------------------------------------------------------------------------

LONG = "The quick brown fox jumps over the lazy dog. " * 300


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/chat/completions", "{not json", 400, None),
        ("/v1/chat/completions", "[1, 2]", 400, None),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": USER, "temperature": "hot"},
            400,
            "temperature",
        ),
        ("/v1/chat/completions", {"model": MODEL, "messages": USER, "temperature": 3}, 400, "temperature"),
        ("/v1/chat/completions", {"model": MODEL, "messages": USER, "n": 0}, 400, "n"),
        ("/v1/chat/completions", {"model": MODEL, "messages": USER, "n": 1000}, 400, "n"),
        ("/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 0}, 400, "max_tokens"),
        # max_tokens past the context is a cap (tests/test_request_caps.py); a prompt that fills it is not
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "fox " * 3000}], "max_tokens": 4},
            400,
            "messages",
        ),
        ("/v1/chat/completions", {"model": MODEL, "messages": USER, "frobnicate": 1}, 400, "frobnicate"),
        ("/v1/chat/completions", {"model": "gpt-4o", "messages": USER}, 404, "model"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": LONG}]},
            400,
            "messages",
        ),
        ("/v1/chat/completions", {"model": MODEL, "messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            },
            400,
            "messages[0].content[0].type",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": USER, "logit_bias": {"abc": 1}},
            400,
            "logit_bias",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": USER, "logit_bias": {"99999": 1}},
            400,
            "logit_bias",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": USER, "response_format": {"type": "json_schema"}},
            400,
            "response_format.json_schema",
        ),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": USER,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
                },
            },
            400,
            "response_format.json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": USER, "tool_choice": "required"},
            400,
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": USER, "stream_options": {"include_usage": True}},
            400,
            "stream_options",
        ),
        # OpenAI fields that are accepted still need the right type and a possible value
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": USER, "reasoning_effort": 5},
            400,
            "reasoning_effort",
        ),
        ("/v1/chat/completions", {"model": MODEL, "messages": USER, "metadata": "x"}, 400, "metadata"),
        ("/v1/chat/completions", {"model": MODEL, "messages": USER, "store": "yes"}, 400, "store"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": USER, "modalities": ["text", "audio"]},
            400,
            "modalities",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": USER, "function_call": "auto"},
            400,
            "function_call",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": USER, "functions": [{"name": "f"}], "function_call": {"name": "g"}},
            400,
            "function_call",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": USER, "tools": [{"type": "custom", "custom": {"name": "sql"}}]},
            400,
            "tools[0]",
        ),
        (
            "/v1/chat/completions",
            json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": "a\ud800b"}]}
            ),  # lone surrogate
            400,
            "messages[0].content",
        ),
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": ["ok", "\udfff"]}), 400, "prompt[1]"),
        ("/v1/completions", {"model": MODEL, "prompt": LONG}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [10**7]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "suffix": "x"}, 400, "suffix"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 9}, 400, "logprobs"),
    ],
)
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    if status == 400 and "context" in err["message"]:
        assert err["code"] == "context_length_exceeded"


def test_deeply_nested_bodies_are_refused_before_anything_recurses_into_them(server):
    deep: dict = {"type": "object"}
    for _ in range(120):
        deep = {"type": "object", "properties": {"a": deep}}
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": USER, "tools": [tool]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "too_deep", r.text
    assert err["param"].startswith("tools[0].function.parameters.properties.a.")
    assert httpx.get(server.base + "/health").status_code == 200


def test_sdk_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=USER)
    long = [{"role": "user", "content": "fox " * 3000}]  # more tokens than the 2,048 of the context
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=long, max_tokens=8)
    assert e.value.code == "context_length_exceeded"
    assert "2048" in e.value.message


# --- structured output -----------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"enum": ["happy", "sad", "meh"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "mood", "tags", "ok"],
    "additionalProperties": False,
}


def test_json_schema_output_always_parses(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=200, temperature=1.0, seed=11, n=4, response_format=fmt
    )
    for ch in r.choices:
        assert ch.finish_reason == "stop", ch.message.content
        jsonschema.validate(json.loads(ch.message.content), PERSON)
    s = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=200, temperature=1.0, seed=5, response_format=fmt, stream=True
    )
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in s)), PERSON)
    # without the grammar the same sampling does not give JSON
    free = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=40, temperature=1.0, seed=11)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)


def test_json_object_mode(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=300,
        temperature=0.7,
        seed=2,
        response_format={"type": "json_object"},
        extra_body={"logit_bias": {"95": 5}},
    )  # "}" a bit likelier: ends sooner
    ch = r.choices[0]
    if ch.finish_reason == "stop":
        assert isinstance(json.loads(ch.message.content), dict)
    else:  # cut by max_tokens: still a valid prefix of an object
        assert ch.finish_reason == "length" and ch.message.content.startswith("{")


# --- tools -------------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "now",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


def _check_call(call, tools):
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), spec[call.function.name])


def test_tool_choice_required_and_named(client):
    tools = [WEATHER, CLOCK]
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=tools,
        tool_choice="required",
        max_tokens=120,
        temperature=0.8,
        seed=4,
        parallel_tool_calls=False,
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert len(ch.message.tool_calls) == 1
    _check_call(ch.message.tool_calls[0], tools)
    named = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=tools,
        max_tokens=120,
        temperature=0.8,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    _check_call(call, tools)


def test_tool_calls_stream_in_delta_format(client):
    s = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=120,
        temperature=0.8,
        seed=9,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for c in s:
        d = c.choices[0].delta
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            if tc.function and tc.function.name:
                slot["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                slot["arguments"] += tc.function.arguments
        finish = c.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    for slot in calls.values():
        assert slot["id"].startswith("call_") and slot["name"] == "get_weather"
        jsonschema.validate(json.loads(slot["arguments"]), WEATHER["function"]["parameters"])


def test_tools_reach_the_template_and_tool_turns_render(client):
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1)
    with_tools = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=1)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    none = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER], tool_choice="none", max_tokens=1
    )
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    history = USER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], max_tokens=4, temperature=0
    )
    assert r.usage.prompt_tokens > with_tools.usage.prompt_tokens + 10
    assert r.choices[0].finish_reason in ("length", "stop")


# --- what real OpenAI clients send ---------------------------------------------------------


def sdk_value(tp):
    """A valid value of an openai SDK request type, with every key of every TypedDict filled in
    (the first choice of each union and literal): the request a client setting everything sends."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Union or origin is types.UnionType:
        return sdk_value(next(a for a in args if a is not type(None)))
    if origin is Literal:
        return args[0]
    if is_typeddict(tp):
        return {k: sdk_value(v) for k, v in get_type_hints(tp).items()}
    if origin in (list, collections.abc.Iterable, collections.abc.Sequence) or (
        getattr(origin, "__name__", "") == "SequenceNotStr"
    ):
        return [sdk_value(args[0])]
    if origin in (dict, collections.abc.Mapping):
        return {"key": sdk_value(args[1])}
    return {str: "text", int: 1, float: 0.5, bool: True, object: "text"}[tp]


def every_chat_field() -> dict:
    """Every field of the installed SDK's chat-completions request, each message kind included."""
    body = sdk_value(chat_create_params.CompletionCreateParamsBase)
    messages = [sdk_value(kind) for kind in get_args(ChatCompletionMessageParam)]
    messages.append({"role": "user", "content": [sdk_value(ChatCompletionContentPartTextParam)]})
    # the values the generic filler cannot know: this server's model, token ids, short replies
    return {
        **body,
        "model": MODEL,
        "messages": messages,
        "logit_bias": {"1": 1},
        "max_tokens": 3,
        "max_completion_tokens": 3,
    }


def every_completion_field() -> dict:
    body = sdk_value(completion_create_params.CompletionCreateParamsBase)
    # echo with logprobs needs prompt logprobs and a suffix needs insertion: neither exists here
    return {**body, "model": MODEL, "logit_bias": {"1": 1}, "max_tokens": 3, "echo": False, "suffix": ""}


def test_every_field_of_the_sdks_chat_request_is_accepted(client):
    body = every_chat_field()
    fields = set(chat_create_params.CompletionCreateParamsBase.__annotations__)
    assert set(body) == fields and len(fields) > 35  # follows the installed SDK
    plain = {k: v for k, v in body.items() if k != "stream_options"}  # only allowed when streaming
    r = client.chat.completions.create(**plain)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert r.choices[0].logprobs.content[0].top_logprobs  # logprobs and top_logprobs were honoured
    chunks = list(client.chat.completions.create(**body, stream=True))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3  # include_usage


def test_every_field_of_the_sdks_completion_request_is_accepted(client):
    body = every_completion_field()
    assert set(body) == set(completion_create_params.CompletionCreateParamsBase.__annotations__)
    plain = {k: v for k, v in body.items() if k != "stream_options"}
    r = client.completions.create(**plain)
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].logprobs.tokens) == 3
    chunks = list(client.completions.create(**body, stream=True))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_paths_without_v1_and_with_a_trailing_slash(server):
    chat = {"model": MODEL, "messages": USER, "max_tokens": 1}
    comp = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for path in ("/v1/chat/completions/", "/chat/completions", "/chat/completions/"):
        r = post(server, path, chat)
        assert r.status_code == 200 and r.json()["object"] == "chat.completion", (path, r.status_code)
    for path in ("/v1/completions/", "/completions", "/completions/"):
        r = post(server, path, comp)
        assert r.status_code == 200 and r.json()["object"] == "text_completion", (path, r.status_code)
    for path in ("/v1/models/", "/models", "/models/"):
        r = httpx.get(server.base + path)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL, path
    for path in ("/models/" + MODEL, "/v1/models/" + MODEL + "/"):
        assert httpx.get(server.base + path).json()["id"] == MODEL, path
    bare = openai.OpenAI(base_url=server.base, api_key="none", max_retries=0)
    assert bare.chat.completions.create(model=MODEL, messages=USER, max_tokens=1).usage.completion_tokens == 1


def test_legacy_functions_and_function_call(client):
    clock = {"name": "now", "description": "The time", "parameters": CLOCK["function"]["parameters"]}
    r = client.chat.completions.create(
        model=MODEL, messages=USER, functions=[clock], function_call={"name": "now"}, max_tokens=60
    )
    ch = r.choices[0]
    assert ch.finish_reason == "function_call" and ch.message.tool_calls is None
    assert ch.message.function_call.name == "now" and json.loads(ch.message.function_call.arguments) == {}
    s = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        functions=[clock],
        function_call={"name": "now"},
        max_tokens=60,
        stream=True,
    )
    name, args, finish = "", "", None
    for c in s:
        fc = c.choices[0].delta.function_call
        name += (fc.name or "") if fc else ""
        args += (fc.arguments or "") if fc else ""
        finish = c.choices[0].finish_reason or finish
    assert (name, json.loads(args), finish) == ("now", {}, "function_call")
    # the legacy turns of a conversation render: the assistant's function_call, the function's result
    history = USER + [
        {"role": "assistant", "content": None, "function_call": {"name": "now", "arguments": "{}"}},
        {"role": "function", "name": "now", "content": '{"time": "12:00"}'},
    ]
    before = client.chat.completions.create(model=MODEL, messages=USER, functions=[clock], max_tokens=1)
    after = client.chat.completions.create(model=MODEL, messages=history, functions=[clock], max_tokens=1)
    assert after.usage.prompt_tokens > before.usage.prompt_tokens + 10


def test_allowed_tools_restrict_what_the_model_may_call(client):
    allowed = {
        "type": "allowed_tools",
        "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "now"}}]},
    }
    r = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER, CLOCK], tool_choice=allowed, max_tokens=60, seed=3, n=3
    )
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls" and [c.function.name for c in ch.message.tool_calls] == [
            "now"
        ]
    # in auto mode the other tools are not offered at all
    auto = {"type": "allowed_tools", "allowed_tools": {**allowed["allowed_tools"], "mode": "auto"}}
    only_clock = client.chat.completions.create(model=MODEL, messages=USER, tools=[CLOCK], max_tokens=1)
    restricted = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER, CLOCK], tool_choice=auto, max_tokens=1
    )
    assert restricted.usage.prompt_tokens == only_clock.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        unknown = {
            "type": "allowed_tools",
            "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "nope"}}]},
        }
        client.chat.completions.create(
            model=MODEL, messages=USER, tools=[CLOCK], tool_choice=unknown, max_tokens=1
        )


def test_refusal_parts_are_read_like_text(client):
    said = "I cannot help with that request."

    def prompt_tokens(assistant: dict) -> int:
        messages = [*USER, {"role": "assistant", **assistant}, {"role": "user", "content": "Why?"}]
        return client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1
        ).usage.prompt_tokens

    as_text = prompt_tokens({"content": said})
    assert prompt_tokens({"content": [{"type": "refusal", "refusal": said}]}) == as_text
    assert prompt_tokens({"content": None, "refusal": said}) == as_text
    assert prompt_tokens({"content": ""}) < as_text


def test_sampling_defaults_are_duets(client):
    from mlx_engine import defaults

    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=24, seed=3)
    omitted = client.completions.create(**kw).choices[0].text
    duets = dict(temperature=defaults.TEMPERATURE, top_p=defaults.TOP_P, extra_body={"top_k": defaults.TOP_K})
    assert client.completions.create(**kw, **duets).choices[0].text == omitted
    openais = dict(temperature=1.0, top_p=1.0)  # what an omitted field meant before
    assert client.completions.create(**kw, **openais).choices[0].text != omitted


def test_omitted_max_tokens_runs_until_the_context_is_full(server):
    body = {"model": MODEL, "prompt": [72] * 2040, "ignore_eos": True, "temperature": 0}  # context 2048
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8 and r.json()["choices"][0]["finish_reason"] == "length"


# --- tools as frameworks declare them ---------------------------------------------------------

Short = Annotated[str, Field(min_length=1, max_length=6)]
CLOSED = ConfigDict(extra="forbid")  # additionalProperties: false, as strict tools have it


class Address(BaseModel):
    model_config = CLOSED
    street: Short
    zip: Annotated[int, Field(ge=0, le=999)]


class Person(BaseModel):
    model_config = CLOSED
    name: Short
    homes: Annotated[list[Address], Field(min_length=1, max_length=2)]


class Parcel(BaseModel):  # another "Address" of its own: the two definitions must not mix
    class Address(BaseModel):
        port: Short

    to: Address


def test_forced_tool_call_with_nested_pydantic_models(client):
    # as instructor writes a tool (model_json_schema) and as the SDK's pydantic_function_tool does
    person = {
        "type": "function",
        "function": {"name": "save_person", "parameters": Person.model_json_schema()},
    }
    tools = [person, openai.pydantic_function_tool(Parcel, name="send_parcel")]
    assert all("$defs" in t["function"]["parameters"] for t in tools)
    models = {"save_person": Person, "send_parcel": Parcel}
    for choice, seed in (
        ("required", 1),
        ("required", 2),
        ({"type": "function", "function": {"name": "save_person"}}, 3),
    ):
        r = client.chat.completions.create(
            model=MODEL,
            messages=USER,
            tools=tools,
            tool_choice=choice,
            max_tokens=300,
            temperature=0.8,
            seed=seed,
        )
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        (call,) = ch.message.tool_calls
        models[call.function.name].model_validate_json(call.function.arguments)  # the client's own check


def test_forced_tool_without_parameters_gets_empty_arguments(server, client):
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(f"{server.proc.args[-1]}/tokenizer.json")  # the served model
    quote = tok.token_to_id('"')  # pushed up: wherever a key may start, the model starts one
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=[{"type": "function", "function": {"name": "now"}}],
        tool_choice="required",
        max_tokens=60,
        seed=5,
        logit_bias={str(quote): 100},
    )
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.arguments == "{}"


def test_tool_call_cut_by_max_tokens_keeps_openais_shape(client):
    long_city = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "minLength": 2000}},  # cannot end in time
                "required": ["city"],
            },
        },
    }
    kw = dict(model=MODEL, messages=USER, tools=[long_city], tool_choice="required", max_tokens=80, seed=1)
    ch = client.chat.completions.create(**kw).choices[0]
    assert ch.finish_reason == "length" and not ch.message.content
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    # what was generated before the cut (80 tokens cover the 52 characters of markup before it)
    assert call.function.arguments.startswith('{"city": "')
    calls, finish = {}, None
    for c in client.chat.completions.create(**kw, stream=True):
        d = c.choices[0].delta
        assert not d.content
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            slot["name"] += (tc.function.name or "") if tc.function else ""
            slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = c.choices[0].finish_reason or finish
    assert finish == "length" and calls == {0: {"name": "get_weather", "arguments": call.function.arguments}}


# --- unexpected errors ---------------------------------------------------------------------------


def test_unexpected_errors_say_internal_error_and_are_logged_once(caplog):
    app = FastAPI()
    errors.install(app)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("secret detail /home/user/model.gguf")

    @app.get("/refused")
    async def refused():
        raise errors.bad_request("no", "x")

    with TestClient(app) as c, caplog.at_level(logging.ERROR, logger="duet.server"):
        r = c.get("/boom")  # TestClient re-raises anything the app lets escape: nothing does
        assert r.status_code == 500 and r.json()["error"]["message"] == "internal error"
        assert "secret" not in r.text
        assert c.get("/refused").json()["error"]["param"] == "x"  # handled errors pass through
    logged = [x for x in caplog.records if x.exc_info]
    assert len(logged) == 1 and "secret detail" in str(logged[0].exc_info[1])


# --- load, disconnects, metrics -------------------------------------------------------------


def cancelled(server, endpoint: str) -> float:
    for fam in text_string_to_metric_families(httpx.get(server.base + "/metrics").text):
        for s in fam.samples:
            if s.name == "duet_requests_total" and unlabelled(s.labels) == {
                "endpoint": endpoint,
                "finish_reason": "cancelled",
            }:
                return s.value
    return 0.0


def test_disconnect_mid_stream_frees_blocks(server):
    before = cancelled(server, "completions")
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(x.startswith("data: {") for x in got)
        assert server.metrics()["duet_kv_blocks_used"] > 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["duet_kv_blocks_used"] == 0 and m["duet_requests_running"] == 0:
            break
        time.sleep(0.05)
    assert m["duet_kv_blocks_used"] == 0 and m["duet_requests_running"] == 0
    assert cancelled(server, "completions") == before + 1


def test_disconnect_while_waiting_for_a_non_streamed_answer_frees_blocks(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1500, "ignore_eos": True}
    before = cancelled(server, "completions")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/v1/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["duet_kv_blocks_used"] == 0 and m["duet_requests_running"] == 0:
            break
        time.sleep(0.05)
    assert m["duet_kv_blocks_used"] == 0 and m["duet_requests_running"] == 0
    assert cancelled(server, "completions") == before + 1


def test_64_concurrent_streaming_clients(aclient_factory, server):
    async def one(ac, i):
        s = await ac.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Client {i} says hello."}],
            max_tokens=12,
            temperature=0.5,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage, finish = "", None, None
        async for c in s:
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
            usage = c.usage or usage
        return text, usage, finish

    async def run():
        async with aclient_factory() as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(64)))

    t = time.monotonic()
    results = asyncio.run(run())
    assert len(results) == 64
    for _, usage, finish in results:
        assert finish == "length" and usage.completion_tokens == 12
    assert time.monotonic() - t < 120
    assert server.metrics()["duet_kv_blocks_used"] == 0


def test_metrics_exposed(server, client):
    client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
    m = server.metrics()
    for name in (
        "duet_time_to_first_token_seconds_count",
        "duet_inter_token_latency_seconds_count",
        "duet_prompt_tokens_total",
        "duet_generation_tokens_total",
        "duet_cached_prompt_tokens_total",
    ):
        assert m[name] > 0, name
    assert 0 <= m["duet_speculative_accepted_tokens_total"] <= m["duet_speculative_proposed_tokens_total"]
    assert m["duet_kv_blocks_total"] == m["duet_kv_blocks_used"] + m["duet_kv_blocks_free"]
    assert 0 < m["duet_prefix_cache_hit_rate"] <= 1
    # MLX's allocator: the weights and the KV pool are held; the cache may be empty
    assert 0 < m["duet_mlx_active_bytes"] <= m["duet_mlx_peak_bytes"] and m["duet_mlx_cache_bytes"] >= 0
    text = httpx.get(server.base + "/metrics").text
    assert f'duet_requests_total{{endpoint="chat",finish_reason="length",model="{MODEL}"}}' in text


# --- API key, full queue, shutdown (a second, small server) -----------------------------------


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-small")
    path = tiny_model(root / "tiny-small")
    srv = ServerProcess(
        path,
        root / "server.log",
        "--cache-gb",
        "0.01",
        "--max-running",
        "1",
        "--max-queue",
        "1",
        "--api-key",
        "sekret",
    )
    yield srv
    srv.stop()


def test_api_key(small_server):
    ok = openai.OpenAI(base_url=small_server.base + "/v1", api_key="sekret", max_retries=0)
    assert ok.models.list().data[0].id == "tiny-small"
    bad = openai.OpenAI(base_url=small_server.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(small_server.base + "/v1/completions", json={"model": "tiny-small", "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(small_server.base + "/health").status_code == 200


def test_full_queue_is_429_with_retry_after(small_server):
    headers = {"Authorization": "Bearer sekret"}

    def body(n_out):
        return {
            "model": "tiny-small",
            "prompt": "Hello",
            "max_tokens": n_out,
            "ignore_eos": True,
            "stream": True,
        }

    async def run():
        async with httpx.AsyncClient(base_url=small_server.base, headers=headers, timeout=60) as c:
            async with c.stream("POST", "/v1/completions", json=body(1500)) as first:  # the one running slot
                assert first.status_code == 200
                lines = first.aiter_lines()  # keep a reference: a dropped iterator closes the stream
                while not (await anext(lines)).startswith("data: {"):
                    pass
                async with c.stream("POST", "/v1/completions", json=body(8)) as second:
                    assert second.status_code == 200  # the one waiting slot
                    return await c.post("/v1/completions", json=body(8), timeout=20)

    third = asyncio.run(run())
    assert third.status_code == 429, third.text
    assert third.headers["retry-after"] == "1"
    assert third.json()["error"]["code"] == "rate_limit_exceeded"


def test_sigterm_ends_open_streams_with_an_error_chunk(small_server):
    body = {"model": "tiny-small", "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    lines = []
    with httpx.stream(
        "POST",
        small_server.base + "/v1/completions",
        json=body,
        timeout=60,
        headers={"Authorization": "Bearer sekret"},
    ) as r:
        it = r.iter_lines()
        while len([x for x in lines if x.startswith("data: {")]) < 3:
            lines.append(next(it))
        small_server.proc.send_signal(signal.SIGTERM)
        lines += list(it)
    data = [x[6:] for x in lines if x.startswith("data: ")]
    assert data[-1] == "[DONE]"
    err = json.loads(data[-2])["error"]
    assert err["type"] == "server_error" and "shutting down" in err["message"]
    assert small_server.proc.wait(30) is not None
