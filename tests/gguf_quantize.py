"""Write quantized GGUF files for tests, without llama.cpp or a network.

- ``quantize(w, qtype)``: float32 rows -> valid ggml blocks of any type we load but the grid IQ types.
  Q2_K ... Q6_K, IQ4_NL and IQ4_XS are written here with NumPy from llama.cpp's block layouts (simple
  round-to-nearest / nearest codebook value: the files only have to be valid, not as good as
  llama-quantize's); the 32-weight types and MXFP4 use the ``gguf`` package's own quantizers.
  ``quantize`` checks every result with ``gguf``'s dequantizer, an implementation independent of
  Duet's (mlx_engine/loading/ggml_blocks.py). The grid types (IQ2_XXS, IQ3_XXS, IQ3_S, IQ1_S) have no
  quantizer here: ``quantize_and_decode`` writes random valid blocks on the row's scale in their place
  (``random_blocks_like``), for tiny models whose reference takes the values ``gguf`` decodes.
- ``write_tiny_gguf(path, arch, ...)``: a tiny random model written as llama.cpp's converter writes it,
  with a chosen type per tensor kind.
- ``q4_k_m_type``: the tensor type llama.cpp's Q4_K_M mix gives a llama tensor (llama.cpp's
  ``src/llama-quant.cpp``: Q6_K for the tied embedding/output and for attn_v/ffn_down of the "more bits"
  layers, Q4_K elsewhere, and Q5_0/Q8_0 in place of Q4_K/Q6_K where rows are not multiples of 256).
- ``requantize(src, dst, type_for, twin=...)``: rewrite a real GGUF (the bundled SmolLM2) with other
  tensor types, and its float32 twin: every tensor as the F32 values ``gguf`` decodes the new file's to.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from tokenizers.pre_tokenizers import ByteLevel

Q = gguf.GGMLQuantizationType
QK_K = 256

# the largest |error| a valid block may have, as a fraction of its row's largest |weight|: half a step
# for round-to-nearest (Q4_0 and Q5_0 clip one end of the range by a whole step, as llama.cpp does), plus
# what a K-quant's rounded-up 6-bit sub-scales and mins add
_MAX_ERROR = {
    Q.Q4_0: 1 / 8, Q.Q4_1: 1 / 15, Q.Q5_0: 1 / 16, Q.Q5_1: 1 / 31, Q.Q8_0: 1.1 / 254,
    Q.Q2_K: 2 / 3 * 0.5 * 17 / 15 + 1 / 15,  # 4 levels over the range (up to 2x the largest |w|)
    Q.Q3_K: 1 / 4 + 1 / 30,  # 8 levels, +4 steps clipped to +3
    Q.Q4_K: 1 / 15 + 1 / 50, Q.Q5_K: 1 / 31 + 1 / 50, Q.Q6_K: 1.1 / 62,
    # the widest gap between kvalues_iq4nl's levels (113 -> 127 at the end, 24 between 89 and 113)
    # with the largest |w| of the block at -127 steps; IQ4_XS's 6-bit sub-scales, rounded up, add
    # a 31st of a step; MXFP4: the scale is 2**floor(log2 max) / 4, so 6 x it clips the top
    Q.IQ4_NL: 14 / 127, Q.IQ4_XS: 14 / 127 * (1 + 1 / 31), Q.MXFP4: 1 / 4,
}  # fmt: skip
GRID_TYPES = (Q.IQ2_XXS, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S)
# the largest |level| of a grid type's weight, in units of its fp16 d (the largest sub-scale times the
# largest grid value): random blocks with d = max|w| / this stay on the row's scale
_GRID_REACH = {Q.IQ2_XXS: 15.5 / 4 * 43, Q.IQ3_XXS: 15.5 / 2 * 62, Q.IQ3_S: 31 * 15, Q.IQ1_S: 15 * 1.125}


# ---- K-quants --------------------------------------------------------------------------------------


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> the 12 bytes of a Q4_K/Q5_K super-block (ggml's get_scale_min_k4
    reads them back): bytes 0-3 / 4-7 hold scales / mins 0-3 and, in their top 2 bits, the top 2 bits
    of scales / mins 4-7; bytes 8-11 hold the low 4 bits of scale 4-7 (low nibble) and min 4-7."""
    lo = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    mid = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([lo, mid, hi], axis=1).astype(np.uint8)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _quantize_k_affine(blocks: np.ndarray, bits: int) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K: per 32-weight sub-block w = d*sc*q - dmin*m, sc and m 6-bit, d and dmin fp16."""
    x = blocks.reshape(-1, 8, 32)
    levels = (1 << bits) - 1
    low = np.minimum(x.min(-1), 0.0)
    sub_scale, sub_min = (x.max(-1) - low) / levels, -low
    d = (sub_scale.max(-1) / 63).astype(np.float16)
    dmin = (sub_min.max(-1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.ceil(sub_scale / d32), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dmin32 > 0, np.ceil(sub_min / dmin32), 0).clip(0, 63).astype(np.uint8)
        step, offset = d32 * sc, dmin32 * mn
        q = np.where(step[..., None] > 0, np.rint((x + offset[..., None]) / step[..., None]), 0)
    q = q.clip(0, levels).astype(np.uint8)  # (blocks, 8 sub-blocks, 32)
    # low 4 bits: run i of 32 bytes holds sub-block 2i (low nibble) and 2i + 1 (high nibble)
    qs = (q[:, 0::2] & 0x0F) | ((q[:, 1::2] & 0x0F) << 4)
    header = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn)], axis=1)
    return header, qs.reshape(len(x), 128), q


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    header, qs, _ = _quantize_k_affine(blocks, 4)
    return np.concatenate([header, qs], axis=1)


def _quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    header, qs, q = _quantize_k_affine(blocks, 5)
    # qh: bit k of byte l is the fifth bit of weight l of sub-block k
    fifth = (q >> 4) & 1  # (blocks, 8, 32)
    qh = np.bitwise_or.reduce(fifth << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    return np.concatenate([header, qh.astype(np.uint8), qs], axis=1)


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: per 16-weight sub-block w = d*sc*(q - 32), sc int8, d fp16, q 6-bit."""
    x = blocks.reshape(-1, 16, 16)
    sub_scale = np.abs(x).max(-1) / 31
    d = (sub_scale.max(-1) / 127).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.ceil(sub_scale / d32), 0).clip(0, 127).astype(np.int8)
        step = d32 * sc
        q = np.where(step[..., None] > 0, np.rint(x / step[..., None]), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(len(x), 2, 128)  # two halves of 128
    # half h: ql byte l (0-63) = low 4 bits of weights l and l + 64; qh byte l (0-31) = top 2 bits of
    # weights l, l + 32, l + 64, l + 96 in bit pairs 0, 2, 4, 6
    ql = (q[..., :64] & 0x0F) | ((q[..., 64:] & 0x0F) << 4)
    top = q.reshape(len(x), 2, 4, 32) >> 4
    qh = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)
    parts = [ql.reshape(len(x), 128), qh.reshape(len(x), 64), sc.view(np.uint8), _f16_bytes(d)]
    return np.concatenate(parts, axis=1).astype(np.uint8)


def _quantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    """Q2_K: per 16-weight sub-block w = d*sc*q - dmin*m, sc and m 4-bit, d and dmin fp16, q 2-bit."""
    x = blocks.reshape(-1, 16, 16)
    n = len(x)
    low = np.minimum(x.min(-1), 0.0)
    sub_scale, sub_min = (x.max(-1) - low) / 3, -low
    d = (sub_scale.max(-1) / 15).astype(np.float16)
    dmin = (sub_min.max(-1) / 15).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.ceil(sub_scale / d32), 0).clip(0, 15).astype(np.uint8)
        mn = np.where(dmin32 > 0, np.ceil(sub_min / dmin32), 0).clip(0, 15).astype(np.uint8)
        step, offset = d32 * sc, dmin32 * mn
        q = np.where(step[..., None] > 0, np.rint((x + offset[..., None]) / step[..., None]), 0)
    q = q.clip(0, 3).astype(np.uint8).reshape(n, 2, 4, 32)
    # half h, bit pair p of byte l holds weight 128h + 32p + l
    qs = np.bitwise_or.reduce(q << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=2).reshape(n, 64)
    return np.concatenate([sc | (mn << 4), qs, _f16_bytes(d), _f16_bytes(dmin)], axis=1).astype(np.uint8)


def _quantize_q3_k(blocks: np.ndarray) -> np.ndarray:
    """Q3_K: per 16-weight sub-block w = d*(sc - 32)*k, sc 6-bit, d fp16, k in [-4, 3]."""
    x = blocks.reshape(-1, 16, 16)
    n = len(x)
    sub_scale = np.abs(x).max(-1) / 4
    d = (sub_scale.max(-1) / 31).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.ceil(sub_scale / d32), 0).clip(0, 31).astype(np.int16)
        step = d32 * sc
        k = np.where(step[..., None] > 0, np.rint(x / step[..., None]), 0)
    k = k.clip(-4, 3).astype(np.int16).reshape(n, QK_K)
    low = (k & 3).astype(np.uint8)  # k + 4 where k < 0, else k
    high = (k >= 0).astype(np.uint8)
    # qs: half h, bit pair p of byte l holds weight 128h + 32p + l; hmask: bit b of byte l, weight 32b + l
    qs = np.bitwise_or.reduce(low.reshape(n, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=2)
    hmask = np.bitwise_or.reduce(high.reshape(n, 8, 32) << np.arange(8, dtype=np.uint8)[:, None], axis=1)
    sc6 = (sc + 32).astype(np.uint8)  # stored as sc + 32: sub-scales 0..31 here
    low_nibbles = (sc6[:, 0:8] & 0x0F) | ((sc6[:, 8:16] & 0x0F) << 4)
    top = (sc6 >> 4).reshape(n, 4, 4)  # [pair p][byte j]: scale 4p + j
    high_pairs = np.bitwise_or.reduce(top << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=1)
    parts = [hmask, qs.reshape(n, 64), low_nibbles, high_pairs, _f16_bytes(d)]
    return np.concatenate(parts, axis=1).astype(np.uint8)


# ---- IQ4 -----------------------------------------------------------------------------------------

IQ4_LEVELS = np.array(gguf.quants.IQ4_NL.kvalues, np.float32)  # kvalues_iq4nl


def _nearest_iq4(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Indices of the kvalues nearest ``x / step`` (step 0: the level nearest 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(step != 0, x / step, 0.0)
    return np.abs(t[..., None] - IQ4_LEVELS).argmin(-1).astype(np.uint8)


def _iq4_nibbles(q: np.ndarray) -> np.ndarray:
    """32 four-bit indices -> ggml's 16 bytes: byte l holds weight l (low nibble) and l + 16 (high)."""
    return q[..., :16] | (q[..., 16:] << 4)


def _signed_extreme(x: np.ndarray) -> np.ndarray:
    """The value of largest magnitude of each row of the last axis, with its sign."""
    return np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]


def _quantize_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    """IQ4_NL: w = d * kvalue, d fp16, the block's largest |w| at kvalue -127 (as llama.cpp)."""
    d = (-_signed_extreme(blocks) / 127).astype(np.float16)
    q = _nearest_iq4(blocks, d.astype(np.float32)[:, None])
    return np.concatenate([_f16_bytes(d), _iq4_nibbles(q)], axis=1).astype(np.uint8)


def _quantize_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS: per 32-weight sub-block w = d * (ls - 32) * kvalue, ls 6-bit, d fp16; each sub-block's
    own step (its largest |w| at -127) rounded away from zero to a multiple of d, so nothing clips."""
    x = blocks.reshape(-1, 8, 32)
    n = len(x)
    own = -_signed_extreme(x) / 127  # (blocks, 8)
    d = (np.abs(own).max(-1) / 31).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sub = np.where(d32 > 0, np.sign(own) * np.ceil(np.abs(own) / d32), 0).clip(-32, 31)
    q = _nearest_iq4(x, (d32 * sub)[..., None])
    ls = (sub + 32).astype(np.uint8)  # (blocks, 8)
    scales_h = np.bitwise_or.reduce(
        (ls >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16)), axis=1
    )
    scales_l = (ls[:, 0::2] & 0x0F) | ((ls[:, 1::2] & 0x0F) << 4)
    parts = [_f16_bytes(d), scales_h.reshape(n, 1).view(np.uint8), scales_l, _iq4_nibbles(q).reshape(n, 128)]
    return np.concatenate(parts, axis=1).astype(np.uint8)


_K_QUANTIZERS: dict[Q, Callable[[np.ndarray], np.ndarray]] = {
    Q.Q2_K: _quantize_q2_k,
    Q.Q3_K: _quantize_q3_k,
    Q.Q4_K: _quantize_q4_k,
    Q.Q5_K: _quantize_q5_k,
    Q.Q6_K: _quantize_q6_k,
    Q.IQ4_NL: _quantize_iq4_nl,
    Q.IQ4_XS: _quantize_iq4_xs,
}


def quantize(w: np.ndarray, qtype: Q) -> np.ndarray:
    """Float rows (..., cols) -> ggml blocks (..., bytes per row) of ``qtype``, checked with ``gguf``'s
    dequantizer: every weight decodes to within ``_MAX_ERROR`` of its value."""
    return quantize_and_decode(w, qtype)[0]


def dequantize(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """``gguf``'s own dequantizer (the oracle), float32."""
    return np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)


def quantize_and_decode(w: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray]:
    """(``quantize(w, qtype)``, the float32 values ``gguf``'s dequantizer decodes it to)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype in (Q.F32, Q.F16, Q.BF16):
        raw = gguf.quants.quantize(w, qtype)
        return raw, dequantize(raw, qtype)
    if qtype in GRID_TYPES:  # no quantizer: random valid blocks on the row's scale (see the docstring)
        raw = random_blocks_like(w, qtype, np.random.default_rng(w.size))
        return raw, dequantize(raw, qtype)
    if qtype in _K_QUANTIZERS:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        assert w.shape[-1] % block == 0, f"{qtype.name} needs rows of multiples of {block} weights"
        raw = _K_QUANTIZERS[qtype](w.reshape(-1, block)).reshape(*w.shape[:-1], w.shape[-1] // block * size)
    else:
        raw = gguf.quants.quantize(w, qtype)
    back = dequantize(raw, qtype)
    # (5% more for the fp16 rounding of the scales and mins)
    bound = 1.05 * _MAX_ERROR[qtype] * np.abs(w).max(axis=-1, keepdims=True) + 1e-7
    assert back.shape == w.shape and np.all(np.abs(back - w) <= bound), qtype.name
    return raw, back


# byte offsets of each block's fp16 fields (scale d, and dmin/min where there is one)
F16_FIELDS = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
    Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
    Q.IQ4_NL: [0], Q.IQ4_XS: [0], Q.IQ2_XXS: [0], Q.IQ3_XXS: [0], Q.IQ3_S: [0], Q.IQ1_S: [0], Q.MXFP4: [],
}  # fmt: skip
E8M0_FIELDS = {Q.MXFP4: 0}  # byte offset of a block's E8M0 exponent (scale 2**(e - 127))


def random_blocks(
    qtype: Q, rows: int, blocks: int, rng: np.random.Generator, scale: float | np.ndarray = 0.01
) -> np.ndarray:
    """Random bytes for every field (so every bit of every code and sub-scale is exercised), with
    finite fp16 scales (normal, ``scale`` their standard deviation; per row if an array of
    (rows, 1)) and E8M0 exponents in [110, 135] (scales 2**-17 ... 2**8)."""
    weights, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        d = (rng.standard_normal((rows, blocks)) * scale).astype(np.float16)
        raw[..., at : at + 2] = d[..., None].view(np.uint8)
    if qtype in E8M0_FIELDS:
        raw[..., E8M0_FIELDS[qtype]] = rng.integers(110, 136, (rows, blocks))
    return raw.reshape(rows, blocks * size)


def random_blocks_like(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks of a grid IQ type for the rows of ``w`` (..., cols), their fp16 ``d`` about
    max|w| / the type's reach, so the decoded rows have about ``w``'s scale (not its values)."""
    rows = int(np.prod(w.shape[:-1]))
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    scale = np.abs(w.reshape(rows, -1)).max(-1, keepdims=True) / _GRID_REACH[qtype]
    raw = random_blocks(qtype, rows, w.shape[-1] // block, rng, scale)
    return raw.reshape(*w.shape[:-1], -1)


# ---- llama.cpp's Q4_K_M mix ---------------------------------------------------------------------------


def _more_bits(layer: int, n_layers: int) -> bool:
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def q4_k_m_type(name: str, cols: int, n_layers: int, tied: bool) -> Q | None:
    """The type llama-quantize's Q4_K_M gives tensor ``name`` (rows of ``cols`` weights) of a llama
    model, or None for tensors it leaves as they are (norms, 1-D tensors)."""
    if not name.endswith(".weight") or "norm" in name or name == "rope_freqs.weight":
        return None
    qtype = Q.Q4_K
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return Q.Q6_K if cols % QK_K == 0 else Q.Q8_0
    if name.startswith("blk."):
        layer, kind = int(name.split(".")[1]), name.split(".")[2]
        if kind in ("attn_v", "ffn_down") and _more_bits(layer, n_layers):
            qtype = Q.Q6_K
    return _FALLBACK[qtype] if cols % QK_K else qtype


# ---- rewriting real GGUF files ------------------------------------------------------------------------


def _copy_metadata(reader: gguf.GGUFReader, dst: Path) -> gguf.GGUFWriter:
    writer = gguf.GGUFWriter(str(dst), arch=reader.get_field("general.architecture").contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.alignment"):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    return writer


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def requantize(
    src: Path, dst: Path, type_for: Callable[[str, int], Q | None], *, twin: Path | None = None
) -> dict[str, Q]:
    """Write ``src`` re-quantized to ``dst``: tensor ``name`` with rows of ``cols`` weights becomes
    ``type_for(name, cols)`` (None: F32), from the values ``gguf`` decodes it to. ``twin``, if given,
    gets the float32 twin of ``dst``: the same metadata, every tensor as the F32 values ``gguf``'s
    dequantizer decodes ``dst``'s to. Returns the type of every tensor of ``dst``."""
    reader = gguf.GGUFReader(str(src))
    writers = [_copy_metadata(reader, dst)] + ([_copy_metadata(reader, twin)] if twin else [])
    types = {}
    for t in reader.tensors:
        values = dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        qtype = type_for(t.name, values.shape[-1]) or Q.F32
        if qtype == Q.F32:
            raw = back = values
        else:
            raw, back = quantize_and_decode(values, qtype)
        writers[0].add_tensor(t.name, raw, raw_dtype=None if qtype == Q.F32 else qtype)
        if twin:
            writers[1].add_tensor(t.name, back)
        types[t.name] = qtype
    for w in writers:
        _finish(w)
    return types


def float32_twin(src: Path, dst: Path) -> None:
    """Write ``src``'s float32 twin to ``dst``: its metadata, every tensor as the F32 values ``gguf``'s
    dequantizer decodes it to."""
    requantize(src, dst, lambda _name, _cols: None)


# ---- tiny GGUF files written the way llama.cpp's converter writes them ---------------------------------

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
TINY_IDS = mx.array([[1, 40, 41, 260, 261, 70, 3, 90, 100, 2, 45, 46, 47, 48]])


def gguf_name(key: str) -> str:
    """mlx-lm parameter name -> llama.cpp tensor name."""
    module, part = key.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, layer, rest = module.split(".", 3)
        return f"blk.{layer}.{_GGUF_NAMES[rest]}.{part}"
    return f"{_GGUF_NAMES[module]}.{part}"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama Q/K rows (HF rotate-half -> interleaved)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_freq_factors(head_dim: int, base: float, s: dict) -> np.ndarray:
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


def tiny_config(arch: str, **overrides) -> dict:
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
    return config | overrides


def tiny_model(arch: str, config: dict) -> nn.Module:
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
    qtypes: dict[str, Q] | Callable[[str], Q] | None = None,
    rope_scaling: dict | None = None,
    gguf_arch: str | None = None,
    config: dict | None = None,
) -> nn.Module:
    """Write a tiny random ``arch`` model as llama.cpp would, and return the mlx-lm model whose logits
    the loaded file must reproduce (its weights replaced by the values the file's blocks decode to, by
    the ``gguf`` package's own dequantizer). ``qtypes`` maps GGUF tensor kinds ("attn_q", "output") to
    a type, or is a function of the full tensor name; the rest stays F32. ``config`` overrides the
    tiny config (``tiny_config``)."""
    config = tiny_config(arch, **(config or {}))
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    model = tiny_model(arch, config)
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
        factors = llama3_freq_factors(config["head_dim"], config["rope_theta"], rope_scaling)
        writer.add_tensor("rope_freqs.weight", factors)

    def type_of(name: str) -> Q:
        if callable(qtypes):
            return qtypes(name)
        return (qtypes or {}).get(name.split(".")[-2], Q.F32)

    return write_model_tensors(
        writer,
        model,
        name_of=gguf_name,
        qtype_of=lambda name, _shape: type_of(name),
        stored_values=lambda name, w: w + 1.0 if arch == "gemma" and name.endswith("norm.weight") else w,
        permuted_heads=(config["num_attention_heads"], config["num_key_value_heads"])
        if arch == "llama"
        else None,
    )


def write_model_tensors(
    writer: gguf.GGUFWriter,
    model: nn.Module,
    *,
    name_of: Callable[[str], str],
    qtype_of: Callable[[str, tuple[int, ...]], Q],
    stored_values: Callable[[str, np.ndarray], np.ndarray],
    permuted_heads: tuple[int, int] | None,
) -> nn.Module:
    """Add ``model``'s parameters to ``writer`` as llama.cpp's converter would and write the file:
    each under ``name_of(key)``, its values changed as the converter changes them
    (``stored_values``: Gemma's norms + 1), quantized to ``qtype_of(name, shape)``, then Q and K rows
    permuted for ggml's RoPE when ``permuted_heads`` (query, key/value heads) says so, as for llama
    (quantization works row by row, so it commutes with the permutation). Returns ``model`` with the values the file decodes to."""
    decoded = []
    for key, value in tree_flatten(model.parameters()):
        name = name_of(key)
        w = stored_values(name, np.array(value, dtype=np.float32))
        qtype = qtype_of(name, w.shape)
        stored = w
        if qtype != Q.F32:
            stored, w = quantize_and_decode(w, qtype)
            decoded.append((key, mx.array(w)))
        if permuted_heads and name.split(".")[-2] in ("attn_q", "attn_k"):
            stored = llama_cpp_permute(stored, permuted_heads[0 if ".attn_q." in name else 1])
        writer.add_tensor(name, stored, raw_dtype=None if qtype == Q.F32 else qtype)
    _finish(writer)
    model.update(tree_unflatten(decoded))
    mx.eval(model.parameters())
    return model
    model.update(tree_unflatten(decoded))
    mx.eval(model.parameters())
    return model


def llama_cpp_quantize(src: Path, dst: Path, ftype_name: str) -> None:
    """Quantize ``src`` to ``dst`` with llama.cpp's own quantizer (``llama_model_quantize`` through
    llama-cpp-python; the caller skips where it is not installed). ``ftype_name``: e.g. "Q4_K_M",
    "Q8_0", "MXFP4_MOE" (llama.cpp's ``LLAMA_FTYPE_MOSTLY_<name>``)."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0, f"llama.cpp could not quantize {src.name} to {ftype_name}"


def llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits at every position of ``ids`` for the GGUF at ``path`` (float32 KV cache,
    so only the weights' and activations' arithmetic differ from ours)."""
    import llama_cpp

    f32 = 0  # GGML_TYPE_F32
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=max(64, len(ids)), n_batch=max(64, len(ids)), logits_all=True,
        verbose=False, n_threads=2, type_k=f32, type_v=f32,
    )  # fmt: skip
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)])
