"""Build a tokenizer from a GGUF file's metadata.

A GGUF carries no tokenizer.json. It stores the vocabulary under llama.cpp's keys
(``tokenizer.ggml.*``): the tokens, their types, BPE merges or SentencePiece scores, the special token
ids, and the name of the pre-tokenizer its vocabulary was trained with (``tokenizer.ggml.pre``). We
rebuild the equivalent ``tokenizers.Tokenizer`` from those and wrap it in our ``Tokenizer``.

Supported vocabularies:
- ``gpt2``: byte-level BPE, with the split regex named by ``tokenizer.ggml.pre`` (see ``_BYTE_LEVEL_PRE``).
- ``llama``: SentencePiece BPE (Llama 1/2, Mistral v0.1-style): merges are recovered from the token
  scores, unknown characters fall back to ``<0xNN>`` byte tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from mlx_engine.loading.gguf_file import GGUFError
from mlx_engine.tokenization.tokenizer import Tokenizer

# llama.cpp token types (llama_token_type in llama.h)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_pre() -> pre_tokenizers.PreTokenizer:
    # StarCoder-style vocabularies (SmolLM, Refact): every digit is its own pre-token.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_pre()])


def _split_pre(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def make() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return make


# tokenizer.ggml.pre -> (pre-tokenizer factory, BPE ignore_merges, NFC normalizer)
_BYTE_LEVEL_PRE: dict[str, tuple[Callable[[], pre_tokenizers.PreTokenizer], bool, bool]] = {
    "default": (_gpt2_pre, False, False),
    "gpt-2": (_gpt2_pre, False, False),
    "gpt2": (_gpt2_pre, False, False),
    "smollm": (_digits_then_gpt2_pre, False, False),
    "starcoder": (_digits_then_gpt2_pre, False, False),
    "refact": (_digits_then_gpt2_pre, False, False),
    "llama3": (_split_pre(_LLAMA3_SPLIT), True, False),
    "llama-v3": (_split_pre(_LLAMA3_SPLIT), True, False),
    "llama-bpe": (_split_pre(_LLAMA3_SPLIT), True, False),
    "qwen2": (_split_pre(_QWEN2_SPLIT), False, True),
    "deepseek-r1-qwen": (_split_pre(_QWEN2_SPLIT), False, True),
}

SUPPORTED_VOCABS = ("gpt2 (byte-level BPE)", "llama (SentencePiece BPE)")

# Tokens that end a turn even when the file only names one EOS (llama.cpp treats them the same way).
_END_OF_TURN_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


def _py(value):
    """Metadata from ``mx.load`` holds numbers as mx.arrays; make everything plain Python."""
    return value.tolist() if isinstance(value, mx.array) else value


def _merge_pair(merge: str) -> tuple[str, str]:
    """A ``tokenizer.ggml.merges`` entry, "left right", as the pair BPE merges."""
    left, space, right = merge.partition(" ")
    if not space:
        raise GGUFError(f"tokenizer.ggml.merges entry {merge!r} is not two tokens separated by a space")
    return left, right


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> HFTokenizer:
    if pre not in _BYTE_LEVEL_PRE:
        raise GGUFError(
            f"unsupported byte-level BPE pre-tokenizer tokenizer.ggml.pre={pre!r}; "
            f"supported: {', '.join(sorted(_BYTE_LEVEL_PRE))}"
        )
    make_pre, ignore_merges, nfc = _BYTE_LEVEL_PRE[pre]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [_merge_pair(m) for m in merges]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    if nfc:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = make_pre()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE stores no merges: a piece is made from any two pieces that spell it, and
    pieces with higher scores merge first."""
    ids = {tok: i for i, tok in enumerate(tokens) if types[i] == NORMAL}
    found = []
    for tok, i in ids.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in ids and right in ids:
                found.append((-scores[i], ids[left], ids[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _sentencepiece_bpe(
    tokens: list[str], scores: list[float], types: list[int], unk_id: int | None, add_space_prefix: bool
) -> HFTokenizer:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    merges = _sentencepiece_merges(tokens, scores, types)
    backend = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True, fuse_unk=True)
    )
    # Like SentencePiece and llama.cpp: spaces become U+2581 and, unless the file says otherwise, every
    # run of text gets one prepended (also one that already starts with a space, or follows a special token).
    normalizer_steps: list[normalizers.Normalizer] = (
        [normalizers.Prepend("\u2581")] if add_space_prefix else []
    )
    backend.normalizer = normalizers.Sequence([*normalizer_steps, normalizers.Replace(" ", "\u2581")])
    decoder_steps: list[decoders.Decoder] = [
        decoders.Replace("\u2581", " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if add_space_prefix:
        decoder_steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(decoder_steps)
    return backend


def tokenizer_from_gguf(metadata: dict) -> Tokenizer:
    """Our ``Tokenizer`` from GGUF metadata (as returned by ``mx.load(path, return_metadata=True)``;
    plain Python values work too). Raises ``GGUFError`` for vocabularies we cannot rebuild."""

    def get(key: str, default=None):
        return _py(metadata.get(f"tokenizer.ggml.{key}", default))

    kind = get("model")
    tokens = get("tokens")
    if kind is None or not tokens:
        raise GGUFError("the GGUF metadata holds no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens)")
    tokens = list(tokens)
    types = list(get("token_type") or [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise GGUFError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")

    if kind == "gpt2":
        merges = get("merges")
        if not merges:
            raise GGUFError("byte-level BPE vocabulary without tokenizer.ggml.merges")
        backend = _byte_level_bpe(tokens, list(merges), get("pre") or "default")
        add_bos_default = False
    elif kind == "llama":
        scores = get("scores")
        if scores is None or len(scores) != len(tokens):
            raise GGUFError("SentencePiece vocabulary without one tokenizer.ggml.scores entry per token")
        scores = list(scores)
        if _py(metadata.get("general.architecture")) in ("gemma", "gemma2", "gemma3"):
            # Gemma files (as transformers reads them): runs of spaces are stored as spaces, not U+2581,
            # and the merge order is the token order, not the scores.
            tokens = ["\u2581" * len(t) if t and set(t) == {" "} else t for t in tokens]
            scores = [-float(i) for i in range(len(tokens))]
        backend = _sentencepiece_bpe(
            tokens, scores, types, get("unknown_token_id"), bool(get("add_space_prefix", True))
        )
        add_bos_default = True
    else:
        raise GGUFError(
            f"unsupported GGUF tokenizer model {kind!r}; supported: {', '.join(SUPPORTED_VOCABS)}"
        )

    # Control tokens (<|im_start|>, <s>, ...) are matched whole and are special; user-defined ones
    # (<think>, ...) are matched whole but are ordinary text.
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == USER_DEFINED
        ]
    )

    def token(key: str) -> str | None:
        i = get(f"{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    extra_eos = [get(f"{k}_token_id") for k in ("eot", "eom")]
    extra_eos += [
        i
        for i, (t, k) in enumerate(zip(tokens, types, strict=True))
        if k == CONTROL and t in _END_OF_TURN_TEXTS
    ]
    return Tokenizer(
        backend,
        bos_token=bos,
        eos_tokens=[eos] if eos else [],
        chat_template=_py(metadata.get("tokenizer.chat_template")),
        add_bos_token=bool(get("add_bos_token", add_bos_default)),
        extra_eos_ids=[i for i in extra_eos if i is not None],
    )
