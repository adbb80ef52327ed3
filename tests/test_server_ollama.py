"""Ollama's native API on `duet serve` (``app/server/ollama.py``), driven by the official ``ollama``
Python client against a real server (uvicorn on a loopback port, in a thread) with two tiny
random-weight models, a tiny BERT embedding model, and a local Hugging Face hub for /api/pull."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import ollama
import pytest
import uvicorn

from app.server import ollama_models
from app.server.app import create_app, server_state
from app.server.ollama_protocol import Message, chat_messages, option_fields, think_fields, tool_call_out
from app.server.registry import ModelRegistry, ServedModel
from mlx_engine.config import EngineConfig
from mlx_engine.embeddings import EmbeddingModel
from mlx_engine.engine import Engine
from tests.hf_endpoint import HubServer, point_hf_at
from tests.test_server_embeddings import make_tiny_bert
from tests.test_server_harness import tiny_model
from tests.tiny_models import make_thinking_model_dir

CONFIG = EngineConfig(cache_gb=0.02, max_running=4)
GREEDY = {"temperature": 0, "num_predict": 6}
HI = [{"role": "user", "content": "Hello there"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
A, B, EMB, THINKER = "tiny-tools", "tiny-b", "tiny-bert", "tiny-thinker"
THOUGHT = "Greeting: answer warmly with care and kindness"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ollama-models")
    return {
        A: tiny_model(root / A, tools_template=True),
        B: tiny_model(root / B),
        EMB: make_tiny_bert(root / EMB),
        THINKER: make_thinking_model_dir(root / THINKER, f"<think>{THOUGHT}</think> Hello there friend."),
    }


def load(model: ServedModel):
    return server_state(Engine.load(model.spec, config=CONFIG), model.ids)


@contextlib.contextmanager
def served(app) -> Iterator[str]:
    """``app`` under uvicorn on a free loopback port, in a thread; yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def server(model_dirs) -> Iterator[tuple[str, ModelRegistry]]:
    models = [
        ServedModel(n, str(model_dirs[n]), info={"format": "safetensors", "size_bytes": 1})
        for n in (A, B, THINKER)
    ]
    registry = ModelRegistry(models, load)
    app = create_app(registry=registry, embedder=EmbeddingModel.load(model_dirs[EMB], name=EMB))
    with served(app) as url:
        yield url, registry
    registry.shutdown()


@pytest.fixture
def client(server) -> ollama.Client:
    return ollama.Client(host=server[0], timeout=120)


def wait_for(predicate, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# --- chat and generate ------------------------------------------------------------------------------
def test_chat_streamed_and_whole(client):
    parts = list(client.chat(model=A, messages=HI, options=GREEDY, stream=True))
    assert all(p.model == A and p.created_at for p in parts)
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    last = parts[-1]
    assert last.done_reason in ("stop", "length") and last.message.role == "assistant"
    assert last.eval_count and last.eval_count <= 6 and last.prompt_eval_count and last.prompt_eval_count > 3
    assert last.total_duration and last.total_duration >= (last.eval_duration or 0) > 0
    assert last.prompt_eval_duration is not None and last.load_duration is not None
    streamed = "".join(p.message.content or "" for p in parts)
    whole = client.chat(model=A, messages=HI, options=GREEDY, stream=False)
    assert whole.done and whole.message.content == streamed  # greedy: the same reply
    assert whole.eval_count == last.eval_count and whole.load_duration == 0  # loaded already


def test_generate_streamed_whole_and_raw(client):
    parts = list(client.generate(model=A, prompt="Once upon", options=GREEDY, stream=True))
    assert parts[-1].done and parts[-1].done_reason in ("stop", "length")
    whole = client.generate(model=A, prompt="Once upon", options=GREEDY)
    assert whole.response == "".join(p.response or "" for p in parts)
    with_system = client.generate(model=A, prompt="Once upon", system="Be brief.", options=GREEDY)
    assert (with_system.prompt_eval_count or 0) > (whole.prompt_eval_count or 0)  # the system prompt counts
    raw = client.generate(model=A, prompt="Once upon", raw=True, options={"temperature": 0, "num_predict": 4})
    assert raw.done and raw.eval_count == 4 and raw.done_reason == "length"
    assert (raw.prompt_eval_count or 0) < (whole.prompt_eval_count or 0)  # no template around it


def test_format_json_schema_is_enforced(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = client.chat(model=A, messages=HI, format=schema, options={"temperature": 0, "num_predict": 150})
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content or ""), schema)
    g = client.generate(model=B, prompt="JSON please", format="json", options={"num_predict": 150, "seed": 1})
    assert isinstance(json.loads(g.response or ""), dict)


def test_tools_reach_the_template_and_a_tool_turn_renders(client):
    plain = client.chat(model=A, messages=HI, options=GREEDY)
    tools = client.chat(model=A, messages=HI, tools=[WEATHER], options=GREEDY)
    assert (tools.prompt_eval_count or 0) > (plain.prompt_eval_count or 0) + 10  # the schema is in the prompt
    history = [
        *HI,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"},
    ]
    after = client.chat(model=A, messages=history, tools=[WEATHER], options=GREEDY)
    assert after.done and (after.prompt_eval_count or 0) > (tools.prompt_eval_count or 0)


def test_tool_call_and_message_mapping():
    out = tool_call_out(0, "call_1", "get_weather", '{"city": "Paris"}')
    assert out == {
        "id": "call_1",
        "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}},
    }
    assert tool_call_out(1, "c", "f", '{"city": "Par')["function"]["arguments"] == {}  # cut short
    msgs = chat_messages(
        [
            Message(
                role="assistant",
                content="",
                thinking="hmm",
                tool_calls=[
                    {"function": {"name": "a", "arguments": {"x": 1}}},
                    {"function": {"name": "b", "arguments": {}}},
                ],
            ),
            Message(role="tool", content="B", tool_name="b"),
            Message(role="tool", content="A", tool_name="a"),
        ]
    )
    calls = msgs[0]["tool_calls"]
    assert msgs[0]["reasoning_content"] == "hmm" and json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert msgs[1]["tool_call_id"] == calls[1]["id"] and msgs[2]["tool_call_id"] == calls[0]["id"]
    assert msgs[1]["name"] == "b"
    opts = option_fields(
        {"num_predict": -1, "repeat_penalty": 1.1, "stop": ["\n"], "num_gpu": 1, "mirostat": 0}
    )
    assert opts == {"repetition_penalty": 1.1, "stop": ["\n"]}
    assert option_fields({"num_predict": 7, "temperature": 0.2})["max_tokens"] == 7
    assert think_fields(False) == {"reasoning_effort": "none"} and think_fields("high") == {
        "reasoning_effort": "high"
    }


def test_think_and_options_are_accepted(client):
    r = client.chat(
        model=A, messages=HI, think=False, options={**GREEDY, "num_ctx": 512, "top_k": 5, "seed": 3}
    )
    assert r.done
    r = client.chat(model=A, messages=HI, think="low", options=GREEDY)
    assert r.done


def test_thinking_is_apart_from_the_answer(client):
    r = client.chat(model=THINKER, messages=HI, options={"temperature": 0, "num_predict": 60})
    assert r.message.thinking == THOUGHT and (r.message.content or "").strip() == "Hello there friend."
    parts = list(
        client.chat(model=THINKER, messages=HI, options={"temperature": 0, "num_predict": 60}, stream=True)
    )
    assert "".join(p.message.thinking or "" for p in parts) == THOUGHT
    assert "".join(p.message.content or "" for p in parts) == r.message.content
    g = client.generate(model=THINKER, prompt="Hello", options={"temperature": 0, "num_predict": 60})
    assert g.thinking == THOUGHT and (g.response or "").strip() == "Hello there friend."
    assert "thinking" in (client.show(THINKER).capabilities or [])
    # the earlier turn's thinking goes back to the template (which keeps or drops it)
    again = [*HI, {"role": "assistant", "content": "Hello there friend.", "thinking": THOUGHT}, *HI]
    assert client.chat(model=THINKER, messages=again, options={"num_predict": 1}).done


def test_the_api_key_guards_the_ollama_routes(model_dirs):
    registry = ModelRegistry([ServedModel(B, str(model_dirs[B]))], load)
    with served(create_app(registry=registry, api_key="sekrit")) as url:
        with pytest.raises(ollama.ResponseError) as e:
            ollama.Client(host=url).list()
        assert e.value.status_code == 401 and "API key" in e.value.error  # Ollama's shape, not a dict
        with pytest.raises(ollama.ResponseError) as e:
            ollama.Client(host=url).chat(model=B, messages=HI)
        assert e.value.status_code == 401
        keyed = ollama.Client(host=url, headers={"Authorization": "Bearer sekrit"})
        assert [m.model for m in keyed.list().models] == [B]
        assert httpx.get(f"{url}/").status_code == 200  # open, as before
    registry.shutdown()


def test_curl_as_ollamas_docs_show_it_works_and_a_foreign_page_does_not(client, server):
    """`curl URL/api/chat -d '{...}'` sends its JSON as a form (no Origin: no browser): read as JSON.
    The same from a web page (a browser sends Origin on every POST) stays refused."""
    url, _ = server
    body = json.dumps({"model": A, "messages": HI, "stream": False, "options": {"num_predict": 2}})
    form = {"content-type": "application/x-www-form-urlencoded"}
    r = httpx.post(f"{url}/api/chat", content=body, headers=form, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["done"] and r.json()["message"]["role"] == "assistant"
    r = httpx.post(f"{url}/api/chat", content=body, headers={**form, "origin": "https://evil.example"})
    assert r.status_code == 403 and set(r.json()) == {"error"}
    same_host = {**form, "origin": url}  # a page the server itself served: still JSON only
    assert httpx.post(f"{url}/api/chat", content=body, headers=same_host).status_code == 415
    assert httpx.post(f"{url}/v1/chat/completions", content=body, headers=form).status_code == 415


# --- errors -----------------------------------------------------------------------------------------
def test_errors_in_ollama_shape(client, server):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="no-such-model", messages=HI)
    assert e.value.status_code == 404 and "not found" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=A, messages=[{"role": "user", "content": "look", "images": ["aGVsbG8="]}])
    assert e.value.status_code == 400 and "text only" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=A, prompt="x", images=["aGVsbG8="])
    assert e.value.status_code == 400 and "text only" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=A, messages=HI, options={"num_ctx": 10**7})
    assert e.value.status_code == 400 and "num_ctx" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=A, prompt="x", suffix="y")
    assert e.value.status_code == 400 and "suffix" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=A, messages=HI, think="very")
    assert e.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=A, input="x")
    assert e.value.status_code == 400 and f"embeddings with `{EMB}`" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=EMB, messages=HI)
    assert e.value.status_code == 400 and "embedding model" in e.value.error
    r = httpx.post(
        f"{server[0]}/api/chat", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and set(r.json()) == {"error"}
    r = httpx.post(f"{server[0]}/api/chat", json={"model": A, "messages": "hi"})
    assert r.status_code == 400 and set(r.json()) == {"error"}


# --- the model routes -------------------------------------------------------------------------------
def test_version_tags_and_show(client, model_dirs):
    v = httpx.get(f"{client._client.base_url}/api/version").json()["version"]
    assert tuple(int(x) for x in v.split(".")) >= (0, 6, 4)
    names = {m.model: m for m in client.list().models}
    assert {A, B, EMB} <= set(names)
    assert names[A].details is not None and names[A].details.format == "safetensors"
    assert names[A].digest and len(names[A].digest) == 64 and names[A].modified_at is not None
    show = client.show(A)
    assert (
        show.capabilities is not None and "completion" in show.capabilities and "tools" in show.capabilities
    )
    assert show.template and "tools" in show.template  # read from the files, not from a loaded engine
    assert show.modelinfo and show.modelinfo["general.architecture"] == "llama"
    assert show.modelinfo["llama.context_length"] == 2048
    assert show.parameters and "temperature" in show.parameters and show.modelfile
    emb = client.show(EMB)
    assert (
        emb.capabilities == ["embedding"] and emb.modelinfo and emb.modelinfo["bert.embedding_length"] == 64
    )
    with pytest.raises(ollama.ResponseError) as e:
        client.show("nope")
    assert e.value.status_code == 404


def test_two_models_chat_and_ps_shows_both(client, server):
    for model in (A, B):
        assert client.chat(model=model, messages=HI, options=GREEDY, keep_alive="10m").done
    ps = {m.model: m for m in client.ps().models}
    assert {A, B} <= set(ps)
    for name in (A, B):
        m = ps[name]
        assert m.expires_at is not None and m.expires_at.timestamp() > time.time() + 500
        assert m.size and m.size > 0 and m.context_length == 2048 and m.name == name
    # the fields `duet ps` reads
    raw = httpx.get(f"{server[0]}/api/ps").json()["models"]
    assert all({"name", "model", "size", "expires_at", "context_length"} <= set(m) for m in raw)


def test_load_unload_and_keep_alive_zero(client, server):
    _, registry = server
    r = client.chat(model=B, messages=[], keep_alive="5m")
    assert r.done and r.done_reason == "load" and registry.get_loaded(B) is not None
    r = client.generate(model=B, prompt="", keep_alive=0)
    assert r.done and r.done_reason == "unload"
    wait_for(lambda: B not in {m.model for m in client.ps().models}, "the unload")
    # keep_alive 0 with a request: unloaded once it is answered
    assert client.chat(model=B, messages=HI, options=GREEDY, keep_alive=0).done
    wait_for(lambda: B not in {m.model for m in client.ps().models}, "the idle unload")


def test_embed_and_legacy_embeddings(client):
    r = client.embed(model=EMB, input=["hello world", "a cat"])
    assert r.model == EMB and len(r.embeddings) == 2 and len(r.embeddings[0]) == 64
    assert r.prompt_eval_count and r.prompt_eval_count > 4
    one = client.embed(model=EMB, input="hello world")
    assert one.embeddings[0] == pytest.approx(r.embeddings[0], abs=1e-5)
    assert client.embeddings(model=EMB, prompt="hello world").embedding == pytest.approx(
        r.embeddings[0], abs=1e-5
    )
    long = "word " * 200  # past the tiny BERT's 64 positions
    assert (
        len(client.embed(model=EMB, input=long).embeddings[0]) == 64
    )  # truncated, as Ollama does by default
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=EMB, input=long, truncate=False)
    assert e.value.status_code == 400
    assert client.embed(model=EMB, input=[]).embeddings == []  # Ollama's "load the model"


# --- pull and delete --------------------------------------------------------------------------------
def test_pull_streams_progress_then_the_model_is_served_and_deleted(
    client, server, model_dirs, monkeypatch, tmp_path
):
    repo = "owner/tiny-pulled"
    files = {p.name: p for p in model_dirs[B].iterdir() if p.is_file()}
    with HubServer({repo: files}) as hub:
        point_hf_at(monkeypatch, hub, tmp_path / "hf")
        progress = list(client.pull(repo, stream=True))
        assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
        weights = [p for p in progress if p.digest and p.total and p.total > 1000]
        assert weights and weights[-1].completed == weights[-1].total
        assert all(
            a.completed <= b.completed
            for a, b in zip(weights, weights[1:], strict=False)
            if a.digest == b.digest
        )
        assert repo in {m.model for m in client.list().models}
        assert client.chat(model=repo, messages=HI, options=GREEDY).done  # servable once pulled
        assert client.pull(repo, stream=False).status == "success"  # cached: nothing to fetch
        with pytest.raises(ollama.ResponseError) as e:
            list(client.pull("owner/no-such-repo", stream=True))
        assert "no such model" in e.value.error
        assert client.delete(repo).status == "success"
        assert repo not in {m.model for m in client.list().models}
        assert not any((tmp_path / "hf" / "hub").glob("models--owner--tiny-pulled/snapshots/*/*.safetensors"))
    with pytest.raises(ollama.ResponseError) as e:
        client.delete(repo)
    assert e.value.status_code == 404


def test_pull_forwards_progress_from_the_puller(client, server, monkeypatch, model_dirs):
    """/api/pull against a stand-in puller: each progress record becomes an NDJSON line."""
    from mlx_engine.loading.pull import PulledModel, PullProgress

    def fake(spec, progress):
        progress(PullProgress("pulling manifest"))
        for done in (0, 50, 100):
            progress(PullProgress("pulling m.gguf", "m.gguf", "ab" * 32, 100, done))
        progress(PullProgress("success"))
        return PulledModel(
            "owner/fake", "owner/fake", "c" * 40, "hf_dir", model_dirs[A], ("config.json",), 100
        )

    monkeypatch.setattr(ollama_models, "run_pull", fake)
    lines = list(client.pull("owner/fake", stream=True))
    assert lines[0].status == "pulling manifest" and lines[-1].status == "success"
    assert lines[-2].completed == lines[-2].total == 100 and lines[-2].digest == "sha256:" + "ab" * 32
    assert "owner/fake" in {m.model for m in client.list().models}


def test_delete_refuses_what_is_not_pulled(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.delete(A)  # a model directory given by path, not in the Hugging Face cache
    assert e.value.status_code == 400 and "pulled" in e.value.error
