"""Property test of the scheduler against a shadow KV store (no model).

Every slot of the shadow store records which token's KV was written there. Random interleavings
of submissions (some sharing prompts through the prefix cache, some forking another request's
prompt as n > 1 choices do), steps, cancellations and preemptions under a small block budget
must keep each running sequence's blocks holding exactly its own tokens — the property that
copy-on-write, prefix hits and recompute exist to preserve — and must leak no block. A finished
sequence's part-full last block is cached too (a tail), so later prompts sharing part of it copy it.
"""

from __future__ import annotations

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlx_engine.kv_cache.block_allocator import BlockAllocator
from mlx_engine.scheduler import FINISHED, RUNNING, Scheduler, SchedulerConfig, Sequence

BS = 4
PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7],
    [1, 2, 3, 4, 5, 6, 7, 8, 9],
    [1, 2, 3, 4, 9, 9],
    [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5],
]


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = BlockAllocator(num_blocks=20, block_size=BS)
        self.sched = Scheduler(
            self.alloc, SchedulerConfig(max_batch_tokens=12, prefill_chunk=5, max_running=6, max_queue=100)
        )
        self.kv: dict[int, list[int | None]] = {b: [None] * BS for b in range(self.alloc.num_blocks)}
        self.seqs: dict[str, Sequence] = {}
        self.n = 0

    @rule(p=st.sampled_from(PROMPTS), max_new=st.integers(1, 8), fork=st.booleans())
    def submit(self, p, max_new, fork):
        self.n += 1
        seq = Sequence(f"r{self.n}", list(p), len(p), len(p) + max_new)
        if fork:  # another choice of a live request with the same prompt, if there is one
            seq.leader = next((s for s in self.seqs.values() if s.tokens[: s.num_prompt] == p), None)
        self.seqs[seq.request_id] = seq
        self.sched.add(seq)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def cancel(self, i):
        seq = list(self.seqs.values())[i % len(self.seqs)]
        self.sched.finish(seq)
        del self.seqs[seq.request_id]

    @rule()
    def step(self):
        step = self.sched.schedule()
        assert sum(step.tokens.values()) <= self.sched.cfg.max_batch_tokens
        assert len(self.sched.running) <= self.sched.cfg.max_running
        for src, dst in step.copies:  # what the engine does before the forward pass
            self.kv[dst] = list(self.kv[src])
        for rid, n in step.tokens.items():
            seq = self.seqs[rid]
            assert seq.status == RUNNING
            for t in range(seq.num_computed, seq.num_computed + n):
                b = seq.blocks[t // BS]
                assert self.alloc.writable(b), f"{rid} writes into block {b} that others hold or may match"
                self.kv[b][t % BS] = seq.tokens[t]
        for rid in self.sched.advance(step):  # "sample": a token unique to this request
            seq = self.seqs[rid]
            seq.tokens.append(1000 + int(rid[1:]))
            if len(seq.tokens) >= seq.max_total:
                self.sched.finish(seq)
                del self.seqs[rid]

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq in self.seqs.values():
            if seq.status == FINISHED:
                continue
            got = [self.kv[seq.blocks[t // BS]][t % BS] for t in range(seq.num_computed)]
            assert got == seq.tokens[: seq.num_computed], seq.request_id
        index = self.alloc.index
        for b in index.blocks() if index is not None else []:  # the prefix cache holds what it says
            path = index.path_tokens(b)
            n = len(path) % BS or BS  # a part-full tail block: its first n tokens
            assert self.kv[b][:n] == path[-n:], f"cached block {b} was overwritten"
        self.alloc.check_invariants()

    def teardown(self):
        for seq in list(self.seqs.values()):
            self.sched.finish(seq)
        self.alloc.check_invariants()
        assert self.alloc.num_used == 0, "blocks leaked"


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)


class SpeculativeSchedulerMachine(SchedulerMachine):
    """The same property with speculative decoding: decoding rows carry proposed tokens (some
    right, then a wrong one), verification keeps the right ones and rolls back the rest."""

    def __init__(self):
        super().__init__()
        self.rng = random.Random(0)

    @staticmethod
    def truth(seq: Sequence, t: int) -> int:
        """What 'sampling' gives at position t: unique to the request and the position."""
        return 100_000 * int(seq.request_id[1:]) + t

    def propose(self, seq: Sequence, max_k: int) -> list[int]:
        k = self.rng.randint(0, max_k)
        right = self.rng.randint(0, k)
        base = len(seq.tokens)
        return [self.truth(seq, base + i) for i in range(right)] + [-1] * (k - right)

    @rule(seed=st.integers(0, 2**16))
    def step(self, seed):
        self.rng.seed(seed)
        # proposals for every decoding sequence, more than fit: the scheduler takes what the budget allows
        proposals = {rid: self.propose(seq, 8) for rid, seq in self.seqs.items() if seq.num_pending == 1}
        step = self.sched.schedule(proposals)
        assert sum(step.tokens.values()) <= self.sched.cfg.max_batch_tokens
        for src, dst in step.copies:
            self.kv[dst] = list(self.kv[src])
        for rid, n in step.tokens.items():
            seq = self.seqs[rid]
            assert seq.status == RUNNING and len(seq.tokens) <= seq.max_total - 1 + (n > 1)
            for t in range(seq.num_computed, seq.num_computed + n):
                b = seq.blocks[t // BS]
                assert self.alloc.writable(b), f"{rid} writes into block {b} that others hold or may match"
                self.kv[b][t % BS] = seq.tokens[t]
        for rid in self.sched.advance(step):
            seq = self.seqs[rid]
            base = seq.num_verified
            drafts = seq.tokens[base:]
            kept = next((i for i, d in enumerate(drafts) if d != self.truth(seq, base + i)), len(drafts))
            if drafts or seq.num_unverified:
                assert self.sched.end_proposals(seq, kept) == drafts
            for i in range(kept + 1):
                seq.tokens.append(self.truth(seq, len(seq.tokens)))
                if len(seq.tokens) >= seq.max_total:
                    self.sched.finish(seq)
                    del self.seqs[rid]
                    break
                if i < kept:
                    self.sched.proposal_kept(seq)


TestSpeculativeScheduler = SpeculativeSchedulerMachine.TestCase
TestSpeculativeScheduler.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
