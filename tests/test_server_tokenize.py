"""llama.cpp's /tokenize, /detokenize and /apply-template (app/server/tokenize.py) on the bundled
SmolLM2 GGUF, in process: the round trip, pieces (a split character as its bytes), BOS where the
model wants one, the template's prompt being the very prompt the chat endpoint uses, 400s for
bad ids and types, 404 for an unknown model, the API key, and the default-model rule."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from app.server.app import create_app, server_state
from app.server.registry import ModelRegistry, ServedModel
from app.server.tokenize import _byte_decoder, default_model
from mlx_engine.config import EngineConfig
from mlx_engine.engine import Engine
from mlx_engine.loading.resolve import bundled_model_path
from mlx_engine.request import GenerationRequest

USER = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


CONFIG = EngineConfig(cache_gb=0.05)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    e = Engine.load(str(bundled_model_path()), config=CONFIG)
    yield e
    e.shutdown()


def http(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=120)


async def test_tokenize_detokenize_round_trip(engine):
    text = "Hello, world! héllo 😀 <|im_start|>"
    async with http(create_app(engine)) as c:
        r = await c.post("/tokenize", json={"content": text})
        assert r.status_code == 200, r.text
        ids = r.json()["tokens"]
        assert ids == engine.tokenizer.encode(text, add_special_tokens=False)
        assert engine.tokenizer.added_id("<|im_start|>") in ids  # parse_special is on by default
        r = await c.post("/detokenize", json={"tokens": ids})
        assert r.status_code == 200 and r.json() == {"content": text}
        # the trailing-slash spelling answers too, and the body's model may name it
        r = await c.post("/tokenize/", json={"content": text, "model": engine.model_name})
        assert r.json()["tokens"] == ids


async def test_parse_special_off_reads_control_text_as_text(engine):
    async with http(create_app(engine)) as c:
        r = await c.post("/tokenize", json={"content": "<|im_start|>", "parse_special": False})
        ids = r.json()["tokens"]
    assert engine.tokenizer.added_id("<|im_start|>") not in ids and len(ids) > 1


async def test_with_pieces_gives_each_tokens_text_or_its_bytes(engine):
    text = "hello 😀 world"
    async with http(create_app(engine)) as c:
        r = await c.post("/tokenize", json={"content": text, "with_pieces": True})
    tokens = r.json()["tokens"]
    assert [t["id"] for t in tokens] == engine.tokenizer.encode(text, add_special_tokens=False)
    pieces = [t["piece"] for t in tokens]
    # the emoji is split over two byte-level tokens: neither half is UTF-8 on its own
    assert pieces[0] == "hello" and pieces[-1] == " world"
    split = [p for p in pieces if isinstance(p, list)]
    assert split and all(isinstance(b, int) and 0 <= b < 256 for p in split for b in p)
    raw = b"".join(p.encode() if isinstance(p, str) else bytes(p) for p in pieces)
    assert raw.decode() == text


async def test_add_special_adds_bos_only_where_the_model_wants_one(engine, monkeypatch):
    tok = engine.tokenizer
    async with http(create_app(engine)) as c:
        plain = (await c.post("/tokenize", json={"content": "hi"})).json()["tokens"]
        assert not tok.add_bos_token  # SmolLM2's GGUF asks for no BOS
        same = (await c.post("/tokenize", json={"content": "hi", "add_special": True})).json()["tokens"]
        assert same == plain
        monkeypatch.setattr(tok, "add_bos_token", True)
        with_bos = (await c.post("/tokenize", json={"content": "hi", "add_special": True})).json()["tokens"]
    assert tok.bos_token_id is not None and with_bos == [tok.bos_token_id, *plain]


@pytest.mark.parametrize("tools", [None, [WEATHER]])
async def test_apply_template_is_the_prompt_the_chat_endpoint_uses(engine, tools):
    extra = {"tools": tools} if tools else {}
    async with http(create_app(engine)) as c:
        r = await c.post("/apply-template", json={"messages": USER, **extra})
        assert r.status_code == 200, r.text
        prompt = r.json()["prompt"]
        assert prompt.endswith("<|im_start|>assistant\n") and USER[0]["content"] in prompt
        if tools:  # the template knows no tools: the server's tools prompt is in it
            assert "get_weather" in prompt
        ids = (await c.post("/tokenize", json={"content": prompt, "add_special": True})).json()["tokens"]
        chat = await c.post(
            "/v1/chat/completions",
            json={"model": engine.model_name, "messages": USER, "max_tokens": 1, **extra},
        )
        assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(ids)
    if not tools:
        assert ids == engine.prepare_prompt(GenerationRequest(messages=USER, max_tokens=1))


async def test_bad_input_is_a_400_in_the_openai_shape(engine):
    vocab = engine.tokenizer.vocab_size
    async with http(create_app(engine)) as c:
        r = await c.post("/detokenize", json={"tokens": [1, vocab]})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "tokens[1]" and str(vocab) in err["message"]
        assert err["type"] == "invalid_request_error"
        assert (await c.post("/detokenize", json={"tokens": [-1]})).status_code == 400
        for path, body in [
            ("/detokenize", {"tokens": ["a"]}),
            ("/detokenize", {"tokens": 5}),
            ("/tokenize", {"content": 5}),
            ("/tokenize", {"content": "x", "add_special": "yes"}),
            ("/tokenize", {}),
            ("/apply-template", {"messages": "hi"}),
            ("/apply-template", {"messages": []}),
        ]:
            r = await c.post(path, json=body)
            assert r.status_code == 400, (path, body, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}


async def test_an_unknown_model_is_a_404(engine):
    async with http(create_app(engine)) as c:
        for path, body in [
            ("/tokenize", {"content": "x"}),
            ("/detokenize", {"tokens": [1]}),
            ("/apply-template", {"messages": USER}),
        ]:
            r = await c.post(path, json={**body, "model": "nope"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_the_routes_need_the_api_key(engine):
    async with http(create_app(engine, api_key="sekrit")) as c:
        assert (await c.post("/tokenize", json={"content": "x"})).status_code == 401
        r = await c.post("/tokenize", json={"content": "x"}, headers={"authorization": "Bearer sekrit"})
        assert r.status_code == 200


async def test_no_model_named_means_the_first_loaded_else_the_first_available():
    loads: list[str] = []

    def load(model: ServedModel):
        loads.append(model.name)
        return server_state(Engine.load(str(bundled_model_path()), config=CONFIG), model.ids)

    reg = ModelRegistry([ServedModel("first", None), ServedModel("second", None)], load)
    assert default_model(reg) == "first"
    try:
        async with http(create_app(registry=reg)) as c:
            r = await c.post("/tokenize", json={"content": "hi", "model": "second"})
            assert r.status_code == 200 and loads == ["second"]
            assert default_model(reg) == "second"  # loaded now: requests naming no model go to it
            r = await c.post("/tokenize", json={"content": "hi"})
            assert r.status_code == 200 and loads == ["second"]
    finally:
        reg.shutdown()  # the engine, and the registry's reaper
    assert default_model(ModelRegistry([], load)) is None


def test_the_byte_level_alphabet_covers_every_byte():
    table = _byte_decoder()
    assert sorted(table.values()) == list(range(256)) and table["Ġ"] == ord(" ")
