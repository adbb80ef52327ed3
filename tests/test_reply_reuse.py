"""Multi-turn prefix reuse that survives re-tokenization (``ReplyMemory`` + ``encode_chat``).

A chat client sends the model's last reply back as text. When that text does not re-tokenize to
the ids that were generated, the prefix cache used to stop matching at the reply; the engine now
keeps the generated ids next to their text and uses them again, and never changes what the
prompt says.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.loading.loader import load_model
from mlx_engine.request import GenerationRequest, SamplingParams
from mlx_engine.tokenization.reply_memory import ReplyMemory
from mlx_engine.tokenization.tokenizer import Tokenizer

BS = 16


@pytest.fixture(scope="module")
def loaded(tiny_dirs):
    return load_model(str(tiny_dirs("llama")))


@pytest.fixture(scope="module")
def tok(loaded) -> Tokenizer:
    return loaded.tokenizer


def odd_ids(tok: Tokenizer, text: str) -> list[int]:
    """A valid tokenization of ``text`` that a plain encode would not give: piece by piece."""
    ids: list[int] = []
    for i in range(0, len(text), 2):
        ids += tok.encode(text[i : i + 2], add_special_tokens=False, parse_special=False)
    return ids


def chat(reply: str) -> list[dict]:
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say something."},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And again?"},
    ]


replies = st.lists(
    st.sampled_from(
        list("abcdefgh ijk.,\n") + ["é", "ü", "Привет", "你好", "😀", "🎉", "<|im_", "end|>", "hello"]
    ),
    min_size=1,
    max_size=30,
).map("".join)


def reads_as_text(tok: Tokenizer, text: str) -> bool:
    """Whether ``encode_chat`` reads ``text`` as plain text (control-token text, or a piece of one at
    either end that could complete one next to the template's text): its ids are not spliced in."""
    controls = [tok.decode([i], False) for i in tok.special_ids]
    return any(
        c in text or any(text.endswith(c[:k]) or text.startswith(c[k:]) for k in range(1, len(c)))
        for c in controls
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reply=replies, cut=st.integers(min_value=0, max_value=3))
@example(reply="Привет<|im_", cut=1)  # 'Привет<|im': ends in a piece of <|im_end|>, read as text
@example(reply="hello", cut=0)
def test_id_substitution_never_changes_the_rendered_prompt(tok, reply, cut):
    # generated ids that end mid-word or inside a multi-byte character: drop a few trailing ids
    ids = odd_ids(tok, reply)
    ids = ids[: max(1, len(ids) - cut)]
    text = tok.decode(ids, False)
    memory = ReplyMemory()
    kept = memory.remember(text, ids, lambda x: tok.decode(x, False))
    messages = chat(text)
    plain = tok.encode_chat(messages)
    spliced = tok.encode_chat(messages, replies=memory.recall)
    rendered = tok.apply_chat_template(chat(text))
    assert tok.decode(spliced, False) == tok.decode(plain, False)
    assert tok.decode(spliced, False) == rendered
    if kept and not reads_as_text(tok, text):
        assert _contains(spliced, memory.recall(text) or [0]), "the generated ids were not used"


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_a_reply_with_a_broken_character_is_not_remembered(tok):
    ids = tok.encode("😀", add_special_tokens=False)
    memory = ReplyMemory()
    assert not memory.remember(tok.decode(ids[:1], False), ids[:1], lambda x: tok.decode(x, False))


def test_memory_is_per_cache_salt_and_bounded(tok):
    memory = ReplyMemory(max_entries=2)
    dec = lambda x: tok.decode(x, False)  # noqa: E731
    for text in ("one two", "three four", "five six"):
        assert memory.remember(text, tok.encode(text, add_special_tokens=False), dec, salt="a")
    assert memory.recall("one two", "a") is None  # evicted, least recently used
    assert memory.recall("five six", "a") is not None
    assert memory.recall("five six", "b") is None  # another tenant never sees it
    assert memory.recall("five six") is None


def unmerged_pieces(tok: Tokenizer) -> dict[int, float]:
    """A logit bias that lets the model write only the two characters of a two-letter token, each
    as a token of its own: its reply then holds them side by side ("h", "e"), which the tokenizer
    reads back as the one token ("he"), so the reply's text does not re-tokenize to its ids."""
    pieces = {tok.piece(i): i for i in range(tok.vocab_size)}
    pair = next(
        p
        for p in pieces
        if len(p) == 2 and p.isascii() and p.isalpha() and p[0] != p[1] and {*p} <= {*pieces}
    )
    keep = {pieces[pair[0]], pieces[pair[1]]}
    return {i: -100.0 for i in range(tok.vocab_size) if i not in keep}


def printable_only(tok: Tokenizer) -> dict[int, float]:
    """A logit bias that keeps a random model to whole printable ASCII pieces (no broken characters)
    and never ends a reply early (no end of sequence: a reply is as long as asked)."""
    ok = {i for i in range(tok.vocab_size) if (p := tok.piece(i)).isascii() and p.isprintable() and p.strip()}
    ok -= tok.eos_token_ids
    return {i: -100.0 for i in range(tok.vocab_size) if i not in ok}


def ask(engine: Engine, messages: list[dict], n: int) -> tuple[str, list[int], object]:
    async def go():
        bias = unmerged_pieces(engine.tokenizer)
        req = GenerationRequest(
            messages=messages, max_tokens=n, sampling=SamplingParams(temperature=0.0, logit_bias=bias)
        )
        text, ids, usage = [], [], None
        async for ev in engine.generate(req):
            text.append(ev.text)
            ids += ev.token_ids
            usage = ev.usage or usage
        return "".join(text), ids, usage

    return asyncio.run(go())


def second_turn_hit(loaded, remember: bool) -> tuple[int, int, int]:
    """(turn 1 prompt + reply tokens, turn 2 cached tokens, turn 2 prompt tokens)."""
    engine = Engine(loaded, EngineConfig(cache_gb=0.01, block_size=BS, kv_dtype="float32"))
    try:
        if not remember:
            engine.replies.max_entries = 0
        history = [{"role": "user", "content": "Tell me about the quick brown fox and the lazy dog."}]
        reply, ids, u1 = ask(engine, history, 40)
        assert reply and len(ids) == 40
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Bonjour à tous."}]
        _, _, u2 = ask(engine, history, 4)
        return u1.prompt_tokens + u1.completion_tokens, u2.cached_tokens, u2.prompt_tokens
    finally:
        engine.shutdown()


def test_the_second_turn_hits_the_cache_through_the_whole_first_reply(loaded, tok):
    total, cached, _ = second_turn_hit(loaded, remember=True)
    # all of turn 1's KV is a hit (the last generated token has none), to the token where its last,
    # part-full block holds at least a quarter block (PrefixIndex.min_tail)
    computed = total - 1
    full = computed // BS * BS
    assert cached == (computed if computed - full >= BS // 4 else full)
    # without the memory this reply does not round-trip, so the hit stops inside it
    total_plain, cached_plain, _ = second_turn_hit(loaded, remember=False)
    assert total_plain == total and cached_plain < cached


def test_a_chat_through_the_server_hits_the_cache_through_the_first_reply(loaded, tok):
    """The server tokenizes a chat once and hands the ids to the engine with the messages: the
    reply is remembered as for a chat sent to the engine directly, so the client's next turn (the
    reply sent back as text) hits the cache as far as ``second_turn_hit`` does."""
    import httpx

    from app.server.app import create_app

    total, cached, _ = second_turn_hit(loaded, remember=True)
    engine = Engine(loaded, EngineConfig(cache_gb=0.01, block_size=BS, kv_dtype="float32"))
    bias = {str(i): v for i, v in unmerged_pieces(tok).items()}

    async def go() -> tuple[int, int]:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:

            async def turn(messages: list[dict], n: int) -> dict:
                body = {
                    "model": engine.model_name,
                    "messages": messages,
                    "max_tokens": n,
                    "temperature": 0,
                    "logit_bias": bias,
                }
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()

            history = [{"role": "user", "content": "Tell me about the quick brown fox and the lazy dog."}]
            first = await turn(history, 40)
            reply, u1 = first["choices"][0]["message"]["content"], first["usage"]
            history += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "Bonjour à tous."},
            ]
            u2 = (await turn(history, 4))["usage"]
            return u1["prompt_tokens"] + u1["completion_tokens"], u2["prompt_tokens_details"]["cached_tokens"]

    try:
        assert asyncio.run(go()) == (total, cached)
    finally:
        engine.shutdown()
