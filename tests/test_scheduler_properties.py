"""Property test of the scheduler against a shadow KV store (no model).

Every slot of the shadow store records which token's KV was written there. Random interleavings
of submissions (some sharing prompts through the prefix cache, some forking another request's
prompt as n > 1 choices do), steps, cancellations and preemptions under a small block budget
must keep each running sequence's blocks holding exactly its own tokens — the property that
copy-on-write, prefix hits and recompute exist to preserve — and must leak no block.
"""

from __future__ import annotations

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
                assert self.alloc.ref[b] == 1, f"{rid} writes into block {b} that others hold"
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
        self.alloc.check_invariants()

    def teardown(self):
        for seq in list(self.seqs.values()):
            self.sched.finish(seq)
        self.alloc.check_invariants()
        assert self.alloc.num_used == 0, "blocks leaked"


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
