"""Tiny random-weight models written as HF-style directories, for tests that must not touch a hub.

``make_tiny_model_dir(path, arch)`` writes config.json, model.safetensors (fp32, random),
tokenizer.json (a byte-level BPE trained here on a small multilingual corpus) and
tokenizer_config.json with a ChatML template, then returns the path.

``gemma3_text`` is the windowed one: its first layer attends over a sliding window of
``SLIDING_WINDOW`` tokens (its second is global), far shorter than the test prompts, so a paged
attention mask that forgot the window gives different tokens from mlx-lm's rotating cache.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma3_text")
SLIDING_WINDOW = 8

CORPUS = [
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "def add(a, b):\n    return a + b\n",
    "Bonjour à tous, ça va? Grüße aus München. Привет мир.",
    "你好，世界。日本語のテキスト。한국어 문장.",
    "Emoji: 😀🎉🚀 and symbols: ∑ ∫ √ ≤ ≥ → ←",
    "Hello world! Hello again, world. The end.",
] * 20

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ids the tiny BPE has (its specials included); its models score a few rows more (an output layer
# padded past the vocabulary, as many real models' are)
TINY_TOKENS = 400
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@cache
def tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok.to_str()


def _config(arch: str, vocab: int) -> dict:
    base = {
        "model_type": arch,
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # GQA 2:1; head_dim 32 (MLX quantizes groups of >= 32)
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": arch in ("qwen3", "gemma"),
        "eos_token_id": 0,
    }
    if arch in ("qwen3", "gemma", "gemma3_text"):
        base["head_dim"] = 32
    if arch == "gemma3_text":
        # layer 0 slides over a short window, layer 1 is global (pattern 2)
        base.update(sliding_window=SLIDING_WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=32)
    if arch == "mistral":
        base["architectures"] = ["MistralForCausalLM"]
    return base


def make_tiny_model_dir(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    tokenizer: tuple[str, dict] | None = None,
    context: int | None = None,
) -> Path:
    """``tokenizer``: another tokenizer.json text and tokenizer_config.json dict (default: the
    tiny BPE and ChatML); ``context``: max_position_embeddings (default 2048)."""
    from mlx_lm.utils import _get_classes

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:  # the tiny BPE: its vocabulary and SPECIAL (the rows its tests were made with)
        tj = tokenizer_json()
        vocab = len(json.loads(tj)["model"]["vocab"]) + len(SPECIAL)
    else:  # every id the tokenizer can produce, added tokens included
        tj = tokenizer[0]
        parsed = json.loads(tj)
        vocab = (
            max([*parsed["model"]["vocab"].values(), *(t["id"] for t in parsed.get("added_tokens") or [])])
            + 1
        )
    config = _config(arch, vocab)
    if context is not None:
        config["max_position_embeddings"] = context
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    # sharpen the output distribution so greedy decoding is far from ties
    weights = dict(tree_flatten(model.parameters()))
    for k, v in weights.items():
        if k.endswith("embed_tokens.weight") or k.endswith("lm_head.weight"):
            weights[k] = v * 4.0
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "tokenizer.json").write_text(tj)
    tokenizer_config = (
        tokenizer[1]
        if tokenizer
        else {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML, "add_bos_token": False}
    )
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


def bundled_tokenizer(chat_template: str | None = None) -> tuple[str, dict]:
    """The bundled SmolLM2's tokenizer (a 49,152-token BPE) as tokenizer.json text and a
    tokenizer_config dict (its chat template unless ``chat_template`` is given): a tiny model
    that tokenizes English as a real one does, so long prompts stay real-sized in tokens."""
    from mlx_engine.loading.gguf_file import read_gguf
    from mlx_engine.loading.resolve import bundled_model_path
    from mlx_engine.tokenization.gguf_tokenizer import tokenizer_from_gguf

    tok = tokenizer_from_gguf(read_gguf(bundled_model_path()).metadata)
    config = {
        "eos_token": tok.eos_token,
        "bos_token": tok.bos_token,
        "chat_template": chat_template or tok.chat_template,
        "add_bos_token": tok.add_bos_token,
    }
    return tok.backend.to_str(), config


def with_added_tokens(
    tokenizer: tuple[str, dict], tokens: list[str], special: bool = False
) -> tuple[str, dict]:
    """``tokenizer`` with ``tokens`` added as whole tokens after its last id (a family's markers:
    ``<think>``, ``[TOOL_CALLS]``...), as its tokenizer.json lists them."""
    tj = json.loads(tokenizer[0])
    added = tj.setdefault("added_tokens", [])
    top = max([*tj["model"]["vocab"].values(), *(t["id"] for t in added)])
    for k, content in enumerate(tokens, 1):
        added.append(
            {"id": top + k, "content": content, "single_word": False, "lstrip": False, "rstrip": False}
            | {"normalized": False, "special": special}
        )
    return json.dumps(tj), tokenizer[1]


def make_scripted_model_dir(
    path: str | Path,
    reply: str = "Hi! How can I help?",
    context: int = 65536,
    tokenizer: tuple[str, dict] | None = None,
) -> Path:
    """A tiny llama with the bundled tokenizer that answers every chat with ``reply``, then ends its
    turn: its attention and MLP outputs are zero, so each next token depends on the current one
    alone, and its embeddings and output rows chain the generation prompt's last token through
    ``reply``'s tokens to the end-of-turn token. Real weights through the real engine, but a reply
    a client can act on (Claude Code treats a reply cut off at max_tokens as an error).
    ``tokenizer``: the bundled one with changes (``with_added_tokens``)."""
    tokenizer = tokenizer or bundled_tokenizer()
    path = make_tiny_model_dir(path, tokenizer=tokenizer, context=context)
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_str(tokenizer[0])
    start = tok.encode("<|im_start|>assistant\n").ids[-1]
    chain = [start, *tok.encode(reply).ids, tok.token_to_id(tokenizer[1]["eos_token"])]
    assert len(set(chain)) == len(chain), "the reply's tokens must differ from each other"
    weights = mx.load(str(path / "model.safetensors"))
    hidden = weights["model.embed_tokens.weight"].shape[1]
    embed = mx.zeros_like(weights["model.embed_tokens.weight"])
    head = mx.zeros_like(weights["lm_head.weight"])
    eye = mx.eye(hidden)
    for k, (cur, nxt) in enumerate(zip(chain, chain[1:], strict=False)):
        embed[cur] = eye[k]  # after the final RMSNorm: sqrt(hidden) along direction k
        head[nxt] = eye[k] * 4.0  # logit ~45 for the next token, 0 for every other
    weights = {
        k: mx.zeros_like(v) if k.endswith(("o_proj.weight", "down_proj.weight")) else v
        for k, v in weights.items()
    }
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = head
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


def make_thinking_model_dir(path: str | Path, reply: str) -> Path:
    """A scripted model (``make_scripted_model_dir``) whose tokenizer has ``<think>`` and
    ``</think>`` as whole tokens, as Qwen3's and DeepSeek-R1's do; ``reply`` marks its thinking."""
    tok = with_added_tokens(bundled_tokenizer(), ["<think>", "</think>"])
    return make_scripted_model_dir(path, reply, context=4096, tokenizer=tok)
