"""The pre-tokenizers of byte-level BPE vocabularies in GGUF files, by ``tokenizer.ggml.pre`` name.

A byte-level BPE vocabulary is only right with the split rules it was trained with: the regex that cuts
text into words before BPE runs (digits one at a time or up to three, contractions, letter case,
whitespace and newline runs). A GGUF does not store that regex, only a name for it
(``tokenizer.ggml.pre``, chosen by convert_hf_to_gguf.py's ``get_vocab_base_pre`` from a hash of how
the model's own tokenizer splits a test text). llama.cpp maps the name to a pre type
(``LLAMA_VOCAB_PRE_TYPE_*`` in ``src/llama-vocab.cpp``) and each pre type to a list of regexes that cut
the text in turn, every piece kept, matched or not. We do the same with ``tokenizers``' ``Split``
(behaviour "isolated" keeps both), then ``ByteLevel`` without its own regex.

Where llama.cpp quotes the model's original tokenizer.json regex next to its rewrite (it rewrites
``(?i:...)`` and the ``\\p{Lu}`` classes for its regex engine), we use the original: it is what the
vocabulary was trained with, and Oniguruma (the engine ``tokenizers`` uses) reads it as written.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

# --- the regexes, one per llama.cpp pre type ---------------------------------------------------------

# GPT-2's (LLAMA_VOCAB_PRE_TYPE_GPT2): lowercase contractions, letters and digits each with one optional
# leading space, other symbols likewise, whitespace not followed by a non-space.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# Llama 3's (cl100k-style): contractions in any case, one non-letter glued to the letters after it,
# digits in runs of at most 3, newlines kept with the whitespace before them.
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2's: Llama 3's with every digit on its own.
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3.5's: Qwen2's with combining marks (\p{M}) counted as letters.
QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# o200k (GPT-4o, gpt-oss, Llama 4, Phi-4-mini): words split where lowercase turns to uppercase
# ("camelCase" -> "camel", "Case"), contractions glued to the word before, digits in runs of at most 3,
# "/" kept with a punctuation run.
GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Mistral's tekken (Nemo, Small 3, Devstral, Magistral, Pixtral's text): o200k's shape without the
# contraction groups and with every digit on its own.
TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Seed-Coder's: Qwen2's, with newlines never glued to a punctuation run.
SEED_CODER = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
    r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The CJK runs DeepSeek's first vocabularies keep apart (U+4E00-U+9FA5, U+0800-U+4E00, Hangul...).
_DEEPSEEK_CJK = r"[一-龥ࠀ-一가-퟿]+"

# DeepSeek LLM's: newlines alone, then runs of cased letters (this character class is the tokenizer's),
# runs of ASCII and full-width punctuation, trailing whitespace, CJK runs and digit runs.
DEEPSEEK_LLM = (
    r"[\r\n]",
    # (written escaped: the file must not be NFC-normalized, it holds singletons like U+212A KELVIN SIGN)
    r"\s?["
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377"
    "\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
    "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
    "]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    _DEEPSEEK_CJK,
    r"\p{N}+",
)

# DeepSeek Coder's: newlines alone, letter runs, punctuation runs, CJK runs, single digits.
DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}")

# DeepSeek V3's: digits in runs of at most 3, Han and kana runs, then one ASCII punctuation mark glued to
# the ASCII letters after it, letters with marks, punctuation and symbol runs, whitespace.
DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

# Bloom's and Poro's: words up to a space or one of these punctuation marks.
BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"


@dataclass(frozen=True)
class PreTokenizer:
    """How one llama.cpp pre type cuts text before byte-level BPE, and what else it implies."""

    pre_type: str  # llama.cpp's LLAMA_VOCAB_PRE_TYPE_* name, for messages and docs
    regexes: tuple[str, ...]  # applied in turn, each to every piece the previous ones left
    ignore_merges: bool = False  # a word that is itself a token is taken whole (llama.cpp's flag)
    add_bos: bool = False  # llama.cpp's add_bos default when the file has no tokenizer.ggml.add_bos_token
    nfc: bool = False  # NFC-normalize first, as the model's tokenizer.json does (Qwen)

    def build(self) -> pre_tokenizers.PreTokenizer:
        """The ``tokenizers`` pre-tokenizer: each regex splits, keeping matches and the text between
        them, then bytes map to GPT-2's printable characters."""
        splits: list[pre_tokenizers.PreTokenizer] = [
            pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in self.regexes
        ]
        return pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )


_DEFAULT = PreTokenizer("DEFAULT", (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_GPT2 = PreTokenizer("GPT2", (GPT2,))
_STARCODER = PreTokenizer("STARCODER", (r"\p{N}", GPT2))
_LLAMA3 = PreTokenizer("LLAMA3", (LLAMA3,), ignore_merges=True, add_bos=True)
_DBRX = PreTokenizer("DBRX", (LLAMA3,))
_CHATGLM4 = PreTokenizer("CHATGLM4", (LLAMA3,))
_QWEN2 = PreTokenizer("QWEN2", (QWEN2,))
_QWEN2_NFC = PreTokenizer("QWEN2", (QWEN2,), nfc=True)
_QWEN35 = PreTokenizer("QWEN35", (QWEN35,), nfc=True)
_TEKKEN = PreTokenizer("TEKKEN", (TEKKEN,), ignore_merges=True, add_bos=True)
_GPT4O = PreTokenizer("GPT4O", (GPT4O,))
_DEEPSEEK_LLM = PreTokenizer("DEEPSEEK_LLM", DEEPSEEK_LLM)
_DEEPSEEK_CODER = PreTokenizer("DEEPSEEK_CODER", DEEPSEEK_CODER)
_DEEPSEEK3 = PreTokenizer("DEEPSEEK3_LLM", DEEPSEEK3)
_FALCON = PreTokenizer("FALCON", (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"))
_BLOOM = PreTokenizer("BLOOM", (BLOOM,))
_VIKING = PreTokenizer("VIKING", (BLOOM, r"\p{N}"))
_SEED_CODER = PreTokenizer("SEED_CODER", (SEED_CODER,))
# digit runs in groups of three from the right ("1234567" -> "1", "234", "567"): an empty-match split
_SUPERBPE = PreTokenizer("SUPERBPE", (r"\p{N}+", r"(?=(\d{3})+(?!\d))"))

# tokenizer.ggml.pre -> its pre-tokenizer: every name llama.cpp maps to one of the pre types above
# (src/llama-vocab.cpp), plus "gpt2", which older files of ours used for "gpt-2".
BYTE_LEVEL_PRE: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    **dict.fromkeys(
        ("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4", "a.x-4.0")
        + ("mellum", "gigachat"),
        _GPT2,
    ),
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
        _STARCODER,
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"), _LLAMA3
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), _DBRX),
    **dict.fromkeys(("glm4", "chatglm-bpe"), _CHATGLM4),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_NFC),
    **dict.fromkeys(("kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open", "grok-2"), _QWEN2),
    "qwen35": _QWEN35,
    "tekken": _TEKKEN,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
    "deepseek-llm": _DEEPSEEK_LLM,
    "deepseek-coder": _DEEPSEEK_CODER,
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), _DEEPSEEK3),
    "falcon": _FALCON,
    **dict.fromkeys(("bloom", "poro-chat", "gpt3-finnish"), _BLOOM),
    "viking": _VIKING,
    "seed-coder": _SEED_CODER,
    "superbpe": _SUPERBPE,
}
