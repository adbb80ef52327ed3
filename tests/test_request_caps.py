"""``max_tokens`` past the context is a cap on every endpoint (opencode sends 32000 whatever the
model), `duet serve --max-tokens` caps every reply, ``--context-length`` sets the context, and
``/`` answers the probes clients send at start. On a tiny random model with a 96-token context."""

from __future__ import annotations

import httpx
import pytest

from app.server.app import create_app
from mlx_engine.config import EngineConfig
from mlx_engine.engine import Engine
from mlx_engine.errors import ConfigError, ContextLengthError
from mlx_engine.request import GenerationRequest, SamplingParams
from tests.test_server_harness import tiny_model

CONTEXT = 96
MODEL = "tiny-caps"
SAY = [{"role": "user", "content": "Tell me about the quick brown fox."}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp("caps") / MODEL)
    e = Engine.load(str(path), config=EngineConfig(cache_gb=0.02, context_length=CONTEXT, max_running=4))
    yield e
    e.shutdown()


def client(engine, **kw) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=create_app(engine, **kw))
    return httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=120)


def test_the_context_length_option_sets_the_context(engine):
    assert engine.context_length == CONTEXT
    with pytest.raises(ConfigError, match="context_length"):
        EngineConfig(context_length=0).validate()
    with pytest.raises(ConfigError, match="at least 16"):
        EngineConfig(context_length=8).validate()


async def test_max_tokens_past_the_context_is_capped_on_every_endpoint(engine):
    """The reply runs to the end of the context and says it stopped for length."""
    huge = {"ignore_eos": True, "temperature": 0}
    async with client(engine) as c:
        r = await c.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": SAY, "max_tokens": 32000, **huge}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length"
        u = body["usage"]
        assert u["prompt_tokens"] + u["completion_tokens"] == CONTEXT

        r = await c.post(
            "/v1/completions", json={"model": MODEL, "prompt": "The fox", "max_tokens": 32000, **huge}
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        u = r.json()["usage"]
        assert u["prompt_tokens"] + u["completion_tokens"] == CONTEXT

        r = await c.post("/v1/messages", json={"model": MODEL, "messages": SAY, "max_tokens": 32000, **huge})
        assert r.status_code == 200, r.text
        assert r.json()["stop_reason"] == "max_tokens"
        u = r.json()["usage"]
        assert u["input_tokens"] + u["cache_read_input_tokens"] + u["output_tokens"] == CONTEXT

        r = await c.post(
            "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 32000, **huge}
        )
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "incomplete"
        assert r.json()["usage"]["total_tokens"] == CONTEXT

        # streamed too: the last chunk with a finish reason says length
        body = {"model": MODEL, "messages": SAY, "max_tokens": 32000, "stream": True, **huge}
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and '"finish_reason": "length"' in r.text.replace('":"', '": "'), r.text[
            -400:
        ]


async def test_a_prompt_that_fills_the_context_alone_is_still_a_400(engine):
    long = [{"role": "user", "content": "fox " * 200}]
    async with client(engine) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": long, "max_tokens": 4})
        assert r.status_code == 400
        assert (
            r.json()["error"]["code"] == "context_length_exceeded"
            and str(CONTEXT) in r.json()["error"]["message"]
        )
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "fox " * 200, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


async def test_a_prompt_one_token_short_of_the_context_gets_one_token(engine):
    """The context holds the prompt and the reply: a prompt as long as the context is refused (no
    position is left for a reply token), one a token shorter gets exactly one."""
    with pytest.raises(ContextLengthError, match=f"context is {CONTEXT} tokens"):
        engine.prepare_prompt(GenerationRequest(prompt=[5] * CONTEXT))
    r = GenerationRequest(prompt=[5] * (CONTEXT - 1), sampling=SamplingParams(temperature=0), ignore_eos=True)
    events = [ev async for ev in engine.generate(r)]
    assert events[-1].finish_reason == "length"
    assert events[-1].usage.prompt_tokens == CONTEXT - 1 and events[-1].usage.completion_tokens == 1


async def test_the_server_cap_holds_whatever_a_request_asks(engine):
    huge = {"ignore_eos": True}
    async with client(engine, max_tokens=5) as c:
        for asked in ({}, {"max_tokens": 50}):
            r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": SAY, **asked, **huge})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
        r = await c.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": SAY, "max_tokens": 3, **huge}
        )
        assert r.json()["usage"]["completion_tokens"] == 3  # a smaller ask is kept
        r = await c.post("/v1/messages", json={"model": MODEL, "messages": SAY, "max_tokens": 32000, **huge})
        assert r.json()["usage"]["output_tokens"] == 5
        r = await c.post("/v1/responses", json={"model": MODEL, "input": "hi", **huge})
        assert r.json()["usage"]["output_tokens"] == 5
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "The fox", **huge})
        assert r.json()["usage"]["completion_tokens"] == 5


async def test_root_answers_the_probes_clients_send(engine):
    async with client(engine, api_key="sekrit") as c:
        for method in ("HEAD", "GET"):
            r = await c.request(method, "/")
            assert r.status_code == 200, (method, r.text)
        assert (await c.get("/")).text == "Duet is running\n"  # no model name without the key
        assert (await c.get("/v1/models")).status_code == 401


async def test_an_engine_error_anywhere_below_a_route_is_mapped_once_per_api(engine, monkeypatch):
    """Every API answers the engine's errors (``DuetError``) in its own shape, from one mapping."""
    from mlx_engine.errors import ContextLengthError, QueueFullError

    def refuse(req):
        raise ContextLengthError("the prompt has 999 tokens but the model's context is 96 tokens", "messages")

    monkeypatch.setattr(engine, "prepare_prompt", refuse)
    async with client(engine) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": SAY})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert r.json()["error"]["param"] == "messages"
        r = await c.post("/v1/responses", json={"model": MODEL, "input": "hi"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        r = await c.post("/v1/messages", json={"model": MODEL, "messages": SAY, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert (
            r.json()["error"]["type"] == "invalid_request_error" and "context" in r.json()["error"]["message"]
        )

    def full(req):
        raise QueueFullError("the queue is full (8 waiting)")

    monkeypatch.setattr(engine, "prepare_prompt", full)
    async with client(engine) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": SAY})
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        r = await c.post("/v1/messages", json={"model": MODEL, "messages": SAY, "max_tokens": 4})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error", r.text
