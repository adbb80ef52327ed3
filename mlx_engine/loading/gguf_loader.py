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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_engine.loading import mlx_lm_lazy, weight_cache
from mlx_engine.loading.dequantize import dequantize_model
from mlx_engine.loading.gguf_archs import ARCHITECTURES, GGUFArch, Meta
from mlx_engine.loading.gguf_file import GGUFError, TensorInfo, read_gguf
from mlx_engine.loading.gguf_tensors import (
    GROUP_SIZE,
    Q6K_GROUP,
    REQUANTIZED_BITS,
    quantization_of,
    read_tensors,
)
from mlx_engine.tokenization.gguf_tokenizer import tokenizer_from_gguf
from mlx_engine.tokenization.tokenizer import Tokenizer

__all__ = ["GGUFError", "SUPPORTED_ARCHITECTURES", "load_gguf"]


SUPPORTED_ARCHITECTURES = ARCHITECTURES

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias|scales|biases)")
_TOP_TENSOR = re.compile(r"(\w+)\.(weight|bias|scales|biases)")
_BARE_PARAMETERS = {"attn_sinks"}  # a GGUF "<name>.weight" that is a plain mlx-lm array (no .weight)
# families whose attention calls ``self.rope(x, offset=...)``: YaRN goes in as mlx-lm's YarnRoPE
# (Qwen2.5/Qwen3 128K files, gpt-oss); Gemma 3 scales only its global layers, Phi-3 has LongRoPE
_YARN_ARCHS = {
    "llama",
    "qwen2",
    "qwen3",
    "qwen3moe",
    "qwen2moe",
    "olmo2",
    "olmoe",
    "granite",
    "granitemoe",
    "gpt-oss",
}
# tensors that configure the model rather than being parameters of it
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _py(value):
    return value.tolist() if isinstance(value, mx.array) else value


def _mlx_name(name: str, spec: GGUFArch) -> str:
    if m := _BLOCK_TENSOR.fullmatch(name):
        layer, base, part = m.groups()
        if base in spec.names:
            if base in _BARE_PARAMETERS:
                return f"model.layers.{layer}.{spec.names[base]}"
            return f"model.layers.{layer}.{spec.names[base]}.{part}"
    elif (m := _TOP_TENSOR.fullmatch(name)) and m.group(1) in _TOP_LEVEL:
        return f"{_TOP_LEVEL[m.group(1)]}.{m.group(2)}"
    raise GGUFError(f"unexpected tensor {name!r} in the GGUF file (not part of a {spec.module} model)")


def _unpermute_rows(x: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K permutation: within each head, rows (2i, 2i+1) go back to (i, i + d/2)."""
    rows = x.shape[0]
    return x.reshape(n_heads, rows // n_heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _rows(weights: Mapping[str, Any], name: str) -> int:
    return weights[name].shape[0] if name in weights else 0


def _check_attention_shape(weights: Mapping[str, Any], n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    if "blk.0.attn_qkv.weight" in weights:  # fused (Phi-3): query rows, then key rows, then value rows
        got, want = _rows(weights, "blk.0.attn_qkv.weight"), (n_heads + 2 * n_kv_heads) * head_dim
        if got != want:
            raise GGUFError(
                f"the metadata's attention shape ({n_heads} query and {n_kv_heads} key/value heads of "
                f"{head_dim}) does not match the tensors ({got} fused query/key/value rows)"
            )
        return
    q_rows, k_rows = (_rows(weights, f"blk.0.attn_{x}.weight") for x in "qk")
    if (q_rows, k_rows) != (n_heads * head_dim, n_kv_heads * head_dim):
        raise GGUFError(
            f"the metadata's attention shape ({n_heads} query and {n_kv_heads} key/value heads of {head_dim}) "
            f"does not match the tensors ({q_rows} query rows, {k_rows} key rows)"
        )


def _config(arch: str, md: dict, weights: Mapping[str, Any]) -> dict:
    """mlx-lm's config for the model: the keys every architecture has, then the family's own."""
    spec, meta = SUPPORTED_ARCHITECTURES[arch], Meta(arch, md)
    if meta.get("expert_count", 0) and "expert_count" not in spec.required:
        raise GGUFError(f"a mixture-of-experts {arch} GGUF is not supported (its dense form is)")
    meta.require("context_length", "embedding_length", "block_count", "attention.head_count", *spec.required)
    if "expert_count" not in spec.required:
        meta.require("feed_forward_length")
    blocks = {int(m.group(1)) for name in weights if (m := _BLOCK_TENSOR.fullmatch(name))}
    n_blocks = meta.get("block_count")
    if n_blocks != len(blocks) or blocks != set(range(len(blocks))):
        raise GGUFError(f"{arch}.block_count is {n_blocks} but the file has tensors for {len(blocks)} blocks")
    hidden, n_heads = meta.get("embedding_length"), meta.get("attention.head_count")
    n_kv_heads = meta.get("attention.head_count_kv") or n_heads
    head_dim = meta.get("attention.key_length") or hidden // max(n_heads, 1)
    if head_dim % 2:
        raise GGUFError(f"odd attention head size {head_dim}")
    _check_attention_shape(weights, n_heads, n_kv_heads, head_dim)
    rope_dims = meta.get("rope.dimension_count") or head_dim
    if rope_dims != head_dim and arch != "phi3":  # Phi-3's partial rotary is in its own config
        raise GGUFError(f"partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    scaling, rope_scaling = meta.get("rope.scaling.type", "none"), None
    if scaling == "linear":
        rope_scaling = {"type": "linear", "factor": meta.get("rope.scaling.factor")}
    elif scaling == "yarn" and arch in _YARN_ARCHS | {"mistral3"}:  # mistral3 moves it to rope_parameters
        rope_scaling = {
            "rope_type": "yarn",
            "factor": meta.get("rope.scaling.factor"),
            "original_max_position_embeddings": meta.get("rope.scaling.original_context_length"),
            "beta_fast": meta.get("rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": meta.get("rope.scaling.yarn_beta_slow", 1.0),
        }
    elif scaling not in ("none", None):
        raise GGUFError(
            f"rope scaling {scaling!r} is not supported for {arch} (supported: none, linear, llama3 "
            f"rope_freqs; yarn for {', '.join(sorted(_YARN_ARCHS))})"
        )
    common = {
        "model_type": spec.module,
        "hidden_size": hidden,
        "num_hidden_layers": n_blocks,
        "intermediate_size": meta.get("feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": meta.get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta.get("rope.freq_base", 10000.0),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": meta.get("context_length"),
        "vocab_size": weights["token_embd.weight"].shape[0],
        "tie_word_embeddings": "output.weight" not in weights,
        "attention_bias": "blk.0.attn_q.bias" in weights,
    }
    try:
        return common | spec.config(meta, weights, common)
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise GGUFError(f"cannot read the {arch} configuration from the GGUF metadata: {e}") from e


def _mlx_weights(
    weights: dict[str, mx.array], spec: GGUFArch, config: dict, dtype: mx.Dtype
) -> tuple[dict[str, mx.array], dict[str, dict]]:
    """GGUF tensors -> (mlx-lm parameters, per-layer quantization parameters for ``nn.quantize``)."""
    out: dict[str, mx.array] = {}
    quant: dict[str, dict] = {}
    for name, value in weights.items():
        key = _mlx_name(name, spec)
        m = _BLOCK_TENSOR.fullmatch(name)
        if m and (fix := spec.reshape.get(f"{m.group(2)}.{m.group(3)}")):
            value = fix(value)
        # whole rows only (not a Q6_K layer's one-element biases, its ratio)
        if spec.permuted_qk and m and m.group(2) in ("attn_q", "attn_k") and value.size > 1:
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


def _quantize(model: nn.Module, quant: dict[str, dict]) -> None:
    """``nn.quantize`` with each layer's parameters. A Q6_K layer in its own form (groups of 16, which
    ``mx.quantize`` refuses) is made as 6-bit groups of 32, the same packed codes, then given its group
    size and scales' and biases' shapes, so that ``load_weights`` checks its arrays as any others."""
    q6k = {p for p, q in quant.items() if q["group_size"] == Q6K_GROUP}
    nn.quantize(
        model,
        class_predicate=lambda p, _m: (
            {"group_size": GROUP_SIZE, "bits": 6} if p in q6k else quant.get(p, False)
        ),
    )
    for path, layer in model.named_modules():
        if path in q6k:
            k = layer["weight"].shape[-1] * 32 // 6
            layer.group_size = Q6K_GROUP
            layer["scales"] = mx.zeros((*layer["weight"].shape[:-1], k // 256 * 18), dtype=mx.uint8)
            layer["biases"] = mx.zeros((1,), dtype=layer["biases"].dtype)


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


def _apply_yarn(model: nn.Module, config: dict) -> None:
    """Every layer's RoPE as mlx-lm's YaRN (some of mlx-lm's classes, e.g. qwen3_moe, ignore
    ``rope_scaling`` and build a plain RoPE; for those that read it this is the same module)."""
    rope_utils = mlx_lm_lazy.import_module("models.rope_utils")
    for layer in model.layers:
        layer.self_attn.rope = rope_utils.initialize_rope(
            config["head_dim"],
            config["rope_theta"],
            False,
            config["rope_scaling"],
            config["max_position_embeddings"],
        )


def _weight_format(tensors: list[TensorInfo], model: nn.Module, dense: bool, dtype: mx.Dtype) -> str:
    """E.g. "quantized 4/8-bit affine, group 32 (GGUF Q4_K/Q6_K/Q8_0; Q6_K re-quantized to 8-bit)", or
    "... affine + mxfp4 ..." where MXFP4 tensors (gpt-oss's experts) stay in MLX's mxfp4 mode; on the
    CPU "...; Q6_K as it is, 6-bit in groups of 16"."""
    matrix_types = sorted({t.ggml_type for t in tensors if len(t.shape) in (2, 3)})
    source = "/".join(matrix_types)
    dtype_name = str(dtype).removeprefix("mlx.core.")
    # QuantizedLinear/Embedding and mlx-lm's QuantizedSwitchLinear (stacked experts) alike
    layers = [m for _, m in model.named_modules() if hasattr(m, "bits") and hasattr(m, "group_size")]
    bits = sorted({m.bits for m in layers if getattr(m, "mode", "affine") == "affine"})
    mxfp4 = any(getattr(m, "mode", "affine") == "mxfp4" for m in layers)
    if dense or not layers:
        return f"dense {dtype_name} (from GGUF {source})"
    kinds = ([f"{'/'.join(map(str, bits))}-bit affine"] if bits else []) + (["mxfp4"] if mxfp4 else [])
    native = any(m.group_size == Q6K_GROUP for m in layers)
    recoded = "/".join(t for t in ("Q2_K", "Q6_K") if t in matrix_types and not (native and t == "Q6_K"))
    notes = ([f"{recoded} re-quantized to {REQUANTIZED_BITS}-bit"] if recoded else []) + (
        [f"Q6_K as it is, 6-bit in groups of {Q6K_GROUP}"] if native else []
    )
    return (
        f"quantized {' + '.join(kinds)}, group {GROUP_SIZE} (GGUF {source}{''.join('; ' + n for n in notes)})"
    )


def architecture(file_name: str, md: dict) -> str:
    """The file's ``general.architecture``, if we load it (else a ``GGUFError`` naming the ones we do)."""
    arch = _py(md.get("general.architecture"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"unsupported GGUF architecture {arch!r} in {file_name}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def build_model(
    file_name: str, arch: str, md: dict, weights: Mapping[str, Any]
) -> tuple[GGUFArch, dict, nn.Module]:
    """The family's mlx-lm model for the file, its parameters not loaded yet (lazy, nothing allocated):
    (architecture spec, mlx-lm config, model). ``weights`` maps tensor names to anything with the
    tensor's ``.shape`` (rows first), and to the values of the few tensors the config reads
    (``CONFIG_TENSORS``)."""
    spec = SUPPORTED_ARCHITECTURES[arch]
    if "token_embd.weight" not in weights:
        raise GGUFError(f"{file_name} has no token_embd.weight tensor")
    config = _config(arch, md, weights)
    models = mlx_lm_lazy.import_module(f"models.{spec.module}")  # not mlx_lm/__init__: seconds of imports
    try:
        model = models.Model(models.ModelArgs.from_dict(config))
    except (ValueError, TypeError, OverflowError) as e:
        raise GGUFError(f"{file_name}: cannot build a {arch} model from its metadata: {e}") from e
    if config["tie_word_embeddings"] and "lm_head" in model and hasattr(model, "tie_word_embeddings"):
        model.tie_word_embeddings = True  # gemma3_text: tied unless the file has an output tensor
        model.pop("lm_head")
    return spec, config, model


def py_value(value: Any) -> Any:
    """A metadata value as plain Python (``mx.load`` gives arrays for numbers)."""
    return _py(value)


def parameter_name(name: str, spec: GGUFArch) -> str:
    """The mlx-lm parameter a GGUF tensor becomes (``GGUFError`` for a tensor the family lacks)."""
    return _mlx_name(name, spec)


def load_gguf(
    path: str | Path, *, dense: bool, dtype: mx.Dtype = mx.float32, evaluate: bool = True, q6k: bool = False
) -> tuple[nn.Module, Tokenizer, dict]:
    """Load a GGUF model: returns (mlx-lm model with evaluated weights, tokenizer, info).

    ``dense=True`` expands quantized tensors to ``dtype`` (fast on CPU); ``dense=False`` keeps them as
    ``QuantizedLinear``/``QuantizedEmbedding`` with each tensor's own bits. ``info`` has ``model_type``,
    ``context_length``, ``weight_format`` and ``name``. Raises ``GGUFError`` with a readable reason.
    ``evaluate=False`` leaves weights read from the converted-weights cache unread until first used:
    the caller converts them layer by layer, then evaluates the model. ``q6k=True`` (the CPU with its
    kernels) keeps Q6_K weights as the file holds them, in groups of 16 that only those kernels read
    (``gguf_tensors``), instead of re-coding them at 8 bits."""
    path = Path(path)
    contents = read_gguf(path)
    tensors, md = contents.tensors, contents.metadata
    arch = architecture(path.name, md)  # before any tensor is decoded
    # decoded once per model, variant and loader version; later starts read the result back
    q6k = q6k and not dense
    variant = "dense" if dense else ("quantized-q6k" if q6k else "quantized")
    weights = weight_cache.load_or_build(path, variant, lambda: read_tensors(path, tensors, dense, q6k))
    spec, config, model = build_model(path.name, arch, md, weights)
    rope_freqs = weights.pop("rope_freqs.weight", None)
    for name in CONFIG_TENSORS:
        weights.pop(name, None)  # read into the config above
    try:
        mlx_weights, quant = _mlx_weights(weights, spec, config, dtype)
        _quantize(model, quant)
        model.load_weights(list(mlx_weights.items()), strict=True)
    except GGUFError:
        raise
    except (ValueError, KeyError, ZeroDivisionError) as e:
        raise GGUFError(
            f"{path.name}: tensors do not match a {arch} model built from its metadata: {e}"
        ) from e
    if rope_freqs is not None:
        _apply_rope_freqs(model, rope_freqs, config["head_dim"], config["rope_theta"])
    if (config.get("rope_scaling") or {}).get("rope_type") == "yarn":
        _apply_yarn(model, config)
    if dense:
        dequantize_model(model, dtype)
    model.eval()
    del weights, mlx_weights  # the model holds the only references: a converted array frees its source
    if evaluate:
        mx.eval(model.parameters())

    info = {
        "model_type": spec.module,
        "context_length": config["max_position_embeddings"],
        "weight_format": _weight_format(tensors, model, dense, dtype),
        "name": _py(md.get("general.name")) or path.stem,
    }
    return model, tokenizer_from_gguf(md), info
