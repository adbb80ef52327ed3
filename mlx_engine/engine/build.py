"""From the KV budget to the engine's KV store: the target's pool, the block allocator, the draft
model's pool (same block ids) and the prefix cache's disk tier.

Each block holds one ``block_size`` of tokens in every layer of the target (and of the draft
model, which then takes its share of the budget); there are never more blocks than the running
sequences could fill at full context. The pool starts small (``kv_first_blocks``) and grows as the
allocator hands out blocks, up to the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_engine.backend import backend_name, total_memory_bytes
from mlx_engine.config import EngineConfig
from mlx_engine.errors import ConfigError
from mlx_engine.kv_cache.block_allocator import BlockAllocator
from mlx_engine.kv_cache.kv_pool import KVPool
from mlx_engine.kv_cache.prefix_disk import PrefixDiskTier
from mlx_engine.loading.identity import numerics_profile
from mlx_engine.loading.loader import LoadedModel

GiB = 2**30


@dataclass
class KVStore:
    pool: KVPool
    allocator: BlockAllocator
    draft_pool: KVPool | None  # the draft model's KV at the same block ids (speculative="draft")
    disk: PrefixDiskTier | None  # the prefix cache's disk tier (disk_cache_dir)
    block_bytes: int  # one block, every layer (and the draft's): the budget is a count of these


def kv_dtype(config: EngineConfig, m: LoadedModel) -> mx.Dtype:
    """What the KV pool of model ``m`` stores (``KVPool.store_dtype``)."""
    return KVPool.store_dtype(config.kv_dtype, m.dtype, config.kv_bits, backend_name())


def kv_bytes_per_token(config: EngineConfig, m: LoadedModel) -> int:
    c = config
    return m.num_layers * KVPool.bytes_per_token_per_layer(
        m.n_kv_heads, m.head_dim, kv_dtype(c, m), c.kv_bits, c.kv_group_size
    )


def engine_numerics(config: EngineConfig, m: LoadedModel) -> dict[str, Any]:
    """What decides whether KV computed elsewhere for this model is bit-identical to this engine's."""
    c = config
    return numerics_profile(
        backend=backend_name(),
        weight_format=m.weight_format,
        dtype=str(m.dtype),
        kv_dtype=str(kv_dtype(c, m)),
        kv_bits=c.kv_bits,
        kv_group_size=c.kv_group_size,
        prefill_chunk=c.prefill_grid,
        cpu_math=kernel_math(m),
    )


def kernel_math(m: LoadedModel) -> str | None:
    """How the CPU kernels multiply this model's quantized weights (None: they do not run here)."""
    if backend_name() != "cpu" or m.weight_format.startswith("dense"):
        return None
    from cpu_kernels.spec import cpu_math, panel_tiles
    from mlx_engine.loading.cpu_layout import panel_types

    # the panel kernel sums in another order than the row kernel: not the same bits, so the types it
    # reads are named (a peer, or an earlier build, with Q6_K in rows computes other KV bits)
    types = panel_types(m.model)
    # exact math's panel kernel joins each row's three int8 planes' sums per group before scaling them
    # (an earlier build scaled each plane's and added the three products: other bits), said "joined:"
    joined = "joined:" if cpu_math() == "exact" else ""
    math = cpu_math() + (f"+panels({joined}{','.join(types)})" if types else "")
    if cpu_math() in ("exact", "int16") and types and panel_tiles():
        # exact (and int16) math keeps the layers in panels on AMX tiles for prefill chunks (x in bfloat16 planes)
        # where a machine without them dequantizes for a float32 GEMM: other bits (int8 math's tiles are
        # the VNNI bits). The types on the tiles are named: an earlier build said "+tiles(bf16)" with
        # Q6_K off them (and "+tiles" with x in int8 planes)
        math += f"+tiles(bf16:{','.join(types)})"
    return math


def _pool(config: EngineConfig, m: LoadedModel, num_blocks: int) -> KVPool:
    c = config
    return KVPool(
        m.num_layers,
        num_blocks,
        c.block_size,
        m.n_kv_heads,
        m.head_dim,
        kv_dtype(c, m),
        c.kv_bits,
        c.kv_group_size,
        capacity=c.kv_first_blocks(),
        act_dtype=m.dtype,
    )


def build_kv(
    config: EngineConfig,
    target: LoadedModel,
    draft: LoadedModel | None,
    context_length: int,
    identity: Callable[[], str],
) -> KVStore:
    """The KV store for ``target`` (and ``draft``) under ``config``'s budget; ``identity()`` (the
    hash of the weights) is asked only when a disk tier is configured. Raises ConfigError when the
    budget and the weights together need more than the machine's memory."""
    c, m = config, target
    memory = total_memory_bytes()
    budget = c.kv_budget_bytes(memory)
    target_bytes = kv_bytes_per_token(c, m)
    draft_bytes = kv_bytes_per_token(c, draft) if draft is not None else 0
    if draft is not None:  # each block holds the draft's KV too (speculative/draft_model.py)
        budget *= target_bytes / (target_bytes + draft_bytes)
    num_blocks = KVPool.blocks_for_budget(
        budget,
        m.num_layers,
        m.n_kv_heads,
        m.head_dim,
        kv_dtype(c, m),
        c.kv_bits,
        c.kv_group_size,
        c.block_size,
    )
    # never more than the running sequences could fill at full context
    num_blocks = min(num_blocks, c.max_running * -(-context_length // c.block_size) + 1)
    block_bytes = c.block_size * (target_bytes + draft_bytes)
    kv_bytes, weight_bytes = num_blocks * block_bytes, m.weight_bytes  # the budget, taken as used
    if kv_bytes + weight_bytes > memory:
        raise ConfigError(
            f"the KV cache ({kv_bytes / GiB:.1f} GiB) and the model's weights ({weight_bytes / GiB:.1f} GiB) "
            f"need more than this machine's {memory / GiB:.1f} GiB of memory; lower cache_gb or cache_fraction",
            "cache_gb" if c.cache_gb is not None else "cache_fraction",
        )
    pool = _pool(c, m, num_blocks)
    allocator = BlockAllocator(
        num_blocks, c.block_size, enable_prefix_cache=c.prefix_cache, initial_blocks=c.kv_first_blocks()
    )
    allocator.on_grow = pool.grow
    draft_pool = _pool(c, draft, num_blocks) if draft is not None else None
    if draft_pool is not None:

        def grow(capacity: int) -> None:
            pool.grow(capacity)
            draft_pool.grow(capacity)

        allocator.on_grow = grow
    disk = None
    if c.disk_cache_dir and c.prefix_cache:
        # the model's identity (a hash of its weights) and the numerics that shape its KV: a cache
        # written by another model, version or KV format is never read back
        fingerprint = {"model": identity(), "block_size": c.block_size, **engine_numerics(c, m)}
        disk = PrefixDiskTier(
            c.disk_cache_dir,
            fingerprint,
            int(c.disk_cache_gb * GiB),
            block_size=c.block_size,
            num_layers=m.num_layers,
        )
        tier = disk
        allocator.on_evict = lambda b, toks: tier.save(toks, pool.read_block(b))
    return KVStore(pool, allocator, draft_pool, disk, block_bytes)
