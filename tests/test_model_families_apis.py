"""Each family's recorded reply (thinking, then two calls with nested JSON arguments) through the
three APIs (issue 31), streamed and not, with the official ``openai`` and ``anthropic`` clients:
reasoning, content and calls come back apart, the arguments valid JSON, no marker in the text.

The model is a tiny random-weight one wearing the family's tokenizer and template, made to write
the recorded reply token for token: its logits are replaced, after the real forward pass, by a
one-hot row of the reply's next token (``Scripted``), so everything after the model (sampling,
the detokenizer, the family's parser, the API adapters) runs as it does for a real model.
"""

from __future__ import annotations

import json

import httpx
import httpx2
import mlx.core as mx
import numpy as np
import pytest

from app.server.app import create_app
from mlx_engine.config import EngineConfig
from mlx_engine.engine import Engine
from tests.family_fixtures import FAMILIES, TOOLS, Family
from tests.tiny_models import make_tiny_model_dir

pytestmark = pytest.mark.slow

MSGS = [{"role": "user", "content": "Weather in Zürich tomorrow, and pizza near me?"}]


class Scripted:
    """Makes the engine's model write ``ids`` after each prompt: the position of a row's next token
    past the last prompt the engine prepared picks the script's token."""

    def __init__(self, engine: Engine, ids: list[int]):
        self.engine, self.ids = engine, ids
        self.prompt_len = 0
        core = engine.core
        self._forward, self._prepare = core.runner.forward, core.inputs.prepare
        core.runner.forward = self.forward
        core.inputs.prepare = self.prepare

    def prepare(self, request, ids=None):
        prepared = self._prepare(request, ids)
        self.prompt_len = len(prepared.ids)
        return prepared

    def forward(self, rows):
        logits = np.array(self._forward(rows).astype(mx.float32))
        for i, r in enumerate(rows):
            k = r.start + len(r.tokens) - self.prompt_len
            if 0 <= k < len(self.ids):
                logits[i, :] = -1e9
                logits[i, self.ids[k]] = 1e9
        return mx.array(logits)


@pytest.fixture(scope="module", params=[f for f in FAMILIES if f.calls], ids=lambda f: f.name)
def family(request, tmp_path_factory):
    f: Family = request.param
    path = make_tiny_model_dir(tmp_path_factory.mktemp(f.name), tokenizer=f.tokenizer(), context=4096)
    engine = Engine.load(str(path), config=EngineConfig(cache_gb=0.05, speculative="off", prefix_cache=False))
    tok = engine.tokenizer
    Scripted(engine, [*tok.encode(f.reply, add_special_tokens=False), sorted(tok.eos_token_ids)[0]])
    yield f, engine
    engine.shutdown()


def _openai(engine: Engine):
    import openai

    http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(engine, aliases=("m",))), base_url="http://127.0.0.1"
    )
    return openai.AsyncOpenAI(
        base_url="http://127.0.0.1/v1", api_key="none", http_client=http, max_retries=0
    ), http


def _calls(pairs) -> list[tuple[str, dict]]:
    return [(name, json.loads(args) if isinstance(args, str) else args) for name, args in pairs]


async def test_openai_chat_streamed_and_not(family):
    f, engine = family
    client, http = _openai(engine)
    try:
        r = await client.chat.completions.create(model="m", messages=MSGS, tools=TOOLS, max_tokens=400)
        m = r.choices[0].message
        assert (m.model_extra or {}).get("reasoning_content", "") == f.reasoning
        assert (m.content or "") == f.content
        assert _calls((c.function.name, c.function.arguments) for c in m.tool_calls or []) == f.calls
        assert r.choices[0].finish_reason == "tool_calls"
        if f.reasoning:
            assert r.usage.completion_tokens_details.reasoning_tokens > 0

        thought, text, calls = "", "", {}
        stream = await client.chat.completions.create(
            model="m", messages=MSGS, tools=TOOLS, max_tokens=400, stream=True
        )
        async for chunk in stream:
            if not chunk.choices:
                continue
            d = chunk.choices[0].delta
            thought += (d.model_extra or {}).get("reasoning_content") or ""
            text += d.content or ""
            for tc in d.tool_calls or []:
                name, args = calls.get(tc.index, ("", ""))
                calls[tc.index] = (name + (tc.function.name or ""), args + (tc.function.arguments or ""))
        assert (thought, text) == (f.reasoning, f.content)
        assert _calls(calls[k] for k in sorted(calls)) == f.calls
    finally:
        await http.aclose()


async def test_anthropic_messages_streamed_and_not(family):
    import anthropic

    f, engine = family
    http = httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=create_app(engine, aliases=("m",))), base_url="http://127.0.0.1"
    )
    client = anthropic.AsyncAnthropic(
        base_url="http://127.0.0.1", api_key="none", http_client=http, max_retries=0
    )
    tools = [
        {"name": t["function"]["name"], "description": "", "input_schema": t["function"]["parameters"]}
        for t in TOOLS
    ]
    try:
        msg = await client.messages.create(model="m", messages=MSGS, max_tokens=400, tools=tools)
        thinking = "".join(b.thinking for b in msg.content if b.type == "thinking")
        text = "".join(b.text for b in msg.content if b.type == "text")
        assert (thinking, text) == (f.reasoning, f.content)
        assert _calls((b.name, b.input) for b in msg.content if b.type == "tool_use") == f.calls
        assert msg.stop_reason == "tool_use"
        async with client.messages.stream(model="m", messages=MSGS, max_tokens=400, tools=tools) as s:
            async for _ in s:
                pass
            final = await s.get_final_message()
        assert _calls((b.name, b.input) for b in final.content if b.type == "tool_use") == f.calls
        assert "".join(b.thinking for b in final.content if b.type == "thinking") == f.reasoning
    finally:
        await http.aclose()


async def test_responses_streamed_and_not(family):
    f, engine = family
    client, http = _openai(engine)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    try:
        resp = await client.responses.create(model="m", input=MSGS, tools=tools, max_output_tokens=400)
        reasoning = "".join(c.text for i in resp.output if i.type == "reasoning" for c in i.content or [])
        assert reasoning == f.reasoning and resp.output_text == f.content
        assert _calls((i.name, i.arguments) for i in resp.output if i.type == "function_call") == f.calls
        deltas, done = "", None
        stream = await client.responses.create(
            model="m", input=MSGS, tools=tools, max_output_tokens=400, stream=True
        )
        async for ev in stream:
            if ev.type == "response.function_call_arguments.delta":
                deltas += ev.delta
            elif ev.type == "response.completed":
                done = ev.response
        assert done is not None
        assert _calls((i.name, i.arguments) for i in done.output if i.type == "function_call") == f.calls
        assert deltas == "".join(i.arguments for i in done.output if i.type == "function_call")
    finally:
        await http.aclose()
