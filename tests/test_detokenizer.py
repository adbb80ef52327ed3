import json

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from mlx_engine.loading.resolve import bundled_model_path
from mlx_engine.tokenization.detokenizer import StreamingDetokenizer
from mlx_engine.tokenization.gguf_tokenizer import tokenizer_from_gguf
from mlx_engine.tokenization.tokenizer import Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello world, this is a test of the tokenizer. Hello again!",
    "def add(x, y):\n    return x + y  # sum\n\n\tprint(add(1, 2))",
    "你好世界，今天天气很好。我们去公园吧。",
    "café naïve résumé coöperate — “quotes” and ‘more’",
    "emoji 🎉😀👍 family 👩‍👩‍👧 flags 🇫🇷 skin 👋🏽",
    "    indented   spaces\n\n\nnewlines\r\n",
] * 20


def byte_level_bpe() -> Tokenizer:
    """GPT-2-style byte-level BPE, small enough that most non-ASCII characters take several tokens."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    hf.train_from_iterator(CORPUS, trainer)
    return Tokenizer(hf, eos_tokens=["<|im_end|>"])


def sentencepiece_bpe() -> Tokenizer:
    """Llama-style SentencePiece BPE: "▁" for spaces, a prepended "▁", <0xNN> byte fallback for
    characters outside the (deliberately small) alphabet, and the Strip decoder."""
    hf = HFTokenizer(models.BPE())
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=50),
    )
    model = json.loads(hf.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    sp = HFTokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    sp.normalizer = hf.normalizer
    sp.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    sp.add_special_tokens(["<unk>", "<s>", "</s>"])
    return Tokenizer(sp, bos_token="<s>", eos_tokens=["</s>"], add_bos_token=True)


def metaspace_unigram() -> Tokenizer:
    """T5 / ALBERT-style Unigram with the Metaspace pre-tokenizer and decoder (drops the first
    token's leading space)."""
    hf = HFTokenizer(models.Unigram())
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    hf.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    hf.train_from_iterator(
        CORPUS, trainers.UnigramTrainer(vocab_size=250, special_tokens=["<unk>", "</s>"], unk_token="<unk>")
    )
    return Tokenizer(hf, eos_tokens=["</s>"])


@pytest.fixture(scope="module")
def bundled() -> Tokenizer:
    _, metadata = mx.load(str(bundled_model_path()), return_metadata=True)
    return tokenizer_from_gguf(metadata)


TOKENIZERS = {
    "byte_level": byte_level_bpe(),
    "sentencepiece": sentencepiece_bpe(),
    "metaspace": metaspace_unigram(),
}


@pytest.fixture(params=["bundled", *TOKENIZERS])
def tok(request, bundled) -> Tokenizer:
    return bundled if request.param == "bundled" else TOKENIZERS[request.param]


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    d = StreamingDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    pieces = [d.add(i) for i in ids]
    pieces.append(d.flush())
    assert d.text == "".join(pieces)
    return pieces


TEXT_ALPHABET = st.one_of(
    st.sampled_from(list("abcdefxyz ABC  \n\t\r.,;:!?'\"()[]{}<>=+-*/#_\\")),
    st.sampled_from(list("你好世界天气我们公园吧日本語한국어")),
    st.sampled_from(["🎉", "😀", "👍", "👩‍👩‍👧", "🇫🇷", "👋🏽", "\u200d", "𝔘"]),
    st.sampled_from(["e\u0301", "\u0301", "ñ", "ö", "é", "—", "“", "’", "\u00a0", "\u3000"]),
    st.characters(codec="utf-8", exclude_categories=("Cs",)),
)
texts = st.lists(TEXT_ALPHABET, max_size=40).map("".join)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts)
def test_text_streams_exactly_and_promptly(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    d = StreamingDetokenizer(tok)
    for i, t in enumerate(ids):
        d.add(t)
        so_far = tok.decode(ids[: i + 1])
        assert "\ufffd" not in d.text or "\ufffd" in full  # never a half character mid-stream
        assert full.startswith(d.text)
        if not so_far.endswith("\ufffd"):
            assert d.text == so_far  # nothing held back once the text is complete
    d.flush()
    assert d.text == full


def byte_fallback_ids(tok: Tokenizer) -> dict[int, int]:
    """byte value -> id of its <0xNN> token, for SentencePiece byte-fallback vocabularies."""
    ids = {b: tok.backend.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    return {b: i for b, i in ids.items() if i is not None}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_random_token_sequences_concat_to_full_decode(tok, data, skip):
    byte_ids = byte_fallback_ids(tok)
    if not byte_ids:  # any ids at all, invalid UTF-8 included
        ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=30))
    else:
        # Byte-fallback runs come as whole UTF-8 characters: for an invalid run, HF's decoder turns
        # the *whole* run into U+FFFD, valid characters before the bad byte included, which no
        # streaming decoder can match (see test_invalid_byte_fallback_run).
        others = (
            st.integers(0, tok.vocab_size - 1).filter(lambda i: i not in byte_ids.values()).map(lambda i: [i])
        )
        chars = st.characters(codec="utf-8", exclude_categories=("Cs",))
        as_bytes = chars.map(lambda c: [byte_ids[b] for b in c.encode()])
        ids = sum(data.draw(st.lists(st.one_of(others, as_bytes), max_size=20)), [])
    assert "".join(stream(tok, ids, skip_special_tokens=skip)) == tok.decode(ids, skip_special_tokens=skip)


def test_invalid_byte_fallback_run():
    tok = TOKENIZERS["sentencepiece"]
    byte_ids = byte_fallback_ids(tok)
    ids = [byte_ids[b] for b in "界".encode()] + [byte_ids[0xF0], tok.backend.token_to_id("▁a")]
    assert tok.decode(ids) == "\ufffd" * 4 + " a"  # HF garbles the whole run
    assert "".join(stream(tok, ids)) == "界\ufffd a"  # we keep the complete character we already emitted


def test_split_multibyte_characters_are_held_back(tok):
    text = "a你好🎉👩‍👩‍👧é b"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    if tok is not TOKENIZERS["metaspace"]:  # that one has no byte fallback: unknown characters drop out
        assert tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_byte_level_splits_characters_across_tokens():
    tok = TOKENIZERS["byte_level"]
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # the small vocabulary really splits the emoji's bytes
    d = StreamingDetokenizer(tok)
    assert [d.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.add(ids[-1]) == "🎉"


def test_spacing_of_leading_space_pieces(tok):
    text = "Hello world  and  more words"
    ids = tok.encode(text, add_special_tokens=False)
    assert "".join(stream(tok, ids)) == tok.decode(ids)
    # a stream that starts mid-text keeps the spacing the full decode gives
    tail = ids[2:]
    assert "".join(stream(tok, tail)) == tok.decode(tail)


def test_special_tokens_skipped(tok):
    specials = sorted(tok.special_ids)
    assert specials
    body = tok.encode("Hi there, friend", add_special_tokens=False)
    ids = [specials[-1], *body[:2], specials[0], *body[2:], specials[-1]]
    skipped = "".join(stream(tok, ids))
    assert skipped == tok.decode(ids)
    assert not any(tok.piece(s) in skipped for s in specials)
    kept = "".join(stream(tok, ids, skip_special_tokens=False))
    assert kept == tok.decode(ids, skip_special_tokens=False)
    assert tok.piece(specials[0]) in kept


def test_chat_special_tokens_around_text(bundled):
    text = "<|im_start|>assistant\nSure, here it is: 42<|im_end|>\n"
    ids = bundled.encode(text, add_special_tokens=False)
    assert "".join(stream(bundled, ids)) == "assistant\nSure, here it is: 42\n"
    assert "".join(stream(bundled, ids, skip_special_tokens=False)) == text


def test_invalid_bytes_come_out_at_flush():
    tok = TOKENIZERS["byte_level"]
    lead = tok.backend.token_to_id("ä")  # byte 0xE4 in the ByteLevel alphabet: starts a 3-byte character
    d = StreamingDetokenizer(tok)
    assert d.add(lead) == ""
    assert d.flush() == "\ufffd" == tok.decode([lead])


def test_window_stays_small(tok):
    """O(1) per token: each decode call sees a few tokens, however long the text grows."""
    seen: list[int] = []

    class Counting(Tokenizer):
        def decode(self, ids, skip_special_tokens=True):
            seen.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    counting = Counting(tok.backend, eos_tokens=[])
    ids = tok.encode(" ".join(CORPUS[:30]), add_special_tokens=False)
    assert len(ids) > 300
    assert "".join(stream(counting, ids)) == tok.decode(ids)
    assert max(seen) <= 12
    assert len(seen) <= 2 * len(ids) + 2
