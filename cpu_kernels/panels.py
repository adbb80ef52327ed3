"""Q4_K, Q5_K and Q6_K layers in 16-row panels: the layout the panel kernel reads.

On AVX-512 VNNI each 4- or 5-bit layer with two-level scales (a GGUF's Q4_K or Q5_K, after
``scales.two_level_scales``) and each Q6_K layer (6-bit codes in groups of 16 with the file's own
scales), a mixture of experts' stacks too, expert by expert, is regrouped by 16 rows
(``src/panels.h``): one 64-byte load then holds 4 codes of each of 16 rows (Q6_K: their low nibbles,
their top two bits in a third load per 16 values), one ``vpdpbusd`` multiplies them with 4 values of a
row of x broadcast to every lane (Q5_K: their fifth bits joined from a fifth load per 32 values), and
16 outputs accumulate side by side, where the row form unpacks a row's codes per row of x and sums each
output horizontally. One thread, a 1B model's matrices: one
row of x 35 -> 71-77 GMAC/s, 8-16 rows 62-67 -> 130-147, 64 rows 107-110 -> 128-133 (the int8 GEMM).
Exact math runs on the same kernel with each row of x split into three int8 planes (as the exact
integer kernels split it: float32's accuracy, within float32's rounding of the row form's results).
The bytes are the same (4.625 bits a weight, Q5_K 5.625, Q6_K 6.5625); the values are the same
(``dequantize`` reads panels bit for bit as the row form). The layer's scales say which form it is in:
``(N / 16, K / 16 * 10)`` instead of ``(N, K / 256 * 10)`` (Q6_K: 18 for 10).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from cpu_kernels.modules import SWITCH_LINEARS, CPUQuantizedEmbedding, CPUQuantizedLinear
from cpu_kernels.qmm import PANEL_ROWS, panel_form
from cpu_kernels.spec import extension


def in_panels(layer: nn.Module) -> bool:
    """Whether a kernel layer holds its weights in 16-row panels: its scales say so, one row of them
    per 16 weight rows (the kernels read the form from the same shapes)."""
    scales = layer.get("scales")
    w = layer.get("weight")
    return scales is not None and w is not None and panel_form(w, scales)


def _candidates(model: nn.Module) -> list[nn.Module]:
    """Kernel layers with two-level scales, N a multiple of 16 and K of 256: linear layers, embeddings
    (a tied LM head is the panel kernel's product; lookups dequantize an id's panel) and expert stacks,
    with 4- or 5-bit codes in groups of 32 (Q4_K, Q5_K) or Q6_K's 6-bit codes in groups of 16 (its
    one-element bias ratio)."""
    out: list[nn.Module] = []
    for _, layer in model.named_modules():
        if type(layer) not in (CPUQuantizedLinear, CPUQuantizedEmbedding, *SWITCH_LINEARS.values()):
            continue
        k32 = (layer.bits, layer.group_size) in ((4, 32), (5, 32))  # Q4_K, Q5_K
        q6k = (layer.bits, layer.group_size) == (6, 16) and layer["biases"].size == 1
        if not (k32 or q6k):
            continue
        w = layer["weight"]
        n, k = w.shape[-2], w.shape[-1] * 32 // layer.bits
        if layer["scales"].dtype == mx.uint8 and n % PANEL_ROWS == 0 and k % 256 == 0:
            out.append(layer)
    return out


def use_panels(model: nn.Module, on: bool) -> list[nn.Module]:
    """Put the model's eligible layers into the panel form (``on``) or back into the row form; returns
    the layers that changed (their new arrays are evaluated). Nothing changes where the panel kernel
    cannot run (no AVX-512 VNNI) and ``on`` is asked. A stack of experts converts as one (a panel never
    straddles two experts: N is a multiple of 16)."""
    ext = extension()
    if ext is None or (on and not ext.panel_kernel()):
        return []
    changed = []
    for layer in _candidates(model):
        if in_panels(layer) == on:
            continue
        layer["weight"], layer["scales"], layer["biases"] = ext.panel_layout(
            layer["weight"], layer["scales"], layer["biases"], on
        )
        changed.append(layer)
    return changed
