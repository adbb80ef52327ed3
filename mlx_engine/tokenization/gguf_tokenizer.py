"""Build a tokenizer from a GGUF file's metadata.

A GGUF carries no tokenizer.json. It stores the vocabulary under llama.cpp's keys
(``tokenizer.ggml.*``): the tokens, their types, BPE merges or SentencePiece scores, the special token
ids, and the name of the pre-tokenizer its vocabulary was trained with (``tokenizer.ggml.pre``). We
rebuild the equivalent ``tokenizers.Tokenizer`` from those and wrap it in our ``Tokenizer``.

Supported vocabularies:
- ``gpt2``: byte-level BPE, with the split regexes named by ``tokenizer.ggml.pre`` (the table is
  ``gguf_pretokenizers.BYTE_LEVEL_PRE``: Llama 3, Qwen 2/3, tekken, o200k, DeepSeek, StarCoder...).
- ``llama``: SentencePiece BPE (Llama 1/2, Mistral v0.1, Phi-3, Gemma 1-3): merges are recovered
  from the token scores, unknown characters fall back to ``<0xNN>`` byte tokens.

Special tokens follow llama.cpp: the end-of-generation tokens are found by their text
(``_END_OF_TURN_TEXTS``), BOS is added by default for SentencePiece vocabularies and the byte-level
ones whose pre type says so, and ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` /
``add_space_prefix`` override the defaults.
"""

from __future__ import annotations

import mlx.core as mx
from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

from mlx_engine.loading.gguf_file import GGUFError
from mlx_engine.tokenization.gguf_pretokenizers import BYTE_LEVEL_PRE, PreTokenizer
from mlx_engine.tokenization.tokenizer import Tokenizer

# llama.cpp token types (llama_token_type in llama.h)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SUPPORTED_VOCABS = ("gpt2 (byte-level BPE)", "llama (SentencePiece BPE)")

# Tokens that end generation whatever the file's EOS is: llama.cpp's list (its ``special_eog_ids``,
# found by text, since converters name one EOS at most), one or more per family: ChatML's <|im_end|>
# (Qwen, SmolLM), <|eot_id|>/<|eom_id|> (Llama 3), <|end|> (Phi-3, Phi-4), <end_of_turn> (Gemma),
# <|return|>/<|call|> (gpt-oss), </s> (Mistral, Llama 2), <|end_of_text|> (Granite),
# <|endoftext|> (OLMo 2, GPT-2 style), <｜end▁of▁sentence｜> (DeepSeek), [EOT]/[EOS] (Kimi K2)...
_END_OF_TURN_TEXTS = frozenset(
    (
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",
        "[e~[",
    )
)


def _py(value):
    """Metadata from ``mx.load`` holds numbers as mx.arrays; make everything plain Python."""
    return value.tolist() if isinstance(value, mx.array) else value


def _merge_pair(merge: str) -> tuple[str, str]:
    """A ``tokenizer.ggml.merges`` entry, "left right", as the pair BPE merges."""
    left, space, right = merge.partition(" ")
    if not space:
        raise GGUFError(f"tokenizer.ggml.merges entry {merge!r} is not two tokens separated by a space")
    return left, right


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> tuple[HFTokenizer, PreTokenizer]:
    """The byte-level BPE backend for ``tokenizer.ggml.pre`` = ``pre``, and what that name implies."""
    if pre not in BYTE_LEVEL_PRE:
        raise GGUFError(
            f"unsupported byte-level BPE pre-tokenizer tokenizer.ggml.pre={pre!r}; "
            f"supported: {', '.join(sorted(BYTE_LEVEL_PRE))}"
        )
    spec = BYTE_LEVEL_PRE[pre]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [_merge_pair(m) for m in merges]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=spec.ignore_merges))
    if spec.nfc:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = spec.build()
    backend.decoder = decoders.ByteLevel()
    return backend, spec


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


def _end_of_turn_ids(tokens: list[str]) -> list[int]:
    """The ids that end generation, found by text as llama.cpp does. gpt-oss (harmony) is the exception:
    there ``<|end|>`` closes one message of a turn that goes on (an analysis message is followed by the
    final one), and ``<|return|>`` / ``<|call|>`` end the turn."""
    found = {t: i for i, t in enumerate(tokens) if t in _END_OF_TURN_TEXTS}
    if "<|end|>" in found and (
        {"<|return|>", "<|call|>"} <= found.keys() or {"<|calls|>", "<|flush|>"} <= found.keys()
    ):
        del found["<|end|>"]
    return sorted(found.values())


def _strips_right(metadata: dict, tokens: list[str], types: list[int]) -> set[str]:
    """Special tokens that swallow the whitespace after them. Phi-3's tokenizer.json says so for its
    chat markers (the newline its template writes after ``<|user|>`` is no token of its own), and
    llama.cpp recognises those files by their ``general.name``: every control, user-defined and unknown token, and ``</s>``, but not ``<unk>``, ``<s>`` and
    ``<|endoftext|>``."""
    name = str(_py(metadata.get("general.name")) or "").lower()
    if "phi-3" not in name and "phi3" not in name:
        return set()
    strip = {t for t, k in zip(tokens, types, strict=True) if k in (CONTROL, USER_DEFINED, UNKNOWN)}
    return (strip | {"</s>"}) - {"<unk>", "<s>", "<|endoftext|>"}


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
        backend, spec = _byte_level_bpe(tokens, list(merges), get("pre") or "default")
        add_bos_default = spec.add_bos
    elif kind == "llama":
        scores = get("scores")
        if scores is None or len(scores) != len(tokens):
            raise GGUFError("SentencePiece vocabulary without one tokenizer.ggml.scores entry per token")
        scores = list(scores)
        if _py(metadata.get("general.architecture")) in ("gemma", "gemma2", "gemma3", "gemma3n"):
            # Gemma files (as transformers reads them): runs of spaces are stored as spaces, not U+2581,
            # and the merge order is the token order, not the scores. A user-defined run of spaces keeps
            # its spaces: it is matched whole in the raw text, like every user-defined token.
            tokens = [
                "\u2581" * len(t) if k == NORMAL and t and set(t) == {" "} else t
                for t, k in zip(tokens, types, strict=True)
            ]
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
    # (<think>, ...) are matched whole but are ordinary text. A token that ends generation is a control
    # token whatever the file says (llama.cpp overrides the type the same way).
    end_ids = _end_of_turn_ids(tokens)
    for i in end_ids:
        types[i] = CONTROL
    rstrip = _strips_right(metadata, tokens, types)
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False, rstrip=t in rstrip)
            for t, k in zip(tokens, types, strict=True)
            if k == CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False, rstrip=t in rstrip)
            for t, k in zip(tokens, types, strict=True)
            if k == USER_DEFINED
        ]
    )

    def token(key: str) -> str | None:
        i = get(f"{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    extra_eos = [get(f"{k}_token_id") for k in ("eot", "eom")] + end_ids
    return Tokenizer(
        backend,
        bos_token=bos,
        eos_tokens=[eos] if eos else [],
        chat_template=_py(metadata.get("tokenizer.chat_template")),
        add_bos_token=bool(get("add_bos_token", add_bos_default)),
        add_eos_token=bool(get("add_eos_token", False)),
        extra_eos_ids=[i for i in extra_eos if i is not None],
    )
