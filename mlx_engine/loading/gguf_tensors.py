"""Read a GGUF file's tensors as MLX arrays: float tensors as they are, quantized blocks decoded by
``ggml_blocks`` into MLX's quantized layouts (or, ``dense``, into their exact float values).

A quantized weight (2-D, or 3-D for a mixture of experts' stacked expert matrices) kept quantized
becomes ``name.weight`` (packed uint32), ``name.scales`` and ``name.biases`` in MLX's affine layout,
groups of 32 along each row; an MXFP4 one becomes ``name.weight`` and ``name.scales`` (uint8 E8M0
exponents, no biases) in MLX's ``mxfp4`` mode. For the CPU kernels (``q6k=True``) a Q6_K one stays as
its file holds it: 6-bit codes in groups of 16, ``name.scales`` per 256 weights the block's float16
``d`` and its 16 int8 sub-scales (uint8, 18 bytes), ``name.biases`` the one ratio -32 (cpu_kernels'
``kSuper16``; MLX's own kernels have no groups of 16, so elsewhere it is re-coded at 8 bits).
``quantization_of`` says which ``nn.quantize`` parameters hold it.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_engine.errors import GGUFError
from mlx_engine.loading.ggml_blocks import Codes, Fp4Codes, decode, to_8bit_groups_of_32
from mlx_engine.loading.gguf_file import TensorInfo

GROUP_SIZE = 32  # MLX's group size for every quantized GGUF tensor (the smallest MLX has)
REQUANTIZED_BITS = 8  # Q6_K's and Q2_K's 16-weight groups, re-coded at 8 bits in groups of 32
Q6K_GROUP = 16  # Q6_K's own groups, as the CPU kernels read them (q6k=True)
_Q6K_BLOCK = 210  # bytes per Q6_K block: ql 128, qh 64, 16 int8 sub-scales at 192, float16 d at 208

_FLOAT_TYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}


_CHUNK_WEIGHTS = 1 << 22  # quantized tensors are decoded this many weights (whole rows) at a time


def _q6k_parts(raw: np.ndarray, codes: Codes) -> tuple[np.ndarray, np.ndarray]:
    """Some rows of a Q6_K tensor as the CPU kernels read it: (packed 6-bit codes, per block its d then
    its 16 sub-scales as bytes), the file's values exactly (``d * sc * (q - 32)``)."""
    rows = codes.q.shape[0]
    blocks = raw.reshape(rows, -1, _Q6K_BLOCK)
    scales = np.concatenate([blocks[..., 208:210], blocks[..., 192:208]], axis=-1).reshape(rows, -1)
    return codes.pack(), scales


def _quantized_parts(t: TensorInfo, codes: Codes | Fp4Codes) -> tuple[np.ndarray, ...]:
    """MLX's quantized form of some decoded rows: (packed, scales, biases) for the affine types,
    (packed, uint8 exponents) for MXFP4."""
    if isinstance(codes, Fp4Codes):
        if not codes.all_finite_exponents():
            raise GGUFError(
                f"tensor {t.name!r} has an MXFP4 block with exponent byte 255 (NaN in MLX's mxfp4 mode, "
                "2**127 in ggml's); load the model with dense weights"
            )
        return codes.pack(), codes.exponents
    if codes.group != GROUP_SIZE:  # Q2_K, Q6_K: 16-weight groups
        codes = to_8bit_groups_of_32(codes)
    return codes.pack(), codes.scales, codes.biases


def _tensor_arrays(t: TensorInfo, data: np.ndarray, dense: bool, q6k: bool = False) -> dict[str, mx.array]:
    """One GGUF tensor as MLX arrays: ``{name: values}``, or for a quantized weight kept quantized
    ``{name: packed, base.scales: ..., base.biases: ...}`` (MXFP4: no biases; with ``q6k`` a Q6_K
    weight in its own form, the biases the one ratio -32)."""
    shape = tuple(reversed(t.shape))  # GGUF lists the innermost dimension first
    if t.ggml_type in _FLOAT_TYPES:
        values = mx.array(data.view(_FLOAT_TYPES[t.ggml_type]).reshape(shape))
        return {t.name: values.view(mx.bfloat16) if t.ggml_type == "BF16" else values}
    rows, cols = t.rows_cols
    row_bytes = t.nbytes // rows
    as_float = dense or len(shape) not in (2, 3) or not t.name.endswith(".weight")
    native = q6k and not as_float and t.ggml_type == "Q6_K"
    parts: list[tuple[np.ndarray, ...]] = []
    # rows decode independently: in chunks, the NumPy temporaries stay small for any tensor size
    for r0 in range(0, rows, max(1, _CHUNK_WEIGHTS // cols)):
        r1 = min(rows, r0 + max(1, _CHUNK_WEIGHTS // cols))
        raw = data[r0 * row_bytes : r1 * row_bytes]
        codes = decode(raw, t.ggml_type, r1 - r0, cols)
        if as_float:
            parts.append((codes.to_float(),))
            continue
        if native and isinstance(codes, Codes):
            parts.append(_q6k_parts(raw, codes))
        else:
            parts.append(_quantized_parts(t, codes))
    arrays = [mx.array(np.concatenate(p) if len(p) > 1 else p[0]) for p in zip(*parts, strict=True)]
    if as_float:
        return {t.name: arrays[0].reshape(shape)}
    base, lead = t.name.removesuffix(".weight"), shape[:-1]  # (experts,) rows for a 3-D tensor
    packed, scales, *biases = (a.reshape(*lead, a.shape[-1]) for a in arrays)
    out = {t.name: packed, f"{base}.scales": scales}
    if biases:
        out[f"{base}.biases"] = biases[0]
    if native:
        out[f"{base}.biases"] = mx.array([-32.0])  # each group's bias is -32 times its scale
    return out


def read_tensors(
    path: Path, tensors: list[TensorInfo], dense: bool, q6k: bool = False
) -> dict[str, mx.array]:
    """Every tensor of ``path``, read from a memory map (``read_gguf`` checked their bounds); ``q6k``:
    Q6_K weights in their own form, for the CPU kernels."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    weights: dict[str, mx.array] = {}
    for t in tensors:
        arrays = _tensor_arrays(t, raw[t.offset : t.offset + t.nbytes], dense, q6k)
        # evaluated one tensor at a time: each tensor's decoding temporaries are freed before the next
        mx.eval(list(arrays.values()))
        weights.update(arrays)
    return weights


MXFP4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}  # nn.quantize's parameters for an MXFP4 tensor


def quantization_of(weights: dict[str, mx.array], base: str) -> dict:
    """``nn.quantize``'s parameters for the quantized tensor ``base`` (``base.weight`` packed,
    ``base.scales``): affine, a row of n weights packs into n*bits/32 uint32 words and has n/32
    float scales; MXFP4 (uint8 exponents for scales, no biases), MLX's ``mxfp4`` mode; Q6_K in its own
    form (uint8 scales and a biases: 6 bits in groups of 16, which only the CPU kernels read)."""
    packed, scales = weights[f"{base}.weight"], weights[f"{base}.scales"]
    if scales.dtype == mx.uint8 and f"{base}.biases" in weights:  # Q6_K as it is (the CPU kernels')
        return {"group_size": Q6K_GROUP, "bits": 6}
    if scales.dtype == mx.uint8:
        return dict(MXFP4)
    return {"group_size": GROUP_SIZE, "bits": packed.shape[-1] // scales.shape[-1]}
