"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), driven by the official
``anthropic`` SDK: in-process on a tiny random model (whose chat template renders tools), and
against a real `duet serve` (the tiny model, and the bundled SmolLM2 for answers that must make
sense). A random model writes garbage, so wherever output must be valid JSON only the grammar
can have made it so.
"""

from __future__ import annotations

import asyncio
import json
import time

import anthropic
import httpx
import httpx2
import jsonschema
import pytest
from fastapi import Request
from prometheus_client.parser import text_string_to_metric_families

from app.server.anthropic import build_call, chat_fields
from app.server.anthropic_protocol import MessagesRequest
from app.server.app import create_app
from app.server.security import SecurityPolicy
from mlx_engine.config import EngineConfig
from mlx_engine.engine import Engine
from tests.route_fuzz import fuzz_route, sse_data
from tests.test_server_harness import ServerProcess, tiny_model, unlabelled

MODEL = "tiny-tools"
HELLO = [{"role": "user", "content": "Tell me a long story about the quick brown fox and the lazy dog."}]
GREEDY = {"temperature": 0}  # today's SDK has no temperature argument: the server still takes it
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp("anthropic") / MODEL, tools_template=True)
    e = Engine.load(str(path), config=EngineConfig(cache_gb=0.05, max_running=4, max_queue=8))
    yield e
    e.shutdown()


def client_for(engine, **app_kw) -> tuple[anthropic.AsyncAnthropic, httpx2.AsyncClient]:
    api_key = app_kw.pop("client_key", "unused")
    http = httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=create_app(engine, **app_kw)),
        base_url="http://127.0.0.1",
        timeout=120,
    )
    client = anthropic.AsyncAnthropic(
        base_url="http://127.0.0.1", api_key=api_key, http_client=http, max_retries=0
    )
    return client, http


@pytest.fixture
async def client(engine):
    c, http = client_for(engine)
    yield c
    await http.aclose()


def sse_events(text: str) -> list[tuple[str, dict]]:
    out = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        out.append((lines["event"], data))
    return out


# --- create, stream, count_tokens -------------------------------------------------------


async def test_create_shape_determinism_usage_and_prefix_cache(client):
    kw = dict(model=MODEL, max_tokens=8, messages=HELLO, extra_body=GREEDY)
    a = await client.messages.create(**kw)
    b = await client.messages.create(**kw)
    assert a.id.startswith("msg_") and a.id != b.id and a.type == "message" and a.role == "assistant"
    assert a.model == MODEL and a.stop_reason == "max_tokens" and a.stop_sequence is None
    (block,) = a.content
    assert block.type == "text" and block.text and block.text == b.content[0].text  # greedy
    count = await client.messages.count_tokens(model=MODEL, messages=HELLO)
    for m in (a, b):  # the prompt's tokens, whether computed or read from the prefix cache
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count.input_tokens
        assert m.usage.output_tokens == 8
    assert b.usage.cache_read_input_tokens >= 16  # the second identical prompt is a prefix-cache hit


async def test_stream_text_matches_create_and_events_are_in_order(engine, client):
    kw = dict(model=MODEL, max_tokens=10, messages=HELLO, extra_body=GREEDY)
    whole = await client.messages.create(**kw)
    async with client.messages.stream(**kw) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10
    assert final.content[0].text == text
    # the raw event sequence, as Anthropic sends it
    _, http = client_for(engine)
    async with http:
        r = await http.post("/v1/messages", json={**kw.pop("extra_body"), **kw, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    kinds = [k for k, _ in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 10


async def test_stop_sequences_end_the_reply_and_are_reported(client):
    kw = dict(model=MODEL, max_tokens=24, messages=HELLO, extra_body=GREEDY)
    text = (await client.messages.create(**kw)).content[0].text
    # a stop string first seen after a few characters: greedy decoding writes the same text again
    at = next(
        i for i in range(4, len(text) - 3) if text[i : i + 3].strip() and text[i : i + 3] not in text[: i + 2]
    )
    stop = text[at : at + 3]
    m = await client.messages.create(**kw, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]


async def test_system_prompt_string_or_blocks_and_count_tokens(client):
    plain = await client.messages.count_tokens(model=MODEL, messages=HELLO)
    as_string = await client.messages.count_tokens(model=MODEL, messages=HELLO, system="You are terse.")
    as_blocks = await client.messages.count_tokens(
        model=MODEL,
        messages=HELLO,
        system=[{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
    )
    assert as_string.input_tokens == as_blocks.input_tokens > plain.input_tokens
    with_tools = await client.messages.count_tokens(model=MODEL, messages=HELLO, tools=[WEATHER])
    assert with_tools.input_tokens > plain.input_tokens + 10  # the tools are in the prompt
    none = await client.messages.count_tokens(
        model=MODEL, messages=HELLO, tools=[WEATHER], tool_choice={"type": "none"}
    )
    assert none.input_tokens == plain.input_tokens  # tool_choice none leaves them out


async def test_a_final_assistant_message_is_a_prefill_the_reply_continues(engine, client):
    state = create_app(engine).state.duet
    prefill = "Once upon a time"
    body = MessagesRequest.model_validate(
        {"model": MODEL, "max_tokens": 5, "messages": [*HELLO, {"role": "assistant", "content": prefill}]}
    )
    call = await build_call(state, body, Request({"type": "http", "headers": [], "state": {}}), "messages", 5)
    prompt = engine.tokenizer.decode(call.prompt, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n" + prefill)  # the turn is open, not closed
    assert prompt.count("<|im_start|>assistant") == 1
    m = await client.messages.create(
        model=MODEL,
        max_tokens=5,
        messages=[*HELLO, {"role": "assistant", "content": prefill}],
        extra_body=GREEDY,
    )
    count = await client.messages.count_tokens(
        model=MODEL, messages=[*HELLO, {"role": "assistant", "content": prefill}]
    )
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count.input_tokens == len(call.prompt)
    assert m.usage.output_tokens == 5 and not m.content[0].text.startswith(prefill)
    with pytest.raises(anthropic.BadRequestError, match="prefill"):
        await client.messages.create(
            model=MODEL,
            max_tokens=5,
            messages=[*HELLO, {"role": "assistant", "content": "{"}],
            output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}},
        )


# --- tools ----------------------------------------------------------------------------------


async def test_tool_use_round_trip(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = await client.messages.create(
        model=MODEL,
        max_tokens=150,
        messages=ask,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])  # only the grammar can have made it so
    # the result goes back as a tool_result block answering the tool_use id
    turn = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 24 C"}],
        },
    ]
    count = await client.messages.count_tokens(model=MODEL, messages=turn, tools=[WEATHER])
    before = await client.messages.count_tokens(model=MODEL, messages=ask, tools=[WEATHER])
    assert count.input_tokens > before.input_tokens
    again = await client.messages.create(
        model=MODEL, max_tokens=6, messages=turn, tools=[WEATHER], extra_body=GREEDY
    )
    assert again.stop_reason in ("max_tokens", "end_turn", "tool_use")
    # "any" forces some call
    anyone = await client.messages.create(
        model=MODEL,
        max_tokens=150,
        messages=ask,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    )
    assert [b.name for b in anyone.content if b.type == "tool_use"] == ["get_weather"]


async def test_streamed_tool_use_sends_input_json_deltas(client):
    async with client.messages.stream(
        model=MODEL,
        max_tokens=150,
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    ) as stream:
        kinds = [ev.type async for ev in stream]
        final = await stream.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    (use,) = final.content
    assert use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])


def test_conversation_translates_to_chat_messages():
    body = MessagesRequest.model_validate(
        {
            "model": MODEL,
            "max_tokens": 5,
            "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "x"},
                        {"type": "text", "text": "Let me look."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Oslo"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "-3 C"}],
                        },
                        {"type": "text", "text": "Thanks"},
                    ],
                },
            ],
            "tools": [WEATHER],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["\n\n"],
            "top_k": 5,
            "metadata": {"user_id": "u1"},
        }
    )
    f = chat_fields(body)
    assert f["messages"] == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "hmm",  # the thinking block, for templates that keep it (issue 31)
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "-3 C"},
        {"role": "user", "content": "Thanks"},
    ]
    assert f["tools"][0]["function"]["parameters"] == WEATHER["input_schema"]
    assert f["tool_choice"] == "required" and f["parallel_tool_calls"] is False
    assert f["stop"] == ["\n\n"] and f["top_k"] == 5 and "metadata" not in f


def test_a_tool_result_with_is_error_reads_as_an_error():
    """The model must know a tool failed: an ``is_error`` result's text says so, another's is as sent."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Atlantis"}}

    def tool_message(result: dict) -> dict:
        body = MessagesRequest.model_validate(
            {
                "model": MODEL,
                "max_tokens": 5,
                "messages": [
                    {"role": "user", "content": "Weather in Atlantis?"},
                    {"role": "assistant", "content": [use]},
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", **result}],
                    },
                ],
                "tools": [WEATHER],
            }
        )
        (tool,) = [m for m in chat_fields(body)["messages"] if m["role"] == "tool"]
        return tool

    assert tool_message({"content": "no such city", "is_error": True})["content"] == "Error: no such city"
    failed = tool_message({"content": [{"type": "text", "text": "no such city"}], "is_error": True})
    assert failed["content"] == "Error: no such city"
    assert tool_message({"content": "no such city", "is_error": False})["content"] == "no such city"


async def test_output_config_json_schema_is_enforced(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    m = await client.messages.create(
        model=MODEL,
        max_tokens=150,
        messages=[{"role": "user", "content": "A person as JSON"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)


# --- errors and auth ----------------------------------------------------------------------


async def test_errors_in_anthropic_shape(engine, client):
    with pytest.raises(anthropic.NotFoundError) as e:
        await client.messages.create(model="claude-nope", max_tokens=4, messages=HELLO)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as e:
        await client.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": [image, {"type": "text", "text": "?"}]}],
        )
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in e.value.body["error"]["message"] and "text only" in e.value.body["error"]["message"]
    # a server tool is left out of what the model sees (nothing here runs it), never a 400
    server_tool = {"type": "web_search_20250305", "name": "web_search"}
    reply = await client.messages.create(model=MODEL, max_tokens=4, messages=HELLO, tools=[server_tool])
    assert [b.type for b in reply.content] == ["text"]
    _, http = client_for(engine)
    async with http:
        r = await http.post("/v1/messages", json={"model": MODEL, "messages": HELLO})  # no max_tokens
        assert r.status_code == 400
        assert r.json() == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
        }
        ok = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
        r = await http.post("/v1/messages", json=ok, headers={"anthropic-version": "yesterday"})
        assert r.status_code == 400 and "anthropic-version" in r.json()["error"]["message"]
        r = await http.post("/v1/messages", json=ok, headers={"anthropic-version": "2023-06-01"})
        assert r.status_code == 200 and r.headers["request-id"].startswith("req_")
        r = await http.post(
            "/v1/messages", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and r.json()["type"] == "error"
        # the OpenAI routes keep OpenAI's shape
        r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": "x"})
        assert r.status_code == 400 and set(r.json()) == {"error"}


async def test_x_api_key_and_bearer_both_authenticate(engine):
    policy = SecurityPolicy.build(api_keys=["sk-right"])
    good, http = client_for(engine, security=policy, client_key="sk-right")  # sent as x-api-key
    async with http:
        m = await good.messages.create(model=MODEL, max_tokens=2, messages=HELLO)
        assert m.usage.output_tokens == 2
        r = await http.post(
            "/v1/messages/count_tokens",
            json={"model": MODEL, "messages": HELLO},
            headers={"authorization": "Bearer sk-right"},
        )
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
    bad, http = client_for(engine, security=policy, client_key="sk-wrong")
    async with http:
        with pytest.raises(anthropic.AuthenticationError) as e:
            await bad.messages.create(model=MODEL, max_tokens=2, messages=HELLO)
    assert e.value.body["error"]["type"] == "authentication_error"


async def test_concurrent_streams(engine, client):
    async def one(i: int) -> str:
        async with client.messages.stream(
            model=MODEL, max_tokens=6, messages=[{"role": "user", "content": f"Story {i}"}], extra_body=GREEDY
        ) as s:
            return "".join([t async for t in s.text_stream])

    texts = await asyncio.gather(*(one(i) for i in range(4)))
    assert all(texts)
    engine.run_on_worker(engine.allocator.check_invariants)


# --- a real `duet serve` ------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-anthropic")
    srv = ServerProcess(
        tiny_model(root / MODEL, tools_template=True), root / "server.log", "--cache-gb", "0.05"
    )
    yield srv
    srv.stop()


def test_duet_serve_speaks_messages(served):
    c = anthropic.Anthropic(base_url=served.base, api_key="unused", max_retries=0, timeout=120)
    m = c.messages.create(model=MODEL, max_tokens=5, messages=HELLO, extra_body=GREEDY)
    with c.messages.stream(model=MODEL, max_tokens=5, messages=HELLO, extra_body=GREEDY) as s:
        streamed = "".join(s.text_stream)
    assert streamed == m.content[0].text and m.usage.output_tokens == 5
    assert c.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens == (
        m.usage.input_tokens + m.usage.cache_read_input_tokens
    )
    with pytest.raises(anthropic.NotFoundError):
        c.messages.create(model="claude-opus", max_tokens=5, messages=HELLO)


def cancelled(server, endpoint: str) -> float:
    text = httpx.get(server.base + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "duet_requests_total" and unlabelled(s.labels) == {
                "endpoint": endpoint,
                "finish_reason": "cancelled",
            }:
                return s.value
    return 0.0


def test_a_client_that_leaves_mid_stream_frees_its_blocks(served):
    before = cancelled(served, "messages")
    body = {"model": MODEL, "max_tokens": 1500, "messages": HELLO, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", served.base + "/v1/messages", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert any(next(lines).startswith("event: content_block_delta") for _ in range(12))
        assert served.metrics()["duet_kv_blocks_used"] > 0
    deadline = time.monotonic() + 30  # only against a hang
    while time.monotonic() < deadline:
        m = served.metrics()
        if m["duet_kv_blocks_used"] == 0 and m["duet_requests_running"] == 0:
            break
        time.sleep(0.05)
    assert m["duet_kv_blocks_used"] == 0 and m["duet_requests_running"] == 0
    assert cancelled(served, "messages") == before + 1


@pytest.mark.slow
def test_bundled_model_answers_and_calls_a_tool(tmp_path):
    srv = ServerProcess(None, tmp_path / "server.log", "--cache-gb", "0.1")
    try:
        c = anthropic.Anthropic(base_url=srv.base, api_key="unused", max_retries=0, timeout=300)
        m = c.messages.create(
            model="default",
            max_tokens=16,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            extra_body=GREEDY,
        )
        assert "Paris" in m.content[0].text and m.stop_reason == "end_turn"
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        t = c.messages.create(
            model="default",
            max_tokens=40,
            messages=ask,
            tools=[WEATHER],
            tool_choice={"type": "any"},
            extra_body=GREEDY,
        )
        (use,) = t.content
        assert t.stop_reason == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
        turn = [
            *ask,
            {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 24 C"}],
            },
        ]
        answer = c.messages.create(
            model="default", max_tokens=40, messages=turn, tools=[WEATHER], extra_body=GREEDY
        )
        assert answer.stop_reason == "end_turn" and answer.content[0].type == "text"
    finally:
        srv.stop()


# --- fuzz -------------------------------------------------------------------------------------


def test_fuzz_messages_routes(engine):
    """Schema-driven and broken bodies: no 5xx, every error in Anthropic's shape, every stream
    ends with message_stop."""

    def bound(body: dict) -> dict:
        if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] > 6:
            body["max_tokens"] = 4
        return body

    def check(status: int, ctype: str, text: str) -> None:
        if status >= 400:
            body = json.loads(text)
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, text
        elif ctype.startswith("text/event-stream"):
            events = sse_data(text)
            assert events[-1]["type"] == "message_stop", text[-500:]
            assert all(e["type"] != "error" for e in events), text
        else:
            body = json.loads(text)
            assert body.get("type") == "message" or "input_tokens" in body, text

    app = create_app(engine)
    base = {"model": MODEL, "max_tokens": 3, "messages": HELLO}
    fuzz_route(app, "/v1/messages", MODEL, base, bound, check)
    fuzz_route(app, "/v1/messages/count_tokens", MODEL, {"model": MODEL, "messages": HELLO}, bound, check)
