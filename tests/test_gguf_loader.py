"""GGUF loading: the bundled SmolLM2 Q4_1 file against an independent reference (transformers reading
the same file, see bench/make_gguf_reference.py), tiny GGUFs written here for every supported
architecture, and the errors for bad files."""

from __future__ import annotations

import importlib
import json
import time
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from tokenizers.pre_tokenizers import ByteLevel

from mlx_engine.loading.dequantize import dequantize_model
from mlx_engine.loading.gguf_loader import GGUFError, load_gguf
from mlx_engine.loading.resolve import bundled_model_path

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


# --- tiny GGUF files written the way llama.cpp's converter writes them --------------------------------

_GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
TOKENS = SPECIALS + sorted(ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"]


def _gguf_name(key: str) -> str:
    module, part = key.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, layer, rest = module.split(".", 3)
        return f"blk.{layer}.{_GGUF_NAMES[rest]}.{part}"
    return f"{_GGUF_NAMES[module]}.{part}"


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama Q/K rows (HF rotate-half -> interleaved)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_freq_factors(head_dim: int, base: float, s: dict) -> np.ndarray:
    """llama.cpp's rope_freqs for Llama 3 rope scaling (divisors of each rotary frequency)."""
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    factors = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def _tiny_config(arch: str) -> dict:
    config = {
        "model_type": arch,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "vocab_size": len(TOKENS),
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": arch != "llama",
    }
    return config


def _tiny_model(arch: str, config: dict) -> nn.Module:
    models = importlib.import_module(f"mlx_lm.models.{arch}")
    model = models.Model(models.ModelArgs.from_dict(config))
    mx.random.seed(7)
    params = [
        (k, 0.2 * mx.random.normal(v.shape) + (1.0 if "norm" in k else 0.0))
        for k, v in tree_flatten(model.parameters())
    ]
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def write_tiny_gguf(
    path: Path,
    arch: str,
    *,
    qtypes: dict[str, Q] | None = None,
    rope_scaling: dict | None = None,
    gguf_arch: str | None = None,
) -> nn.Module:
    """Write a tiny random ``arch`` model as llama.cpp would, and return the mlx-lm model whose logits
    the loaded file must reproduce (its weights replaced by the values the file's blocks decode to, by
    the ``gguf`` package's own dequantizer). ``qtypes`` maps GGUF tensor kinds ("attn_q", "output") to
    a type; the rest stays F32."""
    config = _tiny_config(arch)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    model = _tiny_model(arch, config)
    writer = gguf.GGUFWriter(str(path), arch=gguf_arch or arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in TOKENS])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if rope_scaling:
        factors = _llama3_freq_factors(config["head_dim"], config["rope_theta"], rope_scaling)
        writer.add_tensor("rope_freqs.weight", factors)
    decoded = []
    for key, value in tree_flatten(model.parameters()):
        name = _gguf_name(key)
        w = np.array(value, dtype=np.float32)
        if arch == "gemma" and name.endswith("norm.weight"):
            w = w + 1.0  # llama.cpp stores Gemma's norms with the +1 folded in
        qtype = (qtypes or {}).get(name.split(".")[-2], Q.F32)
        if qtype != Q.F32:
            # quantization works row by row, so it commutes with the row permutation below
            w = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
            decoded.append((key, mx.array(w)))
        stored = w
        if arch == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = config["num_attention_heads" if ".attn_q." in name else "num_key_value_heads"]
            stored = _llama_cpp_permute(w, heads)
        if qtype == Q.F32:
            writer.add_tensor(name, stored)
        else:
            writer.add_tensor(name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.update(tree_unflatten(decoded))
    mx.eval(model.parameters())
    return model


TINY_IDS = mx.array([[1, 40, 41, 260, 261, 70, 3, 90, 100, 2, 45, 46, 47, 48]])


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
    config = _tiny_config("qwen2")
    model = _tiny_model("qwen2", config)
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


def test_unknown_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_tiny_gguf(path, "llama", gguf_arch="mamba")
    with pytest.raises(
        GGUFError, match=r"unsupported GGUF architecture 'mamba'.*supported: llama, qwen2, qwen3, gemma"
    ):
        load_gguf(path, dense=True)


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "q4k.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    bytes_per_row = 256 // 256 * gguf.GGML_QUANT_SIZES[Q.Q4_K][1]
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((8, bytes_per_row), np.uint8), raw_dtype=Q.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        GGUFError, match=r"Q4_K \(1 tensors.*Supported types: F32, F16, Q4_0, Q4_1, Q8_0, BF16"
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
