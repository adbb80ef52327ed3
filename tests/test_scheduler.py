"""Directed scheduler cases, driven step by step (no model): which sequence is preempted and where
it goes, how many run at once, the token budget of a step, n > 1 choices waiting for their leader,
what a prefix hit leaves to compute, and which blocks a released sequence makes matchable.

``Driver.step`` does what the engine does around a forward pass: ``schedule()``, then
``advance(step)`` (mark the step's tokens computed, register the blocks that filled up), and
append a sampled token to every sequence whose tokens are all computed (finishing it at
``max_total``).
"""

from __future__ import annotations

from mlx_engine.kv_cache.block_allocator import BlockAllocator
from mlx_engine.scheduler import FINISHED, RUNNING, WAITING, Scheduler, SchedulerConfig, Sequence

BS = 4


class Driver:
    def __init__(self, num_blocks: int, **config):
        self.alloc = BlockAllocator(num_blocks, BS)
        self.sched = Scheduler(self.alloc, SchedulerConfig(**{"max_queue": 100, **config}))
        self.seqs: dict[str, Sequence] = {}

    def add(self, rid: str, prompt: list[int], arrival: float, max_new: int = 8, **kw) -> Sequence:
        seq = Sequence(rid, list(prompt), len(prompt), len(prompt) + max_new, arrival=arrival, **kw)
        self.seqs[rid] = seq
        self.sched.add(seq)
        return seq

    def step(self) -> dict[str, int]:
        """One scheduled step, run to its end; returns its tokens per request."""
        step = self.sched.schedule()
        for rid in step.tokens:
            assert self.seqs[rid].status == RUNNING
        for rid in self.sched.advance(step):
            seq = self.seqs[rid]
            seq.tokens.append(100 + len(seq.tokens))
            if len(seq.tokens) >= seq.max_total:
                self.sched.finish(seq)
        self.alloc.check_invariants()
        return step.tokens


def test_preemption_takes_the_newest_running_sequence_and_requeues_it_first():
    d = Driver(num_blocks=3, max_batch_tokens=64, prefill_chunk=64, max_running=8)  # 2 usable blocks
    old = d.add("old", [1, 2, 3, 4], arrival=1.0)
    new = d.add("new", [5, 6, 7, 8], arrival=2.0)
    assert d.step() == {"old": 4, "new": 4}  # each fills its block and samples a 5th token
    later = d.add("later", [9, 9], arrival=3.0)
    # both now need a second block and none is free: the newest gives its block up
    assert d.step() == {"old": 1}
    assert (new.status, new.num_computed, new.blocks, new.preemptions) == (WAITING, 0, [], 1)
    assert (old.status, old.preemptions, d.sched.preemptions) == (RUNNING, 0, 1)
    assert list(d.sched.waiting) == [new, later]  # back at the front, ahead of later arrivals
    d.sched.finish(old)
    # recomputed from scratch with the token it had generated, still ahead of "later"
    assert d.step() == {"new": 5}
    assert new.tokens[:5] == [5, 6, 7, 8, 104] and later.status == WAITING


def test_a_recomputed_sequence_counts_its_prefix_hits_once():
    """cached_tokens (and the scheduler's hit count) are what a request's first admission reused:
    a preempted sequence that finds its own blocks cached when it comes back does not count them."""
    d = Driver(num_blocks=4, max_batch_tokens=64, prefill_chunk=64, max_running=8)  # 3 usable blocks
    old = d.add("old", [1, 2, 3, 4], arrival=1.0)
    new = d.add("new", [5, 6, 7, 8, 9, 10, 11, 12], arrival=2.0)
    assert d.step() == {"old": 4, "new": 8}
    assert (new.num_cached, d.sched.prefix_hit_tokens) == (0, 0)
    assert d.step() == {"old": 1}  # "new" is preempted; "old" takes the block of its tail
    assert new.preemptions == 1 and len(d.alloc.index.match(new.tokens)) == 1  # its head is cached
    d.sched.finish(old)
    assert d.step() == {"new": 5}  # re-admitted on its own cached head: 4 of its 9 tokens reused
    assert (new.num_cached, d.sched.prefix_hit_tokens) == (0, 0)


def test_never_runs_more_than_max_running():
    d = Driver(num_blocks=64, max_batch_tokens=100, prefill_chunk=100, max_running=2)
    seqs = [d.add(f"r{i}", [i + 1] * 3, arrival=float(i)) for i in range(4)]
    assert d.step() == {"r0": 3, "r1": 3}
    assert d.sched.running == seqs[:2] and list(d.sched.waiting) == seqs[2:]
    assert d.step() == {"r0": 1, "r1": 1}  # budget and blocks to spare, but no third admission
    d.sched.finish(seqs[0])
    assert d.step() == {"r1": 1, "r2": 3}
    assert len(d.sched.running) == 2 and list(d.sched.waiting) == seqs[3:]


def test_a_step_never_exceeds_the_token_budget():
    d = Driver(num_blocks=64, max_batch_tokens=6, prefill_chunk=4, max_running=8)
    seqs = [d.add(f"r{i}", list(range(10 * i, 10 * i + 10)), arrival=float(i), max_new=3) for i in range(3)]
    for _ in range(100):
        if not d.sched.has_work():
            break
        step = d.step()
        assert 0 < sum(step.values()) <= 6, step
        assert all(n <= 4 for n in step.values()), step
    assert all(s.status == FINISHED and s.num_generated == 3 for s in seqs)
    assert d.alloc.num_used == 0


def test_a_choice_waiting_for_its_leader_keeps_its_place_then_shares_the_prompt():
    d = Driver(num_blocks=32, max_batch_tokens=16, prefill_chunk=4, max_running=8)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks and 2 tokens of a third
    lead = d.add("lead", prompt, arrival=1.0)
    choice = d.add("choice", prompt, arrival=2.0, leader=lead)
    d.add("other", [7, 7, 7], arrival=3.0)
    # the leader computes its prompt in chunks; the choice lets "other" pass and stays queued
    assert d.step() == {"lead": 4, "other": 3}
    assert list(d.sched.waiting) == [choice] and choice.status == WAITING
    assert d.step() == {"lead": 4, "other": 1}
    assert list(d.sched.waiting) == [choice] and choice.status == WAITING
    assert d.step() == {"lead": 2, "other": 1}
    # the leader has its prompt: the choice shares its blocks and computes only the last token
    step = d.step()
    assert step["choice"] == 1 and choice.status == RUNNING and not d.sched.waiting
    assert choice.num_cached == 9 and choice.blocks[:2] == lead.blocks[:2]
    assert all(d.alloc.ref[b] == 2 for b in lead.blocks[:2])


def test_a_block_aligned_prompt_seen_before_still_computes_its_last_token():
    d = Driver(num_blocks=16, max_batch_tokens=64, prefill_chunk=64, max_running=8)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]  # exactly two blocks
    first = d.add("first", prompt, arrival=1.0, max_new=1)
    d.step()
    assert first.status == FINISHED and len(d.alloc.index.match(prompt)) == 2
    again = d.add("again", prompt, arrival=2.0)
    # all but the last token come from the cache, which must be computed for its logits: the second
    # block's first three through a copy, since this sequence writes into it
    cached = d.alloc.index.match(prompt)
    assert d.step() == {"again": 1}
    assert again.num_cached == 7 and again.blocks[0] == cached[0] and again.blocks[1] != cached[1]
    assert d.sched.prefix_hit_tokens == 7


def test_a_released_sequence_registers_only_blocks_it_computed():
    d = Driver(num_blocks=16, max_batch_tokens=64, prefill_chunk=6, max_running=8)
    prompt = list(range(1, 13))  # 3 blocks
    cut = d.add("cut", prompt, arrival=1.0)
    assert d.step() == {"cut": 6}  # one full block and half of the second
    d.sched.finish(cut)  # cancelled mid-prefill
    assert len(d.alloc.index.match(prompt)) == 1
    # a sequence that ends on a block boundary: its last token was sampled, never computed
    ended = d.add("ended", [20, 21, 22, 23, 24, 25], arrival=2.0, max_new=2)  # 6 + 2 = 8 tokens
    assert d.step() == {"ended": 6}
    assert d.step() == {"ended": 1}
    assert ended.status == FINISHED and ended.tokens[6:] == [106, 107] and ended.num_computed == 7
    assert len(d.alloc.index.match(ended.tokens)) == 1  # the second block misses its last KV slot


def test_a_preempted_prefill_registers_only_blocks_it_computed():
    # 3 usable blocks: "a" computes a block and a half of its prompt, then runs out and is preempted
    d = Driver(num_blocks=4, max_batch_tokens=16, prefill_chunk=6, max_running=8)
    d.add("b", [9, 9, 9], arrival=2.0)
    a = d.add("a", [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], arrival=3.0)
    assert d.step() == {"b": 3, "a": 6}
    assert d.step() == {"b": 1}
    assert a.preemptions == 1 and a.status == WAITING
    # what a later request (or "a" itself, recomputed) can match is what "a" had computed
    assert len(d.alloc.index.match(a.tokens)) * BS <= 6
    assert a.num_computed <= 6


def test_can_ever_fit_counts_the_usable_blocks():
    d = Driver(num_blocks=5, max_batch_tokens=64, prefill_chunk=64, max_running=8)  # block 0 is reserved
    assert d.sched.can_ever_fit(4 * BS)
    assert not d.sched.can_ever_fit(4 * BS + 1)
