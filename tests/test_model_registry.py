"""Several models in one server (app/server/registry.py, issue 33): load on first use, one load for
the requests that wait on it, unload after the idle keep-alive, the least recently used idle model
unloaded for room (never a busy one), a model that fails to load leaves the others served; and the
same through the HTTP API with real tiny engines: two models answering concurrently, /v1/models
telling which are loaded, a streamed request that waits on a load."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import mlx.nn as nn
import openai
import pytest
import uvicorn

from app.server.app import create_app, server_state
from app.server.errors import APIError
from app.server.keep_alive import parse_keep_alive
from app.server.registry import ModelRegistry, ServedModel
from mlx_engine.config import EngineConfig
from mlx_engine.engine import Engine
from tests.tiny_models import make_tiny_model_dir


# --- the registry's rules, on engines that only count --------------------------------------------
@dataclass
class _Stats:
    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 10
    kv_block_bytes: int = 100


@dataclass
class _Weights:
    weight_bytes: int
    model: nn.Module = field(default_factory=nn.Module)  # no parameters: nothing on huge pages


@dataclass
class CountingEngine:
    """What the registry asks of an engine: stats, its weights' size, shutdown."""

    name: str
    weight_bytes: int = 1000
    running: int = 0
    shut: bool = False
    loaded: _Weights = field(init=False)

    def __post_init__(self) -> None:
        self.loaded = _Weights(self.weight_bytes)

    def stats(self) -> _Stats:
        return _Stats(running=self.running)

    def shutdown(self) -> None:
        self.shut = True


@dataclass
class _State:
    engine: CountingEngine


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Loader:
    """Builds a counting engine per load; ``gate``: loads wait for it; ``broken``: names that fail."""

    def __init__(self, weight_bytes: int = 1000) -> None:
        self.calls: list[str] = []
        self.engines: dict[str, list[CountingEngine]] = {}
        self.gate: threading.Event | None = None
        self.started = threading.Event()
        self.broken: set[str] = set()
        self.weight_bytes = weight_bytes

    def __call__(self, model: ServedModel):
        self.calls.append(model.name)
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(30)
        if model.name in self.broken:
            raise ValueError(f"{model.name}: the weights are corrupt")
        engine = CountingEngine(model.name, self.weight_bytes)
        self.engines.setdefault(model.name, []).append(engine)
        return _State(engine)


def registry(names=("a", "b", "c"), **kw) -> tuple[ModelRegistry, Loader, Clock]:
    loader, clock = Loader(), Clock()
    models = [ServedModel(n, n, info={"size_bytes": 1000}) for n in names]
    return ModelRegistry(models, loader, clock=clock, **kw), loader, clock  # type: ignore[arg-type]


async def test_a_model_loads_on_first_use_and_once_for_every_request_waiting_on_it():
    reg, loader, _ = registry()
    loader.gate = threading.Event()
    waiting = [asyncio.ensure_future(reg.acquire("a")) for _ in range(3)]
    await asyncio.to_thread(loader.started.wait, 30)
    assert reg.is_loading("a") and reg.loaded() == []
    loader.gate.set()
    leases = await asyncio.gather(*waiting)
    assert loader.calls == ["a"] and {id(x.state) for x in leases} == {id(leases[0].state)}
    for lease in leases:
        lease.release()
    again = await reg.acquire("a")
    again.release()
    assert loader.calls == ["a"]
    reg.shutdown()


async def test_an_unknown_model_is_a_404_that_lists_the_models():
    reg, _, _ = registry()
    with pytest.raises(APIError) as e:
        await reg.acquire("gpt-4")
    assert e.value.status == 404 and e.value.code == "model_not_found"
    assert "`a`" in e.value.message and "`c`" in e.value.message


async def test_idle_models_unload_after_their_keep_alive_and_busy_ones_wait():
    reg, loader, clock = registry(keep_alive=60)
    (await reg.acquire("a")).release()
    lease_b = await reg.acquire("b", keep_alive=5)  # a request's own keep-alive
    clock.now += 30
    assert await reg.reap() == []  # a: 30 of 60 s; b: held
    lease_b.release()
    clock.now += 4
    assert await reg.reap() == []
    clock.now += 1
    assert await reg.reap() == ["b"] and loader.engines["b"][0].shut
    loader.engines["a"][0].running = 1  # a request is generating: idle time does not count
    clock.now += 100
    assert await reg.reap() == []
    loader.engines["a"][0].running = 0
    clock.now += 59
    assert await reg.reap() == []
    clock.now += 1
    assert await reg.reap() == ["a"] and reg.loaded() == []
    (await reg.acquire("a", keep_alive=None)).release()  # None: for ever (Ollama's -1)
    clock.now += 10**6
    assert await reg.reap() == [] and reg.expires_in(reg.loaded()[0]) is None
    reg.shutdown()


async def test_loading_past_max_loaded_unloads_the_least_recently_used_idle_model():
    reg, loader, clock = registry(max_loaded=2)
    (await reg.acquire("a")).release()
    clock.now += 1
    (await reg.acquire("b")).release()
    clock.now += 1
    (await reg.acquire("a")).release()  # a is now the more recent
    clock.now += 1
    (await reg.acquire("c")).release()
    assert sorted(m.model.name for m in reg.loaded()) == ["a", "c"]
    assert loader.engines["b"][0].shut and not loader.engines["a"][0].shut
    reg.shutdown()


async def test_a_busy_model_is_never_unloaded_for_room_the_load_waits_for_it():
    reg, loader, _ = registry(max_loaded=1)
    held = await reg.acquire("a")
    second = asyncio.ensure_future(reg.acquire("b"))
    while not reg.waiting_for_room:  # the load of b waits for room (event-loop steps, no clock)
        await asyncio.sleep(0)
    assert not second.done() and not loader.engines["a"][0].shut
    held.release()  # a goes idle: b may load now
    lease = await asyncio.wait_for(second, 30)
    assert lease.loaded.model.name == "b" and loader.engines["a"][0].shut
    lease.release()
    reg.shutdown()


async def test_a_model_just_loaded_is_not_unloaded_for_another_before_its_request_holds_it():
    """Two requests for two models with room for one: the second load must not evict the first model
    between the end of its load and its request taking the lease."""
    reg, loader, _ = registry(max_loaded=1)
    first = asyncio.ensure_future(reg.acquire("a"))
    second = asyncio.ensure_future(reg.acquire("b"))
    lease_a = await first
    assert not lease_a.loaded.state.engine.shut and reg.get_loaded("a") is lease_a.loaded
    assert not second.done()  # b waits for a to be let go
    lease_a.release()
    lease_b = await asyncio.wait_for(second, 30)
    assert loader.engines["a"][0].shut and not lease_b.loaded.state.engine.shut
    lease_b.release()
    reg.shutdown()


async def test_a_request_without_a_keep_alive_gets_the_servers_again():
    """As Ollama: each request sets the keep-alive, its own or the server's default."""
    reg, _, _ = registry(keep_alive=60)
    (await reg.acquire("a", keep_alive=None)).release()  # for ever
    assert reg.get_loaded("a").keep_alive is None
    (await reg.acquire("a")).release()
    assert reg.get_loaded("a").keep_alive == 60
    reg.shutdown()


async def test_the_memory_cap_unloads_for_room_before_loading():
    # each model: 1000 bytes of file; loaded, 1000 of weights + 10 blocks x 100 of KV = 2000
    reg, loader, _ = registry(max_loaded=3, memory_limit=3500)
    (await reg.acquire("a")).release()
    (await reg.acquire("b")).release()  # 2000 + 1000 <= 3500: fits beside a
    assert len(reg.loaded()) == 2
    (await reg.acquire("c")).release()  # 4000 + 1000 > 3500: a (LRU) goes, then 2000 + 1000 fits
    assert sorted(m.model.name for m in reg.loaded()) == ["b", "c"] and loader.engines["a"][0].shut
    reg.shutdown()


async def test_a_model_that_fails_to_load_is_an_error_and_the_others_are_served():
    reg, loader, _ = registry()
    loader.broken.add("b")
    (await reg.acquire("a")).release()
    with pytest.raises(APIError) as e:
        await reg.acquire("b")
    assert e.value.status == 500 and e.value.code == "model_load_failed" and "corrupt" in e.value.message
    assert "corrupt" in reg.failures["b"] and [m.model.name for m in reg.loaded()] == ["a"]
    (await reg.acquire("a")).release()
    loader.broken.clear()
    (await reg.acquire("b")).release()  # fixed on disk: the next request loads it
    assert "b" not in reg.failures
    reg.shutdown()


async def test_unload_by_hand_now_or_when_the_requests_end_and_never_a_pinned_model():
    loader, clock = Loader(), Clock()
    pinned = ServedModel("p", "p", pinned=True)
    reg = ModelRegistry([pinned, ServedModel("a", "a")], loader, clock=clock)  # type: ignore[arg-type]
    reg.adopt(pinned, loader(pinned))
    with pytest.raises(APIError) as e:
        await reg.unload("p")
    assert e.value.status == 409
    assert await reg.unload("a") == "not_loaded"
    lease = await reg.acquire("a")
    assert await reg.unload("a") == "pending"  # a request holds it
    lease.release()
    assert await reg.reap() == ["a"]  # its keep-alive became 0: gone once idle
    (await reg.acquire("a")).release()
    assert await reg.unload("a") == "unloaded" and [m.model.name for m in reg.loaded()] == ["p"]
    reg.shutdown()


def test_keep_alive_durations_parse_as_ollama_takes_them():
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400
    assert parse_keep_alive("250ms") == 0.25 and parse_keep_alive(0) == 0 and parse_keep_alive("0") == 0
    assert parse_keep_alive(-1) is None and parse_keep_alive("-1m") is None and parse_keep_alive(42) == 42
    for bad in ("5 minutes", "m5", "", True, "1d"):
        with pytest.raises(ValueError, match="keep_alive"):
            parse_keep_alive(bad)


# --- the HTTP API with real tiny engines -----------------------------------------------------------
CONFIG = EngineConfig(cache_gb=0.02, max_running=4)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("registry-models")
    return {
        name: make_tiny_model_dir(root / name, "llama", seed=i) for i, name in enumerate(("alpha", "beta"))
    }


def real_registry(model_dirs: dict[str, Path], **kw) -> tuple[ModelRegistry, list[str]]:
    loads: list[str] = []

    def load(model: ServedModel):
        loads.append(model.name)
        engine = Engine.load(model.spec, config=CONFIG)
        return server_state(engine, model.ids)

    models = [ServedModel(n, str(p), info={"size_bytes": 1}) for n, p in model_dirs.items()]
    return ModelRegistry(models, load, **kw), loads


def client_for(app) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=120)
    return openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="none", http_client=http, max_retries=0)


async def test_two_models_answer_concurrently_and_v1_models_tells_which_are_loaded(model_dirs):
    reg, loads = real_registry(model_dirs)
    app = create_app(registry=reg)
    try:
        async with client_for(app) as client:
            cards = {m.id: m.model_extra for m in (await client.models.list()).data}
            assert set(cards) == {"alpha", "beta"} and not any(c["loaded"] for c in cards.values())

            async def ask(model: str) -> str:
                r = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
                )
                assert r.model == model and r.usage is not None and r.usage.completion_tokens == 4
                return r.choices[0].message.content or ""

            await asyncio.gather(ask("alpha"), ask("beta"), ask("alpha"))
            assert sorted(loads) == ["alpha", "beta"]  # each loaded once, on first use
            cards = {m.id: m.model_extra for m in (await client.models.list()).data}
            assert all(c["loaded"] and c["status"] == "loaded" for c in cards.values())
            assert cards["alpha"]["memory_bytes"] > 0 and cards["alpha"]["expires_in"] > 0
            one = await client.models.retrieve("beta")
            assert one.model_extra is not None and one.model_extra["loaded"]
            metrics = (await client._client.get("http://127.0.0.1/metrics")).text
            assert 'duet_model_loaded{model="alpha"} 1.0' in metrics
            assert 'duet_generation_tokens_total{model="beta"} 4.0' in metrics
            with pytest.raises(openai.NotFoundError, match="Available models: `alpha`, `beta`"):
                await client.chat.completions.create(
                    model="gamma", messages=[{"role": "user", "content": "x"}]
                )
    finally:
        reg.shutdown()


async def test_unload_and_load_routes_and_a_stream_that_waits_on_a_load(model_dirs):
    reg, loads = real_registry(model_dirs)
    app = create_app(registry=reg)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=120) as http:
            r = await http.post("/v1/models/load", json={"model": "alpha", "keep_alive": "10m"})
            assert r.status_code == 200 and r.json()["loaded"] and 590 < r.json()["expires_in"] <= 600
            r = await http.post("/models/unload", json={"model": "alpha"})
            assert r.json()["status"] == "unloaded" and reg.loaded() == []
            body = {"model": "beta", "prompt": "Hello", "max_tokens": 3, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = [line async for line in r.aiter_lines() if line]
            data = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
            assert lines[-1] == "data: [DONE]" and "".join(d["choices"][0]["text"] for d in data)
            assert "beta" in loads and reg.get_loaded("beta") is not None
            r = await http.post("/v1/models/unload", json={"model": "nope"})
            assert r.status_code == 404
    finally:
        reg.shutdown()


@contextlib.contextmanager
def served(app):
    """``app`` under uvicorn on a free loopback port, in a thread (a real socket: streams arrive as
    they are sent)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        thread.join(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(10)


def test_a_streamed_request_shows_the_model_loading_instead_of_a_silent_wait(model_dirs):
    gate = threading.Event()
    reg, loads = real_registry(model_dirs)
    load = reg.loader

    def slow_load(model: ServedModel):
        assert gate.wait(60)  # until the client has seen the loading state
        return load(model)

    reg.loader = slow_load
    body = {
        "model": "alpha",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
    }
    try:
        with served(create_app(registry=reg)) as base:
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                assert next(lines) == ": loading model alpha"  # headers and a comment before the load ends
                gate.set()
                rest = [x for x in lines if x]
            assert rest[-1] == "data: [DONE]" and any('"content"' in x for x in rest)
            reg.loader = lambda m: (_ for _ in ()).throw(ValueError("no such weights"))
            body["model"] = "beta"
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as r:
                frames = [x for x in r.iter_lines() if x.startswith("data: ")]
            error = json.loads(frames[0][6:])["error"]
            assert error["code"] == "model_load_failed" and "no such weights" in error["message"]
            assert frames[-1] == "data: [DONE]"
            r = httpx.post(base + "/v1/chat/completions", json={**body, "model": "alpha", "stream": False})
            assert r.status_code == 200  # the other model is still served
    finally:
        gate.set()
        reg.shutdown()
