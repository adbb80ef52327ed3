"""Decode ggml's quantized blocks (the tensor data of a GGUF file) with NumPy.

Every block type we load but MXFP4 is one of two affine forms over small groups of weights, with
unsigned integer codes ``q``:

- symmetric (Q4_0, Q5_0, Q8_0, Q6_K; IQ4_NL, IQ4_XS, IQ2_XXS at 8 bits, IQ3_XXS at 6):
  ``w = scale * (q - zero)`` with a fixed ``zero`` (8, 16, 128, 32, 31), and Q3_K, decoded straight
  to 8-bit codes in groups of 32 (see ``_q3_k``);
- with a minimum (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K; IQ3_S at 4 bits, IQ1_S at 2): ``w = scale * q + bias``.

The IQ types look values up in a codebook (IQ4: 16 int8 levels; IQ3/IQ2/IQ1: "grids" of 4 or 8
values, with sign bits), but each 32-weight group is still one float step times small integers, so
they are held as affine codes exactly (``_iq4_nl`` ... ``_iq1_s`` say how many bits each needs).
MXFP4 is not affine: 4-bit E2M1 floats with a power-of-two scale per 32 weights, decoded to
``Fp4Codes``, which MLX's own ``mxfp4`` mode holds as they are.

``decode()`` unpacks a tensor's bytes into ``Codes``: the codes, one scale and bias per group, the bit
width and group size. ``Codes.to_float()`` gives the values llama.cpp computes, bit for bit (every
product is exact in float32: an fp16 scale has 11 significant bits, a 6-bit sub-scale 6, a code at
most 8), and ``Codes.pack()`` writes the codes in MLX's packed affine layout: a little-endian bit
stream of ``bits``-wide fields in uint32 words, which is what ``mx.quantize`` produces for every bit
width. MLX's group size starts at 32, so the types decoded in groups of 32 (all but Q2_K and Q6_K)
map to MLX exactly: ``mx.dequantize`` of the packed form gives the same float32 values. Q2_K and Q6_K
have 16-weight groups; ``to_8bit_groups_of_32`` re-codes them for MLX (Q6_K exactly where it can).

Block layouts: llama.cpp's ``ggml/src/ggml-common.h`` (``block_q4_0`` ... ``block_q6_K``,
``block_iq4_nl`` ... ``block_mxfp4``); K-quants and the grid IQ types pack 256 weights in a
super-block with an fp16 ``d`` (and ``dmin``) and small sub-scales. The IQ grids and sign table are
taken from the ``gguf`` package at run time (``_grid``), not copied here.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

QK_K = 256  # weights per K-quant super-block


@dataclass(frozen=True)
class Codes:
    """A tensor of ``rows`` x ``cols`` weights as integer codes with a scale and bias per group."""

    q: np.ndarray  # uint8 (rows, cols), each code < 2**bits
    scales: np.ndarray  # float32 (rows, cols // group)
    biases: np.ndarray  # float32 (rows, cols // group); -zero * scale for symmetric types
    bits: int
    group: int
    zero: int | None  # the fixed zero point of a symmetric type, else None

    def to_float(self) -> np.ndarray:
        """The float32 weights (rows, cols), computed as llama.cpp does."""
        rows, cols = self.q.shape
        q = self.q.reshape(rows, cols // self.group, self.group)
        if self.zero is not None:
            w = self.scales[..., None] * (q.astype(np.float32) - np.float32(self.zero))
        else:
            w = self.scales[..., None] * q.astype(np.float32) + self.biases[..., None]
        return w.reshape(rows, cols)

    def pack(self) -> np.ndarray:
        """The codes in MLX's packed layout: uint32 (rows, cols * bits // 32)."""
        return pack_codes(self.q, self.bits)


# E2M1 (fp4) values doubled, by code: bit 3 is the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6
# (ggml's kvalues_mxfp4; doubled, so a scale 2**(e - 127) becomes ggml's 2**(e - 128))
_FP4_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


@dataclass(frozen=True)
class Fp4Codes:
    """An MXFP4 tensor of ``rows`` x ``cols`` weights: E2M1 codes with one E8M0 exponent per 32.

    Weight ``i`` is ``fp4(q[i]) * 2**(e - 127)`` for its group's exponent byte ``e``. MLX's ``mxfp4``
    mode holds exactly this (its scales are the same E8M0 bytes, uint8), so ``pack()`` only reorders
    the codes into MLX's sequential nibbles. One exception: MLX reads ``e = 255`` as NaN (the MX
    spec's meaning), ggml as 2**127; ggml's quantizer never writes it (``all_finite_exponents``)."""

    q: np.ndarray  # uint8 (rows, cols), each code < 16
    exponents: np.ndarray  # uint8 (rows, cols // 32)
    bits = 4
    group = 32

    def to_float(self) -> np.ndarray:
        """The float32 weights (rows, cols), computed as ggml does: ``kvalue[q] * 2**(e - 128)``."""
        rows, cols = self.q.shape
        half = np.ldexp(np.float32(1), self.exponents.astype(np.int32) - 128).astype(np.float32)
        w = _FP4_DOUBLED[self.q].reshape(rows, cols // 32, 32) * half[..., None]
        return w.reshape(rows, cols)

    def pack(self) -> np.ndarray:
        """The codes in MLX's mxfp4 layout: uint32 (rows, cols // 8), element ``i`` at bits 4i."""
        return pack_codes(self.q, 4)

    def all_finite_exponents(self) -> bool:
        """Whether MLX's mxfp4 mode reads every exponent as ggml does (none is 255)."""
        return not bool((self.exponents == 255).any())


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack ``bits``-wide codes (uint8, last axis a multiple of 32) into a little-endian bit stream of
    uint32 words, element ``i`` at bits ``[i * bits, (i + 1) * bits)``: MLX's affine layout."""
    rows, cols = q.shape
    q = np.ascontiguousarray(q, dtype=np.uint8)
    if bits == 8:
        packed = q
    elif bits == 4:  # code pairs as little-endian uint16: low byte 2k, high byte 2k + 1
        pairs = q.view("<u2")
        packed = ((pairs | (pairs >> np.uint16(4))) & np.uint16(0xFF)).astype(np.uint8)
    else:  # 8 codes of ``bits`` bits fill exactly ``bits`` bytes of a little-endian uint64
        eight = q.reshape(rows, cols // 8, 8)
        stream = np.zeros((rows, cols // 8), np.uint64)
        for i in range(8):
            stream |= eight[..., i].astype(np.uint64) << np.uint64(i * bits)
        packed = stream[..., None].view(np.uint8)[..., :bits]
    return np.ascontiguousarray(packed).reshape(rows, -1).view(np.uint32)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per block (the last axis) read as a little-endian fp16, widened to float32."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit packing of 32 weights: byte j holds weight j (low) and j + 16 (high)."""
    out = np.empty((*qs.shape[:-1], 32), np.uint8)
    np.bitwise_and(qs, np.uint8(0x0F), out=out[..., :16])
    np.right_shift(qs, np.uint8(4), out=out[..., 16:])
    return out


def _bits_of_u32(b: np.ndarray) -> np.ndarray:
    """Four bytes per block read as a little-endian uint32: its 32 bits, bit j at index j."""
    word = np.ascontiguousarray(b).view("<u4")
    return ((word >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)


def _per_row(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).reshape(x.shape[0], -1)


def _q4_0(b: np.ndarray) -> Codes:
    d = _f16(b[..., 0:2])
    return Codes(_nibbles(b[..., 2:18]), d, -8 * d, 4, 32, 8)


def _q4_1(b: np.ndarray) -> Codes:
    return Codes(_nibbles(b[..., 4:20]), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 4, 32, None)


def _q5_0(b: np.ndarray) -> Codes:
    d = _f16(b[..., 0:2])
    q = _nibbles(b[..., 6:22]) | (_bits_of_u32(b[..., 2:6]) << np.uint8(4))
    return Codes(q, d, -16 * d, 5, 32, 16)


def _q5_1(b: np.ndarray) -> Codes:
    q = _nibbles(b[..., 8:24]) | (_bits_of_u32(b[..., 4:8]) << np.uint8(4))
    return Codes(q, _f16(b[..., 0:2]), _f16(b[..., 2:4]), 5, 32, None)


def _q8_0(b: np.ndarray) -> Codes:
    d = _f16(b[..., 0:2])
    return Codes(b[..., 2:34] ^ np.uint8(0x80), d, -128 * d, 8, 32, 128)  # int8 + 128 as uint8


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs of a Q4_K/Q5_K super-block from its 12 packed bytes: pairs 0-3
    are the low 6 bits of bytes 0-3 and 4-7; pairs 4-7 take their low 4 bits from bytes 8-11 and their
    top 2 bits from the top of bytes 0-3 (scales) and 4-7 (mins)."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    six = np.uint8(0x3F)
    sc = np.concatenate([lo & six, (hi & np.uint8(0x0F)) | ((lo >> np.uint8(6)) << np.uint8(4))], axis=-1)
    mn = np.concatenate([mid & six, (hi >> np.uint8(4)) | ((mid >> np.uint8(6)) << np.uint8(4))], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K codes' low 4 bits: 128 bytes in 4 runs of 32; run i holds sub-block 2i in its low
    nibbles and sub-block 2i + 1 in its high nibbles."""
    runs = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    both = runs >> np.array([[0], [4]], dtype=np.uint8)
    return (both & np.uint8(0x0F)).reshape(*qs.shape[:-1], QK_K)


def _k_affine(b: np.ndarray, q: np.ndarray, bits: int) -> Codes:
    sc, mn = _k_scales(b[..., 4:16])
    scales = _f16(b[..., 0:2])[..., None] * sc
    biases = -(_f16(b[..., 2:4])[..., None] * mn)
    return Codes(q, _per_row(scales), _per_row(biases), bits, 32, None)


def _q4_k(b: np.ndarray) -> Codes:
    return _k_affine(b, _k_low_nibbles(b[..., 16:144]), 4)


def _q5_k(b: np.ndarray) -> Codes:
    # qh: 32 bytes; bit k of byte l is the fifth bit of weight l of sub-block k
    qh = b[..., 16:48]
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & np.uint8(1)
    q = _k_low_nibbles(b[..., 48:176]) | (high.reshape(*qh.shape[:-1], QK_K) << np.uint8(4))
    return _k_affine(b, q, 5)


def _q2_k(b: np.ndarray) -> Codes:
    """Q2_K, 84 bytes: scales[16] (low nibble: sub-scale, high nibble: min, per 16 weights), qs[64]
    (2-bit codes: half h, bit pair p of byte l holds weight 128h + 32p + l), d, dmin:
    ``w = d * sc * q - dmin * m``."""
    lead = b.shape[:-1]
    qs = b[..., 16:80].reshape(*lead, 2, 1, 32)
    q = ((qs >> np.array([[0], [2], [4], [6]], dtype=np.uint8)) & np.uint8(3)).reshape(*lead, QK_K)
    s = b[..., 0:16]
    scales = _f16(b[..., 80:82])[..., None] * (s & np.uint8(0x0F)).astype(np.float32)
    biases = -(_f16(b[..., 82:84])[..., None] * (s >> np.uint8(4)).astype(np.float32))
    return Codes(q, _per_row(scales), _per_row(biases), 2, 16, None)


def _q3_k(b: np.ndarray) -> Codes:
    """Q3_K, 110 bytes: hmask[32], qs[64], scales[12], d. Weight ``w = d * (sc - 32) * k`` with a 6-bit
    ``sc`` per 16 weights and ``k`` in [-4, 3]: low 2 bits in qs (half h, bit pair p of byte l: weight
    128h + 32p + l), and k = low - 4 where bit b of hmask[l] (weight 32b + l) is clear. The levels
    ``(sc - 32) * k`` of a group of 32 span at most 252, so 8-bit codes with step ``d`` hold the
    group exactly (``d * level`` is exact in float32, as llama.cpp's product is)."""
    lead = b.shape[:-1]
    qs = b[..., 32:96].reshape(*lead, 2, 1, 32)
    low = ((qs >> np.array([[0], [2], [4], [6]], dtype=np.uint8)) & np.uint8(3)).reshape(*lead, QK_K)
    hmask = b[..., 0:32].reshape(*lead, 1, 32)
    high = ((hmask >> np.arange(8, dtype=np.uint8)[:, None]) & np.uint8(1)).reshape(*lead, QK_K)
    k = low.astype(np.int16) - 4 * (1 - high.astype(np.int16))
    s = b[..., 96:108]
    lo4 = np.concatenate([s[..., 0:8] & np.uint8(0x0F), s[..., 0:8] >> np.uint8(4)], axis=-1)
    hi2 = ((s[..., 8:12, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & np.uint8(3)).swapaxes(-1, -2)
    sc = (lo4 | (hi2.reshape(*lead, 16) << np.uint8(4))).astype(np.int16) - 32
    levels = (sc[..., None] * k.reshape(*lead, 16, 16)).reshape(*lead, 8, 32)
    low_level = levels.min(axis=-1)
    d = _f16(b[..., 108:110])[..., None]
    q = (levels - low_level[..., None]).astype(np.uint8).reshape(*lead, QK_K)
    return Codes(q, _per_row(np.broadcast_to(d, low_level.shape)), _per_row(d * low_level), 8, 32, None)


def _q6_k(b: np.ndarray) -> Codes:
    """Two halves of 128 weights. In half h, ql[64h : 64h + 64] gives the low 4 bits (low nibbles:
    weights 0-63, high nibbles: 64-127) and qh[32h : 32h + 32] the top 2 bits (bit pairs 0, 2, 4, 6 of
    byte l: weights l, l + 32, l + 64, l + 96). Sixteen int8 sub-scales, one per 16 weights."""
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 64)
    low = np.concatenate([ql & np.uint8(0x0F), ql >> np.uint8(4)], axis=-1)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32)
    high = (qh >> np.array([[0], [2], [4], [6]], dtype=np.uint8)) & np.uint8(3)
    q = (low | (high.reshape(*lead, 2, 128) << np.uint8(4))).reshape(*lead, QK_K)
    sub = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    scales = _f16(b[..., 208:210])[..., None] * sub
    return Codes(q, _per_row(scales), _per_row(-32 * scales), 6, 16, 32)


# kvalues_iq4nl, the 16 int8 levels of IQ4_NL and IQ4_XS, as 8-bit codes level + 128
_IQ4_CODES = (
    np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]) + 128
).astype(np.uint8)


def _iq4_nl(b: np.ndarray) -> Codes:
    """IQ4_NL, 18 bytes: fp16 d, 16 bytes of 4-bit indices into kvalues_iq4nl (ggml's nibble order):
    ``w = d * kvalue``. The levels span 241 of 256 8-bit codes, so ``q = kvalue + 128`` on the step
    ``d`` is exact (4.5 bits a weight become 8: the price until a codebook kernel exists)."""
    d = _f16(b[..., 0:2])
    return Codes(_IQ4_CODES[_nibbles(b[..., 2:18])], d, -128 * d, 8, 32, 128)


def _iq4_xs(b: np.ndarray) -> Codes:
    """IQ4_XS, 136 bytes: fp16 d, scales_h (uint16: bits 2j, 2j + 1 are the top 2 bits of sub-block
    j's scale), scales_l[4] (low nibble: sub-block 2i, high: 2i + 1), qs[128] (16 bytes per 32-weight
    sub-block, as IQ4_NL): ``w = d * (ls - 32) * kvalue`` with a 6-bit ``ls``. As IQ4_NL, 8-bit codes
    ``kvalue + 128`` on the step ``d * (ls - 32)`` (at most 16 significant bits) are exact."""
    lead = b.shape[:-1]
    high = (
        np.ascontiguousarray(b[..., 2:4]).view("<u2") >> np.arange(0, 16, 2, dtype=np.uint16)
    ) & np.uint16(3)
    low = np.stack([b[..., 4:8] & np.uint8(0x0F), b[..., 4:8] >> np.uint8(4)], axis=-1).reshape(*lead, 8)
    ls = (low | (high.astype(np.uint8) << np.uint8(4))).astype(np.float32) - np.float32(32)
    step = _f16(b[..., 0:2])[..., None] * ls
    q = _IQ4_CODES[_nibbles(b[..., 8:136].reshape(*lead, 8, 16))].reshape(*lead, QK_K)
    return Codes(q, _per_row(step), _per_row(-128 * step), 8, 32, 128)


def _mxfp4(b: np.ndarray) -> Fp4Codes:
    """MXFP4, 17 bytes: the E8M0 exponent byte, then 16 bytes of E2M1 codes (ggml's nibble order)."""
    return Fp4Codes(_nibbles(b[..., 1:17]), np.ascontiguousarray(b[..., 0]))


@functools.cache
def _grid(type_name: str) -> np.ndarray:
    """ggml's lattice codebook of an IQ type (iq2xxs_grid, iq3xxs_grid, iq3s_grid, iq1s_grid), from the
    ``gguf`` package's copy, as int16 (entries, values per entry)."""
    from gguf import quants

    table = getattr(quants, type_name)
    table.init_grid()
    return np.rint(table.grid).astype(np.int16).reshape(table.grid_shape)


@functools.cache
def _ksign_bits() -> np.ndarray:
    """ggml's ksigns_iq2xs as flags: 7-bit index -> 8 uint8, 1 where the weight is negative (the eighth
    sign makes the number of negatives even)."""
    from gguf.quants import IQ2_XXS

    signs = np.frombuffer(IQ2_XXS.ksigns, np.uint8)
    return (signs[:, None] >> np.arange(8, dtype=np.uint8)) & np.uint8(1)


_SIGN_SHIFTS = np.array([0, 7, 14, 21], np.uint32)  # four 7-bit sign indices in a uint32


def _signed(grid_values: np.ndarray, negative: np.ndarray) -> np.ndarray:
    return np.where(negative.astype(bool), -grid_values, grid_values)


def _iq2_xxs(b: np.ndarray) -> Codes:
    """IQ2_XXS, 66 bytes: fp16 d, then per 32 weights two uint32: four grid indices (one byte each,
    8 weights of iq2xxs_grid: values 8, 25, 43) and four 7-bit sign indices with a 4-bit ``ls`` on
    top: ``w = d * (0.5 + ls) / 4 * g * sign``. The levels ``g * sign`` lie in [-43, 43]: 8-bit codes
    ``level + 128`` on the step ``d * (0.5 + ls) / 4`` (16 significant bits) are exact."""
    lead = b.shape[:-1]
    qs = b[..., 2:66].reshape(*lead, 8, 8)
    aux = np.ascontiguousarray(qs[..., 4:8]).view("<u4")[..., 0]  # (..., 8)
    negative = _ksign_bits()[(aux[..., None] >> _SIGN_SHIFTS) & np.uint32(0x7F)]  # (..., 8, 4, 8)
    levels = _signed(_grid("IQ2_XXS")[qs[..., 0:4]], negative)
    ls = (aux >> np.uint32(28)).astype(np.float32)
    step = _f16(b[..., 0:2])[..., None] * (np.float32(0.5) + ls) * np.float32(0.25)
    q = (levels + 128).astype(np.uint8).reshape(*lead, QK_K)
    return Codes(q, _per_row(step), _per_row(-128 * step), 8, 32, 128)


def _iq3_xxs(b: np.ndarray) -> Codes:
    """IQ3_XXS, 98 bytes: fp16 d, qs[64] (grid indices, 4 weights each of iq3xxs_grid: values 4, 12,
    ..., 52, 62), then per 32 weights a uint32 of four 7-bit sign indices and a 4-bit ``ls`` on top:
    ``w = d * (0.5 + ls) / 2 * g * sign``. Every level is even, ``g * sign / 2`` in [-31, 31]: 6-bit
    codes ``level / 2 + 31`` on the step ``d * (0.5 + ls)`` are exact."""
    lead = b.shape[:-1]
    grid = _grid("IQ3_XXS")[b[..., 2:66]].reshape(*lead, 8, 4, 8)
    aux = np.ascontiguousarray(b[..., 66:98]).view("<u4")  # (..., 8)
    negative = _ksign_bits()[(aux[..., None] >> _SIGN_SHIFTS) & np.uint32(0x7F)]
    q = (_signed(grid, negative) // 2 + 31).astype(np.uint8).reshape(*lead, QK_K)
    step = _f16(b[..., 0:2])[..., None] * (np.float32(0.5) + (aux >> np.uint32(28)).astype(np.float32))
    return Codes(q, _per_row(step), _per_row(-31 * step), 6, 32, 31)


def _iq3_s(b: np.ndarray) -> Codes:
    """IQ3_S, 110 bytes: fp16 d, qs[64] (low 8 bits of 9-bit indices into iq3s_grid, 4 weights each:
    values 1, 3, ..., 15), qh[8] (bit i of byte m: the 9th bit of index 8m + i), signs[32] (bit i of
    byte m: weight 8m + i is negative), scales[4] (a 4-bit ``sc`` per 32 weights, low nibble first):
    ``w = d * (1 + 2 sc) * g * sign``. The levels are the 16 odd numbers in [-15, 15]: 4-bit codes
    ``(level + 15) / 2`` on the step ``2 d (1 + 2 sc)`` with bias ``-15 d (1 + 2 sc)`` are exact."""
    lead = b.shape[:-1]
    bit = np.arange(8, dtype=np.uint8)
    ninth = ((b[..., 66:74, None] >> bit) & np.uint8(1)).reshape(*lead, 64).astype(np.uint16)
    grid = _grid("IQ3_S")[b[..., 2:66].astype(np.uint16) | (ninth << np.uint16(8))].reshape(*lead, QK_K)
    negative = ((b[..., 74:106, None] >> bit) & np.uint8(1)).reshape(*lead, QK_K)
    q = ((_signed(grid, negative) + 15) // 2).astype(np.uint8)
    sc = np.stack([b[..., 106:110] & np.uint8(0x0F), b[..., 106:110] >> np.uint8(4)], axis=-1)
    db = _f16(b[..., 0:2])[..., None] * (1 + 2 * sc.reshape(*lead, 8)).astype(np.float32)
    return Codes(q, _per_row(2 * db), _per_row(-15 * db), 4, 32, None)


def _iq1_s(b: np.ndarray) -> Codes:
    """IQ1_S, 50 bytes: fp16 d, qs[32] (low 8 bits of 11-bit indices into iq1s_grid, 8 weights each:
    values -1, 0, 1), then a uint16 per 32 weights (bits 3k..3k + 2: the top bits of index k; bits
    12-14: ``sc``; bit 15: the sign of ``delta``): ``w = d (2 sc + 1) (g + delta)``, delta = +-1/8.
    Per group that is 2-bit codes ``g + 1`` on the step ``d (2 sc + 1)`` with bias
    ``d (2 sc + 1) (delta - 1)``, exact (the step has 15 significant bits, ``delta - 1`` 4)."""
    lead = b.shape[:-1]
    qh = np.ascontiguousarray(b[..., 34:50]).view("<u2")  # (..., 8)
    top = (qh[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & np.uint16(7)  # (..., 8, 4)
    grid = _grid("IQ1_S")[b[..., 2:34].reshape(*lead, 8, 4).astype(np.uint16) | (top << np.uint16(8))]
    step = _f16(b[..., 0:2])[..., None] * (2 * ((qh >> np.uint16(12)) & np.uint16(7)) + 1).astype(np.float32)
    delta = np.where(qh & np.uint16(0x8000), np.float32(-0.125), np.float32(0.125))
    q = (grid + 1).astype(np.uint8).reshape(*lead, QK_K)
    return Codes(q, _per_row(step), _per_row(step * (delta - np.float32(1))), 2, 32, None)


@dataclass(frozen=True)
class BlockType:
    name: str
    weights: int  # per block
    nbytes: int  # per block
    decode: Callable[[np.ndarray], Codes | Fp4Codes]  # (rows, blocks, nbytes) uint8 -> (rows, blocks, ...)


BLOCK_TYPES: dict[str, BlockType] = {
    t.name: t
    for t in (
        BlockType("Q4_0", 32, 18, _q4_0),
        BlockType("Q4_1", 32, 20, _q4_1),
        BlockType("Q5_0", 32, 22, _q5_0),
        BlockType("Q5_1", 32, 24, _q5_1),
        BlockType("Q8_0", 32, 34, _q8_0),
        BlockType("Q2_K", QK_K, 84, _q2_k),
        BlockType("Q3_K", QK_K, 110, _q3_k),
        BlockType("Q4_K", QK_K, 144, _q4_k),
        BlockType("Q5_K", QK_K, 176, _q5_k),
        BlockType("Q6_K", QK_K, 210, _q6_k),
        BlockType("IQ4_NL", 32, 18, _iq4_nl),
        BlockType("IQ4_XS", QK_K, 136, _iq4_xs),
        BlockType("MXFP4", 32, 17, _mxfp4),
        BlockType("IQ2_XXS", QK_K, 66, _iq2_xxs),
        BlockType("IQ3_XXS", QK_K, 98, _iq3_xxs),
        BlockType("IQ3_S", QK_K, 110, _iq3_s),
        BlockType("IQ1_S", QK_K, 50, _iq1_s),
    )
}


def decode(raw: np.ndarray, type_name: str, rows: int, cols: int) -> Codes | Fp4Codes:
    """Unpack the bytes of a ``rows`` x ``cols`` tensor of block type ``type_name`` (``cols`` a
    multiple of the block's weights; the caller checked the byte count)."""
    t = BLOCK_TYPES[type_name]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // t.weights, t.nbytes)
    c = t.decode(blocks)
    if isinstance(c, Fp4Codes):
        return Fp4Codes(np.ascontiguousarray(c.q).reshape(rows, cols), c.exponents.reshape(rows, -1))
    return Codes(
        np.ascontiguousarray(c.q).reshape(rows, cols),
        _per_row(c.scales),
        _per_row(c.biases),
        c.bits,
        c.group,
        c.zero,
    )


def to_8bit_groups_of_32(codes: Codes) -> Codes:
    """Codes in 16-weight groups (Q6_K, Q2_K) as MLX's 8-bit affine form with groups of 32.

    Q2_K's two sub-blocks in a group have their own minimum, which one bias cannot hold: its values
    are rounded to the nearest of 256 levels over the group's range (``_round_to_8_bits``), off by at
    most half a level. Q6_K is exact where it can be:

    A group of 32 is two sub-blocks with steps ``s1``, ``s2`` (``d * sc``) and codes ``k`` in [-32, 31].
    With ``b`` the larger of ``|s1|``, ``|s2|``, an 8-bit step ``S = b / m`` holds the larger sub-block
    exactly (its levels are ``m * k``, 64m of them: m <= 4 fits 256 codes), and the other one exactly
    when ``m * s_small / b`` is a whole number (e.g. equal sub-scales); otherwise its values round to
    the nearest level, off by at most ``S / 2``. Per group we take the largest m of 4, 2, 1 that is
    exact, else m = 4 (it always fits unless the two sub-scales are opposite and equal in size, and
    then m = 2 is exact). So every weight is exact (to float32 rounding: ``S * q + bias`` rounds where
    ``d * sc * k`` did not) or within 1/8 of its group's larger Q6_K step ``b``. The result is symmetric
    like Q6_K itself: codes are level + 128 and every bias is ``-128 * S`` (zero point 128), so the CPU
    kernels keep no biases for it (``cpu_kernels.scales.implicit_biases``: 8.5 bits a weight, not 9).
    """
    assert codes.group == 16
    if codes.zero is None:
        return _round_to_8_bits(codes.to_float())
    rows, cols = codes.q.shape
    # Blocks of rows, two at a time (NumPy leaves the GIL inside each operation): every group is
    # decided on its own, so the result is the same as the whole tensor's at once. A 3B model's
    # 49152 x 3072 output layer at once took 3.3 GB of temporaries and 16-18 s here; in blocks, each m
    # tried only on the groups still open (_q6_rows_to_8bit), ~90 MB and 0.8 s (the same codes).
    starts = range(0, rows, _ROW_BLOCK)
    with ThreadPoolExecutor(min(2, os.cpu_count() or 1)) as pool:
        parts = list(
            pool.map(
                lambda r: _q6_rows_to_8bit(
                    codes.q[r : r + _ROW_BLOCK], codes.scales[r : r + _ROW_BLOCK], codes.zero or 0
                ),
                starts,
            )
        )
    q = np.concatenate([p[0] for p in parts])
    step = np.concatenate([p[1] for p in parts])
    return Codes(q, step, -128 * step, 8, 32, 128)


_ROW_BLOCK = 512  # rows of a 16-weight-group tensor re-coded at once (to_8bit_groups_of_32)


def _q6_rows_to_8bit(q16: np.ndarray, scales: np.ndarray, zero: int) -> tuple[np.ndarray, np.ndarray]:
    """``to_8bit_groups_of_32`` for some rows of a symmetric 16-weight-group tensor: (codes, steps),
    symmetric again: codes = level + 128, each bias -128 steps (so the CPU kernels store none:
    ``cpu_kernels.scales.implicit_biases``). Each group takes the largest m of 4, 2, 1 whose rounded
    levels lie in [-128, 127], trying each m only on the groups still open. That is the largest exact
    m wherever one is exact: the levels at m are exactly half those at 2m (one more division by a
    power of two), so a group exact at some m is exact at every larger one, and rounding levels that
    are whole numbers leaves them as they are."""
    rows, cols = q16.shape
    steps = scales.reshape(rows * (cols // 32), 2, 1)
    values = (steps * (q16.reshape(-1, 2, 16).astype(np.float32) - np.float32(zero))).reshape(-1, 32)
    # one per group of 32: the larger sub-block's step with its sign, so that its levels 4k (k in
    # [-32, 31]) lie in [-128, 124] whichever its sign
    pair = steps[..., 0]
    big = np.where(np.abs(pair[:, 0]) >= np.abs(pair[:, 1]), pair[:, 0], pair[:, 1])
    chosen_q = np.full(values.shape, 128, np.float32)  # level 0
    chosen_step = np.zeros_like(big)
    unsized = ~np.isfinite(pair).all(axis=1)  # a NaN or infinite scale: its step NaN
    chosen_step[unsized] = np.float32(np.nan)
    idx = np.flatnonzero((big != 0) & ~unsized)  # all-zero groups keep step 0
    for m in (4, 2, 1):
        step = big[idx] / np.float32(m)  # exact: m is a power of two
        rounded = np.rint(values[idx] / step[:, None])
        # at m = 4 the larger sub-block's levels 4k lie in [-128, 124]; only a smaller one of the
        # opposite sign and the same size reaches 128, and m = 2 then holds both exactly
        ok = (rounded.min(axis=1) >= -128) & (rounded.max(axis=1) <= 127)
        take = idx[ok]
        chosen_q[take] = rounded[ok] + 128
        chosen_step[take] = step[ok]
        idx = idx[~ok]
    assert idx.size == 0  # m = 1: levels in [-32, 31]
    return chosen_q.reshape(rows, cols).astype(np.uint8), chosen_step.reshape(rows, -1)


def _round_to_8_bits(w: np.ndarray) -> Codes:
    """Float rows as 8-bit codes in groups of 32, round to nearest: step (max - min) / 255, bias min."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // 32, 32)
    low, high = groups.min(axis=-1), groups.max(axis=-1)
    step = (high - low) / np.float32(255)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint((groups - low[..., None]) / step[..., None]), 0)
    return Codes(q.clip(0, 255).astype(np.uint8).reshape(rows, cols), step, low, 8, 32, None)
