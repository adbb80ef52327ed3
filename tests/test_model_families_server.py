"""Each family end to end through ``duet serve`` (issue 31): a tiny random-weight model wearing the
family's tokenizer and template is forced to call a tool (``tool_choice`` required / Anthropic's
``any``); the grammar writes the family's own syntax, the engine's parser reads it, and the call
reaches the official ``openai`` (chat, streamed and not; Responses) and ``anthropic`` clients with
valid JSON arguments and no markup in the text. A thinking budget closes the thinking section."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.loading.loader import load_model
from mlx_engine.request import GenerationRequest, SamplingParams
from tests.family_fixtures import FAMILIES
from tests.test_server_harness import ServerProcess
from tests.tiny_models import make_thinking_model_dir, make_tiny_model_dir

pytestmark = pytest.mark.slow

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Zürich"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
FN = {"name": "get_weather", "description": "The weather in a city", "parameters": PARAMS}
MSGS = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


def _check(name: str, arguments: str | dict) -> None:
    assert name == "get_weather"
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, PARAMS)


@pytest.mark.parametrize("f", [f for f in FAMILIES if f.calls], ids=lambda f: f.name)
def test_a_forced_call_reaches_every_api_in_the_family_syntax(f, tmp_path):
    import anthropic
    from openai import OpenAI

    model_dir = make_tiny_model_dir(tmp_path / "m", tokenizer=f.tokenizer(), context=4096)
    server = ServerProcess(model_dir, tmp_path / "serve.log", "--cache-gb", "0.05")
    try:
        o = OpenAI(base_url=server.base + "/v1", api_key="none", http_client=httpx.Client(timeout=120))
        model = o.models.list().data[0].id
        tools = [{"type": "function", "function": FN}]
        r = o.chat.completions.create(
            model=model, messages=MSGS, tools=tools, tool_choice="required", max_tokens=200, seed=1
        )
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and len(m.tool_calls) == 1, m
        assert not (m.content or "").strip()
        _check(m.tool_calls[0].function.name, m.tool_calls[0].function.arguments)

        name, arguments, text = "", "", ""
        for chunk in o.chat.completions.create(
            model=model,
            messages=MSGS,
            tools=tools,
            tool_choice="required",
            max_tokens=200,
            stream=True,
            seed=2,
        ):
            if not chunk.choices:
                continue
            d = chunk.choices[0].delta
            text += d.content or ""
            for tc in d.tool_calls or []:
                name += tc.function.name or ""
                arguments += tc.function.arguments or ""
        assert not text.strip()
        _check(name, arguments)

        a = anthropic.Anthropic(base_url=server.base, api_key="none", timeout=120)
        msg = a.messages.create(
            model=model,
            messages=MSGS,
            max_tokens=200,
            tools=[{"name": FN["name"], "description": FN["description"], "input_schema": PARAMS}],
            tool_choice={"type": "any"},
        )
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and len(uses) == 1, msg.content
        _check(uses[0].name, uses[0].input)

        resp = o.responses.create(
            model=model,
            input="Weather in Paris for 3 days?",
            tools=[{"type": "function", **FN}],
            tool_choice="required",
            max_output_tokens=200,
        )
        calls = [i for i in resp.output if i.type == "function_call"]
        assert len(calls) == 1, resp.output
        _check(calls[0].name, calls[0].arguments)

        if f.name == "qwen3":  # thinking off: the template writes an empty thinking section

            def prompt_tokens(**kw):
                r = o.chat.completions.create(model=model, messages=MSGS, max_tokens=1, **kw)
                return r.usage.prompt_tokens

            plain = prompt_tokens()
            off = prompt_tokens(reasoning_effort="none")
            assert off > plain
            assert prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}}) == off
    finally:
        server.stop()


THOUGHT = "Greeting: answer warmly with care and kindness"  # each token once
REPLY = f"<think>{THOUGHT}</think> Hello there friend."


@pytest.fixture(scope="module")
def thinker_dir(tmp_path_factory):
    return make_thinking_model_dir(tmp_path_factory.mktemp("thinker"), REPLY)


@pytest.fixture(scope="module")
def thinker(thinker_dir):
    e = Engine(load_model(str(thinker_dir)), EngineConfig(cache_gb=0.05))
    yield e
    e.shutdown()


def test_duet_generate_json_reports_reasoning_apart(thinker_dir, monkeypatch, capsys):
    import mlx_engine.blas
    from app import cli

    monkeypatch.setattr(mlx_engine.blas, "reexec_with_openblas", lambda: None)
    argv = ["generate", "--model", str(thinker_dir), "--prompt", "hi", "--temperature", "0"]
    assert cli.main([*argv, "--max-tokens", "40", "--json", "--cache-gb", "0.05"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["reasoning"] == THOUGHT and out["text"] == "Hello there friend." and out["tool_calls"] == []
    assert out["usage"]["reasoning_tokens"] > 0


@pytest.mark.parametrize("budget", [3, 6])
def test_a_thinking_budget_ends_thinking_within_budget_and_marker(thinker, budget):
    async def run():
        req = GenerationRequest(
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=40,
            sampling=SamplingParams(temperature=0),
            thinking_budget=budget,
        )
        return [ev async for ev in thinker.generate(req)]

    events = asyncio.run(run())
    reasoning = "".join(e.reasoning for e in events)
    usage = events[-1].usage
    marker = len(thinker.tokenizer.encode("</think>\n\n", add_special_tokens=False))
    assert usage is not None and usage.reasoning_tokens <= budget + marker
    assert THOUGHT.startswith(reasoning) and len(reasoning) < len(THOUGHT)  # cut short
    assert "</think>" not in "".join(e.text for e in events)

    # without a budget the whole thought comes through
    async def whole():
        req = GenerationRequest(
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=40,
            sampling=SamplingParams(temperature=0),
        )
        return [ev async for ev in thinker.generate(req)]

    assert "".join(e.reasoning for e in asyncio.run(whole())) == THOUGHT
