"""Fuzz the running server's request bodies: zero 5xx, and every 4xx is an OpenAI error object.

Bodies come from the app's own OpenAPI schema (schemathesis): positive ones, valid as far as
the schema can say (they reach the model, the grammar compiler and the tool plumbing with odd
values), and negative ones that break it; plus arbitrary JSON and bytes, and valid bodies with
one field replaced by arbitrary JSON. Completion lengths are capped so that a run stays short.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import openapi
from schemathesis.generation import GenerationMode

from tests.test_server_harness import ServerProcess, tiny_model

MODEL = "tiny-fuzz"
ERROR_KEYS = {"message", "type", "param", "code"}
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
FUZZ = settings(
    max_examples=60,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-fuzz")
    # --docs: the schema comes from the server's /openapi.json (off by default)
    srv = ServerProcess(tiny_model(root / MODEL), root / "server.log", "--cache-gb", "0.02", "--docs")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base, timeout=120) as c:
        yield c


def _bounded(body: dict) -> dict:
    """Keep generation short: at most 6 new tokens per choice, the served model's name mostly."""
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and body[key] > 6:
            body[key] = 6
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 4
    return body


def check(http: httpx.Client, path: str, body) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with http.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
        text = r.read().decode("utf-8", "replace")
    assert r.status_code < 500, (body, r.status_code, text)
    if r.status_code >= 400:
        assert set(json.loads(text)["error"]) == ERROR_KEYS, text
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [x[6:] for x in text.split("\n\n") if x.startswith("data: ")]
        assert events[-1] == "[DONE]", text[-500:]
        for e in events[:-1]:
            assert "error" not in json.loads(e), e
    else:
        assert json.loads(text)["choices"], text


@pytest.fixture(scope="module")
def spec(server):
    return httpx.get(server.base + "/openapi.json").json()


def test_openapi_lists_the_endpoints(server):
    paths = httpx.get(server.base + "/openapi.json").json()["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(paths)


def _bodies(spec: dict, path: str, mode: GenerationMode):
    """Positive bodies name the served model (the 404 path is the negative ones' job)."""
    op = openapi.from_dict(spec)[path]["POST"]

    def fix(case):
        body = case.body
        if not isinstance(body, dict):
            return body
        return _bounded({**body, "model": MODEL} if mode == GenerationMode.POSITIVE else dict(body))

    return op.as_strategy(generation_mode=mode).map(fix)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_fuzz_schema_bodies(http, spec, path, mode):
    @FUZZ
    @given(_bodies(spec, path, mode))
    def run(body):
        check(http, path, body)

    run()


def test_fuzz_broken_bodies(http, spec):
    base = {
        "/v1/chat/completions": {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
        },
        "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 3},
    }
    comps = spec["components"]["schemas"]
    fields = {
        p: sorted(comps[n]["properties"])
        for p, n in (
            ("/v1/chat/completions", "ChatCompletionRequest"),
            ("/v1/completions", "CompletionRequest"),
        )
    }

    @st.composite
    def broken(draw):
        path = draw(st.sampled_from(sorted(base)))
        kind = draw(st.sampled_from(["any-json", "one-field", "bytes"]))
        if kind == "any-json":
            return path, draw(JSON)
        if kind == "bytes":
            return path, draw(st.binary(max_size=40))
        body = dict(base[path])
        body[draw(st.sampled_from(fields[path]) | st.text(max_size=8))] = draw(JSON)
        return path, _bounded(body)

    @FUZZ
    @given(broken())
    def run(case):
        check(http, *case)

    run()
