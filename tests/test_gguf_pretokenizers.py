"""The byte-level BPE pre-tokenizers a GGUF names in ``tokenizer.ggml.pre``, built from small
vocabularies made here (no real tokenizer.json can be downloaded in this sandbox, and none is faked).

Two oracles: hand-written splits where the pre type's rules decide (digits one by one or up to three,
contractions, letter case, newlines, punctuation runs), written from llama.cpp's regex comments and the
models' tokenizer.json regexes; and, for every name in the table, Python's ``regex`` module applying the
same regexes in turn the way llama.cpp does (every piece kept, matched or not), over llama.cpp's own
pre-tokenizer check text (convert_hf_to_gguf.py's ``chktxt``) and other strings."""

from __future__ import annotations

import pytest
import regex

from mlx_engine.loading.gguf_file import GGUFError
from mlx_engine.tokenization.gguf_pretokenizers import BYTE_LEVEL_PRE
from mlx_engine.tokenization.gguf_tokenizer import tokenizer_from_gguf


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what ByteLevel writes), rebuilt independently."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


BYTE_CHAR = _bytes_to_unicode()
CHAR_BYTE = {c: b for b, c in BYTE_CHAR.items()}


def as_bytes(text: str) -> str:
    """``text`` in byte-level characters (how a GGUF stores byte-level tokens and merges)."""
    return "".join(BYTE_CHAR[b] for b in text.encode())


def byte_level_metadata(pre: str, merges: list[tuple[str, str]] = (), extra: list[str] = (), **more) -> dict:
    """A byte-level vocabulary: the 256 bytes, each merge's result, ``extra`` tokens (normal, with
    no merge that makes them) and the control tokens <|endoftext|>, <s>, </s>."""
    merges = list(merges) or [("a", "b")]  # BPE needs at least one merge
    tokens = [BYTE_CHAR[b] for b in range(256)]
    for left, right in merges:
        tokens.append(as_bytes(left + right))
    tokens += [as_bytes(t) for t in extra]
    specials = ["<|endoftext|>", "<s>", "</s>"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens + specials,
        "tokenizer.ggml.token_type": [1] * len(tokens) + [3] * len(specials),
        "tokenizer.ggml.merges": [f"{as_bytes(a)} {as_bytes(b)}" for a, b in merges],
        "tokenizer.ggml.bos_token_id": len(tokens) + 1,
        "tokenizer.ggml.eos_token_id": len(tokens) + 2,
        **more,
    }


def pieces(pre: str, text: str) -> list[str]:
    """The words ``tokenizer.ggml.pre = pre`` cuts ``text`` into, as text."""
    backend = tokenizer_from_gguf(byte_level_metadata(pre)).backend
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    out = backend.pre_tokenizer.pre_tokenize_str(text)
    return [bytes(CHAR_BYTE[c] for c in piece).decode() for piece, _ in out]


def oracle(regexes: tuple[str, ...], text: str) -> list[str]:
    """llama.cpp's cut with the ``regex`` module: each regex, in turn, splits every piece at the start
    and end of each of its matches (an empty match splits at its position)."""
    words = [text]
    for pattern in regexes:
        compiled = regex.compile(pattern, regex.MULTILINE)
        nxt = []
        for word in words:
            cuts = {0, len(word)}
            for m in compiled.finditer(word):
                cuts |= {m.start(), m.end()}
            ordered = sorted(cuts)
            nxt += [word[a:b] for a, b in zip(ordered, ordered[1:], strict=False) if b > a]
        words = nxt
    return words


# --- hand-written splits: what each pre type's rules say ---------------------------------------------

CASES = {
    # digits: runs of at most three (llama3, dbrx, glm4, gpt-4o, deepseek-v3), one by one (qwen2, tekken,
    # the starcoder family, deepseek-coder), whole runs (gpt-2, deepseek-llm), threes from the right
    # (superbpe)
    ("llama3", "12345"): ["123", "45"],
    ("llama-bpe", " 2024!"): [" ", "202", "4", "!"],
    ("dbrx", "1234567"): ["123", "456", "7"],
    ("glm4", "12345"): ["123", "45"],
    ("gpt-4o", "x=12345"): ["x", "=", "123", "45"],
    ("deepseek-v3", "12345"): ["123", "45"],
    ("qwen2", "12345"): ["1", "2", "3", "4", "5"],
    ("deepseek-r1-qwen", "v1.25"): ["v", "1", ".", "2", "5"],
    ("tekken", "12345"): ["1", "2", "3", "4", "5"],
    ("smollm", "x=1000"): ["x", "=", "1", "0", "0", "0"],
    ("refact", " 42 apples"): [" ", "4", "2", " apples"],  # Granite 3
    ("command-r", "route66"): ["route", "6", "6"],
    ("deepseek-coder", "abc123"): ["abc", "1", "2", "3"],
    ("gpt-2", "12345 6"): ["12345", " 6"],
    ("olmo", " 2024"): [" 2024"],
    ("deepseek-llm", "abc 123"): ["abc", " ", "123"],
    ("superbpe", "x 1234567"): ["x ", "1", "234", "567"],
    # contractions: lowercase only and split off (gpt-2), any case (llama3, qwen2), glued to the word
    # before (gpt-4o), none at all (tekken: the apostrophe starts a word)
    ("gpt-2", "I'M don't"): ["I", "'", "M", " don", "'t"],
    ("llama3", "I'M don't"): ["I", "'M", " don", "'t"],
    ("qwen2", "WE'LL"): ["WE", "'LL"],
    ("gpt-4o", "I'M don't"): ["I'M", " don't"],
    ("tekken", "I'M don't"): ["I", "'M", " don", "'t"],
    # letter case: o200k and tekken cut where lowercase turns to uppercase; llama3 does not
    ("gpt-4o", "HelloWorld XMLHttp"): ["Hello", "World", " XMLHttp"],
    ("tekken", "camelCase"): ["camel", "Case"],
    ("llama3", "camelCase"): ["camelCase"],
    # punctuation runs and "/": o200k and tekken keep slashes after a punctuation run
    ("gpt-4o", "a?//b"): ["a", "?//", "b"],
    ("llama3", "a?//b"): ["a", "?//", "b"],
    ("gpt-4o", "x:/\n"): ["x", ":/\n"],
    ("tekken", "x ://y"): ["x", " ://", "y"],
    ("llama3", "x!!\n\ny"): ["x", "!!\n\n", "y"],
    ("gpt-2", "x!!\n\ny"): ["x", "!!", "\n", "\n", "y"],  # "\\n" before a letter stands alone
    # whitespace: the last space of a run starts the next word; newlines keep the spaces before them
    ("llama3", "a   b"): ["a", "  ", " b"],
    ("qwen2", "a  \n b"): ["a", "  \n", " b"],
    ("gpt-2", "a  \n b"): ["a", "  \n", " b"],
    ("deepseek-coder", "a\r\nb"): ["a", "\r", "\n", "b"],
    # CJK: DeepSeek's vocabularies cut CJK runs off, the others treat them as letters
    ("deepseek-llm", "我想在apple工作"): ["我想在", "apple", "工作"],
    ("deepseek-v3", "東京tokyo"): ["東京", "tokyo"],
    ("qwen2", "我想在apple工作"): ["我想在apple工作"],
    # the default (a file without tokenizer.ggml.pre): punctuation runs first, then GPT-2's words
    ("default", "a+b=1234"): ["a", "+", "b", "=", "123", "4"],
}


@pytest.mark.parametrize(("pre", "text"), list(CASES), ids=[f"{p}:{t!r}" for p, t in CASES])
def test_hand_written_splits(pre, text):
    assert pieces(pre, text) == CASES[(pre, text)]


# --- every name against the regex module -------------------------------------------------------------

# convert_hf_to_gguf.py's chktxt (the text whose tokenization picks tokenizer.ggml.pre), and more
CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ "
    "🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
    "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
TEXTS = [
    CHKTXT,
    "def f(x):\n    return x**2  # square\r\n",
    "HTTPServer getHTTPResponseCode iPhone McDonald's ÉCOLE école",
    "Grüße, 東京タワー 1,234,567.89 usd/eur 100%",
    "trailing spaces   \nand tabs\t\t\n\n\n",
    "a/b//c ?// ://x",
]


@pytest.mark.parametrize("pre", sorted(BYTE_LEVEL_PRE))
def test_every_pre_name_splits_as_its_regexes(pre):
    spec = BYTE_LEVEL_PRE[pre]
    for text in TEXTS:
        got = pieces(pre, text)
        assert "".join(got) == text  # nothing lost or added
        assert got == oracle(spec.regexes, text), text


# --- ids: the split decides what BPE can merge -------------------------------------------------------

DIGIT_MERGES = [("1", "2"), ("12", "3"), ("4", "5"), ("123", "45")]


@pytest.mark.parametrize(
    ("pre", "expected"),
    [("gpt-2", ["12345"]), ("llama3", ["123", "45"]), ("gpt-4o", ["123", "45"]), ("qwen2", list("12345"))],
)
def test_digit_split_decides_the_ids(pre, expected):
    md = byte_level_metadata(pre, DIGIT_MERGES)
    tok = tokenizer_from_gguf(md)
    ids = tok.encode("12345", add_special_tokens=False)
    assert [md["tokenizer.ggml.tokens"][i] for i in ids] == [as_bytes(p) for p in expected]
    assert tok.decode(ids) == "12345"


@pytest.mark.parametrize(
    ("pre", "whole"), [("llama3", True), ("tekken", True), ("dbrx", False), ("glm4", False)]
)
def test_ignore_merges(pre, whole):
    """llama.cpp's ignore_merges (Llama 3, tekken): a word that is a token is that token, even when no
    merge leads to it; dbrx and glm4 share Llama 3's regex but not the flag."""
    md = byte_level_metadata(pre, [("h", "e")], extra=["hello"])
    ids = tokenizer_from_gguf(md).encode("hello", add_special_tokens=False)
    tokens = [md["tokenizer.ggml.tokens"][i] for i in ids]
    assert tokens == (["hello"] if whole else ["he", "l", "l", "o"])


def test_add_bos_defaults_follow_the_pre_type():
    # llama.cpp adds BOS for the Llama 3 and tekken pre types unless the file says otherwise
    assert tokenizer_from_gguf(byte_level_metadata("llama-bpe")).add_bos_token
    assert tokenizer_from_gguf(byte_level_metadata("tekken")).add_bos_token
    assert not tokenizer_from_gguf(byte_level_metadata("gpt-4o")).add_bos_token
    assert not tokenizer_from_gguf(byte_level_metadata("qwen2")).add_bos_token
    off = byte_level_metadata("tekken", **{"tokenizer.ggml.add_bos_token": False})
    assert not tokenizer_from_gguf(off).add_bos_token
    tok = tokenizer_from_gguf(byte_level_metadata("tekken"))
    assert tok.encode("hi")[0] == tok.bos_token_id and tok.bos_token == "<s>"


def test_qwen_vocabularies_normalize_to_nfc():
    # "é" written as e + U+0301 is one character after NFC, as Qwen's tokenizer.json normalizes
    assert pieces("qwen2", "cafe\u0301") == ["café"]
    assert pieces("tekken", "cafe\u0301") == ["cafe\u0301"]  # \p{M} glued to the letters before it


def test_unknown_pre_names_list_the_supported_ones():
    with pytest.raises(GGUFError, match=r"tokenizer.ggml.pre='kimi-k2'; supported: .*gpt-4o.*tekken"):
        tokenizer_from_gguf(byte_level_metadata("kimi-k2"))
