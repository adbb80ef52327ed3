"""GGUF families beyond llama/qwen/gemma: tiny random files written as llama.cpp's converter writes
them (tests/gguf_families.py: gguf-py's tensor names and metadata writers, the converter's value
changes) load into mlx-lm's model class of the family, reproduce the reference model's logits
dense and kept quantized, mixture-of-experts weights included, and decode in the engine with the
tokens mlx-lm's own generation loop gives."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.loading.gguf_loader import load_gguf
from mlx_engine.loading.loader import load_model
from mlx_engine.model_runner import lm_head
from tests.gguf_families import FAMILIES, MOE_FAMILIES, Q, default_qtype, write_family_gguf
from tests.gguf_quantize import TINY_IDS, TOKENS
from tests.test_engine_tiny import assert_no_leaks, reference_greedy, req, run_all

ARCHS = sorted(FAMILIES)


def engine_greedy(loaded, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The engine's greedy tokens for ``prompts``, batched; no KV block may leak."""
    engine = Engine(loaded, EngineConfig(cache_gb=0.01, block_size=16, kv_dtype="float32"))
    try:
        out = asyncio.run(run_all(engine, [req(p, n) for p in prompts]))
        assert_no_leaks(engine)
        return out
    finally:
        engine.shutdown()


MOE = MOE_FAMILIES


@pytest.mark.parametrize("arch", ARCHS)
def test_float_file_loads_as_the_familys_model(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    expected = write_family_gguf(path, arch, quantized=False)
    model, tokenizer, info = load_gguf(path, dense=True)
    assert type(model) is type(expected)
    assert info["model_type"] == FAMILIES[arch][0]
    assert info["weight_format"] == "dense float32 (from GGUF F32)"
    diff = mx.abs(model(TINY_IDS) - expected(TINY_IDS)).max().item()
    assert diff < 1e-4, diff
    assert tokenizer.encode("the the") == [TOKENS.index("t"), TOKENS.index("he"), TOKENS.index("Ġthe")]


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_file_keeps_its_weights_quantized(tmp_path, arch):
    path = tmp_path / f"{arch}-q8.gguf"
    expected = write_family_gguf(path, arch)
    want = expected(TINY_IDS)
    model, _, info = load_gguf(path, dense=False)
    moe = arch in MOE
    # the routers stay F32 (as llama.cpp's quantizer leaves them), every other matrix is Q8_0
    assert info["weight_format"] == f"quantized 8-bit affine, group 32 (GGUF {'F32/' if moe else ''}Q8_0)"
    quantized = [p for p, m in model.named_modules() if hasattr(m, "bits")]
    plain = [p for p, m in model.named_modules() if isinstance(m, nn.Linear) and not hasattr(m, "bits")]
    assert plain == [
        p for p in plain if p.endswith((".gate", ".router", ".router.layer", ".shared_expert_gate"))
    ], plain
    # stacked experts stay quantized: MLX's gather_qmm (or the CPU kernel) reads them packed
    assert moe == any(p.endswith(("switch_mlp.up_proj", "experts.up_proj")) for p in quantized), quantized
    diff = mx.abs(model(TINY_IDS) - want).max().item()
    assert diff < 1e-3, diff


@pytest.mark.parametrize("arch", ARCHS)
def test_the_engines_output_layer_is_the_models(tmp_path, arch):
    """The engine computes logits with ``lm_head`` (last positions only): it must be the family's
    own output layer, final soft-capping (Gemma 2) and logit scaling (Granite) included."""
    path = tmp_path / f"{arch}.gguf"
    write_family_gguf(path, arch)
    model, _, _ = load_gguf(path, dense=False)
    diff = mx.abs(lm_head(model, model.model(TINY_IDS)) - model(TINY_IDS)).max().item()
    assert diff < 1e-5, diff


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_decodes_the_familys_tokens(tmp_path, arch):
    """Through load_model (the CPU kernels, the paged KV cache with its sliding windows and sinks)
    batched greedy decoding gives mlx-lm's own loop's tokens on the same file."""
    path = tmp_path / f"{arch}.gguf"
    write_family_gguf(path, arch)
    loaded = load_model(str(path), weights="quantized")
    ps = [[1, *range(40, 40 + n)] for n in (3, 11, 19)]  # past gemma3/gpt-oss's window of 8
    expected = [reference_greedy(load_gguf(path, dense=False)[0], p, 8, vocab=len(TOKENS)) for p in ps]
    assert engine_greedy(loaded, ps, 8) == expected


def test_gpt_oss_with_mxfp4_experts_decodes_in_the_engine(tmp_path):
    """gpt-oss as published: experts in MXFP4 (kept in MLX's mxfp4 mode, MLX's own gather_qmm on the
    CPU), the rest Q8_0; the engine's greedy tokens are mlx-lm's own loop's on the same file."""
    path = tmp_path / "gpt-oss-mxfp4.gguf"

    def mxfp4_experts(name: str, shape: tuple[int, ...]) -> Q:
        return Q.MXFP4 if "_exps.weight" in name else default_qtype(name, shape)

    expected = write_family_gguf(path, "gpt-oss", qtype_of=mxfp4_experts)
    model, _, info = load_gguf(path, dense=False)
    assert "mxfp4" in info["weight_format"] and "MXFP4" in info["weight_format"], info["weight_format"]
    assert model.model.layers[0].mlp.experts.up_proj.mode == "mxfp4"
    assert mx.abs(model(TINY_IDS) - expected(TINY_IDS)).max().item() < 1e-3
    loaded = load_model(str(path), weights="quantized")
    ps = [[1, *range(40, 40 + n)] for n in (5, 17)]
    want = [reference_greedy(model, p, 8, vocab=len(TOKENS)) for p in ps]
    assert engine_greedy(loaded, ps, 8) == want


@pytest.mark.parametrize("arch", ["gpt-oss", "olmo2"])
def test_yarn_rope_scaling_is_mlx_lms(tmp_path, arch):
    """A YaRN file (rope.scaling.type yarn: Qwen3's 128K files, gpt-oss) gets mlx-lm's YaRN RoPE in
    every layer, as mlx-lm's own class builds it from the same config (checked against llama.cpp
    in tests/test_gguf_families_llama_cpp.py)."""
    path = tmp_path / f"{arch}-yarn.gguf"
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    expected = write_family_gguf(path, arch, quantized=False, rope_scaling=yarn)
    model, _, _ = load_gguf(path, dense=True)
    assert type(model.model.layers[0].self_attn.rope).__name__ == "YarnRoPE"
    ids = mx.array([[1, *range(40, 100)]])  # past the original 16 positions
    assert mx.abs(model(ids) - expected(ids)).max().item() < 1e-4
    # and in the engine (YaRN's frequencies are computed at load, not on the engine's thread)
    ps = [[1, *range(40, 40 + n)] for n in (9, 30)]
    want = [reference_greedy(model, p, 6, vocab=len(TOKENS)) for p in ps]
    assert engine_greedy(load_model(str(path), weights="quantized"), ps, 6) == want
