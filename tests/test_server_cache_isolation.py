"""Prefix-cache isolation per API key (issue 11: ``cached_tokens`` tells one client whether
another's prompt began with a guessed prefix).

Several API keys (an ``--api-key-file`` of one key a line, comments and blank lines skipped), any of
them accepted and recorded in the ASGI scope by a short hash; ``--cache-isolation per-key`` makes
that key part of every request's cache salt, so two keys never share cached blocks, while
``shared`` (the default) lets them. In-process tests drive the app through httpx's ASGI transport
on a tiny model; one test runs a real `duet serve` with a multi-key file.
"""

from __future__ import annotations

import itertools

import httpx
import pytest

from app.cli import build_parser
from app.server.app import create_app
from app.server.main import api_key, api_keys, parse_key_file, security_policy
from app.server.security import (
    CACHE_SCOPE_STATE,
    KEY_ID_STATE,
    SecurityMiddleware,
    SecurityPolicy,
    effective_cache_salt,
    key_id,
)
from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.errors import ConfigError
from tests.test_server_harness import ServerProcess, tiny_model

pytestmark = pytest.mark.timeout(300)

KEY_A = "alice-key-0123456789"
KEY_B = "bob-key-9876543210"
KEY_C = "carol-key-not-in-the-file"
KEY_FILE = f"""# Duet API keys, one a line
{KEY_A}

   {KEY_B}
# {KEY_C} (revoked)
{KEY_A}
"""
_prompts = itertools.count()


def fresh_text() -> str:
    """A prompt of several full KV blocks that no earlier test has cached (a new first word)."""
    return f"Topic {next(_prompts)}: " + "The quick brown fox jumps over the lazy dog. " * 4


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


# --- the key file and the policy ------------------------------------------------------------------


def test_key_file_with_comments_and_blank_lines(tmp_path, monkeypatch):
    monkeypatch.delenv("DUET_API_KEY", raising=False)
    assert parse_key_file(KEY_FILE) == (KEY_A, KEY_B)  # stripped, comments skipped, repeats once
    f = tmp_path / "keys"
    f.write_text(KEY_FILE)
    args = serve_args("--api-key-file", str(f))
    assert api_keys(args) == (KEY_A, KEY_B) and api_key(args) == KEY_A
    policy = security_policy(args)
    assert policy.api_keys == (KEY_A, KEY_B)
    f.write_text("# no keys yet\n\n   \n")
    with pytest.raises(ConfigError, match="is empty"):
        api_keys(serve_args("--api-key-file", str(f)))


def test_any_listed_key_authenticates_and_is_named_by_a_hash():
    policy = SecurityPolicy.build(api_keys=[KEY_A, KEY_B])
    a, b = policy.authenticate(f"Bearer {KEY_A}"), policy.authenticate(f"bearer  {KEY_B}")
    assert a == key_id(KEY_A) and b == key_id(KEY_B) and a != b
    assert KEY_A not in a and len(a) == 16 and int(a, 16) >= 0  # a short hex name, not the key
    for header in (f"Bearer {KEY_C}", KEY_A, f"Basic {KEY_A}", "Bearer ", f"Bearer {KEY_A}x", ""):
        assert policy.authenticate(header) is None, header
    assert KEY_A not in repr(policy) and KEY_B not in repr(policy)  # a logged policy shows no key
    assert SecurityPolicy.build(api_key=KEY_A, api_keys=[KEY_B, KEY_A]).api_keys == (KEY_A, KEY_B)
    assert SecurityPolicy.build().authorized("") and not policy.authorized("")


def test_per_key_isolation_needs_a_key(monkeypatch):
    monkeypatch.delenv("DUET_API_KEY", raising=False)
    with pytest.raises(ValueError, match="per-key needs API keys"):
        SecurityPolicy.build(cache_isolation="per-key")
    with pytest.raises(ValueError, match="must be one of"):
        SecurityPolicy.build(api_key="k", cache_isolation="per-user")
    with pytest.raises(ConfigError, match="per-key needs API keys") as e:
        security_policy(serve_args("--cache-isolation", "per-key"))
    assert "\n" not in str(e.value)
    assert (
        security_policy(serve_args("--api-key", "k", "--cache-isolation", "per-key")).cache_isolation
        == "per-key"
    )
    assert security_policy(serve_args("--api-key", "k")).cache_isolation == "shared"
    with pytest.raises(SystemExit):
        serve_args("--cache-isolation", "nope")


class ScopeRecorder:
    """A bare ASGI app behind the middleware: keeps each request's ``scope["state"]``."""

    def __init__(self):
        self.states: list[dict] = []

    async def __call__(self, scope, receive, send):
        self.states.append(dict(scope.get("state") or {}))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


@pytest.mark.parametrize("isolation", ["shared", "per-key"])
async def test_the_middleware_records_which_key_authenticated(isolation):
    rec = ScopeRecorder()
    policy = SecurityPolicy.build(api_keys=[KEY_A, KEY_B], cache_isolation=isolation)
    transport = httpx.ASGITransport(app=SecurityMiddleware(rec, policy))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as c:
        assert (await c.get("/v1/models", headers=bearer(KEY_A))).status_code == 200
        assert (await c.get("/v1/models", headers=bearer(KEY_B))).status_code == 200
        assert (await c.get("/v1/models", headers=bearer(KEY_C))).status_code == 401
        assert (await c.get("/health")).status_code == 200
    a, b, health = rec.states
    assert a[KEY_ID_STATE] == key_id(KEY_A) and b[KEY_ID_STATE] == key_id(KEY_B)
    assert KEY_ID_STATE not in health
    assert all(KEY_A not in str(s) and KEY_B not in str(s) for s in rec.states)
    if isolation == "per-key":
        assert a[CACHE_SCOPE_STATE] == a[KEY_ID_STATE] and b[CACHE_SCOPE_STATE] == b[KEY_ID_STATE]
    else:
        assert CACHE_SCOPE_STATE not in a and CACHE_SCOPE_STATE not in b


def test_effective_salt_cannot_be_forged_across_keys():
    a = {"state": {CACHE_SCOPE_STATE: key_id(KEY_A)}}
    b = {"state": {CACHE_SCOPE_STATE: key_id(KEY_B)}}
    assert effective_cache_salt({}, None) is None and effective_cache_salt({}, "s") == "s"
    assert effective_cache_salt(a, None) == effective_cache_salt(a, "") != effective_cache_salt(a, "s")
    a_salts = {effective_cache_salt(a, s) for s in (None, "s", "x/y")}
    # whatever body salt a client of key B picks, it does not land in key A's cache
    crafted = [None, "", "s", key_id(KEY_A), *a_salts, *(x.partition("/")[2] for x in a_salts)]
    assert all(effective_cache_salt(b, x) not in a_salts for x in crafted)


# --- the app on a tiny model -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp("iso") / "tiny")
    e = Engine.load(str(path), config=EngineConfig(cache_gb=0.02, max_running=4, max_queue=8))
    yield e
    e.shutdown()


def body_for(route: str, text: str, salt: str | None = None) -> dict:
    if route == "/v1/chat/completions":
        body: dict = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    else:
        body = {"model": "tiny", "prompt": text, "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    return body


async def cached(c: httpx.AsyncClient, route: str, key: str, text: str, salt: str | None = None) -> int:
    r = await c.post(route, json=body_for(route, text, salt), headers=bearer(key))
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    hit = usage["prompt_tokens_details"]["cached_tokens"]
    assert hit in (0, usage["prompt_tokens"] - 1)  # nothing, or all but the last token (one text)
    return hit


def client_for(engine, isolation: str) -> httpx.AsyncClient:
    policy = SecurityPolicy.build(api_keys=[KEY_A, KEY_B], cache_isolation=isolation)
    transport = httpx.ASGITransport(app=create_app(engine, security=policy))
    return httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000", timeout=60)


ROUTES = ["/v1/completions", "/v1/chat/completions"]


@pytest.mark.parametrize("route", ROUTES)
async def test_per_key_isolation_hides_one_keys_prompts_from_another(engine, route):
    text = fresh_text()
    async with client_for(engine, "per-key") as c:
        assert await cached(c, route, KEY_A, text) == 0
        hit = await cached(c, route, KEY_A, text)
        assert hit > 0  # the same key shares its own prefix cache
        assert await cached(c, route, KEY_B, text) == 0  # another key learns nothing
        assert await cached(c, route, KEY_B, text) == hit  # ... and has a cache of its own
        assert await cached(c, route, KEY_A, text, salt="tab-2") == 0  # a body salt splits further
        assert await cached(c, route, KEY_A, text, salt="tab-2") == hit
        r = await c.post(route, json=body_for(route, text), headers=bearer(KEY_C))
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    engine.allocator.check_invariants()
    assert engine.allocator.num_used == 0


@pytest.mark.parametrize("route", ROUTES)
async def test_shared_cache_is_shared_across_keys(engine, route):
    text = fresh_text()
    async with client_for(engine, "shared") as c:
        assert await cached(c, route, KEY_A, text) == 0
        hit = await cached(c, route, KEY_A, text)
        assert hit > 0
        assert await cached(c, route, KEY_B, text) == hit  # the trade-off: B sees A's prefix
        assert await cached(c, route, KEY_B, text, salt="mine") == 0  # unless it salts its own
        r = await c.post(route, json=body_for(route, text), headers=bearer(KEY_C))
        assert r.status_code == 401


# --- the real command -------------------------------------------------------------------------------


def test_real_server_with_a_multi_key_file_isolates_per_key(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text(KEY_FILE)
    srv = ServerProcess(
        tiny_model(tmp_path / "tiny-iso"),
        tmp_path / "server.log",
        "--cache-gb",
        "0.02",
        "--api-key-file",
        str(key_file),
        "--cache-isolation",
        "per-key",
    )
    try:
        text = fresh_text()
        body = {"model": "tiny-iso", "prompt": text, "max_tokens": 1}

        def post(key: str) -> httpx.Response:
            return httpx.post(srv.base + "/v1/completions", json=body, headers=bearer(key), timeout=60)

        def hit(r: httpx.Response) -> int:
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert hit(post(KEY_A)) == 0
        assert hit(post(KEY_A)) > 0
        assert hit(post(KEY_B)) == 0
        assert post(KEY_C).status_code == 401
        assert httpx.get(srv.base + "/v1/models", headers=bearer(KEY_B), timeout=30).status_code == 200
    finally:
        srv.stop()
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert KEY_A not in log and KEY_B not in log
