"""Hold the kernel layers' scales and biases in fewer bytes: fewer bytes for every decoded token.

``two_level_scales`` (run first) keeps a K-quant's two levels where the loaded float32 scales have
them exactly; ``half_scales`` stores the rest in float16.


A GGUF's blocks load as MLX affine groups of 32 with a float32 scale and bias each (``mlx_engine/
loading/ggml_blocks.py``): 2 bits of overhead per weight, so a 4-bit layer is read as 6 bits a weight
where the file's Q4_K holds 4.5. A decode step streams every weight once, and on the CPU the memory
bus, not arithmetic, sets its speed, so those bits are time. In float16 they are 1 bit a weight
(4-bit layers 6 -> 5 bits, 8-bit 10 -> 9, 5-bit 7 -> 6).

What it costs in accuracy: float16 keeps 11 significant bits, so each scale and bias moves by at
most 2^-11 of itself (2^-25 absolute below float16's normal range), a weight ``s * q + b`` by at most
``q * 2^-11`` of a quantization step: under 1% of a step for 4-bit codes, under 1/8 for 8-bit, where
the step itself is the quantization's error. Many types lose nothing: Q8_0, Q4_0, Q4_1, Q5_0 and
Q5_1 store their scales (and minimums) as float16 already, and ``-zero * scale`` of the symmetric
types is a power of two times the scale, so it rounds as the scale does. A layer whose scales or biases
would overflow float16 (a magnitude above 65504) keeps float32. The kernels read float16 scales with
F16C's ``vcvtph2ps`` and compute in float32 as before; a layer's output keeps the dtype it had (the
promotion of float32 x with float16 scales is float32), and the quantized embedding's lookup
computes in its original dtype (:class:`~cpu_kernels.modules.CPUQuantizedEmbedding`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from cpu_kernels.modules import CPUQuantizedEmbedding, is_kernel_layer
from cpu_kernels.spec import extension

_F16_MAX = 65504.0
_SUPER_GROUPS = 8  # groups of 32 per K-quant super-block (256 weights)


def _kernel_layers(model: nn.Module) -> list[nn.Module]:
    """The layers whose products are the CPU kernels' (``use_cpu_kernels`` switched them)."""
    return [
        layer
        for _, layer in model.named_modules()
        if is_kernel_layer(layer) and layer.get("biases") is not None and layer["scales"].dtype == mx.float32
    ]


def half_scales(model: nn.Module) -> int:
    """Store the float32 scales and biases of the model's CPU-kernel layers as float16, in place,
    where none overflows; returns how many layers changed. Run after ``use_cpu_kernels``."""
    layers = _kernel_layers(model)
    peaks = [mx.maximum(mx.abs(layer["scales"]).max(), mx.abs(layer["biases"]).max()) for layer in layers]
    mx.eval(peaks)
    changed = 0
    for layer, peak in zip(layers, peaks, strict=True):
        if not peak.item() <= _F16_MAX:  # type: ignore[operator]  # also a NaN: leave such a layer as it was
            continue
        if isinstance(layer, CPUQuantizedEmbedding):
            layer.lookup_dtype = layer["scales"].dtype
        layer["scales"] = layer["scales"].astype(mx.float16)
        layer["biases"] = layer["biases"].astype(mx.float16)
        mx.eval(layer["scales"], layer["biases"])  # one layer's float32 copy alive at a time
        changed += 1
    return changed


def _two_level_candidates(model: nn.Module) -> list[nn.Module]:
    """Kernel layers that could hold two-level scales: 4- or 5-bit, groups of 32, float32 scales and
    biases, rows of a multiple of 256 weights."""
    return [
        layer
        for layer in _kernel_layers(model)
        if layer.bits in (4, 5)
        and layer.group_size == 32
        and layer["biases"].dtype == mx.float32
        and layer["scales"].shape[-1] % _SUPER_GROUPS == 0
    ]


def two_level_scales(model: nn.Module) -> int:
    """Store the scales and biases of the model's 4- and 5-bit CPU-kernel layers in the K-quants' own
    two levels (a float16 step per 256 weights and a uint8 multiple per 32), where they are exactly
    that; returns how many layers changed. Run after ``use_cpu_kernels``, before ``half_scales``.

    A Q4_K or Q5_K tensor loads as float32 scales ``d * sc`` and biases ``-dmin * m`` per group of 32
    (``mlx_engine/loading/ggml_blocks.py``), products of a float16 and a 6-bit whole number, so this
    form holds them without loss, where float16 rounds each to 11 bits: 0.625 bits a weight of
    overhead instead of 1 (a Q4_K layer 4.625 bits a weight to read per token, the file's 4.5)."""
    ext = extension()
    if ext is None:
        return 0
    changed = 0
    for layer in _two_level_candidates(model):
        # the step tried per 8 groups is their largest magnitude / 63, what a Q4_K/Q5_K super-block
        # holds (llama.cpp rounds its largest 6-bit sub-scale and min to 63); every value is then
        # checked, so anything else (a Q4_1 file's float16 per group) is left as it is
        scales, biases = ext.two_level_scales(layer["scales"]), None
        if scales is not None:
            biases = ext.two_level_scales(layer["biases"])
        if scales is None or biases is None:
            continue
        if isinstance(layer, CPUQuantizedEmbedding):
            layer.lookup_dtype = layer["scales"].dtype
        layer["scales"], layer["biases"] = scales, biases
        mx.eval(scales, biases)
        changed += 1
    return changed


def _zero_point(scales: mx.array, biases: mx.array) -> float | None:
    """The ratio r with every bias exactly r times its group's scale in float32 (a symmetric type's
    -zero: Q8_0's -128, Q4_0's -8, IQ3_XXS's -31), or None."""
    s32, b32 = scales.astype(mx.float32), biases.astype(mx.float32)
    at = mx.argmax(mx.abs(s32).reshape(-1))
    s, b = float(s32.reshape(-1)[at].item()), float(b32.reshape(-1)[at].item())  # type: ignore[arg-type]
    if not s or not b or not -256 < b / s < 0:
        return None
    r = float(round(b / s))  # the candidate zero point (b is s * r rounded); then checked exactly
    return r if mx.array_equal(b32, s32 * r).item() else None


def implicit_biases(model: nn.Module) -> int:
    """Drop the biases of the model's CPU-kernel layers where each is exactly a fixed multiple of its
    scale (a symmetric type: Q8_0, Q4_0, Q5_0, IQ4_NL, IQ4_XS, IQ2_XXS, IQ3_XXS), keeping that ratio as
    a one-element ``biases``: the kernels then compute each bias as ratio * scale (bit for bit the
    stored value), and the layer reads half the bytes of overhead (Q8_0 8.5 bits a weight with float16
    scales, the file's, instead of 9). Returns how many layers changed. Run after ``two_level_scales``,
    before ``half_scales``."""
    changed = 0
    for layer in _kernel_layers(model):
        biases = layer["biases"]
        if biases.size == 1 or biases.shape != layer["scales"].shape:
            continue
        r = _zero_point(layer["scales"], biases)
        if r is None:
            continue
        if isinstance(layer, CPUQuantizedEmbedding) and layer.lookup_dtype is None:
            layer.lookup_dtype = biases.dtype
        layer["biases"] = mx.array([r], dtype=biases.dtype)
        changed += 1
    return changed
