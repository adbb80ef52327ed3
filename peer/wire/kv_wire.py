"""KV arrays <-> LAYER_KV payloads, in the receiver's pool format (bit-exact).

The parts of one layer's token range are the pool's arrays for those tokens, in pool order: K and V
``(T, n_kv_heads, head_dim)`` in the activation dtype, or with ``kv_bits`` the affine triplets
K.q ``uint32 (T, H, head_dim * bits / 32)``, K.scales, K.biases ``(T, H, head_dim / group)`` and the
same for V. bfloat16 has no numpy dtype, so it moves as its uint16 bits; everything is little-endian.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from peer.wire.framing import Frame, encode_frame
from peer.wire.handshake import check_supported
from peer.wire.protocol import Hello, LayerKV, bad_frame

MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
DTYPE_NAMES = {v: k for k, v in MX_DTYPES.items()}
# how each dtype travels: numpy has no bfloat16, its bits go as uint16
NP_WIRE: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
}
U32 = np.dtype("<u4")


@dataclass(frozen=True)
class KVFormat:
    """One side's pool format: what every LAYER_KV frame to it must hold, part by part."""

    num_layers: int
    n_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: str
    kv_bits: int | None
    group_size: int
    max_tokens: int

    @classmethod
    def from_hello(cls, hello: Hello) -> KVFormat:
        check_supported(hello)
        spec = hello.layers[0]
        return cls(
            hello.num_layers,
            spec.n_kv_heads,
            spec.head_dim,
            spec.v_head_dim,
            hello.dtype,
            hello.kv_bits,
            hello.kv_group_size,
            hello.max_tokens,
        )

    @classmethod
    def from_pool(cls, pool, max_tokens: int) -> KVFormat:
        """``pool``: an ``mlx_engine.kv_cache.kv_pool.KVPool``."""
        return cls(
            pool.num_layers,
            pool.n_kv_heads,
            pool.head_dim,
            pool.v_head_dim,
            DTYPE_NAMES[pool.dtype],
            pool.kv_bits,
            pool.group_size,
            max_tokens,
        )

    def part_specs(self, ntok: int) -> list[tuple[tuple[int, ...], np.dtype]]:
        """(shape, wire dtype) of each payload part for ``ntok`` tokens."""
        act = NP_WIRE[self.dtype]
        out: list[tuple[tuple[int, ...], np.dtype]] = []
        for dim in (self.head_dim, self.v_head_dim):
            if self.kv_bits is None:
                out.append(((ntok, self.n_kv_heads, dim), act))
                continue
            groups = (ntok, self.n_kv_heads, dim // self.group_size)
            out += [((ntok, self.n_kv_heads, dim * self.kv_bits // 32), U32), (groups, act), (groups, act)]
        return out

    def nbytes(self, ntok: int) -> int:
        return sum(int(np.prod(shape)) * dt.itemsize for shape, dt in self.part_specs(ntok))

    def check_frame(self, msg: LayerKV) -> int:
        """Validate a LAYER_KV header against this format; returns its payload size."""
        if msg.layer >= self.num_layers:
            raise bad_frame(f"LAYER_KV layer {msg.layer} of a {self.num_layers}-layer model")
        if msg.t1 > self.max_tokens:
            raise bad_frame(f"LAYER_KV tokens up to {msg.t1} exceed the {self.max_tokens}-token limit")
        if (msg.dtype, msg.kv_bits) != (self.dtype, self.kv_bits) or (
            self.kv_bits and msg.group_size != self.group_size
        ):
            raise bad_frame(
                f"LAYER_KV format {msg.dtype}/kv_bits={msg.kv_bits}/group={msg.group_size} is not this "
                f"pool's {self.dtype}/kv_bits={self.kv_bits}/group={self.group_size}"
            )
        specs = self.part_specs(msg.t1 - msg.t0)
        if msg.shapes != [list(shape) for shape, _ in specs]:
            raise bad_frame(f"LAYER_KV part shapes {str(msg.shapes)[:80]} do not match the pool's")
        return self.nbytes(msg.t1 - msg.t0)


def to_wire(part) -> np.ndarray:
    """One part (mx.array or numpy; bfloat16 included) as a C-contiguous little-endian numpy
    array that ``memoryview`` can send without a copy."""
    if isinstance(part, mx.array):
        if part.dtype == mx.bfloat16:
            part = part.view(mx.uint16)
        part = np.asarray(part)
    part = np.ascontiguousarray(part)
    if part.dtype.byteorder == ">":
        part = part.astype(part.dtype.newbyteorder("<"))
    return part


def encode_layer(
    fmt: KVFormat, request_id: str, load_id: int, layer: int, t0: int, t1: int, parts
) -> list[memoryview | bytes]:
    """A LAYER_KV frame (buffers for ``send_frame``) carrying ``parts`` in ``fmt``."""
    specs = fmt.part_specs(t1 - t0)
    arrays = [to_wire(p) for p in parts]
    if len(arrays) != len(specs):
        raise ValueError(f"{len(arrays)} KV parts for a format with {len(specs)}")
    for a, (shape, dt) in zip(arrays, specs, strict=True):
        if a.shape != shape or a.dtype != dt:
            raise ValueError(f"KV part {a.dtype}{a.shape} is not the wire's {dt}{shape}")
    msg = LayerKV(
        request_id,
        load_id,
        layer,
        t0,
        t1,
        fmt.dtype,
        fmt.kv_bits,
        fmt.group_size,
        [list(shape) for shape, _ in specs],
    )
    return encode_frame(msg.to_header(), arrays)


def decode_layer(frame: Frame, fmt: KVFormat) -> list[np.ndarray]:
    """The parts of a LAYER_KV frame as numpy views into its (pooled) payload buffer: convert
    them (``to_mx``) before releasing the frame."""
    msg = frame.msg
    assert isinstance(msg, LayerKV) and frame.payload is not None
    buf = frame.payload.array
    out, offset = [], 0
    for shape, dt in fmt.part_specs(msg.t1 - msg.t0):
        count = int(np.prod(shape))
        out.append(np.frombuffer(buf, dt, count, offset).reshape(shape))
        offset += count * dt.itemsize
    return out


# the exponent bits of each wire float: all ones is an Inf or a NaN
_EXPONENT: dict[str, tuple[np.dtype, int]] = {
    "float32": (np.dtype("<u4"), 0x7F800000),
    "float16": (np.dtype("<u2"), 0x7C00),
    "bfloat16": (np.dtype("<u2"), 0x7F80),
}


def nonfinite_part(parts: list[np.ndarray], fmt: KVFormat) -> int | None:
    """The index of the first part holding a NaN or an Inf, or None: a full scan of every float part
    (K, V, or a quantized pool's scales and biases; packed codes are any bits), on the exponent bits
    as integers (~16-28 GB/s on one Zen 4 core, above any link's rate: docs/peers.md)."""
    bits, mask = _EXPONENT[fmt.dtype]
    for i, p in enumerate(parts):
        if p.dtype == U32 and fmt.kv_bits is not None:
            continue  # packed quantized codes
        if p.size and int(np.bitwise_and(p.view(bits), mask).max()) == mask:
            return i
    return None


def to_mx(parts: list[np.ndarray], fmt: KVFormat) -> list[mx.array]:
    """Wire parts -> mx arrays in the pool's dtypes (copies: the frame may be released after)."""
    out = []
    for p in parts:
        a = mx.array(p)
        if fmt.dtype == "bfloat16" and p.dtype == np.uint16:
            a = a.view(mx.bfloat16)
        out.append(a)
    return out
