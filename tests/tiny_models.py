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


def make_tiny_model_dir(path: str | Path, arch: str = "llama", seed: int = 0) -> Path:
    from mlx_lm.utils import _get_classes

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tj = tokenizer_json()
    vocab = len(json.loads(tj)["model"]["vocab"]) + len(SPECIAL)
    config = _config(arch, vocab)
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
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML, "add_bos_token": False}
        )
    )
    return path
