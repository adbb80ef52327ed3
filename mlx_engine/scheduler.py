"""The scheduler: each ``schedule()`` says, per sequence, how many tokens the step processes
(continuous batching, chunked prefill on a grid anchored at token 0, preemption by recompute,
round-robin fairness across requests, ``n > 1`` choices sharing a prompt, KV loads from sources).
How and why: docs/architecture.md ("Scheduler step", "Copy-on-write", "KV sources").

Invariants: a step's tokens stay within ``max_batch_tokens`` (a lone exact-grid piece aside); a
sequence never writes into a block another holds or the prefix index lists (``Step.copies`` first);
a block is registered in the prefix index only once every token of it is computed, in every
layer, and verified; the ``Step`` is never changed after ``schedule()`` returns it, and the
scheduler never calls the engine (proposals come in, what was computed comes back, as data).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from mlx_engine.config import EngineConfig
from mlx_engine.errors import QueueFullError
from mlx_engine.kv_cache.block_allocator import BlockAllocator
from mlx_engine.kv_cache.kv_source import KVSource, LandedKV
from mlx_engine.scheduler_loads import LiveLoads, ask_sources
from mlx_engine.sequence import (
    FINISHED,
    LOADING,
    RUNNING,
    WAITING,
    KVTarget,
    SeqStatus,
    Sequence,
    StartLoad,
    Step,
)

_ENGINE_DEFAULTS = EngineConfig()  # each default is written once, in EngineConfig


@dataclass
class SchedulerConfig:
    max_batch_tokens: int = (
        _ENGINE_DEFAULTS.max_batch_tokens
    )  # token budget per step (decodes + prefill chunks)
    prefill_chunk: int = (
        _ENGINE_DEFAULTS.prefill_grid
    )  # largest prefill piece of one sequence in a step (the grid)
    max_running: int = _ENGINE_DEFAULTS.max_running  # running + loading sequences
    max_queue: int = _ENGINE_DEFAULTS.max_queue
    max_load_share: float = 0.5  # of the pool's blocks that LOADING sequences may hold
    # compute a prompt's last token as a piece of its own, as after a remote prefill: the first
    # token's logits are then bit-identical whether the prompt's KV came from a peer or not
    last_token_alone: bool = False

    @classmethod
    def of(cls, config: EngineConfig) -> SchedulerConfig:
        """The scheduler's part of an engine's options."""
        return cls(config.max_batch_tokens, config.prefill_grid, config.max_running, config.max_queue)


def fair_order(seqs: Iterable[Sequence], running: Counter | None = None) -> list[tuple[int, Sequence]]:
    """``(rank, seq)`` in round-robin order across groups: a sequence's rank is the number of
    sequences of its group before it, plus those the group already runs (``running``); equal
    ranks keep the order given."""
    seen = Counter(running)
    ranked = []
    for i, seq in enumerate(seqs):
        ranked.append((seen[seq.group_key], i, seq))
        seen[seq.group_key] += 1
    return [(rank, seq) for rank, _, seq in sorted(ranked, key=lambda r: r[:2])]


class Scheduler:
    def __init__(self, allocator: BlockAllocator, config: SchedulerConfig, num_layers: int = 1):
        self.alloc = allocator
        self.cfg = config
        self.bs = allocator.block_size
        self.num_layers = num_layers
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []
        self.sources: list[KVSource] = []
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.preemptions = 0
        self.live_loads = LiveLoads()

    # --- queue ------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.cfg.max_queue:
            raise QueueFullError(f"the request queue is full ({self.cfg.max_queue} waiting)")
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> list[tuple[KVSource, int]]:
        """Release a sequence (finished, cancelled or failed), wherever it is. Returns the loads
        it still had in flight, as ``(source, load_id)``, for the engine to cancel at their source
        (their ids are dead already: frames that still arrive are dropped)."""
        cancelled = []
        if seq.status == RUNNING:
            self.running.remove(seq)
        elif seq.status == LOADING:
            self.loading.remove(seq)
            for load_id in sorted(seq.loads):
                st = self.live_loads.pop(load_id)
                assert st is not None  # a LOADING sequence's loads are live
                cancelled.append((st.source, load_id))
            seq.loads.clear()
            seq.landed = None
        elif seq.status == WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = FINISHED
        return cancelled

    def _release(self, seq: Sequence) -> None:
        # full blocks, and the part-full last one, become matchable by later requests, then every
        # block loses this reference
        self._drop_proposals(seq)
        full, tail = divmod(seq.num_computed, self.bs)  # no proposals left: all computed are kept
        self.alloc.register(seq.tokens, seq.blocks, full, seq.cache_salt, tail)
        self.alloc.free(seq.blocks)
        seq.blocks = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    @property
    def num_active(self) -> int:
        """Sequences holding a running slot: running and loading."""
        return len(self.running) + len(self.loading)

    # --- one step ---------------------------------------------------------------
    def _piece(self, seq: Sequence) -> int:
        """Tokens up to the sequence's next prefill grid boundary (the grid is anchored at 0)."""
        chunk = seq.chunk or self.cfg.prefill_chunk
        n = min(seq.num_pending, chunk - seq.num_computed % chunk)
        if self.cfg.last_token_alone and not seq.exact_grid and seq.num_computed < seq.num_prompt - 1:
            n = min(n, seq.num_prompt - 1 - seq.num_computed)
        return n

    def _grow(self, seq: Sequence, n: int, copies: list[tuple[int, int]]) -> bool:
        """Give ``seq`` writable blocks for its next ``n`` tokens; False when blocks ran out."""
        end = -(-(seq.num_computed + n) // self.bs)  # blocks the sequence spans after this step
        need = max(end - len(seq.blocks), 0)
        shared = [
            i
            for i in range(seq.num_computed // self.bs, min(end, len(seq.blocks)))
            if not self.alloc.writable(seq.blocks[i])  # shared, or a cached block ends mid-way
        ]
        if need + len(shared) > self.alloc.num_free:
            return False
        for i in shared:  # copy-on-write
            src = seq.blocks[i]
            dst, copy = self.alloc.make_writable(src)
            seq.blocks[i] = dst
            if copy:
                copies.append((src, dst))
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

    def _drop_proposals(self, seq: Sequence) -> None:
        if seq.num_unverified:
            del seq.tokens[seq.num_verified :]
            seq.num_computed = min(seq.num_computed, len(seq.tokens))
            seq.num_unverified = 0

    def _propose(self, seq: Sequence, budget: int, proposals: Mapping[str, list[int]]) -> int:
        """Put a decoding sequence's proposed tokens (as many as fit) after its last one; returns
        the row's token count."""
        k = min(budget - 1, seq.max_total - len(seq.tokens) - 1)
        if seq.num_pending != 1 or seq.num_generated < 1 or k < 1:
            return 1
        tokens = list(proposals.get(seq.request_id, ()))[:k]
        seq.tokens += tokens
        seq.num_unverified = len(tokens)
        return 1 + len(tokens)

    def end_proposals(self, seq: Sequence, kept: int) -> list[int]:
        """After the forward pass of a row with proposed tokens: takes them off the sequence
        (returned) and keeps the blocks its next ``kept + 1`` tokens need; the engine then appends
        the kept ones again with ``proposal_kept`` after each (their KV is in the pool already)."""
        proposed = seq.tokens[seq.num_verified :]
        del seq.tokens[seq.num_verified :]
        seq.num_unverified = 0
        seq.num_computed = min(seq.num_computed, len(seq.tokens))
        need = -(-(len(seq.tokens) + kept + 1) // self.bs)
        if len(seq.blocks) > need:  # blocks that only rejected proposals used: fresh, unshared
            self.alloc.free(seq.blocks[need:])
            del seq.blocks[need:]
        seq.spec_proposed += len(proposed)
        seq.spec_accepted += kept
        return proposed

    def withdraw_proposals(self, seq: Sequence) -> None:
        """Before the forward pass: the proposer had nothing for the tokens ``seq`` reserved (a
        draft model still catching up): the row decodes its one token (``advance`` is told so)."""
        self._drop_proposals(seq)

    def proposal_kept(self, seq: Sequence) -> None:
        """The token just appended was a kept proposal: its KV is computed."""
        seq.num_computed += 1
        self._register_full(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.num_registered = 0
        seq.status = WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _groups(self) -> Counter:
        """Running slots per group (loading sequences hold one too)."""
        return Counter(s.group_key for s in (*self.running, *self.loading))

    def _make_room(self) -> int:
        """Fairness for the first waiting sequence in fair order when another group runs more
        sequences than its group will (the other group's newest rank above it): if the running
        slots or the free blocks do not let it in, preempt those newest sequences, while they
        still rank above it. Returns the tokens of this step's budget to keep for it, so that the
        running prefills of the other group cannot take them all."""
        ready = [
            (rank, seq)
            for rank, seq in fair_order(self.waiting, self._groups())
            if seq.leader is None or seq.leader.status == FINISHED
        ]
        order = fair_order(sorted(self.running, key=lambda s: s.arrival))
        if not ready or not order or order[-1][0] <= ready[0][0]:
            return 0
        rank, seq = ready[0]
        need = -(-min(seq.num_pending, self.cfg.prefill_chunk) // self.bs)

        def blocked() -> bool:
            return self.num_active >= self.cfg.max_running or need > self.alloc.num_free

        while order and blocked():
            victim_rank, victim = order.pop()
            if victim_rank <= rank:
                break
            self._preempt(victim)
        if blocked():
            return 0
        decodes = sum(s.num_pending == 1 for s in self.running)
        return max(min(seq.num_pending, self.cfg.prefill_chunk, self.cfg.max_batch_tokens - decodes), 0)

    def schedule(self, proposals: Mapping[str, list[int]] | None = None) -> Step:
        """The next step. ``proposals``: tokens to verify after decoding sequences' last ones
        (speculative decoding; by request id), as many as the budget and blocks allow."""
        step = Step()
        budget = self.cfg.max_batch_tokens
        reserve = self._make_room()  # kept from the running sequences for a waiting group
        budget -= reserve
        # 1. running sequences, round-robin across groups, oldest first within a group: decodes
        # (1 token) and unfinished prefills; an export whose grid piece did not fit last time first
        order = [seq for _, seq in fair_order(sorted(self.running, key=lambda s: s.arrival))]
        place = {seq: i for i, seq in enumerate(order)}
        order.sort(key=lambda s: not s.starved)
        bumped: set[Sequence] = set()  # preempted for blocks now: not re-admitted in this step
        for seq in order:
            if seq.status != RUNNING or seq.paused:
                continue
            n = self._piece(seq)
            if n == 1 and budget > 1 and proposals:
                n = self._propose(seq, budget, proposals)
                if n > 1 and not self._grow(seq, n, step.copies):
                    self._drop_proposals(seq)  # no blocks for proposals: plain decoding
                    n = 1
            if seq.exact_grid:
                if n > budget and step.tokens:  # a whole grid piece or nothing (alone it may exceed)
                    seq.starved = True
                    continue
            elif budget <= 0:
                continue
            else:
                n = min(n, budget)
            while not self._grow(seq, n, step.copies):
                victim = max(
                    (s for s in self.running if s.request_id not in step.tokens), key=place.__getitem__
                )
                self._preempt(victim)
                bumped.add(victim)
                if victim is seq:
                    break
            if seq.status == RUNNING:
                self._take(step, seq, n)
                budget -= n
        # 2. admit waiting sequences round-robin across groups (the groups running fewest first),
        # in arrival order within a group, while budget and blocks last; a choice whose leader is
        # still computing the shared prompt lets the ones behind it go first
        budget += reserve
        self.waiting = deque(seq for _, seq in fair_order(self.waiting, self._groups()))
        held: list[Sequence] = []
        while self.waiting and budget > 0 and self.num_active < self.cfg.max_running:
            seq = self.waiting[0]
            if seq in bumped or seq.paused or (not seq.blocks and not self._follow(seq)):
                held.append(self.waiting.popleft())
                continue
            matched = not seq.blocks and self.alloc.index is not None
            if matched:
                # reuse the longest cached prefix; always recompute at least the last token
                end = len(seq.tokens) - 1
                hit = self.alloc.match_prefix(seq.tokens, end, seq.cache_salt)
                seq.blocks, seq.num_computed = hit, len(hit) * self.bs
                tail = self.alloc.match_tail(seq.tokens, hit, end, seq.cache_salt)
                if tail is not None:  # a block that ends mid-way: copied when this writes on
                    seq.blocks = [*hit, tail[0]]
                    seq.num_computed += tail[1]
            if matched and self._start_loads(seq, step):
                self._count_reuse(seq)
                self.waiting.popleft()
                self._admit(step, seq)
                continue
            n = self._piece(seq)
            if not seq.exact_grid:
                n = min(n, budget)
            elif n > budget and step.tokens:
                n = 0  # admitted now, its whole grid piece goes first next step
                seq.starved = True
            if not self._grow(seq, max(n, 1), step.copies):
                if matched:  # give the hit back (it stays cached): waiting sequences must not hold
                    self.alloc.free(seq.blocks)  # blocks that running ones need
                    seq.blocks, seq.num_computed = [], 0
                break  # wait for running sequences to free blocks
            if matched:
                self._count_reuse(seq)
            self.waiting.popleft()
            self._admit(step, seq)
            self.running.append(seq)
            if n:
                self._take(step, seq, n)
                budget -= n
        self.waiting.extendleft(reversed(held))
        return step

    def _admit(self, step: Step, seq: Sequence) -> None:
        if seq.status != LOADING:
            seq.status = RUNNING
        seq.admitted_once = True
        step.admitted.append(seq.request_id)

    def _take(self, step: Step, seq: Sequence, n: int) -> None:
        step.tokens[seq.request_id] = n
        step.seqs[seq.request_id] = seq
        seq.starved = False

    def advance(self, step: Step, computed: Mapping[str, int] | None = None) -> list[str]:
        """After the step's forward pass: its tokens are computed (``computed``: the tokens each
        row did compute, when not what the step asked, e.g. withdrawn proposals or a row left out).
        Registers the blocks that filled up; returns the request ids whose tokens are now all
        computed (to sample)."""
        out = []
        for rid, n in (step.tokens if computed is None else computed).items():
            seq = step.seqs[rid]
            if seq.status != RUNNING:
                continue
            before = seq.num_computed
            seq.num_computed += n
            seq.prompt_computed += max(min(seq.num_computed, seq.num_prompt) - before, 0)
            self._register_full(seq)
            if seq.num_computed == len(seq.tokens):
                out.append(rid)
        return out

    def _register_full(self, seq: Sequence) -> None:
        full = min(seq.num_computed, seq.num_verified) // self.bs  # never a block with proposals
        if full > seq.num_registered:  # a block filled up: make it matchable by later requests
            self.alloc.register(seq.tokens, seq.blocks, full, seq.cache_salt)
            seq.num_registered = full

    def can_ever_fit(self, num_tokens: int) -> bool:
        return -(-num_tokens // self.bs) <= self.alloc.num_blocks - 1

    # --- KV loads ---------------------------------------------------------------
    def _start_loads(self, seq: Sequence, step: Step) -> bool:
        """Ask the sources, in order, for the tokens after the prefix hit (each one continuing
        where the one before stopped); reserve the blocks and make ``seq`` LOADING if any offer.
        Salted sequences never load: a source keys its KV by tokens alone."""
        if not self.sources or seq.cache_salt is not None or not seq.may_load:
            return False
        offers = ask_sources(self.sources, seq.tokens, seq.num_computed, len(seq.tokens) - 1)
        pos = offers[-1][2] if offers else 0
        if not offers or not self._grow(seq, 0, step.copies):  # own a part-full hit before loads write
            return False
        # blocks: what is free, and the share of the pool loads may hold
        held = sum(len(s.blocks) for s in self.loading)
        cap = int(self.cfg.max_load_share * (self.alloc.num_blocks - 1))
        room = max(min(self.alloc.num_free, cap - held), 0)
        pos = min(pos, (len(seq.blocks) + room) * self.bs)
        offers = [(src, a, min(b, pos)) for src, a, b in offers if a < pos]
        if not offers:
            return False
        seq.blocks.extend(self.alloc.allocate(-(-pos // self.bs) - len(seq.blocks)))
        seq.status = LOADING
        seq.landed = LandedKV(self.num_layers)
        self.loading.append(seq)
        step.loads.extend(self.live_loads.start(seq, offers, self.bs))
        return True

    @property
    def loads_started(self) -> int:
        return self.live_loads.started

    @property
    def loads_failed(self) -> int:
        return self.live_loads.failed

    def source_of(self, load_id: int) -> KVSource | None:
        """The source of the live load with this id (None: cancelled, finished or unknown)."""
        st = self.live_loads.get(load_id)
        return st.source if st is not None else None

    def kv_target(self, load_id: int, layer: int, t0: int, t1: int) -> KVTarget | None:
        """Where tokens ``[t0, t1)`` of layer ``layer`` of load ``load_id`` go, or None to drop
        the frame: the load is no longer live, or every token of it is complete already. Raises
        ValueError for a frame outside its load's range (the load must then fail)."""
        return self.live_loads.target(load_id, layer, t0, t1, self.num_layers)

    def kv_landed(self, load_id: int, layer: int, t0: int, t1: int) -> None:
        """Layer ``layer`` of tokens ``[t0, t1)`` is in the pool: advance ``num_computed`` over
        what every layer holds now and register the blocks that completed."""
        seq, cached = self.live_loads.landed(load_id, layer, t0, t1)
        if seq is None:
            return
        if cached and seq.preemptions == 0:  # first admission: hits count once per request
            seq.num_cached += cached
            self.prefix_hit_tokens += cached
        self._register_full(seq)

    def load_finished(self, load_id: int, reason: str | None = None) -> Sequence | None:
        """Load ``load_id`` ended: ``reason`` None for done, else why it failed. Its sequence
        keeps what landed; when none of its loads is left it goes back to RUNNING to compute the
        rest. Returns the sequence, or None for a load that was no longer live."""
        seq = self.live_loads.end(load_id, reason)
        if seq is not None and not seq.loads:
            self.loading.remove(seq)
            seq.landed = None
            seq.status = RUNNING
            self.running.append(seq)
        return seq


__all__ = [
    "FINISHED",
    "LOADING",
    "RUNNING",
    "WAITING",
    "KVTarget",
    "Scheduler",
    "SchedulerConfig",
    "SeqStatus",
    "Sequence",
    "StartLoad",
    "Step",
    "fair_order",
]
