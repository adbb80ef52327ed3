"""Continuous batching with chunked prefill.

Each ``schedule()`` returns one step: ``{request_id: tokens_to_process}`` under a token
budget. Running sequences go first (decodes take one token, unfinished prefills a chunk), then
waiting sequences are admitted, so a long prompt stalls the running streams for at most one
chunk. When KV blocks run out, the last running sequence in fair order (below) is preempted:
its blocks are released (full ones stay in the prefix cache) and it is re-queued at the front,
to be recomputed later (vLLM's recompute policy).

Fairness between client requests: the sequences of one request (its prompts x ``n`` choices)
share a ``group``. Running and waiting sequences are served round-robin across groups (every
group's first sequence, then every group's second, ...), a waiting group counting the sequences
it already runs, so the group that runs fewest is admitted first. When the running slots or the
KV blocks are all taken, the first waiting sequence of a group takes the place of the newest
sequence of a group that runs at least two more (preempted). One client's 256 sequences thus
delay another client's one by a step, not until they finish.

A sequence with a ``leader`` (another choice of the same prompt) waits until the leader has
computed the prompt, then shares all of the leader's prompt blocks, the partly filled last one
included, and computes only the prompt's last token itself. Before any step writes into a
block that another sequence also holds, the writer gets its own copy: the step's
``(source, destination)`` block copies are left in ``copies`` for the engine to make first.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .block_allocator import BlockAllocator
from .errors import QueueFullError

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    tokens: list[int]  # prompt + generated so far
    num_prompt: int
    max_total: int  # stop once len(tokens) reaches this
    arrival: float = field(default_factory=time.monotonic)
    num_computed: int = 0  # tokens whose KV is in the pool
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0  # prompt tokens served by the prefix cache at first admission
    num_registered: int = 0  # full blocks already offered to the prefix index
    status: str = WAITING
    preemptions: int = 0
    admitted_once: bool = False
    leader: Sequence | None = None  # shares this running sequence's prompt blocks (n > 1)
    group: str | None = None  # the client request it belongs to (None: a group of its own)
    cache_salt: str | None = None  # shares prefix-cache blocks only with sequences of this salt

    @property
    def group_key(self) -> str:
        return self.request_id if self.group is None else self.group

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def num_pending(self) -> int:
        return len(self.tokens) - self.num_computed


@dataclass
class SchedulerConfig:
    max_batch_tokens: int = 512  # token budget per step (decodes + prefill chunks)
    prefill_chunk: int = 256  # largest prefill piece of one sequence in a step
    max_running: int = 64
    max_queue: int = 256


class Scheduler:
    def __init__(self, allocator: BlockAllocator, config: SchedulerConfig):
        self.alloc = allocator
        self.cfg = config
        self.bs = allocator.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.preemptions = 0
        # (tokens, blocks already matched, max tokens) -> more blocks loaded from the disk tier
        self.disk_lookup: Callable[[list[int], int, int], list[int]] | None = None
        self.copies: list[tuple[int, int]] = []  # copy-on-write block copies the last step needs

    # --- queue ------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.cfg.max_queue:
            raise QueueFullError(f"the request queue is full ({self.cfg.max_queue} waiting)")
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a sequence (finished, cancelled or failed), wherever it is."""
        if seq.status == RUNNING:
            self.running.remove(seq)
        elif seq.status == WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = FINISHED

    def _release(self, seq: Sequence) -> None:
        # full blocks become matchable by later requests, then every block loses this reference
        self.alloc.register(seq.tokens, seq.blocks, seq.num_computed // self.bs, seq.cache_salt)
        self.alloc.free(seq.blocks)
        seq.blocks = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step ---------------------------------------------------------------
    def _grow(self, seq: Sequence, n: int) -> bool:
        """Give ``seq`` writable blocks for its next ``n`` tokens; False when blocks ran out."""
        end = -(-(seq.num_computed + n) // self.bs)  # blocks the sequence spans after this step
        need = max(end - len(seq.blocks), 0)
        shared = [
            i
            for i in range(seq.num_computed // self.bs, min(end, len(seq.blocks)))
            if self.alloc.ref[seq.blocks[i]] > 1
        ]
        if need + len(shared) > self.alloc.num_free:
            return False
        for i in shared:  # copy-on-write
            src = seq.blocks[i]
            dst, copy = self.alloc.make_writable(src)
            seq.blocks[i] = dst
            if copy:
                self.copies.append((src, dst))
        if need:
            seq.blocks.extend(self.alloc.allocate(need))
        return True

    def _follow(self, seq: Sequence) -> bool:
        """Share the leader's prompt blocks; False while the leader has not computed the prompt."""
        lead = seq.leader
        if lead is None or lead.status == FINISHED or seq.num_prompt < 2:
            seq.leader = None
            return True
        if lead.status != RUNNING or lead.num_computed < seq.num_prompt - 1:
            return False
        seq.leader = None
        seq.num_computed = seq.num_prompt - 1
        seq.blocks = self.alloc.fork(lead.blocks[: -(-seq.num_computed // self.bs)])
        self._count_reuse(seq)
        return True

    def _count_reuse(self, seq: Sequence) -> None:
        """Record the prompt tokens a sequence got without computing them, at first admission."""
        if not seq.admitted_once:
            seq.num_cached = seq.num_computed
            self.prefix_query_tokens += seq.num_prompt
            self.prefix_hit_tokens += seq.num_computed

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.num_registered = 0
        seq.status = WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    @staticmethod
    def _fair(seqs: Iterable[Sequence], running: Counter | None = None) -> list[tuple[int, Sequence]]:
        """``(rank, seq)`` in round-robin order across groups: a sequence's rank is the number of
        sequences of its group before it, plus those the group already runs (``running``); equal
        ranks keep the order given."""
        seen = Counter(running)
        ranked = []
        for i, seq in enumerate(seqs):
            ranked.append((seen[seq.group_key], i, seq))
            seen[seq.group_key] += 1
        return [(rank, seq) for rank, _, seq in sorted(ranked, key=lambda r: r[:2])]

    def _make_room(self) -> int:
        """Fairness for the first waiting sequence in fair order when another group runs more
        sequences than its group will (the other group's newest rank above it): if the running
        slots or the free blocks do not let it in, preempt those newest sequences, while they
        still rank above it. Returns the tokens of this step's budget to keep for it, so that the
        running prefills of the other group cannot take them all."""
        groups = Counter(s.group_key for s in self.running)
        ready = [
            (rank, seq)
            for rank, seq in self._fair(self.waiting, groups)
            if seq.leader is None or seq.leader.status == FINISHED
        ]
        order = self._fair(sorted(self.running, key=lambda s: s.arrival))
        if not ready or not order or order[-1][0] <= ready[0][0]:
            return 0
        rank, seq = ready[0]
        need = -(-min(seq.num_pending, self.cfg.prefill_chunk) // self.bs)

        def blocked() -> bool:
            return len(self.running) >= self.cfg.max_running or need > self.alloc.num_free

        while order and blocked():
            victim_rank, victim = order.pop()
            if victim_rank <= rank:
                break
            self._preempt(victim)
        if blocked():
            return 0
        decodes = sum(s.num_pending == 1 for s in self.running)
        return max(min(seq.num_pending, self.cfg.prefill_chunk, self.cfg.max_batch_tokens - decodes), 0)

    def schedule(self) -> dict[str, int]:
        step: dict[str, int] = {}
        self.copies = []
        budget = self.cfg.max_batch_tokens
        reserve = self._make_room()  # kept from the running sequences for a waiting group
        budget -= reserve
        # 1. running sequences, round-robin across groups, oldest first within a group: decodes
        # (1 token) and unfinished prefills
        order = [seq for _, seq in self._fair(sorted(self.running, key=lambda s: s.arrival))]
        place = {seq: i for i, seq in enumerate(order)}
        for seq in order:
            if seq.status != RUNNING or budget <= 0:
                continue
            n = min(seq.num_pending, self.cfg.prefill_chunk, budget)
            while not self._grow(seq, n):
                victim = max((s for s in self.running if s.request_id not in step), key=place.__getitem__)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status == RUNNING:
                step[seq.request_id] = n
                budget -= n
        # 2. admit waiting sequences round-robin across groups (the groups running fewest first),
        # in arrival order within a group, while budget and blocks last; a choice whose leader is
        # still computing the shared prompt lets the ones behind it go first
        budget += reserve
        groups = Counter(s.group_key for s in self.running)
        self.waiting = deque(seq for _, seq in self._fair(self.waiting, groups))
        held: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running:
            seq = self.waiting[0]
            if not seq.blocks and not self._follow(seq):
                held.append(self.waiting.popleft())
                continue
            matched = not seq.blocks and self.alloc.index is not None
            if matched:
                # reuse the longest cached prefix; always recompute at least the last token
                hit = self.alloc.match_prefix(seq.tokens, len(seq.tokens) - 1, seq.cache_salt)
                if self.disk_lookup is not None and seq.cache_salt is None:  # the disk is unsalted
                    hit += self.disk_lookup(seq.tokens, len(hit), len(seq.tokens) - 1)
                seq.blocks = hit
                seq.num_computed = len(hit) * self.bs
            n = min(seq.num_pending, self.cfg.prefill_chunk, budget)
            if not self._grow(seq, n):
                if matched:  # give the hit back (it stays cached): waiting sequences must not hold
                    self.alloc.free(seq.blocks)  # blocks that running ones need
                    seq.blocks, seq.num_computed = [], 0
                break  # wait for running sequences to free blocks
            if matched:
                self._count_reuse(seq)
            self.waiting.popleft()
            seq.status = RUNNING
            seq.admitted_once = True
            self.running.append(seq)
            step[seq.request_id] = n
            budget -= n
        self.waiting.extendleft(reversed(held))
        return step

    def can_ever_fit(self, num_tokens: int) -> bool:
        return -(-num_tokens // self.bs) <= self.alloc.num_blocks - 1
