"""Duet's peer protocol: message types, their typed headers, and the checks run on a peer's HELLO.

A frame is ``u32 length`` (big-endian) + a msgpack header (a map with ``type`` and the fields of
one of the dataclasses below, plus the frame fields ``nbytes`` and ``checksum``) + a raw payload of
exactly ``nbytes`` bytes. Framing, sockets and buffers are in ``peer/framing.py``; the HELLO
checks in ``peer/handshake.py``; KV arrays <-> payload bytes in ``peer/kv_wire.py``; the whole
protocol is described in ``docs/peer-protocol.md``.

Decoding is strict about the fields it knows (type, range) and ignores keys it does not know, so a
newer peer can add fields without breaking an older one. Every violation raises ``ProtocolError``
with a typed ``ErrorCode``; callers branch on the code, never on the message.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

import msgpack

from mlx_engine.errors import DuetError

PROTOCOL_MIN = 1
PROTOCOL_MAX = 1
MAX_HEADER_BYTES = 64 * 1024  # headers are small: prompts and KV travel as payload
U64 = 1 << 64

# activation dtypes a pool (and so the wire) may hold; bf16 travels as its uint16 bits
WIRE_DTYPES = ("float32", "float16", "bfloat16")
SUPPORTED_LAYER_KINDS = ("full", "sliding")  # each writes its own full KV exactly once


class MsgType(StrEnum):
    HELLO = "hello"
    PREFILL = "prefill"
    ACCEPT = "accept"
    BUSY = "busy"
    LAYER_KV = "layer_kv"
    DONE = "done"
    ERROR = "error"
    CANCEL = "cancel"


class ErrorCode(StrEnum):
    VERSION = "version"  # no protocol version in common
    FINGERPRINT = "fingerprint"  # the two sides run different models
    UNSUPPORTED_MODEL = "unsupported_model"  # layers that do not each write their own KV once
    BUSY = "busy"
    BAD_FRAME = "bad_frame"  # malformed header, unknown type, wrong field, size not matching shapes
    TRUNCATED = "truncated"  # the connection closed inside a frame
    CHECKSUM = "checksum"
    MAC = "mac"  # a frame failed its MAC on a trusted link (corrupted, replayed, reordered, injected)
    TIMEOUT = "timeout"  # no byte from the peer within the stall deadline
    DISCONNECTED = "disconnected"  # connection reset or refused
    CANCELLED = "cancelled"
    INTERNAL = "internal"  # also what an error code this version does not know decodes to


class ProtocolError(DuetError):
    """A peer protocol failure; ``code`` says which kind (a caller falls back to local prefill)."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


def bad_frame(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_FRAME, message)


# --- messages ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerSpec:
    """One layer's KV as the pool stores it. ``kind``: full, sliding (supported), or e.g. shared,
    mla, linear, ssm (refused)."""

    kind: str
    n_kv_heads: int
    head_dim: int
    v_head_dim: int
    window: int | None = None


@dataclass(frozen=True)
class Message:
    TYPE: ClassVar[MsgType]

    def check(self) -> None:
        """Field relations beyond their types; raises ``ProtocolError(BAD_FRAME)``."""

    def to_header(self) -> dict[str, Any]:
        self.check()
        return {"type": self.TYPE.value, **_to_plain(self)}


@dataclass(frozen=True)
class Hello(Message):
    """Both sides send one first. The model identity is ``model_fingerprint``; the numerics
    profile (``numerics()``) decides whether a remote prefill is bit-exact."""

    TYPE = MsgType.HELLO
    protocol_min: int
    protocol_max: int
    model_fingerprint: str
    backend: str  # cpu, metal, cuda
    mlx_version: str
    mlx_lm_version: str
    weight_format: str
    dtype: str  # activation dtype, one of WIRE_DTYPES
    block_size: int
    kv_bits: int | None
    kv_group_size: int
    num_layers: int
    layers: list[LayerSpec]
    max_tokens: int  # the longest prompt a PREFILL to this side may carry

    def check(self) -> None:
        if not 1 <= self.protocol_min <= self.protocol_max:
            raise bad_frame(f"HELLO protocol range {self.protocol_min}..{self.protocol_max} is empty")
        if self.dtype not in WIRE_DTYPES:
            raise bad_frame(f"HELLO dtype {self.dtype!r} is not one of {', '.join(WIRE_DTYPES)}")
        if self.kv_bits not in (None, 4, 8):
            raise bad_frame(f"HELLO kv_bits {self.kv_bits} is not 4, 8 or none")
        if self.block_size < 1 or self.kv_group_size < 1 or self.max_tokens < 1:
            raise bad_frame("HELLO block_size, kv_group_size and max_tokens must be positive")
        if self.num_layers < 1 or len(self.layers) != self.num_layers:
            raise bad_frame(f"HELLO has {len(self.layers)} layer specs for {self.num_layers} layers")

    def numerics(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "mlx": self.mlx_version,
            "mlx_lm": self.mlx_lm_version,
            "dtype": self.dtype,
            "kv_bits": self.kv_bits,
            "kv_group_size": self.kv_group_size if self.kv_bits else None,
        }


@dataclass(frozen=True)
class Prefill(Message):
    """Compute KV for a prompt and send ``[start, n_tokens - 1)``. The token ids are the payload
    (``n_tokens`` little-endian uint32). ``chunk_size`` is the decoder's prefill chunk: the peer
    computes on the same grid anchored at token 0, or its KV is not bit-exact."""

    TYPE = MsgType.PREFILL
    request_id: str
    load_id: int
    n_tokens: int
    start: int  # leading tokens the decoder already holds
    chunk_size: int

    def check(self) -> None:
        if not 0 <= self.start < self.n_tokens - 1:
            raise bad_frame(f"PREFILL start {self.start} leaves nothing to send of {self.n_tokens} tokens")
        if self.chunk_size < 1:
            raise bad_frame("PREFILL chunk_size must be positive")


@dataclass(frozen=True)
class Accept(Message):
    """The peer takes the request: it holds ``hit`` leading tokens in its own prefix cache and
    computes ``n_tokens - 1 - hit``; ``eta_s`` is when it expects to finish, from its live queue."""

    TYPE = MsgType.ACCEPT
    request_id: str
    load_id: int
    hit: int
    eta_s: float


@dataclass(frozen=True)
class Busy(Message):
    TYPE = MsgType.BUSY
    request_id: str
    load_id: int
    retry_after_s: float


@dataclass(frozen=True)
class LayerKV(Message):
    """One layer's KV for tokens ``[t0, t1)``; the payload is the parts in order (K, V, or the
    quantized triplets K.q, K.scales, K.biases, V.q, V.scales, V.biases), each C-contiguous."""

    TYPE = MsgType.LAYER_KV
    request_id: str
    load_id: int
    layer: int
    t0: int
    t1: int
    dtype: str  # the pool's activation dtype (bfloat16 parts travel as uint16)
    kv_bits: int | None
    group_size: int
    shapes: list[list[int]]

    def check(self) -> None:
        if self.t0 >= self.t1:
            raise bad_frame(f"LAYER_KV token range [{self.t0}, {self.t1}) is empty")


@dataclass(frozen=True)
class Done(Message):
    TYPE = MsgType.DONE
    request_id: str
    load_id: int
    tokens_computed: int
    compute_s: float


@dataclass(frozen=True)
class Error(Message):
    """A refusal or failure; ``request_id`` is None for one about the whole connection."""

    TYPE = MsgType.ERROR
    code: ErrorCode
    message: str
    request_id: str | None = None
    load_id: int | None = None


@dataclass(frozen=True)
class Cancel(Message):
    TYPE = MsgType.CANCEL
    request_id: str
    load_id: int


MESSAGES: dict[str, type[Message]] = {
    c.TYPE.value: c for c in (Hello, Prefill, Accept, Busy, LayerKV, Done, Error, Cancel)
}

# --- header encoding / decoding ----------------------------------------------------------------


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [_to_plain(x) for x in obj]
    if isinstance(obj, StrEnum):
        return obj.value
    return obj


def pack_header(header: dict[str, Any]) -> bytes:
    raw = msgpack.packb(header, use_bin_type=True)
    if len(raw) > MAX_HEADER_BYTES:
        raise bad_frame(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    return raw


def unpack_header(raw: bytes | memoryview) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated classes for malformed input
        raise bad_frame(f"undecodable header: {type(e).__name__}") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise bad_frame("header is not a map with a string 'type'")
    return header


def _convert(value: Any, tp: Any, name: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is types.UnionType:  # X | None
        if value is None:
            return None
        return _convert(value, args[0], name)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < U64:
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            if value >= 0:
                return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is ErrorCode:
        if isinstance(value, str):
            return ErrorCode(value) if value in set(ErrorCode) else ErrorCode.INTERNAL
    elif origin is list:
        if isinstance(value, list):
            return [_convert(v, args[0], name) for v in value]
    elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return _from_fields(tp, value)
    raise bad_frame(f"field {name!r} has a bad value for {getattr(tp, '__name__', tp)}")


_HINTS: dict[type, dict[str, Any]] = {}


def _from_fields(cls: type, header: dict[str, Any]) -> Any:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in header:
            kwargs[f.name] = _convert(header[f.name], hints[f.name], f.name)
        elif f.default is dataclasses.MISSING:
            raise bad_frame(f"{cls.__name__} lacks field {f.name!r}")
    return cls(**kwargs)  # keys this version does not know are ignored


def decode_message(header: dict[str, Any]) -> Message:
    cls = MESSAGES.get(header.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise bad_frame(f"unknown message type {str(header.get('type'))[:40]!r}")
    msg = _from_fields(cls, header)
    msg.check()
    return msg
