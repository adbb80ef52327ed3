"""A thinking model's reply through the engine and the server: the thinking arrives apart from the
answer (GenerationEvent.reasoning; OpenAI chat's reasoning_content, streamed and not), counted in
usage as reasoning tokens, and no marker text reaches the answer. The model is a scripted tiny
llama (tests/tiny_models.py) whose tokenizer has ``<think>`` and ``</think>`` as whole tokens, as
Qwen3's and DeepSeek-R1's do; a raw completion keeps the text as generated."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.loading.loader import load_model
from mlx_engine.request import GenerationRequest, SamplingParams
from tests.tiny_models import make_thinking_model_dir

THOUGHT = "Greeting: answer warmly"  # each token once: the scripted model chains them
ANSWER = "Hello! Nice to see you."
REPLY = f"<think>{THOUGHT}</think> {ANSWER}"


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    return make_thinking_model_dir(tmp_path_factory.mktemp("thinker"), REPLY)


@pytest.fixture(scope="module")
def engine(thinker):
    e = Engine(load_model(str(thinker)), EngineConfig(cache_gb=0.05))
    yield e
    e.shutdown()


def generate(engine, **kw):
    async def run():
        events = [
            ev
            async for ev in engine.generate(GenerationRequest(sampling=SamplingParams(temperature=0), **kw))
        ]
        return events

    return asyncio.run(run())


def test_the_engine_gives_thinking_apart_from_the_answer(engine):
    events = generate(engine, messages=[{"role": "user", "content": "hi"}], max_tokens=64)
    assert "".join(e.reasoning for e in events) == THOUGHT
    assert "".join(e.text for e in events) == ANSWER
    usage = events[-1].usage
    assert usage is not None and 0 < usage.reasoning_tokens < usage.completion_tokens
    n_thought = len(engine.tokenizer.encode(THOUGHT, add_special_tokens=False))
    assert usage.reasoning_tokens == n_thought + 2  # the thought and its two markers


def test_split_reasoning_off_keeps_the_text_as_generated(engine):
    events = generate(
        engine, messages=[{"role": "user", "content": "hi"}], max_tokens=64, split_reasoning=False
    )
    assert "".join(e.text for e in events) == REPLY and not any(e.reasoning for e in events)


def test_openai_chat_returns_reasoning_content_streamed_and_not(thinker, tmp_path):
    from openai import OpenAI

    from tests.test_server_harness import ServerProcess

    server = ServerProcess(thinker, tmp_path / "serve.log", "--cache-gb", "0.05")
    try:
        client = OpenAI(base_url=server.base + "/v1", api_key="none", http_client=httpx.Client(timeout=120))
        msgs = [{"role": "user", "content": "hi"}]
        MODEL = client.models.list().data[0].id
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=64, temperature=0)
        m = r.choices[0].message
        assert m.content == ANSWER and m.model_extra["reasoning_content"] == THOUGHT
        assert r.usage.completion_tokens_details.reasoning_tokens > 0
        thought, answer = "", ""
        stream = client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=64, temperature=0, stream=True
        )
        for chunk in stream:
            if chunk.choices:
                d = chunk.choices[0].delta
                thought += (d.model_extra or {}).get("reasoning_content") or ""
                answer += d.content or ""
        assert (thought, answer) == (THOUGHT, ANSWER)
        raw = client.completions.create(
            model=MODEL,
            prompt="<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
            max_tokens=64,
            temperature=0,
        )
        assert raw.choices[0].text.startswith("<think>")  # a raw completion: the text as generated
    finally:
        server.stop()


def test_anthropic_and_responses_give_thinking_blocks_and_reasoning_items(thinker, tmp_path):
    import anthropic
    from openai import OpenAI

    from tests.test_server_harness import ServerProcess

    server = ServerProcess(thinker, tmp_path / "serve.log", "--cache-gb", "0.05")
    try:
        o = OpenAI(base_url=server.base + "/v1", api_key="none", http_client=httpx.Client(timeout=120))
        model = o.models.list().data[0].id
        a = anthropic.Anthropic(base_url=server.base, api_key="none", timeout=120)
        msgs = [{"role": "user", "content": "hi"}]
        r = a.messages.create(model=model, messages=msgs, max_tokens=64)
        kinds = [b.type for b in r.content]
        assert kinds == ["thinking", "text"], kinds
        assert r.content[0].thinking == THOUGHT and r.content[1].text == ANSWER
        with a.messages.stream(model=model, messages=msgs, max_tokens=64) as s:
            thought = "".join(
                e.delta.thinking
                for e in s
                if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
            )
            final = s.get_final_message()
        assert thought == THOUGHT and [b.type for b in final.content] == ["thinking", "text"]
        assert final.content[1].text == ANSWER

        resp = o.responses.create(model=model, input="hi", max_output_tokens=64, temperature=0)
        assert [i.type for i in resp.output] == ["reasoning", "message"]
        assert resp.output[0].content[0].text == THOUGHT and resp.output_text == ANSWER
        assert resp.usage.output_tokens_details.reasoning_tokens > 0
        deltas, done = "", None
        for ev in o.responses.create(
            model=model, input="hi", max_output_tokens=64, temperature=0, stream=True
        ):
            if ev.type == "response.reasoning_text.delta":
                deltas += ev.delta
            elif ev.type == "response.completed":
                done = ev.response
        assert deltas == THOUGHT and done is not None and done.output_text == ANSWER
        assert [i.type for i in done.output] == ["reasoning", "message"]
    finally:
        server.stop()
