"""The paged KV pool: per-layer arrays of fixed-size token blocks (layout: docs/architecture.md).

Unquantized, each layer has K and V of shape ``(num_blocks, block_size, n_kv_heads, head_dim)``
in the pool's ``dtype`` (``KVPool.store_dtype``: float16 on the CPU by default; reads return the
model's activation dtype, ``act_dtype``). With ``kv_bits`` 8 or 4 each of K and V is a triplet in
MLX's affine format along ``head_dim``: packed ``uint32 (..., head_dim * bits / 32)``, and scales
and biases ``(..., head_dim / group_size)`` in ``dtype``. Token ``t`` of a sequence lives in block
``block_table[t // block_size]`` at slot ``t % block_size``; block 0 is the null block.

Writes are indexed assignments on a flat ``(num_blocks * block_size, ...)`` view, so MLX
updates the pool buffer in place (the old array has no other reference when the step is
evaluated); reads gather whole token rows by slot index.

Memory is taken as blocks are used: the arrays hold ``capacity`` blocks (``num_blocks``, the
budget, at most) and ``grow`` re-allocates them larger, a layer at a time, when the block
allocator needs more (``BlockAllocator.on_grow``). Each layer stays one array, so the reference
gather and the paged attention kernels read the pool exactly as before; growing at least
doubles the capacity, so the copies add up to less than the final size.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype = mx.float32,
        kv_bits: int | None = None,
        group_size: int = 32,
        v_head_dim: int | None = None,
        capacity: int | None = None,
        act_dtype: mx.Dtype | None = None,
    ):
        """``num_blocks`` (the null block included) is the most the pool may grow to; ``capacity``
        blocks of it are allocated now (all when None). ``dtype`` is what the pool stores,
        ``act_dtype`` (``dtype`` when None) what its reads return."""
        if kv_bits not in (None, 4, 8):
            raise ValueError("kv_bits must be 4, 8 or None")
        if kv_bits is not None and head_dim % 32:
            raise ValueError(f"KV quantization needs head_dim divisible by 32 (this model has {head_dim})")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.dtype, self.kv_bits = dtype, kv_bits
        self.act_dtype = act_dtype or dtype
        self.group_size = min(group_size, head_dim)
        self.capacity = num_blocks if capacity is None else max(2, min(capacity, num_blocks))
        n = self.capacity * block_size
        self.k = [self._empty(n, head_dim) for _ in range(num_layers)]
        self.v = [self._empty(n, self.v_head_dim) for _ in range(num_layers)]
        mx.eval(self.k, self.v)

    def _empty(self, n: int, dim: int):
        if self.kv_bits is None:
            return mx.zeros((n, self.n_kv_heads, dim), self.dtype)
        packed = dim * self.kv_bits // 32
        groups = dim // self.group_size
        return (
            mx.zeros((n, self.n_kv_heads, packed), mx.uint32),
            mx.zeros((n, self.n_kv_heads, groups), self.dtype),
            mx.zeros((n, self.n_kv_heads, groups), self.dtype),
        )

    def grow(self, capacity: int) -> None:
        """Hold ``capacity`` blocks (at most ``num_blocks``); the new blocks are zeros. Existing
        contents are kept. One layer is re-allocated at a time, so the transient extra memory is
        one layer's old arrays."""
        if not self.capacity < capacity <= self.num_blocks:
            raise ValueError(f"cannot grow the KV pool from {self.capacity} to {capacity} blocks")
        n_old, n = self.capacity * self.block_size, capacity * self.block_size
        for pools in (self.k, self.v):
            for layer, old in enumerate(pools):
                pools[layer] = self._enlarged(old, n_old, n)
                mx.eval(pools[layer])  # now nothing holds the old buffers: they are freed
        self.capacity = capacity

    @staticmethod
    def _enlarged(old, n_old: int, n: int):
        def one(a: mx.array) -> mx.array:
            # zeros, then the old rows written over their head: in place on the fresh buffer, so
            # the peak is old + new (a concatenate would also hold the zero tail on its own)
            out = mx.zeros((n, *a.shape[1:]), a.dtype)
            out[:n_old] = a
            return out

        return tuple(one(a) for a in old) if isinstance(old, tuple) else one(old)

    @staticmethod
    def store_dtype(kv_dtype: str, model_dtype: mx.Dtype, kv_bits: int | None, backend: str) -> mx.Dtype:
        """The dtype a pool stores for ``EngineConfig.kv_dtype`` (``config.KV_DTYPES``) on ``backend``
        (``backend_name()``): a quantized pool's scales and biases stay in the model's dtype; "auto"
        stores float16 for a float32 model on the CPU (whose attention kernel widens it as it reads)
        and the model's own dtype elsewhere (the Metal kernels read the activation dtype)."""
        if kv_bits is not None:
            return model_dtype
        if kv_dtype == "auto":
            return mx.float16 if backend == "cpu" and model_dtype == mx.float32 else model_dtype
        return getattr(mx, kv_dtype)

    @staticmethod
    def bytes_per_token_per_layer(
        n_kv_heads: int, head_dim: int, dtype: mx.Dtype, kv_bits: int | None, group_size: int = 32
    ) -> int:
        if kv_bits is None:
            return 2 * n_kv_heads * head_dim * dtype.size
        gs = min(group_size, head_dim)
        return 2 * n_kv_heads * (head_dim * kv_bits // 8 + 2 * (head_dim // gs) * dtype.size)

    @staticmethod
    def blocks_for_budget(
        budget_bytes: float,
        num_layers: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype,
        kv_bits: int | None,
        group_size: int,
        block_size: int,
    ) -> int:
        """How many blocks (the null block included) a KV budget in bytes pays for."""
        per_token = num_layers * KVPool.bytes_per_token_per_layer(
            n_kv_heads, head_dim, dtype, kv_bits, group_size
        )
        return max(2, int(budget_bytes // (per_token * block_size)))

    @property
    def nbytes(self) -> int:
        """Bytes allocated now."""

        def size(a):
            return sum(x.nbytes for x in a) if isinstance(a, tuple) else a.nbytes

        return sum(size(a) for a in self.k) + sum(size(a) for a in self.v)

    @property
    def max_nbytes(self) -> int:
        """Bytes the pool takes once grown to ``num_blocks`` (its budget)."""
        return self.nbytes // self.capacity * self.num_blocks

    def arrays(self) -> list:
        """Everything to evaluate after a step."""
        out: list[mx.array] = []
        for a in (*self.k, *self.v):
            out.extend(a if isinstance(a, tuple) else (a,))
        return out

    # --- write / read -----------------------------------------------------------
    def _store(self, pool, slots: mx.array, x: mx.array):
        if self.kv_bits is None:
            pool[slots] = x if x.dtype == self.dtype else x.astype(self.dtype)
            return pool
        q, s, b = mx.quantize(x, group_size=self.group_size, bits=self.kv_bits)
        pool[0][slots] = q
        pool[1][slots] = s.astype(self.dtype)
        pool[2][slots] = b.astype(self.dtype)
        return pool

    def write(self, layer: int, slots: mx.array, k: mx.array, v: mx.array) -> None:
        """``slots``: (T,) flat slot ids; ``k``/``v``: (T, n_kv_heads, head_dim)."""
        self.k[layer] = self._store(self.k[layer], slots, k)
        self.v[layer] = self._store(self.v[layer], slots, v)

    def _load(self, pool, slots: mx.array) -> mx.array:
        if self.kv_bits is None:
            x = pool[slots]
        else:
            q, s, b = (p[slots] for p in pool)
            x = mx.dequantize(q, s, b, group_size=self.group_size, bits=self.kv_bits)
        return x if x.dtype == self.act_dtype else x.astype(self.act_dtype)

    def gather(self, layer: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """``slots``: (B, S) -> K, V as (B, n_kv_heads, S, head_dim) in the activation dtype."""
        k = mx.contiguous(self._load(self.k[layer], slots).transpose(0, 2, 1, 3))
        v = mx.contiguous(self._load(self.v[layer], slots).transpose(0, 2, 1, 3))
        return k, v

    def _slots(self, block: int) -> mx.array:
        return mx.arange(block * self.block_size, (block + 1) * self.block_size)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's tokens in every layer (copy-on-write)."""
        # the source is read (and evaluated) before any write: a scatter whose input a pending
        # read still holds cannot update the pool in place and would copy the whole layer
        parts = self.read_block(src)
        mx.eval(parts)
        self.write_block(dst, parts)

    # --- token ranges (remote prefill: peer/kv_wire.py) ------------------------------
    def layer_arrays(self, layer: int) -> list[mx.array]:
        """One layer's pool arrays in wire order: K (or its triplet), then V (or its triplet)."""
        return [x for a in (self.k[layer], self.v[layer]) for x in (a if isinstance(a, tuple) else (a,))]

    def token_slots(self, table, t0: int, t1: int) -> mx.array:
        """Flat slots of tokens ``[t0, t1)`` of a sequence with block table ``table``
        (``table[t // block_size] * block_size + t % block_size``: any alignment)."""
        if not 0 <= t0 < t1:
            raise ValueError(f"token range [{t0}, {t1}) is empty or negative")
        bs = self.block_size
        blocks = np.asarray(table[t0 // bs : (t1 - 1) // bs + 1], dtype=np.int64)
        if len(blocks) != (t1 - 1) // bs - t0 // bs + 1:
            raise ValueError(f"block table of {len(table)} blocks does not cover tokens up to {t1}")
        if blocks.min() < 1 or blocks.max() >= self.capacity:
            raise ValueError(f"block table names a block outside 1..{self.capacity - 1}")
        t = np.arange(t0, t1)
        return mx.array((blocks[t // bs - t0 // bs] * bs + t % bs).astype(np.int32))

    def write_tokens(self, layer: int, table, t0: int, parts: list[mx.array]) -> None:
        """Store KV that is already in this pool's format (``layer_arrays`` order, each part
        ``(t1 - t0, n_kv_heads, ...)``) for tokens ``[t0, t1)``. Idempotent: writing the same range
        again overwrites the same slots. Evaluate ``layer_arrays(layer)`` (once per step, with
        nothing else holding the old buffers) and MLX updates the pool in place."""
        pool = self.layer_arrays(layer)
        if len(parts) != len(pool):
            raise ValueError(f"{len(parts)} KV parts for a pool layer of {len(pool)} arrays")
        t1 = t0 + parts[0].shape[0]
        slots = self.token_slots(table, t0, t1)
        for a, p in zip(pool, parts, strict=True):
            if p.shape != (t1 - t0, *a.shape[1:]) or p.dtype != a.dtype:
                raise ValueError(f"KV part {p.dtype}{tuple(p.shape)} does not fit pool {a.dtype}{a.shape}")
        for a, p in zip(pool, parts, strict=True):
            a[slots] = p

    def read_tokens(self, layer: int, table, t0: int, t1: int) -> list[mx.array]:
        """Tokens ``[t0, t1)`` of one layer in this pool's format, as evaluated arrays of their
        own. Never a slice or a pending gather: while one of those is held, the next write to the
        layer cannot reuse its buffer and copies the whole pool array."""
        slots = self.token_slots(table, t0, t1)
        parts = [a[slots] for a in self.layer_arrays(layer)]
        mx.eval(parts)
        return parts

    # --- block transfer (copy-on-write, disk tier) ----------------------------------
    def read_block(self, block: int) -> list[mx.array]:
        """One block of every pool array, as arrays of their own (not views into the pool)."""
        slots = self._slots(block)
        return [a[slots] for a in self.arrays()]

    def write_block(self, block: int, parts: list[mx.array]) -> None:
        slots = self._slots(block)
        for a, p in zip(self.arrays(), parts, strict=True):
            a[slots] = p
