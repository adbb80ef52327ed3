"""Fuzz one POST route of an in-process app (no tests here; the route tests call ``fuzz_route``).

As ``test_server_fuzz.py`` does for the chat and completions routes: bodies from the app's own
OpenAPI schema (schemathesis), valid ones naming the served model and invalid ones, plus
arbitrary JSON, bytes and valid bodies with one field replaced by arbitrary JSON. Zero 5xx, and
``check(status, content_type, text)`` judges each answer.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st
from schemathesis import openapi
from schemathesis.generation import GenerationMode

from tests.test_server_fuzz import FUZZ, JSON

Check = Callable[[int, str, str], None]


def sse_data(text: str) -> list[dict]:
    """The JSON payloads of an SSE stream's events."""
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ")]


def fuzz_route(app, path: str, model: str, base: dict, bound: Callable[[dict], dict], check: Check) -> None:
    """``base``: a valid body; ``bound``: keeps a body's generation short."""
    spec = app.openapi()
    op = openapi.from_dict(spec)[path]["POST"]
    schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    fields = sorted(spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]["properties"])

    def fix(mode: GenerationMode):
        def apply(case):
            body = case.body
            if not isinstance(body, dict):
                return body
            return bound({**body, "model": model} if mode == GenerationMode.POSITIVE else dict(body))

        return apply

    @st.composite
    def broken(draw):
        kind = draw(st.sampled_from(["any-json", "one-field", "bytes"]))
        if kind == "any-json":
            return draw(JSON)
        if kind == "bytes":
            return draw(st.binary(max_size=40))
        body = dict(base)
        body[draw(st.sampled_from(fields) | st.text(max_size=8))] = draw(JSON)
        return bound(body)

    bodies = (
        op.as_strategy(generation_mode=GenerationMode.POSITIVE).map(fix(GenerationMode.POSITIVE))
        | op.as_strategy(generation_mode=GenerationMode.NEGATIVE).map(fix(GenerationMode.NEGATIVE))
        | broken()
    )
    with TestClient(app, raise_server_exceptions=True) as client:

        @FUZZ
        @given(bodies)
        def run(body):
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = client.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code < 500, (body, r.status_code, r.text)
            check(r.status_code, r.headers.get("content-type", ""), r.text)

        run()
