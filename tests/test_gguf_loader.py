"""GGUF loading: the bundled SmolLM2 Q4_1 file against an independent reference (transformers reading
the same file, see bench/make_gguf_reference.py), tiny GGUFs written here for every supported
architecture, and the errors for bad files."""

from __future__ import annotations

import json
import time
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_engine.loading.dequantize import dequantize_model
from mlx_engine.loading.gguf_loader import GGUFError, load_gguf
from mlx_engine.loading.resolve import bundled_model_path
from tests.gguf_quantize import TINY_IDS, TOKENS, tiny_config, tiny_model, write_tiny_gguf

REFERENCE = json.loads((Path(__file__).parent / "data/smollm2_reference.json").read_text())
Q = gguf.GGMLQuantizationType


def _compare(model: nn.Module, prompts: list[dict]) -> tuple[int, int, float]:
    """Teacher-force each prompt: (positions whose top-1 equals the reference's, positions, max |logit
    difference| over the reference's top-k entries)."""
    agree = total = 0
    max_diff = 0.0
    for p in prompts:
        logits = np.array(model(mx.array([p["ids"]]))[0].astype(mx.float32))
        top_ids, top_logits = np.array(p["topk_ids"]), np.array(p["topk_logits"])
        agree += int((logits.argmax(-1) == top_ids[:, 0]).sum())
        total += len(p["ids"])
        max_diff = max(max_diff, float(np.abs(np.take_along_axis(logits, top_ids, -1) - top_logits).max()))
    return agree, total, max_diff


@pytest.fixture(scope="module")
def bundled() -> Path:
    return bundled_model_path()


@pytest.fixture(scope="module")
def dense_model(bundled):
    start = time.perf_counter()
    loaded = load_gguf(bundled, dense=True)
    print(f"\nload_gguf(dense=True): {time.perf_counter() - start:.2f}s")
    return loaded


@pytest.fixture(scope="module")
def quantized_model(bundled):
    start = time.perf_counter()
    loaded = load_gguf(bundled, dense=False)
    print(f"\nload_gguf(dense=False): {time.perf_counter() - start:.2f}s")
    return loaded


def test_reference_is_for_the_bundled_file(bundled):
    assert REFERENCE["gguf_name"] == bundled.name
    assert bundled.stat().st_size > 50_000_000
    assert sum(len(p["ids"]) for p in REFERENCE["prompts"]) >= 500


def test_dense_matches_reference(dense_model):
    model, _, info = dense_model
    assert info["weight_format"] == "dense float32 (from GGUF Q4_1/Q8_0)"
    assert all(type(m) is not nn.QuantizedLinear for _, m in model.named_modules())
    agree, total, max_diff = _compare(model, REFERENCE["prompts"])
    print(
        f"dense fp32: top-1 agrees on {agree}/{total} positions, max |logit diff| over top-k {max_diff:.4f}"
    )
    assert agree >= 0.99 * total
    # Both sides expand the same Q4_1/Q8_0 blocks exactly in fp32; only summation order differs.
    assert max_diff < 0.02


def test_quantized_matches_reference(quantized_model):
    model, _, info = quantized_model
    assert info["weight_format"] == "quantized 4/8-bit affine, group 32 (GGUF Q4_1/Q8_0)"
    # per-tensor quantization: Q4_1 projections, the Q8_0 embedding doubles as the output layer
    assert model.model.layers[0].self_attn.q_proj.bits == 4
    assert model.model.embed_tokens.bits == 8
    assert model.model.embed_tokens.group_size == model.model.layers[0].mlp.down_proj.group_size == 32
    # MLX's CPU quantized matmul is ~10x slower than dense: the shortest prompt (55 positions) keeps
    # this quick; the tiny mixed-type test checks the quantized path equals the dense one everywhere.
    prompts = sorted(REFERENCE["prompts"], key=lambda p: len(p["ids"]))[:1]
    agree, total, max_diff = _compare(model, prompts)
    print(f"quantized: top-1 agrees on {agree}/{total} positions, max |logit diff| over top-k {max_diff:.4f}")
    # The packed weights hold the file's exact values and the matmul runs in fp32 (scales are cast to
    # the model dtype), so the bar is the dense one.
    assert agree >= 0.99 * total
    assert max_diff < 0.02


def test_info_and_tokenizer(dense_model, bundled):
    model, tokenizer, info = dense_model
    assert info["model_type"] == "llama"
    assert info["context_length"] == 8192
    assert info["name"] == "Smollm2 135M 8k Lc100K Mix1 Ep2"
    assert set(info) >= {"model_type", "context_length", "weight_format", "name"}
    assert tokenizer.encode(REFERENCE["prompts"][0]["text"]) == REFERENCE["prompts"][0]["ids"]
    assert 2 in tokenizer.eos_token_ids  # <|im_end|>
    assert model.model.embed_tokens.weight.shape == (49152, 576)
    assert model.args.tie_word_embeddings and not hasattr(model, "lm_head")


def test_greedy_continuation_is_sensible(dense_model):
    model, tokenizer, _ = dense_model
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = tokenizer.encode(prompt)
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)
    out = []
    for _ in range(12):
        token = int(mx.argmax(logits[0, -1]).item())
        if token in tokenizer.eos_token_ids:
            break
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    assert "Paris" in tokenizer.decode(out)


# --- tiny GGUF files written the way llama.cpp's converter writes them (tests/gguf_quantize.py) ----


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma"])
def test_tiny_architectures_round_trip(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    expected = write_tiny_gguf(path, arch)
    model, tokenizer, info = load_gguf(path, dense=True)
    assert info == {
        "model_type": arch,
        "context_length": 256,
        "weight_format": "dense float32 (from GGUF F32)",
        "name": f"tiny-{arch}",
    }
    diff = mx.abs(model(TINY_IDS) - expected(TINY_IDS)).max().item()
    assert diff < 1e-4, diff
    assert tokenizer.encode("the the") == [TOKENS.index("t"), TOKENS.index("he"), TOKENS.index("Ġthe")]


def test_tiny_mixed_quant_types_dense_and_quantized(tmp_path):
    path = tmp_path / "llama-q.gguf"
    qtypes = {
        "token_embd": Q.Q8_0,
        "output": Q.Q8_0,
        "attn_q": Q.Q4_0,
        "attn_k": Q.Q4_1,
        "attn_v": Q.Q8_0,
        "attn_output": Q.Q4_0,
        "ffn_gate": Q.Q4_1,
        "ffn_up": Q.Q4_0,
        "ffn_down": Q.Q8_0,
    }
    expected = write_tiny_gguf(path, "llama", qtypes=qtypes)
    want = expected(TINY_IDS)

    dense, _, info = load_gguf(path, dense=True)
    assert info["weight_format"] == "dense float32 (from GGUF Q4_0/Q4_1/Q8_0)"
    assert mx.abs(dense(TINY_IDS) - want).max().item() < 1e-4

    quantized, _, info = load_gguf(path, dense=False)
    assert info["weight_format"] == "quantized 4/8-bit affine, group 32 (GGUF Q4_0/Q4_1/Q8_0)"
    layer = quantized.model.layers[1]
    assert (layer.self_attn.q_proj.bits, layer.self_attn.k_proj.bits, layer.self_attn.v_proj.bits) == (
        4,
        4,
        8,
    )
    assert (quantized.lm_head.bits, quantized.model.embed_tokens.bits, layer.mlp.down_proj.bits) == (8, 8, 8)
    assert mx.abs(quantized(TINY_IDS) - want).max().item() < 1e-4


def test_tiny_float_types(tmp_path):
    path = tmp_path / "qwen3-f16.gguf"
    qtypes = {k: Q.F16 for k in ("token_embd", "attn_q", "attn_k", "attn_v", "attn_output")}
    qtypes |= {k: Q.BF16 for k in ("ffn_gate", "ffn_up", "ffn_down")}
    expected = write_tiny_gguf(path, "qwen3", qtypes=qtypes)
    for dense in (True, False):
        model, _, info = load_gguf(path, dense=dense)
        assert info["weight_format"] == "dense float32 (from GGUF BF16/F16)"
        assert model.model.layers[0].mlp.up_proj.weight.dtype == mx.float32
        assert mx.abs(model(TINY_IDS) - expected(TINY_IDS)).max().item() < 1e-4


def test_tiny_llama3_rope_freqs(tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    path = tmp_path / "llama3.gguf"
    expected = write_tiny_gguf(path, "llama", rope_scaling=scaling)
    model, _, _ = load_gguf(path, dense=True)
    assert mx.abs(model(TINY_IDS) - expected(TINY_IDS)).max().item() < 1e-4
    # and the scaling matters: without it the logits differ
    plain = tmp_path / "plain.gguf"
    write_tiny_gguf(plain, "llama")
    unscaled, _, _ = load_gguf(plain, dense=True)
    assert mx.abs(unscaled(TINY_IDS) - expected(TINY_IDS)).max().item() > 1e-3


def test_dequantize_model_matches_quantized_layers():
    config = tiny_config("qwen2")
    model = tiny_model("qwen2", config)
    nn.quantize(
        model,
        class_predicate=lambda p, m: (
            hasattr(m, "to_quantized") and {"group_size": 32, "bits": 8 if "embed" in p else 4}
        ),
    )
    want = model(TINY_IDS)
    dequantize_model(model, mx.float32)
    assert not any(
        isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding) for _, m in model.named_modules()
    )
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # biases survive
    assert mx.abs(model(TINY_IDS) - want).max().item() < 1e-4
    dequantize_model(model, mx.bfloat16)
    assert all(v.dtype == mx.bfloat16 for _, v in tree_flatten(model.parameters()))


# --- bad files ------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="not found"):
        load_gguf(tmp_path / "nope.gguf", dense=True)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty"),
        (b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 20, "not a GGUF file"),
        (b"GGUF" + bytes(range(255, -1, -1)) * 20, "unsupported GGUF version"),  # crashed mx.load
        (b"GGUF\x03\x00\x00\x00" + b"\xff" * 64, "truncated or corrupt"),
    ],
)
def test_garbage_files(tmp_path, content, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFError, match=message):
        load_gguf(path, dense=True)


def test_truncated_files(tmp_path, bundled):
    with open(bundled, "rb") as f:
        head = f.read(400_000)  # ends inside the vocabulary
    (tmp_path / "head.gguf").write_bytes(head)
    with pytest.raises(GGUFError, match="truncated or corrupt: the header runs past the end"):
        load_gguf(tmp_path / "head.gguf", dense=True)

    write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    data = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-1000])
    with pytest.raises(GGUFError, match=r"truncated or corrupt: tensor '.*' ends at byte \d+, past the end"):
        load_gguf(tmp_path / "cut.gguf", dense=True)


def test_a_file_changed_between_check_and_load_is_read_again(tmp_path):
    """The model check's parse is reused by the load that follows only for the same, unchanged file."""
    from mlx_engine.loading.gguf_file import read_gguf, read_tensor_table

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "llama")
    llama_tensors = read_tensor_table(path)
    write_tiny_gguf(path, "qwen3")
    qwen = read_gguf(path)
    assert qwen.metadata["general.architecture"] == "qwen3"
    assert [t.name for t in qwen.tensors] != [t.name for t in llama_tensors]
    read_tensor_table(path)
    path.unlink()
    with pytest.raises(GGUFError, match="not found"):
        read_gguf(path)


def test_unknown_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_tiny_gguf(path, "llama", gguf_arch="mamba")
    with pytest.raises(
        GGUFError, match=r"unsupported GGUF architecture 'mamba' in mamba.gguf; supported: "
    ) as e:
        load_gguf(path, dense=True)
    # the message names what does load, e.g. the families people download most
    named = str(e.value).split("supported: ")[1].split(", ")
    assert {"llama", "qwen3", "qwen3moe", "gemma3", "phi3", "gpt-oss", "mistral3"} <= set(named)


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "iq2.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    bytes_per_row = 256 // 256 * gguf.GGML_QUANT_SIZES[Q.IQ2_XS][1]
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((8, bytes_per_row), np.uint8), raw_dtype=Q.IQ2_XS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        GGUFError,
        match=r"IQ2_XS \(1 tensors, e\.g\. blk\.0\.attn_q\.weight\).*"
        r"Supported types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, "
        r"IQ4_NL, IQ4_XS, MXFP4, IQ2_XXS, IQ3_XXS, IQ3_S, IQ1_S \(",
    ):
        load_gguf(path, dense=True)


def test_metadata_that_contradicts_the_tensors(tmp_path):
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, "llama")
    data = bytearray(path.read_bytes())
    key = b"llama.block_count"
    at = data.index(key) + len(key) + 4  # skip the value type
    data[at : at + 4] = (200).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="block_count is 200 but the file has tensors for 2 blocks"):
        load_gguf(path, dense=True)
