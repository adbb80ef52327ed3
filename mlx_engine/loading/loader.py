"""Load a model (GGUF file or HF/MLX directory) into mlx-lm's model classes.

Weight format per backend: on CPU, dense float32 weights with a fast BLAS beat MLX's
single-threaded quantized matmul by a wide margin (docs/BENCHMARKS.md), so quantized
weights are expanded when they fit the memory budget; on Metal and CUDA they stay
quantized, where MLX's quantized kernels are fast.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlx_engine import heap
from mlx_engine.backend import backend_name
from mlx_engine.errors import ModelLoadError
from mlx_engine.huge_pages import use_huge_pages
from mlx_engine.loading.resolve import ModelSource, resolve_model
from mlx_engine.loading.weight_policy import keep_quantized
from mlx_engine.mlx_tree import flat_parameters
from mlx_engine.tokenization.tokenizer import Tokenizer

WEIGHT_FORMATS = ("auto", "dense", "quantized")


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Tokenizer
    name: str
    path: Path
    model_type: str
    context_length: int
    weight_format: str
    num_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: mx.Dtype
    load_seconds: float = 0.0

    @property
    def weight_bytes(self) -> int:
        from mlx_engine.mlx_tree import flat_parameters

        return sum(v.nbytes for _, v in flat_parameters(self.model))


def _want_dense(weights: str) -> bool:
    if weights not in WEIGHT_FORMATS:
        raise ModelLoadError(f"weights must be one of {WEIGHT_FORMATS}, not {weights!r}")
    if weights != "auto":
        return weights == "dense"
    return not keep_quantized(backend_name())


def _attention_shape(model: nn.Module) -> tuple[int, int, int]:
    args = model.args
    heads = args.num_attention_heads
    kv = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    return len(model.layers), kv, head_dim


def _activation_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype the model computes in: its embedding's (affine scales or dense weight), else, for
    an embedding without float parameters (mxfp4: uint8 scales), the first float parameter's."""
    emb = model.model.embed_tokens
    for a in (emb.get("scales"), emb.weight):
        if a is not None and mx.issubdtype(a.dtype, mx.floating):
            return a.dtype
    return next(v.dtype for _, v in flat_parameters(model) if mx.issubdtype(v.dtype, mx.floating))


def _cpu_kernels_built() -> bool:
    """Whether quantized layers will run through the CPU kernels (the CPU backend, the extension built)."""
    if backend_name() != "cpu":
        return False
    from cpu_kernels.spec import available

    return available()


def load_model(
    spec: str | os.PathLike | None = None, *, weights: str = "auto", huge_pages: bool = True
) -> LoadedModel:
    """Load a model (``spec``: an HF repo id, a local directory or GGUF, None for the bundled one).
    ``huge_pages`` (CPU): move the weights onto 2 MiB pages before returning; the engine passes False
    and moves them itself once its own layout is in place (``Engine``), in the background."""
    t0 = time.perf_counter()
    src = resolve_model(spec)
    dense = _want_dense(weights)
    if src.kind == "gguf":
        from mlx_engine.loading.gguf_loader import load_gguf

        # unevaluated: the CPU's passes below read each layer's float32 scales and biases and
        # replace them, so they never all sit in memory beside the model (the synthetic 1B Q8_0
        # model's load peaked at 1596 MB against 1265 after it; now 1316-1338)
        # on the CPU with its kernels, Q6_K weights as the file holds them (6.56 bits a weight to
        # read per token, not the 8.5 of an 8-bit re-code that MLX's own kernels need)
        model, tokenizer, info = load_gguf(src.path, dense=dense, evaluate=False, q6k=_cpu_kernels_built())
        model_type, ctx, fmt = info["model_type"], info["context_length"], info["weight_format"]
    else:
        model, tokenizer, model_type, ctx, fmt = _load_hf_dir(src, dense)
    dtype = _activation_dtype(model)  # before the kernels' float16 scales (cpu_kernels/scales.py)
    if backend_name() == "cpu":
        _input_major_weights(model)
        if not dense:
            from cpu_kernels.modules import use_cpu_kernels
            from cpu_kernels.scales import half_scales, implicit_biases, two_level_scales

            use_cpu_kernels(model)  # quantized layers run through the CPU kernels (weight_policy.py)
            two_level_scales(model)  # K-quants: 1.375 bits a weight less to read per token
            implicit_biases(model)  # symmetric types (Q8_0, Q4_0, ...): no biases to read
            half_scales(model)  # float16 scales (and biases): 1 bit a weight less
    mx.eval(model.parameters())
    if backend_name() == "cpu":
        if not dense:
            # the float32 scales and biases just replaced go back to the system, not kept free in
            # glibc's heap (the synthetic 1B Q8_0 model: 1622 -> 1290 MB resident after the load)
            mx.clear_cache()
            heap.release_free()
        if huge_pages:
            use_huge_pages(v for _, v in flat_parameters(model))  # fewer TLB misses per decode step
    _evaluate_constants(model)
    layers, kv, hd = _attention_shape(model)
    from mlx_engine.loading.catalogue import record_use

    record_use(src.name)  # `duet models`' "last used"
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=src.name,
        path=src.path,
        model_type=model_type,
        context_length=ctx,
        weight_format=fmt,
        num_layers=layers,
        n_kv_heads=kv,
        head_dim=hd,
        dtype=dtype,
        load_seconds=time.perf_counter() - t0,
    )


def _evaluate_constants(model: nn.Module) -> None:
    """Evaluate the arrays modules keep outside their parameters (YaRN's and LongRoPE's frequencies,
    ``_freqs``). Built lazily on the loading thread, they would otherwise first be computed inside a
    forward pass on the engine's thread, whose MLX streams differ ("no Stream(cpu, 0) in current
    thread")."""
    # mlx's Module keeps array attributes as dict items; ``parameters()`` leaves out "_"-named ones
    constants = [v for _, m in model.named_modules() for v in m.values() if isinstance(v, mx.array)]
    mx.eval(constants)


def _input_major_weights(model: nn.Module) -> None:
    """Store each dense ``Linear`` weight (out, in) as the transpose of a contiguous (in, out) array.

    ``Linear`` computes ``x @ W.T``; with OpenBLAS, a forward pass of the bundled model runs
    9-12% faster for one decode row and for prefill when ``W.T`` is the contiguous operand
    (``bench/linear_layout.py``, docs/BENCHMARKS.md). The module still sees an (out, in) array,
    so mlx-lm's model code is unchanged.
    """
    for _, m in model.named_modules():
        if type(m) is nn.Linear and m.weight.dtype == mx.float32:
            m.weight = mx.contiguous(m.weight.T).T
            mx.eval(m.weight)


def _load_hf_dir(src: ModelSource, dense: bool):
    from mlx_lm.utils import load_model as mlx_lm_load_model

    config = json.loads((src.path / "config.json").read_text())
    model_type = config.get("model_type", "?")
    try:
        model, config = mlx_lm_load_model(src.path, lazy=True)
    except ValueError as e:
        if "not supported" in str(e):
            raise ModelLoadError(f"unsupported architecture {model_type!r} in {src.path}: {e}") from e
        raise ModelLoadError(f"could not load {src.path}: {e}") from e
    quant = config.get("quantization")
    if quant and dense:
        from mlx_engine.loading.dequantize import dequantize_model

        model = dequantize_model(model, mx.float32)
        fmt = f"dense float32 (from {quant.get('bits')}-bit affine)"
    elif quant:
        fmt = f"quantized {quant.get('bits')}-bit affine (group {quant.get('group_size')})"
    else:
        dtype = _activation_dtype(model)
        if dense and backend_name() == "cpu" and dtype != mx.float32:
            # half-precision matmuls are slow on the CPU backend
            model.set_dtype(mx.float32)
        fmt = f"dense {str(_activation_dtype(model)).split('.')[-1]}"
    mx.eval(model.parameters())
    tokenizer = Tokenizer.from_hf_dir(src.path)
    ctx = int(config.get("max_position_embeddings") or config.get("max_seq_len") or 4096)
    return model, tokenizer, model_type, ctx, fmt
