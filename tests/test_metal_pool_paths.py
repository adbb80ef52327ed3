"""The kernel path's pool write and prefill gather (what a Mac runs) store and return exactly what
the reference path does: quantized K/V through the fused quantize kernel (its Metal source, run by
the CPU emulator) are bit for bit the pool's own ``mx.quantize`` rows, and the prefill K/V read back
without the copy to contiguous equal the pool's gather."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import metal_kernels.kv_quantize as kvq
from mlx_engine.kv_cache.kv_pool import KVPool
from mlx_engine.kv_cache.paged_attention import AttentionRoute, BatchLayout, PagedLayerCache


@pytest.mark.parametrize(
    "kv_bits,dtype", [(None, mx.float16), (8, mx.float16), (4, mx.bfloat16), (8, mx.float32)]
)
def test_kernel_path_writes_and_gathers_like_the_reference(kv_bits, dtype, monkeypatch):
    pools = [KVPool(1, 8, 16, 2, 64, dtype, kv_bits=kv_bits) for _ in range(2)]
    layout = BatchLayout(starts=[0, 5], num_new=20, block_tables=[[1, 2], [4, 3]], block_size=16)
    rng = np.random.default_rng(0)
    keys, values = (
        mx.array(rng.standard_normal((2, 2, 20, 64)).astype(np.float32)).astype(dtype) for _ in range(2)
    )
    if kv_bits is not None:  # row 1's first 5 tokens are a cached prefix: the same in both pools
        prefix = mx.array(rng.standard_normal((5, 2, 64)).astype(np.float32)).astype(dtype)
        for p in pools:
            p.write(0, mx.arange(4 * 16, 4 * 16 + 5), prefix, prefix)
    calls = []
    real = kvq.write_quantized

    def counting(*a, **kw):
        calls.append(kw.get("backend"))
        return real(*a, **kw)

    monkeypatch.setattr(kvq, "write_quantized", counting)
    expected = PagedLayerCache(pools[0], 0, layout).update_and_fetch(keys, values)
    kernel_layout = BatchLayout(
        starts=[0, 5],
        num_new=20,
        block_tables=[[1, 2], [4, 3]],
        block_size=16,
        route=AttentionRoute.metal_kernels("emulator"),
    )
    got = PagedLayerCache(pools[1], 0, kernel_layout).update_and_fetch(keys, values)
    mx.eval(got, pools[1].arrays())
    assert calls == ([] if kv_bits is None else ["emulator", "emulator"])
    for a, b in zip(pools[0].arrays(), pools[1].arrays(), strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.array(a.view(mx.uint8)), np.array(b.view(mx.uint8)))
    for e, g in zip(expected, got, strict=True):
        assert e.shape == g.shape == (2, 2, 25, 64)
        assert np.array_equal(np.array(e.astype(mx.float32)), np.array(g.astype(mx.float32)))
