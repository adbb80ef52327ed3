"""KV block bookkeeping: free list, reference counts, copy-on-write, and the prefix index.

Blocks are integers ``1..num_blocks-1``; block 0 is the null block (padding in block
tables, scratch target for padded writes) and is never handed out.

A block is in exactly one of four states:
- in use: ``ref[b] > 0`` (held by one or more sequences),
- cached: ``ref[b] == 0`` but registered in the prefix index, so a new request can
  revive it; it sits in the LRU free queue and is evicted when allocation reaches it,
- free: ``ref[b] == 0`` and not cached (its content is of no use to anyone),
- not allocated yet: ``b >= capacity``. The pool's memory grows as blocks are needed
  (``on_grow``), up to ``num_blocks``, the budget.

Allocation takes a free block first, then grows the pool, and only then evicts a cached
block: memory is taken for sequences and for the prefix cache, never for nothing. The free
queue is ordered least-recently-released first, so eviction takes the coldest cached
prefixes first (vLLM's block pool works the same way). Each growth at least doubles the
capacity (the pool re-allocates its arrays to grow them, so doubling keeps the copying
linear in the final size).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from mlx_engine.kv_cache.prefix_index import PrefixIndex


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_cache: bool = True,
        initial_blocks: int | None = None,
    ):
        """``num_blocks`` (the null block included) is the budget; ``initial_blocks`` of them
        exist at start (all when None) and the rest are added as allocation needs them."""
        if num_blocks < 2:
            raise ValueError("need at least 2 KV blocks (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.capacity = num_blocks if initial_blocks is None else max(2, min(initial_blocks, num_blocks))
        self.ref = [0] * num_blocks
        # ordered set of blocks with ref == 0 (free or cached); first = next to be evicted
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, self.capacity))
        # the subset of ``_free`` not in the prefix index, taken before anything is evicted
        self._blank: OrderedDict[int, None] = OrderedDict(self._free)
        self.index = PrefixIndex(block_size) if enable_prefix_cache else None
        self.evictions = 0
        self.growths = 0
        # callback(block_id, prefix tokens through it) before a cached block is reused
        self.on_evict: Callable[[int, list[int]], None] | None = None
        # callback(new capacity) before blocks ``old capacity..new capacity-1`` are handed out
        self.on_grow: Callable[[int], None] | None = None

    # --- counts ---------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free, evictable cached, or not allocated yet)."""
        return len(self._free) + self.num_blocks - self.capacity

    @property
    def num_used(self) -> int:
        return self.capacity - 1 - len(self._free)

    @property
    def num_cached(self) -> int:
        return 0 if self.index is None else len(self.index)

    # --- alloc / free ---------------------------------------------------------
    def allocate(self, n: int = 1) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} KV blocks, {self.num_free} free")
        if n > len(self._blank) and self.capacity < self.num_blocks:
            self._grow(n - len(self._blank))
        out = []
        for _ in range(n):
            if self._blank:
                b, _ = self._blank.popitem(last=False)
                del self._free[b]
            else:
                b = self._evict()
            self.ref[b] = 1
            out.append(b)
        return out

    def _grow(self, shortfall: int) -> None:
        new = min(self.num_blocks, max(self.capacity + shortfall, 2 * self.capacity))
        if self.on_grow is not None:
            self.on_grow(new)  # may raise (out of memory): then nothing here has changed
        for b in range(self.capacity, new):
            self._free[b] = None
            self._blank[b] = None
        self.capacity = new
        self.growths += 1

    def _evict(self) -> int:
        """Take the coldest block with no reference, dropping it (and its subtree) from the index."""
        b, _ = self._free.popitem(last=False)
        if self.index is not None and self.index.contains_block(b):
            # salted blocks never reach the disk tier: its files are keyed by tokens alone
            if self.on_evict is not None and self.index.salt_of(b) is None:
                for blk in self.index.subtree(b):  # their contents are still intact: spill them
                    if not self.index.is_tail(blk):  # the disk tier keeps whole blocks
                        self.on_evict(blk, self.index.path_tokens(blk))
            for blk in self.index.remove_block(b):
                if blk != b and self.ref[blk] == 0:
                    self._blank[blk] = None  # unreachable now: free, not cached
            self.evictions += 1
        return b

    def incref(self, b: int) -> None:
        if self.ref[b] == 0:
            self._free.pop(b)
            self._blank.pop(b, None)
        self.ref[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; the tail of a sequence is released first so it is evicted first."""
        for b in reversed(blocks):
            if b == 0:
                continue
            if self.ref[b] <= 0:
                raise AssertionError(f"double free of KV block {b}")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self._free[b] = None
                if self.index is None or not self.index.contains_block(b):
                    self._blank[b] = None

    def fork(self, blocks: list[int]) -> list[int]:
        """Share all blocks with a new sequence (n > 1 sampling); writes go through ``make_writable``."""
        for b in blocks:
            self.incref(b)
        return list(blocks)

    def writable(self, b: int) -> bool:
        """Only one sequence holds ``b`` and no later request can match it."""
        return self.ref[b] == 1 and (self.index is None or not self.index.contains_block(b))

    def make_writable(self, b: int) -> tuple[int, bool]:
        """Copy-on-write: returns (block to write into, whether its content must be copied from ``b``)."""
        if self.writable(b):
            return b, False
        (new,) = self.allocate(1)
        self.free([b])
        return new, True

    # --- prefix cache -----------------------------------------------------------
    def match_prefix(self, tokens: list[int], max_tokens: int, salt: str | None = None) -> list[int]:
        """Blocks caching the longest full-block prefix of ``tokens[:max_tokens]`` registered under
        the same ``salt``; each gets a reference."""
        if self.index is None:
            return []
        blocks = self.index.match(tokens, max_tokens, salt)
        for b in blocks:
            self.incref(b)
        return blocks

    def match_tail(
        self, tokens: list[int], hit: list[int], max_tokens: int, salt: str | None = None
    ) -> tuple[int, int] | None:
        """After the full-block ``hit``: ``(block, n)``, a cached block whose first ``n`` tokens are
        the prompt's next (prefix_index.PrefixIndex.match_tail), with a reference; None if none."""
        if self.index is None:
            return None
        tail = self.index.match_tail(tokens, hit, max_tokens, salt)
        if tail is not None:
            self.incref(tail[0])
        return tail

    def register(
        self, tokens: list[int], blocks: list[int], num_full: int, salt: str | None = None, tail: int = 0
    ) -> None:
        """Make the first ``num_full`` full blocks of a sequence matchable by later requests with
        the same ``salt``, and with ``tail`` the first ``tail`` tokens of the block after them."""
        if self.index is not None and num_full + tail > 0:
            n = num_full * self.block_size + tail
            self.index.insert(tokens[:n], blocks[: num_full + (tail > 0)], salt)

    def check_invariants(self) -> None:
        assert 2 <= self.capacity <= self.num_blocks
        for b in range(1, self.capacity):
            assert self.ref[b] >= 0
            assert (self.ref[b] == 0) == (b in self._free), f"block {b}: ref {self.ref[b]}"
            cached = self.index is not None and self.index.contains_block(b)
            assert (b in self._blank) == (self.ref[b] == 0 and not cached), f"block {b}: blank state"
        assert all(self.ref[b] == 0 for b in range(self.capacity, self.num_blocks))
        assert 0 not in self._free and len(self._free) <= self.capacity - 1
        if self.index is not None:
            self.index.check_invariants()
