"""Windowed models decode through the paged attention kernel on every layer.

Gemma 3 and gpt-oss mix sliding-window layers with global ones, and mlx-lm builds both masks before
its layer loop. The engine maps each layer's mask back to its window, so the kernel (its exact Metal
source, run by the CPU emulator) serves the windowed layers with their window and the global layers
without one, and the greedy tokens equal mlx-lm's own generation loop (rotating caches) on the same
weights. On a Mac the same test runs the kernel for real (``-m apple``). Windows of 8 tokens are far shorter than the prompts, so a layer given the wrong window (or
none) decodes different tokens.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from metal_kernels.spec import metal_available
from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.kv_cache import paged_attention
from mlx_engine.loading.loader import load_model
from tests.test_engine_tiny import prompts, reference_greedy, req, run_all
from tests.tiny_models import CHATML, SLIDING_WINDOW, SPECIAL, tokenizer_json


def make_gpt_oss_dir(path: Path, seed: int = 0) -> Path:
    """A tiny random gpt-oss: layer 0 slides over ``SLIDING_WINDOW`` tokens, layer 1 is global,
    GQA 4, per-head attention sinks (random, so they matter), a 4-expert MoE."""
    from mlx_lm.utils import _get_classes

    path.mkdir(parents=True, exist_ok=True)
    tj = tokenizer_json()
    vocab = len(json.loads(tj)["model"]["vocab"]) + len(SPECIAL)
    config = dict(
        model_type="gpt_oss",
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=64,
        head_dim=32,
        num_attention_heads=8,
        num_key_value_heads=2,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        eos_token_id=0,
    )
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    for k, v in weights.items():
        if k.endswith("sinks"):
            weights[k] = mx.random.normal(v.shape)
        elif k.endswith("embed_tokens.weight") or k.endswith("lm_head.weight"):
            weights[k] = v * 4.0  # sharp logits: greedy decoding far from ties
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "tokenizer.json").write_text(tj)
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML, "add_bos_token": False}
        )
    )
    return path


@pytest.fixture(scope="module", params=["gemma3_text", "gpt_oss"])
def windowed_model(request, tiny_dirs, tmp_path_factory):
    if request.param == "gpt_oss":
        return request.param, load_model(str(make_gpt_oss_dir(tmp_path_factory.mktemp("gpt_oss") / "m")))
    return request.param, load_model(str(tiny_dirs(request.param)))


BACKENDS = [
    "emulator",
    pytest.param(
        "metal",
        marks=[
            pytest.mark.apple,
            pytest.mark.skipif(not metal_available(), reason="needs Apple Silicon with Metal"),
        ],
    ),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_bits", [None, 8])
def test_windowed_and_global_layers_all_use_the_kernel(windowed_model, kv_bits, backend, monkeypatch):
    arch, loaded = windowed_model
    ps = prompts(loaded.tokenizer.vocab_size, [3, 21, 37], seed=31)  # one row shorter than the window
    expected = [reference_greedy(loaded.model, p, 6) for p in ps]
    calls: list[tuple[int, int | None]] = []

    def counting(queries, cache, scale, sinks, window):
        out = paged_attention.metal_decode(queries, cache, scale, sinks, window)
        if queries.shape[2] == 1:  # prefill passes keep the reference path on Metal
            assert out is not None
            calls.append((cache.layer, window))
        return out

    # the pool Metal's "auto" keeps, the model's own dtype, also under the emulator (the CPU
    # backend's "auto" stores float16 KV for this float32 model)
    cfg = EngineConfig(
        cache_gb=0.01, kv_bits=kv_bits, kv_dtype="auto" if kv_bits else str(loaded.dtype).split(".")[-1]
    )
    engine = Engine(loaded, cfg)
    engine.runner.attention = paged_attention.AttentionRoute(
        kernel=counting, metal=True, metal_backend=backend
    )
    try:
        got = asyncio.run(run_all(engine, [req(p, 6) for p in ps]))
    finally:
        engine.shutdown()
    if kv_bits is None:
        assert got == expected, arch
    else:  # 8-bit KV rounds differently from mlx-lm's fp32 cache: the kernel must match the engine's own path
        engine = Engine(loaded, cfg)
        try:
            assert got == asyncio.run(run_all(engine, [req(p, 6) for p in ps])), arch
        finally:
            engine.shutdown()
    assert calls, "decode never reached the kernel"
    assert {w for layer, w in calls if layer == 0} == {SLIDING_WINDOW}, "layer 0 slides over its window"
    assert {w for layer, w in calls if layer == 1} == {None}, "layer 1 is global"
    decode_steps = sum(1 for layer, _ in calls if layer == 0)
    assert sum(1 for layer, _ in calls if layer == 1) == decode_steps, "every layer of every step"
