"""The HELLO exchange: what must match before a PREFILL is sent, and what makes a result exact.

Both sides send a ``Hello`` first. A version or model mismatch, or a model whose layers do not each
write one uniform KV of their own exactly once, is refused here, before any compute. The numerics
profile (backend, mlx and mlx-lm versions, activation dtype, KV format) only decides whether a
remote prefill is bit-exact; block size and weight format need not match.
"""

from __future__ import annotations

from peer.wire.protocol import SUPPORTED_LAYER_KINDS, ErrorCode, Hello, ProtocolError


def negotiate_version(local: Hello, remote: Hello) -> int:
    """The highest protocol version both sides speak."""
    top = min(local.protocol_max, remote.protocol_max)
    if top < max(local.protocol_min, remote.protocol_min):
        raise ProtocolError(
            ErrorCode.VERSION,
            f"peer speaks protocol {remote.protocol_min}..{remote.protocol_max}, "
            f"this side {local.protocol_min}..{local.protocol_max}: upgrade the older side",
        )
    return top


def check_supported(hello: Hello) -> None:
    """Refuse models whose layers do not each write one uniform KV of their own exactly once."""
    for i, spec in enumerate(hello.layers):
        if spec.kind not in SUPPORTED_LAYER_KINDS:
            raise ProtocolError(
                ErrorCode.UNSUPPORTED_MODEL,
                f"layer {i} is {spec.kind!r}: remote prefill supports only {'/'.join(SUPPORTED_LAYER_KINDS)} "
                "attention layers",
            )
    shapes = {(s.n_kv_heads, s.head_dim, s.v_head_dim) for s in hello.layers}
    if len(shapes) != 1:
        raise ProtocolError(ErrorCode.UNSUPPORTED_MODEL, "layers differ in KV heads or head dims")


def check_peer(local: Hello, remote: Hello) -> int:
    """Everything that must match before a PREFILL is sent; returns the protocol version."""
    version = negotiate_version(local, remote)
    if local.model_fingerprint != remote.model_fingerprint:
        raise ProtocolError(
            ErrorCode.FINGERPRINT,
            f"peer runs model {remote.model_fingerprint[:16]}, this side {local.model_fingerprint[:16]}",
        )
    check_supported(local)
    check_supported(remote)
    if local.layers != remote.layers:
        raise ProtocolError(ErrorCode.FINGERPRINT, "peer reports different KV shapes for the same model")
    return version


def inexact_reasons(local: Hello, remote: Hello) -> list[str]:
    """Why a remote prefill would not be bit-exact with local prefill (empty: exact).

    Block size and weight format need not match; the chunk grid is carried by each PREFILL."""
    a, b = local.numerics(), remote.numerics()
    return [f"{k} {b[k]} != {a[k]}" for k in a if a[k] != b[k]]
