"""Attention over the paged KV pool, plugged into mlx-lm's model modules without forking them.

mlx-lm attention layers do ``keys, values = cache.update_and_fetch(keys, values)`` and then
call ``scaled_dot_product_attention(queries, keys, values, cache=cache, scale, mask)``, a
function each model file imports by name. We hand every layer a ``PagedLayerCache``:

- ``offset`` is the per-sequence start position (B,), so RoPE rotates each row correctly;
- ``update_and_fetch`` scatters the new K/V into the pool and returns the sequences' whole
  K/V gathered through their block tables, (B, n_kv_heads, S, head_dim);
- ``make_mask`` returns the (B, 1, L, S) boolean mask: causal, per-sequence length, window.

mlx-lm calls ``update_and_fetch`` once per layer, in layer order, which is where a prefill peer
exports KV as it is computed (the layout's ``exports``; docs/architecture.md, "KV sources").

The seam: ``install()`` points ``scaled_dot_product_attention`` of the loaded mlx-lm model modules
at ``_dispatching_sdpa`` (mlx-lm's models import it by name; the one patch we make to them),
which sends paged caches to ``paged_attention``, and leaves every other cache to mlx-lm's own.
*Which* attention runs is not module state: it is the ``AttentionRoute`` the model runner chose
for its backend, carried by each pass's ``BatchLayout``. A route's kernel reads the pool through
the block table and takes what it can, so the gather is never evaluated: on Metal single-token
decode (``metal_kernels``), on the CPU every pass (``cpu_kernels``: decode, prefill chunks,
verification of proposed tokens); what it declines runs on the reference path (gather + SDPA).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from mlx_engine.kv_cache.kv_pool import KVPool


@dataclass
class LayerExport:
    """Tokens ``[t0, t1)`` of a row (block table ``blocks``) to hand to ``on_layer(layer, t0, t1,
    parts)`` after each layer's pool write; ``parts`` are evaluated arrays of their own in the pool's
    format (``KVPool.layer_arrays`` order)."""

    blocks: list[int]
    t0: int
    t1: int
    on_layer: Callable[[int, int, int, list[mx.array]], None]


# A kernel over the paged pool: (queries (B, Hq, L, D), cache, scale, sinks, window) -> (B, Hq, L, D),
# or None to decline (the reference path then runs).
AttentionKernel = Callable[..., "mx.array | None"]


@dataclass(frozen=True)
class AttentionRoute:
    """How attention over the paged pool runs, chosen once per model runner for its backend.

    ``kernel`` None is the reference path (gather + ``mx.fast.scaled_dot_product_attention``).
    ``metal`` routes the Metal kernels' way: quantized pool writes through the fused quantize
    kernel and prefill gathers without the contiguous copy, on ``metal_backend`` (None: Metal;
    tests pass "emulator" to run the kernels' exact MSL on the CPU)."""

    kernel: AttentionKernel | None = None
    metal: bool = False
    metal_backend: str | None = None

    @classmethod
    def reference(cls) -> AttentionRoute:
        return cls()

    @classmethod
    def cpu(cls) -> AttentionRoute:
        """The CPU kernels' paged attention for every pass (``cpu_kernels/paged_attention.py``)."""
        return cls(kernel=cpu_attention)

    @classmethod
    def metal_kernels(cls, backend: str | None = None) -> AttentionRoute:
        """Single-token decode through the Metal paged attention kernel, fused quantized writes."""
        return cls(kernel=metal_decode, metal=True, metal_backend=backend)

    @classmethod
    def for_backend(cls, backend: str, cpu_kernels: bool) -> AttentionRoute:
        if backend == "metal":
            return cls.metal_kernels()
        if backend == "cpu" and cpu_kernels:
            return cls.cpu()
        return cls.reference()


@dataclass
class BatchLayout:
    """Where the rows of one forward pass read and write KV, and how attention runs over them.
    Built by the model runner."""

    starts: list[int]  # tokens already in the cache per row
    num_new: int  # tokens processed per row this pass (same for all rows of a pass)
    block_tables: list[list[int]]
    block_size: int
    exports: list[LayerExport] = field(default_factory=list)  # ranges to export per layer
    route: AttentionRoute = field(default_factory=AttentionRoute)
    # dimensions of a mask asked for as an array: (B, 1, L, S), or (B, 1, 1, L, S) for models that
    # apply it to (B, kv_heads, repeats, L, S) scores themselves (Gemma 2's grouped queries)
    array_mask_rank: int = 4

    def __post_init__(self):
        bs, L = self.block_size, self.num_new
        B = len(self.starts)
        ends = [s + L for s in self.starts]
        S = max(ends)
        nblk = (S + bs - 1) // bs
        table = mx.array([(t + [0] * nblk)[:nblk] for t in self.block_tables], dtype=mx.int32)  # (B, nblk)
        pos = mx.arange(S)
        self.read_slots = table[:, pos // bs] * bs + pos % bs  # (B, S)
        new_pos = mx.array(self.starts, dtype=mx.int32)[:, None] + mx.arange(L)[None]  # (B, L)
        self.write_slots = mx.take_along_axis(self.read_slots, new_pos, axis=1).reshape(-1)  # (B*L,)
        self.offsets = mx.array(self.starts, dtype=mx.int32) if B > 1 else self.starts[0]
        self._q_pos = new_pos[:, None, :, None]  # (B, 1, L, 1)
        self._k_pos = pos[None, None, None, :]  # (1, 1, 1, S)
        self.table = table
        self.context_lens = mx.array(ends, dtype=mx.int32)
        self._masks: dict[int | None, mx.array] = {}

    def window_of(self, mask: object) -> int | None:
        """The sliding window of a mask this layout made (None: the layer is global).

        mlx-lm builds every mask before its layer loop and hands each layer the one for its kind,
        so the mask object a layer receives says which window it attends over. Raises ``LookupError``
        for a mask this layout did not make (the caller then keeps the reference path)."""
        if mask is None or isinstance(mask, str):
            return None  # ``mask`` returns these only without a window
        for window, m in self._masks.items():
            if m is mask:
                return window
        raise LookupError("a mask this layout did not make")

    def mask(self, window: int | None = None, as_array: bool = False) -> mx.array | str | None:
        """The pass's attention mask for layers attending over ``window`` keys (None: all). Without
        ``as_array`` a plain causal mask is MLX's "causal" (or None for one query per row); models
        that apply the mask themselves (Gemma 2's soft-capped scores) ask for the boolean array."""
        if window is None and len(set(self.starts)) == 1 and not as_array:
            # every row sees exactly keys [0, start + L): plain causal (or none for one query),
            # which lets MLX take its fast attention path
            return "causal" if self.num_new > 1 else None
        if window not in self._masks:
            m = self._k_pos <= self._q_pos
            if window is not None:
                m = m & (self._k_pos > self._q_pos - window)
            self._masks[window] = m
        m = self._masks[window]
        return m.reshape(m.shape[0], *[1] * (self.array_mask_rank - 3), *m.shape[2:]) if as_array else m


# Every this many layers, the layers built so far start computing (``mx.async_eval`` of the layer's
# pool write) while Python builds the next ones: the graph's construction (~3 ms a decode step of
# a 30-layer model) and MLX's per-op scheduling overlap the computation instead of preceding it.
# Bundled model, one kernel thread, decode at a 64-token context: ~44 -> ~53 tok/s.
ASYNC_EVERY = 2


class PagedLayerCache:
    """mlx-lm's cache contract for one layer of one forward pass over the paged pool."""

    def __init__(self, pool: KVPool, layer: int, layout: BatchLayout):
        self.pool, self.layer, self.layout = pool, layer, layout

    @property
    def offset(self):
        return self.layout.offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        B, H, L, D = keys.shape
        k = keys.transpose(0, 2, 1, 3).reshape(B * L, H, D)
        v = values.transpose(0, 2, 1, 3).reshape(B * L, H, values.shape[-1])
        _write(self.pool, self.layer, self.layout.write_slots, k, v, self.layout.route)
        if self.layer % ASYNC_EVERY == ASYNC_EVERY - 1 and not self.layout.exports:
            mx.async_eval(self.pool.layer_arrays(self.layer))  # the layers so far, computing meanwhile
        if self.layout.exports:
            # this layer's KV is final now: evaluate the write (in place), then copy the exported
            # rows out, never holding a slice or a pending gather of the pool array
            mx.eval(self.pool.layer_arrays(self.layer))
            for e in self.layout.exports:
                e.on_layer(self.layer, e.t0, e.t1, self.pool.read_tokens(self.layer, e.blocks, e.t0, e.t1))
        return _gather(self.pool, self.layer, self.layout.read_slots, self.layout.route)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return self.layout.mask(window_size, as_array=return_array)

    def is_trimmable(self) -> bool:
        return False

    @property
    def state(self):
        return ()

    @property
    def nbytes(self) -> int:
        return 0


def _write(
    pool: KVPool, layer: int, slots: mx.array, k: mx.array, v: mx.array, route: AttentionRoute
) -> None:
    """Store the pass's new K/V. Quantized pools on the kernel path take the fused quantize kernel
    (one launch per K and V, bit for bit ``mx.quantize`` on the CPU) instead of ``mx.quantize``."""
    gs = pool.group_size
    fused = gs in (32, 64, 128) and not k.shape[-1] % gs and not v.shape[-1] % gs
    if route.metal and pool.kv_bits is not None and fused:
        from metal_kernels.kv_quantize import write_quantized

        for pools, x in ((pool.k, k), (pool.v, v)):
            pools[layer] = write_quantized(
                pools[layer], slots, x, gs, pool.kv_bits, backend=route.metal_backend
            )
        return
    pool.write(layer, slots, k, v)


def _gather(pool: KVPool, layer: int, slots: mx.array, route: AttentionRoute) -> tuple[mx.array, mx.array]:
    """The rows' K/V as (B, n_kv_heads, S, D). On the kernel path the transposed view is returned
    as it is: Metal's SDPA needs only a unit last stride, so the copy to contiguous is saved (the
    pool's own ``gather`` makes one for the CPU)."""
    if not route.metal:
        return pool.gather(layer, slots)
    return (
        pool._load(pool.k[layer], slots).transpose(0, 2, 1, 3),
        pool._load(pool.v[layer], slots).transpose(0, 2, 1, 3),
    )


def paged_attention(
    queries, keys, values, cache: PagedLayerCache, scale: float, mask, sinks=None
) -> mx.array:
    """Attention of ``queries`` (B, Hq, L, D) over the sequences' paged KV (already gathered
    into ``keys``/``values`` by ``update_and_fetch``; lazily, so a kernel that reads the pool
    directly makes the gather free)."""
    kernel = cache.layout.route.kernel
    if kernel is not None:
        out = _kernel_attention(kernel, queries, cache, scale, mask, sinks)
        if out is not None:
            return out
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def _kernel_attention(kernel, queries, cache: PagedLayerCache, scale: float, mask, sinks) -> mx.array | None:
    try:
        window = cache.layout.window_of(mask)  # per layer: windowed and global layers both
    except LookupError:
        return None  # a mask from elsewhere: the reference path applies it as given
    return kernel(queries, cache, scale, sinks, window)


def metal_decode(queries, cache: PagedLayerCache, scale: float, sinks, window: int | None) -> mx.array | None:
    from metal_kernels.paged_attention import declines, paged_decode_attention

    if queries.shape[2] != 1:
        return None  # the Metal kernel is for single-token decode
    layout, pool = cache.layout, cache.pool
    k, v = pool.k[cache.layer], pool.v[cache.layer]
    extra = {}
    if pool.kv_bits is not None:
        (k, ks, kb), (v, vs, vb) = k, v
        extra = dict(
            k_scales=ks, k_biases=kb, v_scales=vs, v_biases=vb, bits=pool.kv_bits, group_size=pool.group_size
        )
    if declines(queries, k, v, pool.kv_bits, pool.group_size) is not None:
        return None  # the gather update_and_fetch already set up serves it
    out = paged_decode_attention(
        queries[:, :, 0, :],
        k,
        v,
        layout.table,
        layout.context_lens,
        scale=scale,
        sinks=sinks,
        block_size=pool.block_size,
        window=window,
        max_context=max(layout.starts) + layout.num_new,  # partitions from the rows' lengths, no sync
        backend=cache.layout.route.metal_backend,
        **extra,
    )
    return out[:, :, None, :]


def cpu_attention(
    queries, cache: PagedLayerCache, scale: float, sinks, window: int | None
) -> mx.array | None:
    from cpu_kernels.paged_attention import fits
    from cpu_kernels.paged_attention import paged_attention as kernel

    pool, layout = cache.pool, cache.layout
    if pool.kv_bits is not None:
        return None  # quantized KV: the reference path dequantizes the gathered rows
    k, v = pool.k[cache.layer], pool.v[cache.layer]
    if not fits(queries, k, v):
        return None
    return kernel(
        queries,
        k,
        v,
        layout.table,
        layout.context_lens,
        scale=scale,
        block_size=pool.block_size,
        window=window,
        sinks=sinks,
    )


def _dispatching_sdpa(queries, keys, values, cache, scale, mask, sinks=None):
    if isinstance(cache, PagedLayerCache):
        return paged_attention(queries, keys, values, cache, scale, mask, sinks)
    return _ORIGINAL_SDPA(queries, keys, values, cache, scale, mask, sinks)


_ORIGINAL_SDPA = None
_SDPA_NAME = "scaled_dot_product_attention"  # the name each mlx-lm model module imports


def install() -> None:
    """Point every loaded mlx-lm model module's ``scaled_dot_product_attention`` at the dispatcher."""
    global _ORIGINAL_SDPA
    from mlx_engine.loading import mlx_lm_lazy

    base = mlx_lm_lazy.import_module("models.base")

    if _ORIGINAL_SDPA is None:
        _ORIGINAL_SDPA = base.scaled_dot_product_attention
    for name, mod in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(mod, _SDPA_NAME, None) is not None:
            setattr(mod, _SDPA_NAME, _dispatching_sdpa)  # ModuleType declares no such attribute
