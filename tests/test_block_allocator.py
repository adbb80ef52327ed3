"""Property tests: random interleavings of alloc / fork / free / cache / match keep the invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlx_engine.kv_cache.block_allocator import BlockAllocator, OutOfBlocks
from mlx_engine.kv_cache.prefix_index import PrefixIndex

BS = 4


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.a = BlockAllocator(num_blocks=24, block_size=BS)
        self.seqs: list[tuple[list[int], list[int]]] = []  # (tokens, blocks) per live sequence

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40))
    def admit(self, tokens):
        hit = self.a.match_prefix(tokens, len(tokens) - 1)
        # matched blocks must hold exactly this prompt's prefix
        assert len(hit) * BS <= len(tokens) - 1
        need = -(-len(tokens) // BS) - len(hit)
        try:
            new = self.a.allocate(need)
        except OutOfBlocks:
            self.a.free(hit)
            return
        blocks = hit + new
        self.a.register(tokens, blocks, len(tokens) // BS)
        self.seqs.append((tokens, blocks))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 1000))
    def finish(self, i):
        tokens, blocks = self.seqs.pop(i % len(self.seqs))
        self.a.free(blocks)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 1000))
    def fork_and_write_last(self, i):
        tokens, blocks = self.seqs[i % len(self.seqs)]
        child = self.a.fork(blocks)
        try:
            new, copy = self.a.make_writable(child[-1])
        except OutOfBlocks:
            self.a.free(child)
            return
        assert copy  # the last block is shared with the parent, so it must be copied
        assert new != blocks[-1]
        child[-1] = new
        self.seqs.append((list(tokens), child))

    @invariant()
    def consistent(self):
        self.a.check_invariants()
        held: dict[int, int] = {}
        for _, blocks in self.seqs:
            for b in blocks:
                held[b] = held.get(b, 0) + 1
        for b in range(1, self.a.num_blocks):
            assert self.a.ref[b] == held.get(b, 0), f"block {b}"
        assert self.a.num_used == len(held)

    def teardown(self):
        for _, blocks in self.seqs:
            self.a.free(blocks)
        self.a.check_invariants()
        assert self.a.num_used == 0  # no leaks: everything free or only cached


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=24), min_size=1, max_size=12))
@settings(max_examples=200, deadline=None)
def test_prefix_index_matches_longest_inserted_prefix(prompts):
    idx = PrefixIndex(BS)
    next_block = iter(range(1, 10_000))
    inserted: list[list[int]] = []
    for p in prompts:
        blocks = [next(next_block) for _ in range(len(p) // BS)]
        idx.insert(p, blocks)
        inserted.append(p)
        idx.check_invariants()
    for q in prompts:
        got = len(idx.match(q)) * BS
        # longest common full-block prefix with any inserted prompt
        best = 0
        for p in inserted:
            n = 0
            while n + BS <= min(len(p), len(q)) and p[n : n + BS] == q[n : n + BS]:
                n += BS
            best = max(best, n)
        assert got == best


@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=24), min_size=1, max_size=12))
@settings(max_examples=200, deadline=None)
def test_a_prompt_reuses_the_longest_cached_prefix_to_the_token(prompts):
    """Sequences end mid-block: with their last block indexed as a tail, a later prompt's hit (full
    blocks, then a tail or full block below them) is its longest common prefix with any of them, the
    part of a block taken only from ``min_tail`` tokens."""
    a = BlockAllocator(num_blocks=200, block_size=BS)
    for p in prompts:
        blocks = a.allocate(-(-len(p) // BS))
        full, tail = divmod(len(p), BS)
        a.register(p, blocks, full, tail=tail)
        a.free(blocks)
        a.check_invariants()
    for q in prompts:
        hit = a.match_prefix(q, len(q))
        tail = a.match_tail(q, hit, len(q))
        got = len(hit) * BS + (tail[1] if tail else 0)
        best = 0
        for p in prompts:
            n = 0
            while n < min(len(p), len(q)) and p[n] == q[n]:
                n += 1
            best = max(best, n)
        full = best // BS * BS
        assert got == (best if best - full >= a.index.min_tail else full)
        a.free(hit + ([tail[0]] if tail else []))
    a.check_invariants()


def test_a_cached_tail_is_copied_before_it_is_written_and_evicted_like_any_block():
    a = BlockAllocator(num_blocks=4, block_size=4)
    blocks = a.allocate(2)
    a.register([1, 2, 3, 4, 5, 6], blocks, 1, tail=2)  # a sequence that ended after 6 tokens
    a.free(blocks)
    assert a.num_cached == 2 and a.num_used == 0
    hit = a.match_prefix([1, 2, 3, 4, 5, 6, 7], 6)
    assert a.match_tail([1, 2, 3, 4, 5, 9], hit, 6) == (blocks[1], 1)
    assert not a.writable(blocks[1])  # held once, but a later prompt may still match it
    new, copy = a.make_writable(blocks[1])
    assert copy and new != blocks[1]
    a.free(hit + [new])
    a.allocate(3)  # the pool's three blocks: the cached ones are evicted
    assert a.num_cached == 0
    a.check_invariants()


def test_eviction_drops_unreachable_descendants():
    a = BlockAllocator(num_blocks=4, block_size=2)
    blocks = a.allocate(3)
    a.register([1, 2, 3, 4, 5, 6], blocks, 3)
    a.free(blocks)
    assert a.num_used == 0 and a.num_cached == 3
    # allocation evicts the coldest: the sequence's tail was released first
    (b,) = a.allocate(1)
    assert b == blocks[-1]
    assert a.match_prefix([1, 2, 3, 4, 5, 6, 7], 7) == blocks[:2]
    a.check_invariants()


def test_double_free_is_caught():
    a = BlockAllocator(num_blocks=4, block_size=2)
    (b,) = a.allocate(1)
    a.free([b])
    with pytest.raises(AssertionError):
        a.free([b])


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_pool_copy_block_copies_every_layer(kv_bits):
    import mlx.core as mx

    from mlx_engine.kv_cache.kv_pool import KVPool

    pool = KVPool(num_layers=2, num_blocks=4, block_size=BS, n_kv_heads=2, head_dim=32, kv_bits=kv_bits)
    slots = mx.arange(1 * BS, 2 * BS)
    for layer in range(2):
        pool.write(layer, slots, mx.random.normal((BS, 2, 32)), mx.random.normal((BS, 2, 32)))
    pool.copy_block(1, 3)
    for layer in range(2):
        src = pool.gather(layer, slots[None])
        dst = pool.gather(layer, mx.arange(3 * BS, 4 * BS)[None])
        assert all(mx.array_equal(a, b).item() for a, b in zip(src, dst, strict=True))
