"""The scheduler's vocabulary: a ``Sequence`` (one generation or peer prefill, its tokens, blocks
and KV-load state), its ``SeqStatus``, and a ``Step`` (what one scheduler step runs)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from mlx_engine.kv_cache.kv_source import KVLoad, KVSource, LandedKV


class SeqStatus(enum.StrEnum):
    WAITING = "waiting"  # queued (new, or preempted: to be recomputed)
    RUNNING = "running"  # holds blocks and a running slot; scheduled each step
    LOADING = "loading"  # its KV is arriving from KV sources; holds blocks and a slot, takes no budget
    FINISHED = "finished"  # released


WAITING, RUNNING, LOADING, FINISHED = (
    SeqStatus.WAITING,
    SeqStatus.RUNNING,
    SeqStatus.LOADING,
    SeqStatus.FINISHED,
)


@dataclass(eq=False)
class Sequence:
    request_id: str
    tokens: list[int]  # prompt + generated so far
    num_prompt: int
    max_total: int  # stop once len(tokens) reaches this
    arrival: float = field(default_factory=time.monotonic)
    num_computed: int = 0  # tokens whose KV is in the pool
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0  # prompt tokens served by the prefix cache (memory or disk) at first admission
    num_registered: int = 0  # full blocks already offered to the prefix index
    status: SeqStatus = WAITING
    preemptions: int = 0
    admitted_once: bool = False
    leader: Sequence | None = None  # shares this running sequence's prompt blocks (n > 1)
    group: str | None = None  # the client request it belongs to (None: a group of its own)
    cache_salt: str | None = None  # shares prefix-cache blocks only with sequences of this salt
    chunk: int | None = None  # prefill grid of this sequence (None: the scheduler's prefill_chunk)
    exact_grid: bool = False  # never split a grid piece to fit the budget (a peer's export)
    may_load: bool = True  # KV sources may be asked for its tokens
    prompt_computed: int = 0  # prompt tokens this engine computed itself (recomputes included)
    loaded: dict[str, int] = field(default_factory=dict)  # source name -> tokens it landed
    load_failures: list[str] = field(default_factory=list)  # why loads ended early
    loads: set[int] = field(default_factory=set)  # live load ids (LOADING)
    load_ranges: list[tuple[str, bool, int, int]] = field(default_factory=list)  # (source, is_cache, [a, b))
    landed: LandedKV | None = None  # per-layer landed ranges while LOADING
    starved: bool = False  # an exact_grid piece did not fit the last step's budget
    paused: bool = False  # not scheduled for now (a peer export whose send queue is full)
    num_unverified: int = 0  # proposed tokens at the end of ``tokens``, not verified yet (speculative/)
    spec_proposed: int = 0  # proposed tokens verified so far
    spec_accepted: int = 0  # of which kept

    @property
    def group_key(self) -> str:
        return self.request_id if self.group is None else self.group

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def num_pending(self) -> int:
        return len(self.tokens) - self.num_computed

    def credit_sources(self, a: int, b: int) -> int:
        """Tokens ``[a, b)`` landed in every layer: credit each source with its own (``loaded``);
        returns how many came from caches (prefix-cache hits)."""
        cached = 0
        for name, cache, lo, hi in self.load_ranges:
            n = max(min(b, hi) - max(a, lo), 0)
            if n:
                self.loaded[name] = self.loaded.get(name, 0) + n
                cached += n if cache else 0
        return cached

    @property
    def num_verified(self) -> int:
        """Tokens that are the sequence's own (proposed ones excluded)."""
        return len(self.tokens) - self.num_unverified


@dataclass
class StartLoad:
    """A load the engine starts after ``schedule()``: ``source.start_load(load, sink)``."""

    source: KVSource
    load: KVLoad


@dataclass(frozen=True)
class Step:
    """One scheduler step: what the engine runs before calling ``advance(step, computed)``. Made
    by ``schedule()`` and never changed after: what the engine learns while running it (a row
    that computed fewer tokens, proposals kept) goes back to the scheduler as data."""

    tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens to compute
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), first
    loads: list[StartLoad] = field(default_factory=list)  # KV loads to start
    admitted: list[str] = field(default_factory=list)  # request ids admitted (or re-admitted)
    seqs: dict[str, Sequence] = field(default_factory=dict)  # the sequences in ``tokens``

    def __bool__(self) -> bool:
        return bool(self.tokens or self.loads)


@dataclass
class KVTarget:
    """Where an arriving layer range goes: tokens ``[t0, t1)`` of the frame (already clipped to
    what is not yet complete) into the sequence with block table ``blocks``."""

    seq: Sequence
    blocks: list[int]
    t0: int
    t1: int
