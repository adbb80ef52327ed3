"""KV pool updates happen in place: a step never copies a layer's whole pool array.

MLX updates an array in place only when nothing else still holds its old buffer. When a step
builds two forward passes (decode rows and prefill chunks have different lengths) into one
graph, or a copy-on-write reads and writes the same pool, the scatter can end up scheduled while
the old buffer is still referenced, and MLX silently copies the layer's entire pool: with a
GiB-sized cache that turned a 2 s step into 10 s. Peak memory shows it without timing anything.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from mlx_engine.kv_cache.kv_pool import KVPool
from mlx_engine.loading.loader import load_model
from mlx_engine.model_runner import ModelRunner, Row


@pytest.fixture(scope="module")
def runner(tiny_dirs):
    loaded = load_model(str(tiny_dirs("llama")))
    # a pool far larger than any activation of these small steps: 4096 blocks x 16 tokens
    pool = KVPool(loaded.num_layers, 4096, 16, loaded.n_kv_heads, loaded.head_dim, loaded.dtype)
    return ModelRunner(loaded.model, pool)


def layer_array_bytes(pool: KVPool) -> int:
    return pool.k[0].nbytes


def peak_growth(fn) -> int:
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    fn()
    mx.synchronize()
    return mx.get_peak_memory() - base


def test_mixed_decode_and_prefill_step_updates_pool_in_place(runner):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(40)] for _ in range(4)]
    tables = [[1 + 4 * i + j for j in range(4)] for i in range(4)]
    runner.forward([Row(prompts[i], 0, tables[i]) for i in range(2)])

    def mixed_step():  # two decode rows and two prefill rows: two passes in one step
        runner.forward(
            [Row([7], 40, tables[0]), Row([9], 40, tables[1])]
            + [Row(prompts[i], 0, tables[i]) for i in (2, 3)]
        )

    grew = peak_growth(mixed_step)
    assert grew < layer_array_bytes(runner.pool), f"a step allocated {grew} bytes: the KV pool was copied"


def test_copy_on_write_copies_one_block_not_the_pool(runner):
    grew = peak_growth(lambda: (runner.pool.copy_block(3, 4000), mx.eval(runner.pool.arrays())))
    assert grew < layer_array_bytes(runner.pool), f"copy_block allocated {grew} bytes: the KV pool was copied"


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_held_export_does_not_make_the_next_write_copy_the_layer(kv_bits):
    # the peer exports a token range and keeps it queued for its sender while the next chunk's
    # write lands in the same layer: the export must be an array of its own, not a view or a
    # pending gather of the pool array, or that write copies the whole layer
    pool = KVPool(2, 4096, 16, 2, 64, mx.float32, kv_bits)
    table = list(range(100, 110))
    snapshot = [bytes(memoryview(p)) for p in pool.read_tokens(0, table, 3, 40)]
    held = pool.read_tokens(0, table, 3, 40)  # untouched until the write has run
    fresh = [mx.full((37, *a.shape[1:]), 7, a.dtype) for a in pool.layer_arrays(0)]
    mx.eval(fresh)

    grew = peak_growth(lambda: (pool.write_tokens(0, table, 3, fresh), mx.eval(pool.layer_arrays(0))))
    smallest = min(a.nbytes for a in pool.layer_arrays(0))
    assert grew < smallest, f"a {grew}-byte peak for a 37-token write: the pool layer was copied"
    assert [bytes(memoryview(p)) for p in held] == snapshot  # the export kept its own values
    assert [bytes(memoryview(p)) for p in pool.read_tokens(0, table, 3, 40)] == [
        bytes(memoryview(p)) for p in fresh
    ]
