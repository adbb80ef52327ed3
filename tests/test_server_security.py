"""Server hardening (issue 11): DNS rebinding and foreign origins, the API key before anything is
parsed, body and prompt size limits, work kept off the event loop, fan-out, idle and slow
connections, the port taken, a public bind without a key.

In-process tests drive the app (or the bare middleware) through httpx's ASGI transport and the
connection guard through an in-process uvicorn; the real-server tests run `duet serve`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import uvicorn

from app.fd_limit import raise_fd_limit
from app.server.app import create_app
from app.server.common import max_prompt_chars
from app.server.connections import RateLimitFilter, protocol_class
from app.server.errors import APIError
from app.server.generation import check_fanout
from app.server.security import SecurityMiddleware, SecurityPolicy
from mlx_engine.engine import Engine, EngineConfig
from tests.test_server_harness import ServerProcess, free_port, tiny_model

pytestmark = pytest.mark.timeout(300)

BASE = "http://127.0.0.1:8000"  # what the in-process app believes it is serving
MB = 2**20
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp("sec") / "tiny")
    e = Engine.load(str(path), config=EngineConfig(cache_gb=0.02, max_running=4, max_queue=8))
    yield e
    e.shutdown()


def client(app, base: str = BASE) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base, timeout=60)


def app_for(engine, docs: bool = False, **policy) -> object:
    return create_app(engine, security=SecurityPolicy.build(**policy), docs=docs)


class Recorder:
    """A bare ASGI app behind the middleware: records what reaches it."""

    def __init__(self):
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        self.bodies.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


class Source:
    """A request body of ``total`` bytes in 1 MB chunks that counts what was pulled from it."""

    def __init__(self, total: int):
        self.total, self.pulled = total, 0

    async def __aiter__(self):
        while self.pulled < self.total:
            n = min(MB, self.total - self.pulled)
            self.pulled += n
            yield b" " * n


# --- Host and Origin ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host, ok",
    [
        ("127.0.0.1:8000", True),
        ("localhost:8000", True),
        ("LocalHost", True),
        ("[::1]:8000", True),
        ("app.localhost:8000", True),
        ("192.168.1.20:8000", True),  # an IP literal cannot be rebound
        ("evil.example:8000", False),
        ("evil.example", False),
        ("localhost.evil.example:8000", False),
        ("127.0.0.1.nip.io:8000", False),
        ("", False),
        ("[::1:8000", False),
    ],
)
async def test_rebinding_hosts_get_403(engine, host, ok):
    async with client(app_for(engine)) as c:
        r = await c.get("/v1/models", headers={"Host": host})
        assert r.status_code == (200 if ok else 403), r.text
        if not ok:
            assert r.json()["error"]["code"] == "host_not_allowed"
            # nor does a completion run
            r = await c.post("/v1/chat/completions", json=CHAT, headers={"Host": host})
            assert r.status_code == 403


async def test_allowed_hosts(engine):
    app = app_for(engine, allowed_hosts=["mybox.lan", "*.example.lan"])
    async with client(app) as c:
        for host, status in [
            ("mybox.lan:8000", 200),
            ("a.b.example.lan", 200),
            ("example.lan", 403),  # "*." means subdomains only
            ("other.lan", 403),
        ]:
            assert (await c.get("/v1/models", headers={"Host": host})).status_code == status, host
    async with client(app_for(engine, allowed_hosts=["*"])) as c:
        assert (await c.get("/v1/models", headers={"Host": "anything.example"})).status_code == 200


@pytest.mark.parametrize(
    "origin, host, status",
    [
        (None, "127.0.0.1:8000", 200),  # curl, SDKs: no Origin
        ("http://evil.example", "127.0.0.1:8000", 403),
        ("http://evil.example:8000", "127.0.0.1:8000", 403),
        ("null", "127.0.0.1:8000", 403),  # sandboxed frames, file:// pages
        ("http://localhost:8000", "localhost:8000", 200),  # same origin (the /docs page)
        ("http://127.0.0.1:8000", "127.0.0.1:8000", 200),
        ("http://localhost:8000", "127.0.0.1:8000", 200),  # loopback, the server's own port
        ("http://[::1]:8000", "127.0.0.1:8000", 200),
        ("http://localhost:3000", "127.0.0.1:8000", 403),  # another local app needs --allowed-origins
        ("https://127.0.0.1:8000", "127.0.0.1:8000", 200),
        ("not a url", "127.0.0.1:8000", 403),
    ],
)
async def test_origins(engine, origin, host, status):
    headers = {"Host": host} | ({"Origin": origin} if origin else {})
    async with client(app_for(engine)) as c:
        r = await c.get("/v1/models", headers=headers)
        assert r.status_code == status, r.text
        assert "access-control-allow-origin" not in r.headers  # CORS stays closed by default
        r = await c.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert r.status_code == status, r.text
        if status == 403:
            assert r.json()["error"]["code"] == "origin_not_allowed"


async def test_cors_only_for_allowed_origins(engine):
    ui = "http://localhost:3000"
    app = app_for(engine, api_key="k", allowed_origins=[ui])
    async with client(app) as c:
        # a preflight carries no credentials: it must pass without the key
        pre = await c.options(
            "/v1/chat/completions",
            headers={
                "Origin": ui,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ui
        ok = await c.post(
            "/v1/chat/completions", json=CHAT, headers={"Origin": ui, "Authorization": "Bearer k"}
        )
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ui
        # the UI can read its errors too
        denied = await c.get("/v1/models", headers={"Origin": ui})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ui
        other = await c.options(
            "/v1/chat/completions",
            headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert other.status_code == 403 and "access-control-allow-origin" not in other.headers


# --- content type, body size, body time -----------------------------------------------------------


@pytest.mark.parametrize(
    "ctype, status",
    [
        ("text/plain", 415),  # the cross-site form POST that needs no preflight
        ("application/x-www-form-urlencoded", 415),
        ("multipart/form-data; boundary=x", 415),
        (None, 415),
        ("application/json", 200),
        ("application/json; charset=utf-8", 200),
        ("application/merge-patch+json", 200),
    ],
)
async def test_post_bodies_must_be_json(ctype, status):
    rec = Recorder()
    headers = {"content-type": ctype} if ctype else {}
    async with client(SecurityMiddleware(rec, SecurityPolicy())) as c:
        r = await c.post("/v1/chat/completions", content=b'{"a": 1}', headers=headers)
    assert r.status_code == status, r.text
    assert rec.bodies == ([b'{"a": 1}'] if status == 200 else [])


async def test_oversized_body_by_content_length_is_refused_unread():
    rec, src = Recorder(), Source(20 * MB)
    async with client(SecurityMiddleware(rec, SecurityPolicy.build(max_body_mb=8))) as c:
        r = await c.post(
            "/v1/completions",
            content=src,
            headers={"content-type": "application/json", "content-length": str(20 * MB)},
        )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert src.pulled == 0 and rec.bodies == []


async def test_oversized_streamed_body_is_cut_at_the_limit():
    rec, src = Recorder(), Source(20 * MB)
    async with client(SecurityMiddleware(rec, SecurityPolicy.build(max_body_mb=8))) as c:
        r = await c.post("/v1/completions", content=src, headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert src.pulled <= 9 * MB and rec.bodies == []  # stopped reading just past 8 MB


async def test_body_under_the_limit_reaches_the_app_whole():
    rec, src = Recorder(), Source(3 * MB)
    async with client(SecurityMiddleware(rec, SecurityPolicy.build(max_body_mb=8))) as c:
        r = await c.post("/v1/completions", content=src, headers={"content-type": "application/json"})
    assert r.status_code == 200 and rec.bodies == [b" " * (3 * MB)]


async def test_a_body_that_stops_arriving_times_out():
    rec = Recorder()
    mw = SecurityMiddleware(rec, SecurityPolicy.build(body_timeout_s=0.2))
    first = True

    async def receive():
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": b'{"model"', "more_body": True}
        await asyncio.Event().wait()  # the rest never comes

    sent = []

    async def send(m):
        sent.append(m)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json")],
        "server": ("127.0.0.1", 8000),
    }
    await asyncio.wait_for(mw(scope, receive, send), 30)
    assert sent[0]["status"] == 408 and (b"connection", b"close") in sent[0]["headers"]
    assert rec.bodies == []


# --- the API key ----------------------------------------------------------------------------------


async def test_only_health_answers_without_the_key(engine):
    app = app_for(engine, api_key="sekret", docs=True)
    routes = [
        ("GET", "/metrics"),
        ("GET", "/docs"),
        ("GET", "/redoc"),
        ("GET", "/openapi.json"),
        ("GET", "/v1/models"),
        ("GET", "/v1/models/tiny"),
        ("GET", "/no/such/route"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
    ]
    async with client(app) as c:
        assert (await c.get("/health")).status_code == 200
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
                r = await c.request(method, path, json=CHAT if method == "POST" else None, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert r.headers["www-authenticate"] == "Bearer"
                assert r.json()["error"]["code"] == "invalid_api_key"
        good = {"Authorization": "Bearer sekret"}
        for path in ("/metrics", "/docs", "/openapi.json", "/v1/models"):
            assert (await c.get(path, headers=good)).status_code == 200, path
        assert (await c.post("/v1/chat/completions", json=CHAT, headers=good)).status_code == 200


async def test_no_body_is_read_before_the_key_is_checked():
    rec, src = Recorder(), Source(20 * MB)
    async with client(SecurityMiddleware(rec, SecurityPolicy.build(api_key="k"))) as c:
        r = await c.post("/v1/completions", content=src, headers={"content-type": "application/json"})
    assert r.status_code == 401 and src.pulled == 0 and rec.bodies == []


async def test_docs_are_off_by_default(engine):
    async with client(app_for(engine)) as c:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert (await c.get(path)).status_code == 404, path
        assert (await c.get("/metrics")).status_code == 200  # no key set: open


# --- prompts: size bound, tokenized off the loop, fan-out -----------------------------------------


async def test_text_that_cannot_fit_is_refused_before_tokenizing(engine, monkeypatch):
    calls = []
    real = engine.prepare_prompt
    monkeypatch.setattr(engine, "prepare_prompt", lambda req: calls.append(req) or real(req))
    limit = max_prompt_chars(engine)
    assert limit >= engine.context_length * 4  # never below one character per token
    async with client(app_for(engine, max_body_mb=64)) as c:
        for path, body in [
            ("/v1/completions", {"model": "tiny", "prompt": "a" * (limit + 1), "max_tokens": 1}),
            (
                "/v1/chat/completions",
                {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "a" * (limit + 1)}],
                    "max_tokens": 1,
                },
            ),
        ]:
            r = await c.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert calls == []


def test_the_prompt_bound_is_safe_for_the_vocabulary(engine):
    """Text made of the longest token, repeated to fill the context, stays under the bound."""
    vocab = engine.tokenizer.backend.get_vocab(with_added_tokens=True)
    longest = max(vocab, key=len)
    assert max_prompt_chars(engine) >= engine.context_length * len(engine.tokenizer.decode([vocab[longest]]))


async def test_prompts_are_tokenized_off_the_event_loop(engine, monkeypatch):
    """Templates and tokenization (text prompts) run in a worker thread; the engine's own check of
    the token ids it is then given is cheap and may run on the loop."""
    texts = []
    real = engine.prepare_prompt

    def spy(req):
        if not isinstance(req.prompt, list):
            texts.append(threading.get_ident())
        return real(req)

    monkeypatch.setattr(engine, "prepare_prompt", spy)
    async with client(app_for(engine)) as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        body = {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 1}
        assert (await c.post("/v1/completions", json=body)).status_code == 200
    assert len(texts) == 3 and threading.get_ident() not in texts


async def test_fan_out_is_bounded(engine):
    """The engine runs 4 at once: a request for more sequences is a 400, whatever the queue holds."""
    async with client(app_for(engine)) as c:
        r = await c.post(
            "/v1/completions", json={"model": "tiny", "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1}
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "too_many_sequences" and r.json()["error"]["param"] == "n"
        r = await c.post("/v1/chat/completions", json={**CHAT, "n": 5})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sequences"
        r = await c.post("/v1/chat/completions", json={**CHAT, "n": 4})
        assert r.status_code == 200 and len(r.json()["choices"]) == 4


def test_a_request_bigger_than_the_queue_is_400_not_429():
    small_queue = SimpleNamespace(config=SimpleNamespace(max_running=64, max_queue=2))
    check_fanout(small_queue, 2, 2)
    with pytest.raises(APIError) as e:
        check_fanout(small_queue, 3, 3)
    assert e.value.status == 400 and "at most 2" in e.value.message


# --- connections: header timeout, idle eviction, fd limit, log flood -------------------------------


async def _ok(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def guarded_server():
    """Start an in-process uvicorn with the guarded protocol; yields a function taking its limits."""
    servers = []

    def start(header_timeout: float, max_connections: int) -> int:
        port = free_port()
        config = uvicorn.Config(
            _ok,
            host="127.0.0.1",
            port=port,
            http=protocol_class(header_timeout=header_timeout, max_connections=max_connections),
            log_level="warning",
            lifespan="off",
        )
        srv = uvicorn.Server(config)
        thread = threading.Thread(target=srv.run, daemon=True)
        thread.start()
        while not srv.started:
            thread.join(0.05)
            assert thread.is_alive()
        servers.append((srv, thread))
        return port

    yield start
    for srv, thread in servers:
        srv.should_exit = True
        thread.join(10)


def closed_by_server(sock: socket.socket, deadline: float = 30) -> bool:
    """Waits until the server closes ``sock`` (EOF or reset); False if it is still open at the deadline."""
    sock.settimeout(deadline)
    try:
        while sock.recv(1024):
            pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


def get(port: int) -> int:
    return httpx.get(f"http://127.0.0.1:{port}/", timeout=30).status_code


def test_silent_and_slow_header_connections_are_closed(guarded_server):
    port = guarded_server(header_timeout=0.5, max_connections=100)
    silent = socket.create_connection(("127.0.0.1", port))
    partial = socket.create_connection(("127.0.0.1", port))
    partial.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
    trickle = socket.create_connection(("127.0.0.1", port))
    stop = threading.Event()

    def drip():  # one header byte every 50 ms: each byte must not restart the deadline
        try:
            while not stop.is_set():
                trickle.sendall(b"X")
                stop.wait(0.05)
        except OSError:
            pass

    threading.Thread(target=drip, daemon=True).start()
    try:
        assert closed_by_server(silent) and closed_by_server(partial) and closed_by_server(trickle)
        assert get(port) == 200  # complete requests are unaffected
    finally:
        stop.set()
        for s in (silent, partial, trickle):
            s.close()


def test_idle_connections_give_way_to_new_ones(guarded_server):
    port = guarded_server(header_timeout=120, max_connections=4)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]
    try:
        assert get(port) == 200
        assert closed_by_server(idle[0])  # the oldest idle one made room
    finally:
        for s in idle:
            s.close()


def test_raise_fd_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(256, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        raised = raise_fd_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == raised
        assert raised == hard if hard != resource.RLIM_INFINITY else raised > low
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_repeated_errors_are_logged_once_per_interval():
    now = [0.0]
    f = RateLimitFilter(interval=10, clock=lambda: now[0])

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, None)

    accept = "socket.accept() out of system resource\nsocket: <fd=3>"
    assert f.filter(record(accept))
    assert not any(f.filter(record(accept)) for _ in range(10_000))
    assert f.filter(record("another kind of error"))  # other messages are not held back
    now[0] = 10.5
    r = record(accept)
    assert f.filter(r) and "10000 more like this" in r.getMessage()


# --- the real server --------------------------------------------------------------------------------


KEY = "sekret"


def _low_fd_limit():
    """The child starts with a typical desktop default (1,024) that 2,500 sockets would exhaust."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-sec")
    key_file = root / "key"
    key_file.write_text(KEY + "\n")
    srv = ServerProcess(
        tiny_model(root / "tiny-sec"),
        root / "server.log",
        "--cache-gb",
        "0.02",
        "--api-key-file",
        str(key_file),
        "--docs",
        preexec_fn=_low_fd_limit,
    )
    srv.api_key = KEY
    yield srv
    srv.stop()


def test_real_server_host_and_origin(server):
    p = server.port
    h = server.headers
    for host in (f"localhost:{p}", f"127.0.0.1:{p}", f"[::1]:{p}"):
        r = httpx.get(server.base + "/v1/models", headers={**h, "Host": host})
        assert r.status_code == 200, (host, r.text)
    r = httpx.get(server.base + "/v1/models", headers={**h, "Host": f"evil.example:{p}"})
    assert r.status_code == 403  # the key does not help a rebound name
    body = {"model": "tiny-sec", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(
        server.base + "/v1/chat/completions",
        json=body,
        headers={**h, "Host": f"evil.example:{p}", "Origin": f"http://evil.example:{p}"},
    )
    assert r.status_code == 403
    r = httpx.post(
        server.base + "/v1/chat/completions", json=body, headers={**h, "Origin": "http://evil.example"}
    )
    assert r.status_code == 403
    r = httpx.post(server.base + "/v1/chat/completions", json=body, headers=h)
    assert r.status_code == 200


def test_real_server_only_health_without_the_key(server):
    assert httpx.get(server.base + "/health").status_code == 200
    for path in ("/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models", "/nope"):
        assert httpx.get(server.base + path).status_code == 401, path
    assert httpx.get(server.base + "/docs", headers=server.headers).status_code == 200
    assert server.metrics()["duet_kv_blocks_total"] > 0


def test_real_server_refuses_a_20mb_body_while_health_answers(server):
    """A 20 MB chat body (valid JSON, which used to be parsed and tokenized on the event loop)
    gets 413 fast, and /health keeps answering while it is sent and refused."""
    head = b'{"model": "tiny-sec", "max_tokens": 1, "messages": [{"role": "user", "content": "'
    tail = b'"}]}'
    total = 20 * MB
    probed = threading.Event()  # set after every answered /health probe
    done = threading.Event()

    def body(hold: bool):
        yield head
        sent, held = len(head), False
        while sent < total - len(tail):
            if hold and sent >= 2 * MB and not held:
                held = True
                probed.clear()  # mid-upload: wait for a /health answer from now on
                assert probed.wait(60)
            n = min(MB, total - len(tail) - sent)
            yield b"ab " * (n // 3) + b"a" * (n % 3)
            sent += n
        yield tail

    latencies: list[float] = []
    statuses: list[int] = []

    def probe():
        with httpx.Client(base_url=server.base, timeout=60) as c:
            while not done.is_set():
                t0 = time.perf_counter()
                statuses.append(c.get("/health").status_code)
                latencies.append(time.perf_counter() - t0)
                probed.set()
                done.wait(0.01)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        headers = {**server.headers, "content-type": "application/json"}
        for content in (body(hold=True), b"".join(body(hold=False))):  # chunked, then Content-Length
            t0 = time.perf_counter()
            r = httpx.post(
                server.base + "/v1/chat/completions", content=content, headers=headers, timeout=120
            )
            elapsed = time.perf_counter() - t0
            assert r.status_code == 413, (r.status_code, r.text[:200])
            assert elapsed < 20, elapsed  # it used to take 100 s (20 MB on the tiny model)
    finally:
        done.set()
        prober.join(60)
    assert statuses and set(statuses) == {200}
    assert max(latencies) < 5, max(latencies)  # /health used to stall as long
    assert httpx.get(server.base + "/health").status_code == 200


def test_real_server_survives_2500_idle_sockets(server):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2500 + 256
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"the hard file limit ({hard}) is below {need}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    idle = []
    try:
        for _ in range(2500):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=30))
        r = httpx.get(server.base + "/v1/models", headers=server.headers, timeout=30)
        assert r.status_code == 200
        r = httpx.post(
            server.base + "/v1/completions",
            json={"model": "tiny-sec", "prompt": "Hello", "max_tokens": 2},
            headers=server.headers,
            timeout=60,
        )
        assert r.status_code == 200
    finally:
        for s in idle:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    log = server.log_path.read_text(errors="replace")
    assert "Too many open files" not in log
    assert len(log) < 200_000  # no flood of tracebacks


# --- start-up errors of the real command ------------------------------------------------------------


def run_serve(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "DUET_API_KEY": "", **(env or {})},
    )


def test_port_taken_is_a_one_line_error_before_loading(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run_serve("--model", str(tiny_model(tmp_path / "tiny")), "--port", str(port))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("duet: error:") and "already in use" in lines[0], r.stderr
    assert "serving" not in r.stderr


def test_public_host_without_a_key_is_refused(tmp_path):
    r = run_serve("--model", str(tiny_model(tmp_path / "tiny")), "--host", "0.0.0.0", "--port", "0")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "without an API key" in lines[0] and "--insecure-no-key" in lines[0], r.stderr
