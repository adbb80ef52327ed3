"""Who a side is, for the HELLO exchange (the identity and profile come from ``mlx_engine.loading.identity``): the model identity (a hash of its weights) and the
numerics profile and KV layout of its pool.

``model_fingerprint(path)`` hashes the weight files (a GGUF file, or an HF/MLX directory's
``*.safetensors`` and ``config.json``) with xxh3-128; two sides must agree on it before a PREFILL is
sent. ``layer_specs(model)`` reads each layer's KV kind from the mlx-lm modules (the caches the
model would make for itself), so models whose layers do not each write their own KV once are refused
before any compute. ``local_hello(engine)`` puts it together for a running ``Engine``.
"""

from __future__ import annotations

from typing import Any

from mlx_engine.loading.identity import model_fingerprint, package_version
from peer.wire.protocol import PROTOCOL_MAX, PROTOCOL_MIN, Hello, LayerSpec


def _cache_kind(cache: Any) -> tuple[str, int | None]:
    name = type(cache).__name__
    if name in ("KVCache", "QuantizedKVCache", "ConcatenateKVCache"):
        return "full", None
    if name == "RotatingKVCache":
        return "sliding", int(getattr(cache, "max_size", 0)) or None
    if name in ("MambaCache", "ArraysCache"):
        return "ssm", None
    if name == "CacheList":
        return "hybrid", None
    return name.lower(), None


def layer_specs(model: Any, n_kv_heads: int, head_dim: int, v_head_dim: int | None = None) -> list[LayerSpec]:
    """Each layer's KV as this engine's pool stores it, with its kind from the cache mlx-lm would
    give it (``make_cache``): full, sliding (with its window), or a kind remote prefill refuses
    (ssm, hybrid, mla, shared: layers without a KV of their own)."""
    layers = list(getattr(getattr(model, "model", model), "layers", None) or getattr(model, "layers", []))
    make = getattr(model, "make_cache", None)
    caches = list(make()) if callable(make) else [None] * len(layers)
    specs = []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if i >= len(caches):
            kind, window = "shared", None  # fewer caches than layers: later layers reuse another's KV
        elif caches[i] is None:
            kind, window = "full", None
        else:
            kind, window = _cache_kind(caches[i])
        if attn is None and kind == "full":
            kind = "linear"  # no attention module of its own (linear or state-space mixing)
        if attn is not None and getattr(attn, "kv_lora_rank", None):
            kind = "mla"
        heads = getattr(attn, "n_kv_heads", None) or n_kv_heads
        specs.append(LayerSpec(kind, int(heads), head_dim, v_head_dim or head_dim, window))
    return specs


def local_hello(engine: Any) -> Hello:
    """This side's HELLO, from a running ``mlx_engine.Engine`` (its model, pool and options)."""
    from mlx_engine.backend import backend_name
    from peer.wire.kv_wire import DTYPE_NAMES

    loaded, pool = engine.loaded, engine.pool
    capacity = (pool.num_blocks - 1) * pool.block_size
    specs = layer_specs(loaded.model, pool.n_kv_heads, pool.head_dim, pool.v_head_dim)
    return Hello(
        protocol_min=PROTOCOL_MIN,
        protocol_max=PROTOCOL_MAX,
        model_fingerprint=model_fingerprint(loaded.path),
        backend=backend_name(),
        mlx_version=package_version("mlx"),
        mlx_lm_version=package_version("mlx-lm"),
        weight_format=loaded.weight_format,
        dtype=DTYPE_NAMES[pool.dtype],
        block_size=pool.block_size,
        kv_bits=pool.kv_bits,
        kv_group_size=pool.group_size,
        num_layers=pool.num_layers,
        layers=specs,
        max_tokens=max(1, min(engine.context_length - 1, capacity)),  # a prompt shorter than the context
    )
