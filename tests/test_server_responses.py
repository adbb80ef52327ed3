"""OpenAI's Responses API (/v1/responses and its GET, DELETE and input_items), driven by the
official ``openai`` SDK: in-process on a tiny random model (whose chat template renders tools)
and against a real `duet serve`. A random model writes garbage, so wherever output must be
valid JSON only the grammar can have made it so.
"""

from __future__ import annotations

import json
import time

import httpx
import httpx2
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.server.app import create_app
from app.server.responses import ResponseStore
from app.server.security import SecurityPolicy
from mlx_engine.config import EngineConfig
from mlx_engine.engine import Engine
from tests.route_fuzz import fuzz_route, sse_data
from tests.test_server_harness import ServerProcess, tiny_model, unlabelled

MODEL = "tiny-tools"
STORY = "Tell me a long story about the quick brown fox and the lazy dog, with many details."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp("responses") / MODEL, tools_template=True)
    e = Engine.load(str(path), config=EngineConfig(cache_gb=0.05, max_running=4, max_queue=8))
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def app(engine):
    return create_app(engine)


@pytest.fixture
async def client(app):
    http = httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=120
    )
    async with openai.AsyncOpenAI(
        base_url="http://127.0.0.1/v1", api_key="none", http_client=http, max_retries=0
    ) as c:
        yield c


async def test_create_shape_usage_and_retrieval(client):
    r = await client.responses.create(model=MODEL, input=STORY, max_output_tokens=8, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.output_text == item.content[0].text and r.output_text
    assert r.usage.output_tokens == 8 and r.usage.total_tokens == r.usage.input_tokens + 8
    got = await client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    items = await client.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", STORY)]
    again = await client.responses.create(model=MODEL, input=STORY, max_output_tokens=8, temperature=0)
    assert again.output_text == r.output_text  # greedy
    await client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(r.id)


async def test_input_items_page_on_after_each_item_once(client):
    """``input_items`` pages: ``after`` starts past that item, in either order, and ``has_more``
    says whether a page is the last."""
    said = [{"role": "user", "content": f"message {i}"} for i in range(3)]
    r = await client.responses.create(model=MODEL, input=said, max_output_tokens=1)

    async def page(**kw) -> tuple[list[str], bool]:
        p = await client.responses.input_items.list(r.id, limit=2, **kw)
        return [i.content[0].text for i in p.data], p.has_more

    texts = [m["content"] for m in said]
    assert await page(order="asc") == (texts[:2], True)
    ids = [i.id for i in (await client.responses.input_items.list(r.id, order="asc")).data]
    assert await page(order="asc", after=ids[0]) == (texts[1:], False)
    assert await page(order="asc", after=ids[1]) == (texts[2:], False)
    assert await page(order="desc", after=ids[2]) == ([texts[1], texts[0]], False)
    assert await page(order="asc", after=ids[2]) == ([], False)


async def test_stream_events_match_create(client):
    kw = dict(model=MODEL, input=STORY, max_output_tokens=10, temperature=0)
    whole = await client.responses.create(**kw)
    stream = await client.responses.create(**kw, stream=True)
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    final = events[-1].response
    assert final.output_text == deltas and final.usage.output_tokens == 10
    assert (await client.responses.retrieve(final.id)).output_text == deltas  # streamed ones are stored too
    # the SDK's stream helper reads the same events (its get_final_response() wants a
    # response.completed, which a reply cut by max_output_tokens is not, at OpenAI too)
    async with client.responses.stream(**kw) as s:
        helper = [e async for e in s]
    (done,) = [e for e in helper if e.type == "response.output_text.done"]
    assert done.text == whole.output_text and helper[-1].type == "response.incomplete"


async def test_previous_response_id_continues_from_the_prefix_cache(client):
    first = await client.responses.create(
        model=MODEL, input=STORY, instructions="Be brief.", max_output_tokens=6, temperature=0
    )
    second = await client.responses.create(
        model=MODEL,
        input="And then what happened to the fox?",
        instructions="Be brief.",
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    # the continued prompt begins with the first one: its KV blocks come from the prefix cache
    assert second.usage.input_tokens > first.usage.input_tokens
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached > 0 and cached >= (first.usage.input_tokens // 16 - 1) * 16
    third = await client.responses.create(
        model=MODEL, input="Thanks", previous_response_id=second.id, max_output_tokens=2, temperature=0
    )
    assert third.usage.input_tokens > second.usage.input_tokens  # the whole chain is the context
    with pytest.raises(openai.BadRequestError, match="not found"):
        await client.responses.create(
            model=MODEL, input="hi", previous_response_id="resp_nope", max_output_tokens=2
        )


async def test_store_false_keeps_nothing(client):
    r = await client.responses.create(model=MODEL, input="Hello", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model=MODEL, input="Hi", previous_response_id=r.id, max_output_tokens=2)


async def test_function_tool_round_trip(client):
    ask = "What is the weather in Paris?"
    r = await client.responses.create(
        model=MODEL,
        input=ask,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=150,
        temperature=0,
    )
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])  # only the grammar can
    # the output goes back as a function_call_output item, by continuing the stored response ...
    follow = await client.responses.create(
        model=MODEL,
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}],
        tools=[WEATHER],
        max_output_tokens=4,
        temperature=0,
    )
    assert follow.usage.input_tokens > r.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens > 0
    # ... or statelessly, with the call item sent back as well (the Agents SDK's way with store off)
    stateless = await client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": ask},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"},
        ],
        tools=[WEATHER],
        max_output_tokens=4,
        temperature=0,
        store=False,
    )
    assert stateless.usage.input_tokens == follow.usage.input_tokens


async def test_streamed_function_call_events(client):
    stream = await client.responses.create(
        model=MODEL,
        input="Weather in Rome?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=150,
        temperature=0,
        stream=True,
    )
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == args
    jsonschema.validate(json.loads(args), WEATHER["parameters"])
    (call,) = [o for o in events[-1].response.output if o.type == "function_call"]
    assert call.arguments == args


async def test_text_format_json_schema(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = await client.responses.create(
        model=MODEL,
        input="Describe a person as JSON.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
        max_output_tokens=200,
        temperature=0,
    )
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)


async def test_refusals_are_clear_400s(client):
    with pytest.raises(openai.BadRequestError, match="text only"):
        await client.responses.create(
            model=MODEL,
            input=[
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}],
                }
            ],
        )
    # a hosted tool is left out of what the model sees (Codex sends web_search by default), not a 400
    r = await client.responses.create(
        model=MODEL, input="hi", max_output_tokens=4, tools=[{"type": "web_search"}], tool_choice="auto"
    )
    assert r.output and all(x.type == "message" for x in r.output)
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model="gpt-5", input="hi")
    with pytest.raises(openai.BadRequestError, match="input is required"):
        await client.responses.create(model=MODEL)


def as_key(app, key: str) -> openai.AsyncOpenAI:
    """A client of ``app`` (in process) that authenticates with ``key``."""
    http = httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=120
    )
    return openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key=key, http_client=http, max_retries=0)


async def test_a_stored_response_belongs_to_the_key_that_made_it(engine):
    app = create_app(engine, security=SecurityPolicy.build(api_keys=["sk-alice", "sk-bob"]))

    async with as_key(app, "sk-alice") as alice, as_key(app, "sk-bob") as bob:
        r = await alice.responses.create(model=MODEL, input="Hello", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            await bob.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            await bob.responses.input_items.list(r.id)
        with pytest.raises(openai.NotFoundError):
            await bob.responses.delete(r.id)
        with pytest.raises(openai.BadRequestError, match="not found"):
            await bob.responses.create(
                model=MODEL, input="Hi", previous_response_id=r.id, max_output_tokens=2
            )
        assert (await alice.responses.retrieve(r.id)).id == r.id  # still there for its owner
        await alice.responses.delete(r.id)


async def test_one_key_filling_its_share_evicts_only_its_own_responses(engine, monkeypatch):
    from app.server import responses

    monkeypatch.setattr(responses, "MAX_ITEMS", 4)  # two keys: two responses each
    app = create_app(engine, security=SecurityPolicy.build(api_keys=["sk-alice", "sk-bob"]))

    async with as_key(app, "sk-alice") as alice, as_key(app, "sk-bob") as bob:
        a = await alice.responses.create(model=MODEL, input="Hello", max_output_tokens=2)
        bobs = [
            (await bob.responses.create(model=MODEL, input=f"Hi {i}", max_output_tokens=2)).id
            for i in range(5)  # more than the whole store holds
        ]
        assert (await alice.responses.retrieve(a.id)).id == a.id  # bob's flood did not evict it
        cont = await alice.responses.create(
            model=MODEL, input="And then?", previous_response_id=a.id, max_output_tokens=2
        )
        assert cont.previous_response_id == a.id
        for old in bobs[:3]:  # bob's own oldest went
            with pytest.raises(openai.NotFoundError):
                await bob.responses.retrieve(old)
        assert [(await bob.responses.retrieve(r)).id for r in bobs[3:]] == bobs[3:]
        with pytest.raises(openai.BadRequestError, match="not found"):  # and still none of alice's
            await bob.responses.create(
                model=MODEL, input="Hi", previous_response_id=cont.id, max_output_tokens=2
            )


def test_each_owner_has_its_own_share_of_the_store():
    store = ResponseStore(max_items=4, max_chars=20_000, shares=2)
    assert (store.items_per_owner, store.chars_per_owner) == (2, 10_000)
    store.put({"id": "a0"}, [], [{"role": "user", "content": "x"}], owner="alice")
    for i in range(6):
        store.put({"id": f"b{i}"}, [], [{"role": "user", "content": "x"}], owner="bob")
    assert store.get("a0", "alice") is not None and len(store) == 3
    assert store.get("b3", "bob") is None and store.get("b5", "bob") is not None
    assert store.get("a0", "bob") is None and store.get("b5", "alice") is None and store.get("a0") is None
    assert not store.delete("a0", "bob") and store.get("a0", "alice") is not None
    # by size too: bob's big responses push out bob's, never alice's
    for i in range(3):
        store.put({"id": f"big{i}"}, [], [{"role": "user", "content": "y" * 4000}], owner="bob")
    assert store.get("a0", "alice") is not None and store.get("big0", "bob") is None
    assert store.get("big2", "bob") is not None
    store.put({"id": "huge"}, [], [{"role": "user", "content": "z" * 12_000}], owner="bob")
    assert store.get("huge", "bob") is None  # larger than a share: not kept
    assert store.delete("a0", "alice") and store.get("a0", "alice") is None


def test_store_is_bounded():
    store = ResponseStore(max_items=3, max_chars=10_000)
    for i in range(5):
        store.put({"id": f"r{i}"}, [], [{"role": "user", "content": "x"}])
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    store.put({"id": "big"}, [], [{"role": "user", "content": "y" * 4000}])
    store.put({"id": "big2"}, [], [{"role": "user", "content": "y" * 4000}])
    store.put({"id": "big3"}, [], [{"role": "user", "content": "y" * 4000}])
    assert store.get("big") is None and store.get("big3") is not None  # bounded by size too
    store.put({"id": "huge"}, [], [{"role": "user", "content": "z" * 20_000}])
    assert store.get("huge") is None  # larger than the whole store: not kept


# --- a real `duet serve` ------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-responses")
    srv = ServerProcess(
        tiny_model(root / MODEL, tools_template=True), root / "server.log", "--cache-gb", "0.05"
    )
    yield srv
    srv.stop()


def test_duet_serve_speaks_responses(served):
    c = openai.OpenAI(base_url=served.base + "/v1", api_key="none", max_retries=0, timeout=120)
    r = c.responses.create(model=MODEL, input=STORY, max_output_tokens=5, temperature=0)
    streamed = "".join(
        e.delta
        for e in c.responses.create(model=MODEL, input=STORY, max_output_tokens=5, temperature=0, stream=True)
        if e.type == "response.output_text.delta"
    )
    assert streamed == r.output_text
    follow = c.responses.create(
        model=MODEL, input="More.", previous_response_id=r.id, max_output_tokens=3, temperature=0
    )
    assert follow.usage.input_tokens_details.cached_tokens > 0
    c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)


def test_a_client_that_stops_waiting_frees_its_blocks(served):
    def cancelled() -> float:
        text = httpx.get(served.base + "/metrics", timeout=10).text
        labels = {"endpoint": "responses", "finish_reason": "cancelled"}
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        return sum(
            s.value for s in samples if s.name == "duet_requests_total" and unlabelled(s.labels) == labels
        )

    before = cancelled()
    body = {"model": MODEL, "input": STORY, "max_output_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.base + "/v1/responses", json=body, timeout=1.0)
    deadline = time.monotonic() + 30  # only against a hang
    while time.monotonic() < deadline:
        m = served.metrics()
        if m["duet_kv_blocks_used"] == 0 and m["duet_requests_running"] == 0:
            break
        time.sleep(0.05)
    assert m["duet_kv_blocks_used"] == 0 and m["duet_requests_running"] == 0
    assert cancelled() == before + 1


@pytest.mark.slow
def test_bundled_model_json_schema_and_function_call(tmp_path):
    srv = ServerProcess(None, tmp_path / "server.log", "--cache-gb", "0.1")
    try:
        c = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=300)
        r = c.responses.create(
            model="default", input="What is the capital of France?", max_output_tokens=16, temperature=0
        )
        assert "Paris" in r.output_text and r.status == "completed"
        person = {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        }
        j = c.responses.create(
            model="default",
            input="Marie Curie was 66. Describe her as JSON.",
            text={"format": {"type": "json_schema", "name": "person", "schema": person, "strict": True}},
            max_output_tokens=60,
            temperature=0,
        )
        assert j.status == "completed" and "Curie" in json.loads(j.output_text)["name"]
        jsonschema.validate(json.loads(j.output_text), person)
        ask = "What is the weather in Paris?"
        t = c.responses.create(
            model="default",
            input=ask,
            tools=[WEATHER],
            tool_choice="required",
            max_output_tokens=40,
            temperature=0,
        )
        (call,) = t.output
        assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
        answer = c.responses.create(
            model="default",
            previous_response_id=t.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}],
            tools=[WEATHER],
            max_output_tokens=40,
            temperature=0,
        )
        assert answer.status == "completed" and answer.usage.input_tokens_details.cached_tokens > 0
    finally:
        srv.stop()


# --- fuzz -------------------------------------------------------------------------------------


def test_fuzz_responses_route(engine):
    """Schema-driven and broken bodies: no 5xx, every error an OpenAI error object, every
    stream ends with response.completed or response.incomplete."""

    def bound(body: dict) -> dict:
        if not isinstance(body.get("max_output_tokens"), int) or body["max_output_tokens"] > 6:
            body["max_output_tokens"] = 4
        return body

    def check(status: int, ctype: str, text: str) -> None:
        if status >= 400:
            assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}, text
        elif ctype.startswith("text/event-stream"):
            events = sse_data(text)
            assert events[-1]["type"] in ("response.completed", "response.incomplete"), text[-500:]
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
        else:
            assert json.loads(text)["object"] == "response", text

    app = create_app(engine)
    fuzz_route(
        app, "/v1/responses", MODEL, {"model": MODEL, "input": "hi", "max_output_tokens": 3}, bound, check
    )
