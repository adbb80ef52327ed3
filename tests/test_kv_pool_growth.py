"""The KV pool takes memory as sequences use it: it starts with one chunk and grows, up to the budget.

A desktop app must not take memory it does not use: the engine used to allocate and zero-fill
the whole KV budget (15% of RAM) at start. Now the block allocator hands out blocks from what is
allocated, reuses freed blocks before growing, grows (at least doubling) before evicting cached
prefixes, and never passes the budget; the pool re-allocates each layer's arrays to the new size
keeping their contents, so the paged attention kernels and the gather still read one array per
layer. The engine gives the same greedy tokens while its pool grows under it.
"""

from __future__ import annotations

import asyncio

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlx_engine import config as engine_config
from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.errors import ContextLengthError
from mlx_engine.kv_cache.block_allocator import BlockAllocator, OutOfBlocks
from mlx_engine.kv_cache.kv_pool import KVPool
from mlx_engine.loading.loader import load_model
from mlx_engine.model_runner import ModelRunner, Row
from tests.test_engine_tiny import assert_no_leaks, kv_token_bytes, prompts, reference_greedy, req, run_all

BS = 4


def grown_allocator(num_blocks: int, initial: int, **kw) -> tuple[BlockAllocator, list[int]]:
    """An allocator whose growths are recorded (the capacity asked for each time)."""
    a = BlockAllocator(num_blocks, BS, initial_blocks=initial, **kw)
    grows: list[int] = []
    a.on_grow = grows.append
    return a, grows


# --- the allocator ------------------------------------------------------------------------


def test_starts_with_the_first_chunk_and_counts_the_rest_as_free():
    a, grows = grown_allocator(100, 5)
    assert a.capacity == 5 and grows == []
    assert a.num_free == 99 and a.num_used == 0  # the scheduler sees the whole budget
    assert a.allocate(4) == [1, 2, 3, 4]
    assert grows == [] and a.capacity == 5
    a.check_invariants()


def test_grows_by_doubling_when_free_blocks_run_out():
    a, grows = grown_allocator(100, 5)
    a.allocate(4)
    assert a.allocate(1) == [5]
    assert grows == [10] and a.capacity == 10  # doubled, not one block at a time
    assert a.allocate(8) == [6, 7, 8, 9, 10, 11, 12, 13]
    assert grows == [10, 20]
    assert a.allocate(30) == list(range(14, 44))  # a need above the doubling grows to fit it
    assert grows == [10, 20, 44]
    assert all(b < a.capacity for b in range(1, 44))
    a.check_invariants()


def test_freed_blocks_are_reused_before_growing():
    a, grows = grown_allocator(100, 9, enable_prefix_cache=False)
    first = a.allocate(8)
    a.free(first)
    for _ in range(20):  # one request after another: the same memory every time
        again = a.allocate(8)
        assert sorted(again) == first
        a.free(again)
    assert grows == [] and a.capacity == 9
    a.check_invariants()


def test_grows_before_evicting_a_cached_prefix_and_evicts_only_at_the_budget():
    a, grows = grown_allocator(12, 5)
    tokens = list(range(4 * BS))
    blocks = a.allocate(4)
    a.register(tokens, blocks, 4)
    a.free(blocks)  # all four cached now
    other = a.allocate(3)
    assert set(other).isdisjoint(blocks) and a.evictions == 0 and grows == [10]
    assert a.match_prefix(tokens, len(tokens)) == blocks  # the cache survived the growth
    a.free(blocks)
    more = a.allocate(3)  # 10 -> 12, the budget
    assert grows == [10, 12] and a.evictions == 0
    last = a.allocate(2)  # the last free block, then at the budget the coldest cached one goes
    assert last == [11, blocks[-1]] and a.evictions == 1 and a.capacity == 12
    assert a.match_prefix(tokens, len(tokens)) == blocks[:3]  # the rest of the prefix is still cached
    a.check_invariants()
    a.free(other + more + last + blocks[:3])
    a.check_invariants()


def test_a_revived_cached_block_is_never_handed_out():
    a, _ = grown_allocator(8, 3)
    tokens = list(range(2 * BS))
    blocks = a.allocate(2)
    a.register(tokens, blocks, 2)
    a.free(blocks)  # cached, evictable
    hit = a.match_prefix(tokens + [0], 2 * BS)  # a prefix hit takes them back
    assert hit == blocks and a.num_free == 5
    rest = a.allocate(a.num_free)
    assert set(rest).isdisjoint(hit) and a.capacity == 8 and a.evictions == 0
    a.check_invariants()


def test_the_budget_is_enforced():
    a, grows = grown_allocator(10, 3, enable_prefix_cache=False)
    held = a.allocate(9)
    assert a.capacity == 10 and grows[-1] == 10
    with pytest.raises(OutOfBlocks):
        a.allocate(1)
    a.free(held[:2])
    assert a.num_free == 2
    with pytest.raises(OutOfBlocks):
        a.allocate(3)
    assert a.capacity == 10
    a.check_invariants()


def test_a_failed_growth_changes_nothing():
    a = BlockAllocator(50, BS, initial_blocks=3)

    def refuse(capacity: int) -> None:
        raise MemoryError("no memory")

    a.on_grow = refuse
    a.allocate(2)
    with pytest.raises(MemoryError):
        a.allocate(1)
    assert a.capacity == 3 and a.num_used == 2
    a.check_invariants()


class GrowingAllocatorMachine(RuleBasedStateMachine):
    """Random alloc / fork / copy-on-write / free / prefix hits on a pool that starts tiny: every
    block handed out exists, the capacity only grows, never past the budget, and only when
    the free blocks were too few."""

    def __init__(self):
        super().__init__()
        self.a = BlockAllocator(num_blocks=40, block_size=BS, initial_blocks=3)
        self.a.on_grow = self.on_grow
        self.seqs: list[tuple[list[int], list[int]]] = []
        self.asked = 0  # blocks the allocation in progress asked for

    def on_grow(self, capacity: int) -> None:
        assert self.a.capacity < capacity <= self.a.num_blocks
        assert len(self.a._blank) < self.asked, "grew while enough free blocks were left"

    def take(self, n: int) -> list[int]:
        self.asked = n
        blocks = self.a.allocate(n)
        assert all(1 <= b < self.a.capacity for b in blocks)
        return blocks

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40))
    def admit(self, tokens):
        hit = self.a.match_prefix(tokens, len(tokens) - 1)
        need = -(-len(tokens) // BS) - len(hit)
        try:
            new = self.take(need)
        except OutOfBlocks:
            self.a.free(hit)
            return
        blocks = hit + new
        self.a.register(tokens, blocks, len(tokens) // BS)
        self.seqs.append((tokens, blocks))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 1000))
    def finish(self, i):
        _, blocks = self.seqs.pop(i % len(self.seqs))
        self.a.free(blocks)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 1000))
    def fork_and_write_last(self, i):
        tokens, blocks = self.seqs[i % len(self.seqs)]
        child = self.a.fork(blocks)
        self.asked = 1
        try:
            new, _ = self.a.make_writable(child[-1])
        except OutOfBlocks:
            self.a.free(child)
            return
        assert new < self.a.capacity
        child[-1] = new
        self.seqs.append((list(tokens), child))

    @invariant()
    def consistent(self):
        self.a.check_invariants()
        held: dict[int, int] = {}
        for _, blocks in self.seqs:
            for b in blocks:
                held[b] = held.get(b, 0) + 1
        assert all(self.a.ref[b] == held.get(b, 0) for b in range(1, self.a.num_blocks))
        assert self.a.num_used == len(held)
        assert self.a.num_free + self.a.num_used == self.a.num_blocks - 1

    def teardown(self):
        for _, blocks in self.seqs:
            self.a.free(blocks)
        self.a.check_invariants()
        assert self.a.num_used == 0


TestGrowingAllocator = GrowingAllocatorMachine.TestCase
TestGrowingAllocator.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


# --- the pool -----------------------------------------------------------------------------


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_pool_growth_keeps_contents_and_adds_zeros(kv_bits):
    pool = KVPool(3, 64, BS, 2, 32, mx.float32, kv_bits=kv_bits, capacity=4)
    first = pool.k[0] if kv_bits is None else pool.k[0][0]
    assert pool.capacity == 4 and first.shape[0] == 4 * BS
    table = [1, 2, 3]
    rng = np.random.default_rng(0)
    for layer in range(3):
        k = mx.array(rng.standard_normal((10, 2, 32)).astype(np.float32))
        pool.write(layer, pool.token_slots(table, 0, 10), k, -k)
    mx.eval(pool.arrays())
    before = [[np.array(p) for p in pool.read_tokens(layer, table, 0, 10)] for layer in range(3)]
    small = pool.nbytes
    pool.grow(9)
    assert pool.capacity == 9 and pool.nbytes == small // 4 * 9
    for layer in range(3):
        after = pool.read_tokens(layer, table, 0, 10)
        assert all(np.array_equal(b, np.array(a)) for b, a in zip(before[layer], after, strict=True))
        fresh = pool.read_tokens(layer, [4, 5, 6, 7, 8], 0, 5 * BS)
        assert all(not np.array(p).any() for p in fresh)
    with pytest.raises(ValueError, match="outside"):
        pool.token_slots([9], 0, 1)  # not allocated yet
    with pytest.raises(ValueError, match="cannot grow"):
        pool.grow(65)
    assert pool.max_nbytes == pool.nbytes // 9 * 64


def test_pool_growth_takes_one_layer_extra_at_most_and_writes_stay_in_place(tiny_dirs):
    loaded = load_model(str(tiny_dirs("llama")))
    pool = KVPool(loaded.num_layers, 2048, 16, loaded.n_kv_heads, loaded.head_dim, loaded.dtype, capacity=256)
    runner = ModelRunner(loaded.model, pool)
    prompt = list(range(3, 43))
    runner.forward([Row(prompt, 0, [1, 2, 3])])
    layer_new = pool.k[0].nbytes * 4  # one layer's K at 1024 blocks

    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    pool.grow(1024)
    mx.synchronize()
    assert mx.get_active_memory() - base == pool.nbytes * 3 // 4  # the old arrays were freed
    # the peak is the grown pool plus one layer's old array, never two whole pools
    assert mx.get_peak_memory() - base <= pool.nbytes * 3 // 4 + layer_new

    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    runner.forward([Row([7], 40, [1, 2, 3]), Row(prompt, 0, [1000, 1001, 1002])])
    mx.synchronize()
    assert mx.get_peak_memory() - base < pool.k[0].nbytes, "a step after growth copied a pool array"


# --- the engine ---------------------------------------------------------------------------


@pytest.fixture
def small_first_chunk(monkeypatch):
    monkeypatch.setattr(engine_config, "KV_FIRST_CHUNK_TOKENS", 32)  # 2 blocks of 16 + the null block


def test_engine_allocates_only_the_first_chunk_at_start(tiny_dirs):
    loaded = load_model(str(tiny_dirs("llama")))
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    engine = Engine(loaded, EngineConfig(cache_gb=1.0, block_size=16))
    try:
        mx.synchronize()
        pool = engine.pool
        first = -(-engine_config.KV_FIRST_CHUNK_TOKENS // 16) + 1
        assert pool.capacity == engine.allocator.capacity == first
        assert engine.stats().kv_bytes == pool.nbytes == pool.max_nbytes // pool.num_blocks * first
        assert pool.max_nbytes > 8 * pool.nbytes  # what a fully allocated pool would have taken
        assert mx.get_peak_memory() - base < 2 * pool.nbytes
    finally:
        engine.shutdown()


def test_the_chat_shows_kv_in_use_against_the_budget_not_the_allocated_pool(tiny_dirs, small_first_chunk):
    """The TUI's status bar and /metrics: KV held by requests out of the budget the pool may grow to
    (the allocated pool starts small, so showing it as the total said the cache was nearly full)."""
    from app.server.metrics import Metrics
    from app.tui.backends import LocalBackend

    loaded = load_model(str(tiny_dirs("llama")))
    engine = Engine(loaded, EngineConfig(cache_gb=0.05, block_size=16))
    try:
        pool, backend = engine.pool, LocalBackend(engine)
        budget = pool.max_nbytes // pool.num_blocks * (pool.num_blocks - 1)  # the null block is never used
        res = backend.resources()
        assert res.kv_total_bytes == budget > 4 * pool.nbytes and res.kv_used_bytes == 0
        lines = Metrics(engine).render().decode().splitlines()
        gauges = {
            n: float(v) for n, v in (line.split() for line in lines if line.startswith("duet_kv_cache_"))
        }
        assert gauges == {"duet_kv_cache_bytes": pool.nbytes, "duet_kv_cache_budget_bytes": budget}
        # as a request's blocks would be, on the worker that owns the allocator (stats() then shows it)
        held = engine.run_on_worker(lambda: engine.allocator.allocate(3), 60)
        try:
            assert backend.resources().kv_used_bytes == 3 * (budget // (pool.num_blocks - 1))
        finally:
            engine.run_on_worker(lambda: engine.allocator.free(held), 60)
    finally:
        engine.shutdown()


def test_engine_grows_under_running_requests_with_the_same_tokens(tiny_dirs, small_first_chunk):
    loaded = load_model(str(tiny_dirs("llama")))
    ps = prompts(loaded.tokenizer.vocab_size, [40, 9, 70, 33, 17, 55], seed=11)
    expected = [reference_greedy(loaded.model, p, 20) for p in ps]
    engine = Engine(loaded, EngineConfig(cache_gb=1.0, block_size=16))
    try:
        assert engine.pool.capacity == 3
        assert asyncio.run(run_all(engine, [req(p, 20) for p in ps])) == expected
        used = sum(-(-(len(p) + 20) // 16) for p in ps)
        assert engine.allocator.growths >= 2
        assert engine.pool.capacity == engine.allocator.capacity <= 2 * (used + 1)
        assert engine.pool.nbytes == engine.pool.max_nbytes // engine.pool.num_blocks * engine.pool.capacity
        assert_no_leaks(engine)
    finally:
        engine.shutdown()


def test_engine_reuses_freed_blocks_instead_of_growing(tiny_dirs, small_first_chunk):
    loaded = load_model(str(tiny_dirs("llama")))
    ps = prompts(loaded.tokenizer.vocab_size, [40] * 6, seed=12)
    engine = Engine(loaded, EngineConfig(cache_gb=1.0, block_size=16, prefix_cache=False))
    try:
        asyncio.run(run_all(engine, [req(ps[0], 20)]))
        capacity = engine.pool.capacity
        for p in ps[1:]:  # one request after another: the memory of one request
            asyncio.run(run_all(engine, [req(p, 20)]))
        assert engine.pool.capacity == capacity
        assert_no_leaks(engine)
    finally:
        engine.shutdown()


def test_engine_budget_is_enforced_while_growing(tiny_dirs, small_first_chunk):
    loaded = load_model(str(tiny_dirs("llama")))
    ps = prompts(loaded.tokenizer.vocab_size, [30, 28, 26, 31, 29, 27], seed=7)
    expected = [reference_greedy(loaded.model, p, 40) for p in ps]
    per_block = 16 * kv_token_bytes(loaded)
    engine = Engine(loaded, EngineConfig(cache_gb=12 * per_block / 2**30, block_size=16, prefix_cache=False))
    try:
        assert engine.pool.num_blocks == 12 and engine.pool.capacity == 3
        # ~2.5 sequences fit in the budget: the pool grows to it, then the scheduler preempts
        assert asyncio.run(run_all(engine, [req(p, 40) for p in ps])) == expected
        assert engine.stats().preemptions > 0
        assert engine.pool.capacity == 12 and engine.pool.nbytes == engine.pool.max_nbytes
        with pytest.raises(ContextLengthError, match="KV cache"):
            asyncio.run(run_all(engine, [req(list(range(3, 200)), 4)]))
        assert engine.pool.capacity == 12
        assert_no_leaks(engine)
    finally:
        engine.shutdown()
