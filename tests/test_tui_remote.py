"""`duet chat --server URL`: the chat talking to Duet's own OpenAI-compatible server (in-process, loopback)."""

from __future__ import annotations

import socket
import threading
from functools import partial

import pytest
import uvicorn

from app.server.app import create_app
from app.tui.app import ChatApp
from app.tui.backends import RemoteBackend
from app.tui.screens import ErrorScreen, ModelPicker
from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.request import GenerationRequest, SamplingParams
from tests.test_tui import (  # noqa: F401 (count_handled_lines: an autouse fixture type_and_send needs)
    EngineGate,
    count_handled_lines,
    loaded,
    reply_done,
    type_and_send,
    until,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tiny_dirs):
    engine = Engine.load(str(tiny_dirs("llama")), config=EngineConfig(cache_gb=0.02))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        thread.join(0.05)
    yield f"http://127.0.0.1:{port}", engine
    srv.should_exit = True
    thread.join(10)
    engine.shutdown()


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DUET_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("DUET_NO_HISTORY", raising=False)


def remote_app(url: str) -> ChatApp:
    return ChatApp(None, load_backend=partial(RemoteBackend.connect, url), remote=True)


async def test_chat_through_the_server(server, data_dir):
    url, engine = server
    app = remote_app(url)
    async with app.run_test() as pilot:
        await loaded(pilot)
        assert app.backend.name == "llama" and app.backend.url == url + "/v1"
        for cmd in ("/temp 0", "/max 16", "Hello server"):
            await type_and_send(pilot, cmd)
        await reply_done(pilot)
        reply = app.conv.messages[-1]
        expected = []
        req = GenerationRequest(
            messages=[{"role": "user", "content": "Hello server"}],
            max_tokens=16,
            sampling=SamplingParams(temperature=0.0),
        )
        async for ev in engine.generate(req):
            expected.append(ev.text)
        assert reply.content == "".join(expected)
        assert "16 reply tok" in reply.meta and "tok/s" in reply.meta
        assert app.last_usage.prompt_tokens > 0 and app.context_used == app.last_usage.total_tokens
        assert "prefill server" in str(app.status_bar.render())

        # Esc closes the stream; the server cancels the request. The server's engine is held after 20
        # passes, so the reply is mid-stream when Esc comes however fast the model is.
        await type_and_send(pilot, "/new")
        await type_and_send(pilot, "/max 1500")
        with EngineGate(engine, passes=20) as gate:
            await type_and_send(pilot, "Write a very long story")
            await until(
                pilot,
                lambda: gate.blocked.is_set() and app.conv.messages[-1].content,
                what="streamed text, then the engine held",
            )
            # stats() is published between steps: the step the gate holds counts once it ends
            steps = engine.stats().steps + 1
            await pilot.press("escape")
            await reply_done(pilot)  # the engine is still held: the stop does not wait for the server
            assert app.conv.messages[-1].meta == "stopped"
            await until(pilot, gate.cancelled.is_set, what="the server to cancel the request")
        await until(
            pilot,
            lambda: (s := engine.stats()).running == 0 and s.kv_blocks_used == 0,
            what="the server's engine to drop the request and free its blocks",
        )
        assert engine.stats().steps == steps, "the server ran another step for a stopped reply"

        await pilot.press("f2")
        await until(pilot, lambda: isinstance(app.screen, ModelPicker), what="the model picker")
        assert [spec for spec, _ in app.screen.choices][0] == "llama"
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, ModelPicker), what="the picker to close")


async def test_unreachable_server_is_a_clear_error(data_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    app = remote_app(f"http://127.0.0.1:{port}")
    async with app.run_test() as pilot:
        await until(pilot, lambda: isinstance(app.screen, ErrorScreen), what="the error screen")
        assert f"cannot reach the server at http://127.0.0.1:{port}/v1" in str(
            app.screen.query_one("#message").render()
        )
