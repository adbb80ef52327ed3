"""Load a llama-family GGUF file into mlx-lm's model classes.

We read the file ourselves (``gguf_file.read_gguf``: header, metadata, where each tensor is) and take
each tensor's bytes from a memory map: F32/F16/BF16 as float arrays, quantized blocks decoded by
``ggml_blocks``. With ``dense=False`` a quantized 2-D weight becomes MLX's affine quantization
(``name.weight`` packed uint32, ``name.scales``, ``name.biases``, groups of 32 along each row):
Q4_0/Q4_1/Q4_K at 4 bits, Q5_0/Q5_1/Q5_K at 5, Q8_0 at 8, Q3_K at 8 (its 16-weight groups
with 6-bit sub-scales fit 8-bit codes on one step ``d``), all exact (``mx.dequantize`` gives the
values llama.cpp computes, bit for bit); Q6_K and Q2_K, whose 16-weight groups MLX cannot hold, are
re-coded at 8 bits in groups of 32: Q6_K exactly where it can be and otherwise within 1/8 of a step,
Q2_K rounded to 256 levels per group (``ggml_blocks.to_8bit_groups_of_32``; errors in
docs/gguf.md). With ``dense=True`` every tensor is the exact float values. Quantization is per
tensor (a Q4_K_M file mixes Q4_K, Q5_0, Q6_K and Q8_0), so each layer gets its own bits. The rest is renaming llama.cpp's tensors and metadata to mlx-lm's,
and undoing what llama.cpp's converter changed:

- ``llama``: Q and K projection rows were permuted from HF's "rotate half" layout to the interleaved
  pairs ggml's rotary embedding uses. We permute them back (whole rows, so it works on quantized
  weight/scales/biases alike) and the model runs mlx-lm's standard (non-traditional) RoPE.
- ``gemma``: norm weights were stored as ``1 + w``; mlx-lm's Gemma adds the 1 itself.
- Llama 3 rope scaling is stored as per-frequency divisors (``rope_freqs.weight``), applied here.

Architectures: llama (also Mistral, SmolLM, TinyLlama...), qwen2, qwen3, gemma.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlx_engine.loading import mlx_lm_lazy, weight_cache
from mlx_engine.loading.dequantize import dequantize_model
from mlx_engine.loading.gguf_file import GGUFError, TensorInfo, read_gguf
from mlx_engine.loading.gguf_tensors import GROUP_SIZE, REQUANTIZED_BITS, quantization_of, read_tensors
from mlx_engine.tokenization.gguf_tokenizer import tokenizer_from_gguf
from mlx_engine.tokenization.tokenizer import Tokenizer

__all__ = ["GGUFError", "SUPPORTED_ARCHITECTURES", "load_gguf"]


@dataclass(frozen=True)
class _Arch:
    module: str  # mlx_lm.models.<module>
    permuted_qk: bool  # llama.cpp permuted Q/K rows for ggml's interleaved RoPE
    norm_offset: float  # llama.cpp stored norm weights as w + offset


SUPPORTED_ARCHITECTURES = {
    "llama": _Arch("llama", permuted_qk=True, norm_offset=0.0),
    "qwen2": _Arch("qwen2", permuted_qk=False, norm_offset=0.0),
    "qwen3": _Arch("qwen3", permuted_qk=False, norm_offset=0.0),
    "gemma": _Arch("gemma", permuted_qk=False, norm_offset=1.0),
}

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_IN_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias|scales|biases)")
_TOP_TENSOR = re.compile(r"(\w+)\.(weight|bias|scales|biases)")


def _py(value):
    return value.tolist() if isinstance(value, mx.array) else value


def _mlx_name(name: str) -> str:
    if m := _BLOCK_TENSOR.fullmatch(name):
        layer, base, part = m.groups()
        if base in _IN_BLOCK:
            return f"model.layers.{layer}.{_IN_BLOCK[base]}.{part}"
    elif (m := _TOP_TENSOR.fullmatch(name)) and m.group(1) in _TOP_LEVEL:
        return f"{_TOP_LEVEL[m.group(1)]}.{m.group(2)}"
    raise GGUFError(f"unexpected tensor {name!r} in the GGUF file (not part of the architectures we load)")


def _unpermute_rows(x: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K permutation: within each head, rows (2i, 2i+1) go back to (i, i + d/2)."""
    rows = x.shape[0]
    return x.reshape(n_heads, rows // n_heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _config(arch: str, md: dict, weights: dict[str, mx.array]) -> dict:
    def get(key: str, default=None):
        value = _py(md.get(f"{arch}.{key}", default))
        if isinstance(value, list):
            raise GGUFError(f"{arch}.{key} varies per layer in this file; only uniform layers are supported")
        return value

    if get("expert_count", 0):
        raise GGUFError("mixture-of-experts GGUF models are not supported")
    required = [
        "context_length",
        "embedding_length",
        "block_count",
        "feed_forward_length",
        "attention.head_count",
    ]
    missing = [f"{arch}.{k}" for k in required if get(k) is None]
    if missing:
        raise GGUFError(f"the GGUF metadata lacks {', '.join(missing)}")
    blocks = {int(m.group(1)) for name in weights if (m := _BLOCK_TENSOR.fullmatch(name))}
    if get("block_count") != len(blocks) or blocks != set(range(len(blocks))):
        raise GGUFError(
            f"{arch}.block_count is {get('block_count')} but the file has tensors for {len(blocks)} blocks"
        )
    hidden, n_heads = get("embedding_length"), get("attention.head_count")
    n_kv_heads = get("attention.head_count_kv") or n_heads
    head_dim = get("attention.key_length") or hidden // max(n_heads, 1)
    q_rows, k_rows = (
        weights[f"blk.0.attn_{x}.weight"].shape[0] if f"blk.0.attn_{x}.weight" in weights else 0 for x in "qk"
    )
    if head_dim % 2 or (q_rows, k_rows) != (n_heads * head_dim, n_kv_heads * head_dim):
        raise GGUFError(
            f"the metadata's attention shape ({n_heads} query and {n_kv_heads} key/value heads of {head_dim}) "
            f"does not match the tensors ({q_rows} query rows, {k_rows} key rows)"
        )
    rope_dims = get("rope.dimension_count") or head_dim
    if rope_dims != head_dim:
        raise GGUFError(f"partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    scaling, rope_scaling = get("rope.scaling.type", "none"), None
    if scaling == "linear":
        rope_scaling = {"type": "linear", "factor": get("rope.scaling.factor")}
    elif scaling not in ("none", None):
        raise GGUFError(
            f"rope scaling {scaling!r} is not supported (supported: none, linear, llama3 rope_freqs)"
        )
    return {
        "model_type": SUPPORTED_ARCHITECTURES[arch].module,
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": get("context_length"),
        "vocab_size": weights["token_embd.weight"].shape[0],
        "tie_word_embeddings": "output.weight" not in weights,
        "attention_bias": "blk.0.attn_q.bias" in weights,
    }


def _mlx_weights(
    weights: dict[str, mx.array], spec: _Arch, config: dict, dtype: mx.Dtype
) -> tuple[dict[str, mx.array], dict[str, dict]]:
    """GGUF tensors -> (mlx-lm parameters, per-layer quantization parameters for ``nn.quantize``)."""
    out: dict[str, mx.array] = {}
    quant: dict[str, dict] = {}
    for name, value in weights.items():
        key = _mlx_name(name)
        if spec.permuted_qk and (m := _BLOCK_TENSOR.fullmatch(name)) and m.group(2) in ("attn_q", "attn_k"):
            value = _unpermute_rows(
                value, config["num_attention_heads" if m.group(2) == "attn_q" else "num_key_value_heads"]
            )
        if spec.norm_offset and name.endswith("norm.weight"):
            value = value.astype(mx.float32) - spec.norm_offset
        if mx.issubdtype(value.dtype, mx.floating):
            value = value.astype(dtype)
        if key.endswith(".scales"):
            quant[key.removesuffix(".scales")] = quantization_of(weights, name.removesuffix(".scales"))
        out[key] = value
    return out, quant


class _ScaledRoPE(nn.Module):
    """Rotary embedding with explicit per-pair periods: Llama 3 rope scaling as GGUF stores it."""

    def __init__(self, dims: int, periods: mx.array):
        super().__init__()
        self.dims = dims
        self._periods = periods  # underscore: not a parameter

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return mx.fast.rope(
            x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._periods
        )


def _apply_rope_freqs(model: nn.Module, factors: mx.array, head_dim: int, base: float) -> None:
    """ggml divides rotary frequency i by ``factors[i]``, i.e. multiplies its period by it."""
    periods = base ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim) * factors.astype(mx.float32)
    for layer in model.layers:
        layer.self_attn.rope = _ScaledRoPE(head_dim, periods)


def _weight_format(tensors: list[TensorInfo], model: nn.Module, dense: bool, dtype: mx.Dtype) -> str:
    matrix_types = sorted({t.ggml_type for t in tensors if len(t.shape) == 2})
    source = "/".join(matrix_types)
    dtype_name = str(dtype).removeprefix("mlx.core.")
    bits = sorted(
        {
            m.bits
            for _, m in model.named_modules()
            if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding)
        }
    )
    if dense or not bits:
        return f"dense {dtype_name} (from GGUF {source})"
    recoded = "/".join(t for t in ("Q2_K", "Q6_K") if t in matrix_types)
    requantized = f"; {recoded} re-quantized to {REQUANTIZED_BITS}-bit" if recoded else ""
    return f"quantized {'/'.join(map(str, bits))}-bit affine, group {GROUP_SIZE} (GGUF {source}{requantized})"


def load_gguf(
    path: str | Path, *, dense: bool, dtype: mx.Dtype = mx.float32
) -> tuple[nn.Module, Tokenizer, dict]:
    """Load a GGUF model: returns (mlx-lm model with evaluated weights, tokenizer, info).

    ``dense=True`` expands quantized tensors to ``dtype`` (fast on CPU); ``dense=False`` keeps them as
    ``QuantizedLinear``/``QuantizedEmbedding`` with each tensor's own bits. ``info`` has ``model_type``,
    ``context_length``, ``weight_format`` and ``name``. Raises ``GGUFError`` with a readable reason."""
    path = Path(path)
    contents = read_gguf(path)
    tensors, md = contents.tensors, contents.metadata
    arch = _py(md.get("general.architecture"))
    if arch not in SUPPORTED_ARCHITECTURES:  # before any tensor is decoded
        raise GGUFError(
            f"unsupported GGUF architecture {arch!r} in {path.name}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    spec = SUPPORTED_ARCHITECTURES[arch]
    # decoded once per model, variant and loader version; later starts read the result back
    weights = weight_cache.load_or_build(
        path, "dense" if dense else "quantized", lambda: read_tensors(path, tensors, dense)
    )
    if "token_embd.weight" not in weights:
        raise GGUFError(f"{path.name} has no token_embd.weight tensor")
    config = _config(arch, md, weights)
    models = mlx_lm_lazy.import_module(f"models.{spec.module}")  # not mlx_lm/__init__: seconds of imports
    try:
        model = models.Model(models.ModelArgs.from_dict(config))
    except (ValueError, TypeError, OverflowError) as e:
        raise GGUFError(f"{path.name}: cannot build a {arch} model from its metadata: {e}") from e

    rope_freqs = weights.pop("rope_freqs.weight", None)
    try:
        mlx_weights, quant = _mlx_weights(weights, spec, config, dtype)
        nn.quantize(model, class_predicate=lambda p, _m: quant.get(p, False))
        model.load_weights(list(mlx_weights.items()), strict=True)
    except GGUFError:
        raise
    except (ValueError, KeyError, ZeroDivisionError) as e:
        raise GGUFError(
            f"{path.name}: tensors do not match a {arch} model built from its metadata: {e}"
        ) from e
    if rope_freqs is not None:
        _apply_rope_freqs(model, rope_freqs, config["head_dim"], config["rope_theta"])
    if dense:
        dequantize_model(model, dtype)
    model.eval()
    mx.eval(model.parameters())

    info = {
        "model_type": spec.module,
        "context_length": config["max_position_embeddings"],
        "weight_format": _weight_format(tensors, model, dense, dtype),
        "name": _py(md.get("general.name")) or path.stem,
    }
    return model, tokenizer_from_gguf(md), info
