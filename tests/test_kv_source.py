"""KV sources at the scheduler (no model): LOADING sequences, landed ranges, failures, late frames.

A fake source offers token ranges; the tests play the engine's part: ``schedule()``, then for
each arriving frame ``kv_target`` (where to write, or drop) and ``kv_landed``, and
``load_finished``. The shadow-KV state machine at the end writes each frame into a per-layer
shadow store exactly where ``kv_target`` says, under random interleavings of submissions, frames
(also of loads that were cancelled, with their blocks reused), failures, cancels and steps:
every sequence must read its own tokens in every layer up to ``num_computed``, every block in
the prefix index must hold its tokens in every layer, and no block may leak.
"""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlx_engine.kv_cache.block_allocator import BlockAllocator
from mlx_engine.kv_cache.kv_source import KVLoad, KVSink, KVSource, LandedKV, RangeSet
from mlx_engine.kv_cache.prefix_index import prefix_hash
from mlx_engine.scheduler import FINISHED, LOADING, RUNNING, WAITING, Scheduler, SchedulerConfig, Sequence

BS = 4


# --- ranges ------------------------------------------------------------------------------------


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=30), st.integers(0, 45))
def test_range_set_is_the_union_of_its_ranges(ranges, probe):
    rs, covered = RangeSet(), set()
    for a, b in ranges:
        rs.add(a, b)
        covered |= set(range(a, b))
    got = rs.ranges()
    assert all(a < b for a, b in got) and all(b1 < a2 for (_, b1), (a2, _) in zip(got, got[1:], strict=False))
    assert {t for a, b in got for t in range(a, b)} == covered  # disjoint, merged, exact
    end = probe
    while end in covered:
        end += 1
    assert rs.end_from(probe) == end


def test_landed_kv_is_complete_only_where_every_layer_landed():
    landed = LandedKV(3)
    landed.add(0, 0, 8)
    landed.add(1, 0, 8)
    assert landed.complete_from(0) == 0  # layer 2 has nothing yet
    landed.add(2, 4, 8)
    assert landed.complete_from(0) == 0 and landed.complete_from(4) == 8
    landed.add(2, 0, 4)
    assert landed.complete_from(0) == 8


# --- a fake source and the engine's part ---------------------------------------------------------


class FakeSource(KVSource):
    """Offers prompts of at least ``min_tokens`` tokens everything (or ``offer`` tokens)."""

    def __init__(
        self, name: str = "peer", offer: int | None = None, is_cache: bool = False, min_tokens: int = 10
    ):
        self.name, self.offer, self.is_cache, self.min_tokens = name, offer, is_cache, min_tokens
        self.cancelled: list[int] = []

    def match(self, tokens: list[int], start: int, end: int) -> int:
        if len(tokens) < self.min_tokens:
            return 0
        return end - start if self.offer is None else min(self.offer, end - start)

    def start_load(self, load: KVLoad, sink: KVSink) -> None:
        raise AssertionError("the tests start loads themselves")

    def cancel(self, load_id: int) -> None:
        self.cancelled.append(load_id)


def make(num_blocks: int = 64, layers: int = 2, **config) -> Scheduler:
    cfg = SchedulerConfig(
        **{"max_batch_tokens": 16, "prefill_chunk": 8, "max_running": 8, "max_queue": 100, **config}
    )
    return Scheduler(BlockAllocator(num_blocks, BS), cfg, num_layers=layers)


def deliver(sched: Scheduler, load_id: int, layer: int, t0: int, t1: int) -> bool:
    """What the engine does with a frame; True when it was written."""
    target = sched.kv_target(load_id, layer, t0, t1)
    if target is None:
        return False
    sched.kv_landed(load_id, layer, t0, t1)
    return True


def seq(rid: str, prompt: list[int], max_new: int = 4, **kw) -> Sequence:
    return Sequence(rid, list(prompt), len(prompt), len(prompt) + max_new, **kw)


PROMPT = list(range(1, 22))  # 21 tokens: a load covers [0, 20)


def test_a_loading_sequence_holds_its_blocks_and_a_slot_but_no_budget():
    sched = make(max_running=2)
    sched.sources.append(FakeSource())
    a, b, c = seq("a", PROMPT), seq("b", [7, 7, 7]), seq("c", [8, 8, 8])
    for s in (a, b, c):
        sched.add(s)
    step = sched.schedule()
    assert [(sl.load.start, sl.load.end, sl.load.tokens) for sl in step.loads] == [(0, 20, PROMPT)]
    assert a.status == LOADING and len(a.blocks) == 5  # reserved with the match: [0, 20)
    assert step.tokens == {"b": 3}  # "a" took no budget, but one of the two running slots
    assert c.status == WAITING and sched.num_active == 2
    assert step.admitted == ["a", "b"]


def test_a_loading_sequence_is_never_preempted():
    sched = make(num_blocks=9, max_load_share=1.0)  # 8 usable blocks
    sched.sources.append(FakeSource())
    a = seq("a", PROMPT)  # loads 5 blocks
    b = seq("b", [5] * 9, max_new=20)  # 3 blocks, then more as it decodes
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert a.status == LOADING and b.status == RUNNING
    for _ in range(12):
        step = sched.schedule()
        if sched.advance(step) == ["b"]:
            b.tokens.append(9)
    # b ran out of blocks: it was preempted (itself), never the loading sequence
    assert a.status == LOADING and len(a.blocks) == 5
    assert b.preemptions >= 1
    sched.alloc.check_invariants()


def test_num_computed_advances_only_over_tokens_landed_in_every_layer():
    sched = make(layers=2)
    sched.sources.append(FakeSource())
    a = seq("a", PROMPT)
    sched.add(a)
    (sl,) = sched.schedule().loads
    lid = sl.load.load_id
    assert deliver(sched, lid, 0, 0, 8)
    assert a.num_computed == 0 and sched.alloc.index.match(PROMPT) == []
    assert deliver(sched, lid, 1, 0, 6)
    assert a.num_computed == 6 and len(sched.alloc.index.match(PROMPT)) == 1  # block 0 complete
    assert deliver(sched, lid, 1, 6, 12)
    assert a.num_computed == 8 and len(sched.alloc.index.match(PROMPT)) == 2
    # a frame below num_computed is written only where it is not complete yet
    target = sched.kv_target(lid, 0, 4, 12)
    assert (target.t0, target.t1) == (8, 12)
    assert sched.kv_target(lid, 0, 0, 8) is None  # all complete: nothing to write
    with pytest.raises(ValueError):
        sched.kv_target(lid, 0, 16, 21)  # past the load's end
    with pytest.raises(ValueError):
        sched.kv_target(lid, 2, 0, 4)  # no such layer


def test_done_returns_the_sequence_to_running_for_its_last_token():
    sched = make()
    sched.sources.append(FakeSource())
    a = seq("a", PROMPT)
    sched.add(a)
    (sl,) = sched.schedule().loads
    for layer in (0, 1):
        deliver(sched, sl.load.load_id, layer, 0, 20)
    assert sched.load_finished(sl.load.load_id) is a
    assert a.status == RUNNING and a.num_computed == 20 and not a.load_failures
    step = sched.schedule()
    assert step.tokens == {"a": 1}
    assert sched.advance(step) == ["a"]
    assert a.prompt_computed == 1 and a.loaded == {"peer": 20}


def test_a_failed_load_keeps_the_landed_prefix_and_computes_the_rest():
    sched = make()
    src = FakeSource()
    sched.sources.append(src)
    a = seq("a", PROMPT)
    sched.add(a)
    (sl,) = sched.schedule().loads
    lid = sl.load.load_id
    for layer in (0, 1):
        deliver(sched, lid, layer, 0, 8)
    deliver(sched, lid, 0, 8, 16)  # half of the next range: not landed
    assert sched.load_finished(lid, "peer died") is a
    assert a.status == RUNNING and a.num_computed == 8 and a.load_failures == ["peer: peer died"]
    assert len(a.blocks) == 5  # kept: the rest is computed into them
    assert not deliver(sched, lid, 1, 8, 16)  # a late frame of the failed load: dropped
    assert sched.load_finished(lid, None) is None  # and its late done
    steps = []
    while a.num_computed < len(a.tokens):
        step = sched.schedule()
        steps.append(step.tokens["a"])
        sched.advance(step)
    assert steps == [8, 5]  # on the grid, from the landed end
    assert a.prompt_computed == 13 and sched.loads_failed == 1


def test_done_with_a_gap_is_a_failure_at_the_gap():
    sched = make()
    sched.sources.append(FakeSource())
    a = seq("a", PROMPT)
    sched.add(a)
    (sl,) = sched.schedule().loads
    for layer in (0, 1):
        deliver(sched, sl.load.load_id, layer, 0, 8)
        deliver(sched, sl.load.load_id, layer, 12, 20)
    sched.load_finished(sl.load.load_id)
    assert a.num_computed == 8 and a.status == RUNNING and a.load_failures


def test_cancel_of_a_loading_sequence_names_its_loads_and_registers_only_landed_blocks():
    sched = make()
    src = FakeSource()
    sched.sources.append(src)
    a = seq("a", PROMPT)
    sched.add(a)
    (sl,) = sched.schedule().loads
    for layer in (0, 1):
        deliver(sched, sl.load.load_id, layer, 0, 6)
    deliver(sched, sl.load.load_id, 0, 6, 20)
    assert sched.finish(a) == [(src, sl.load.load_id)]
    assert a.status == FINISHED and sched.alloc.num_used == 0
    assert len(sched.alloc.index.match(PROMPT)) == 1  # only block 0 landed in both layers
    assert not deliver(sched, sl.load.load_id, 1, 6, 20)  # late: the load id is dead
    sched.alloc.check_invariants()


def test_sources_continue_each_other_and_cache_hits_count_as_cached():
    sched = make()
    disk, peer = FakeSource("disk", offer=8, is_cache=True), FakeSource("peer")
    sched.sources += [disk, peer]
    a = seq("a", PROMPT)
    sched.add(a)
    loads = [(sl.source.name, sl.load.start, sl.load.end) for sl in sched.schedule().loads]
    assert loads == [("disk", 0, 8), ("peer", 8, 20)]
    disk_id, peer_id = sorted(a.loads)
    for layer in (0, 1):
        deliver(sched, peer_id, layer, 8, 20)  # the peer's frames arrive first: not complete yet
    assert a.num_computed == 0
    for layer in (0, 1):
        deliver(sched, disk_id, layer, 0, 8)
    assert a.num_computed == 20 and a.loaded == {"disk": 8, "peer": 12}
    assert a.num_cached == 8 and sched.prefix_hit_tokens == 8
    sched.load_finished(disk_id)
    assert a.status == LOADING  # the peer's load is still open
    sched.load_finished(peer_id)
    assert a.status == RUNNING


def test_loads_hold_at_most_their_share_of_the_pool():
    sched = make(num_blocks=9, max_load_share=0.5)  # 8 usable: loads may hold 4 blocks
    sched.sources.append(FakeSource())
    a = seq("a", PROMPT)
    sched.add(a)
    (sl,) = sched.schedule().loads
    assert (sl.load.start, sl.load.end, len(a.blocks)) == (0, 16, 4)
    b = seq("b", [3] * 21)
    sched.add(b)
    step = sched.schedule()
    assert not step.loads and b.status == RUNNING  # no share left: prefilled locally


def test_salted_and_export_sequences_never_load():
    sched = make()
    sched.sources.append(FakeSource())
    s1 = seq("s", PROMPT, cache_salt="alice")
    s2 = seq("x", PROMPT[:-1], may_load=False)
    sched.add(s1)
    sched.add(s2)
    step = sched.schedule()
    assert not step.loads and s1.status == RUNNING and s2.status == RUNNING


def test_prefill_pieces_lie_on_a_grid_anchored_at_zero():
    sched = make(max_batch_tokens=64, prefill_chunk=8)
    first = seq("first", list(range(1, 6)), max_new=1)
    sched.add(first)
    while first.status != FINISHED:
        step = sched.schedule()
        if sched.advance(step) == ["first"]:
            first.tokens.append(0)
            sched.finish(first)
    # a 5-token prefix hit: a block and the first token of the part-full one "first" left
    again = seq("again", list(range(1, 6)) + [50] * 15)
    sched.add(again)
    pieces = []
    while again.num_computed < again.num_prompt:
        step = sched.schedule()
        start = again.num_computed  # after the prefix hit
        pieces.append((start, start + step.tokens["again"]))
        sched.advance(step)
    assert pieces == [(5, 8), (8, 16), (16, 20)]


def test_an_exact_grid_piece_is_never_split_and_goes_first_when_starved():
    sched = make(max_batch_tokens=10, prefill_chunk=8)
    d = [seq(f"d{i}", [i + 1], max_new=30) for i in range(4)]
    for s in d:
        sched.add(s)
    sched.advance(sched.schedule())
    for s in d:
        s.tokens.append(5)
    x = seq("x", list(range(1, 30)), chunk=8, exact_grid=True, may_load=False)
    sched.add(x)
    sizes = []
    while x.num_computed < len(x.tokens):
        step = sched.schedule()
        sizes.append(step.tokens.get("x", 0))
        for rid in sched.advance(step):
            if rid != "x":
                step.seqs[rid].tokens.append(5)
    # whole grid pieces only (4 decodes leave 6 of the 10 tokens: a piece of 8 waits), and a
    # piece that had to wait goes first in the next step, even past the budget
    assert sizes == [0, 8, 0, 8, 0, 8, 5]


# --- the engine's disk tier is a KV source ---------------------------------------------------------


class RecordingSink:
    def __init__(self):
        self.layers, self.ends = [], []

    def layer(self, load_id, layer, t0, t1, parts, release=None):
        self.layers.append((layer, t0, t1, [p.shape for p in parts]))

    def done(self, load_id, tokens_computed=None, compute_s=None):
        self.ends.append("done")

    def failed(self, load_id, reason):
        self.ends.append(f"failed: {reason}")


def test_the_disk_tier_loads_whole_blocks_and_stops_at_an_unreadable_one(tmp_path):
    from mlx_engine.kv_cache.kv_pool import KVPool
    from mlx_engine.kv_cache.prefix_disk import PrefixDiskTier

    pool = KVPool(2, 8, BS, 2, 32, mx.float32, 8)  # quantized: 3 arrays per K and per V
    disk = PrefixDiskTier(tmp_path, {"m": 1}, 2**30, block_size=BS, num_layers=2)
    tokens = list(range(1, 18))
    for k, b in enumerate((1, 2, 3)):
        disk.save(tokens[: (k + 1) * BS], pool.read_block(b))
    assert (
        disk.match(tokens, 0, 16) == 12 and disk.match(tokens, 4, 16) == 8 and disk.match(tokens, 2, 16) == 0
    )
    sink = RecordingSink()
    disk.start_load(KVLoad(1, "r", tokens[:13], 0, 12, BS), sink)
    assert sink.ends == ["done"]
    assert [(ly, t0, t1) for ly, t0, t1, _ in sink.layers] == [(0, 0, 12), (1, 0, 12)]
    assert [list(s) for s in sink.layers[0][3]] == [[12, *a.shape[1:]] for a in pool.layer_arrays(0)]
    (disk.dir / f"{prefix_hash(tokens[:8])}.safetensors").write_bytes(b"junk")
    sink = RecordingSink()
    disk.start_load(KVLoad(2, "r", tokens[:13], 0, 12, BS), sink)
    assert [(ly, t0, t1) for ly, t0, t1, _ in sink.layers] == [(0, 0, 4), (1, 0, 4)]
    assert len(sink.ends) == 1 and sink.ends[0].startswith("failed")


def test_an_unreadable_disk_block_keeps_the_blocks_before_it(tiny_dirs, tmp_path):
    from mlx_engine.engine import Engine, EngineConfig
    from mlx_engine.loading.loader import load_model
    from tests.test_engine_tiny import assert_no_leaks, prompts, reference_greedy, req, run_all

    loaded = load_model(str(tiny_dirs("llama")))
    (base,) = prompts(loaded.tokenizer.vocab_size, [50], seed=3)
    cfg = EngineConfig(cache_gb=0.01, disk_cache_dir=str(tmp_path / "kv"))
    first = Engine(loaded, cfg)
    asyncio.run(run_all(first, [req(base)]))
    first.shutdown()  # 3 full blocks on disk
    (second_block,) = (tmp_path / "kv").rglob(f"{prefix_hash(base[:32])}.safetensors")
    second_block.write_bytes(b"not a safetensors file")
    engine = Engine(loaded, cfg)
    try:
        follow = base + [5, 6, 7]
        events = []

        async def one():
            async for ev in engine.generate(req(follow, 8)):
                events.append(ev)

        asyncio.run(one())
        usage = events[-1].usage
        assert usage.cached_tokens == 16  # the first block; the rest was computed
        assert usage.prompt_tokens_computed == len(follow) - 16
        assert "disk" in usage.fallback_reason and usage.prefill_location == "local"
        assert [t for ev in events for t in ev.token_ids] == reference_greedy(loaded.model, follow, 8)
        assert_no_leaks(engine)
    finally:
        engine.shutdown()


# --- the shadow-KV state machine with loads ---------------------------------------------------------

LAYERS = 2
PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
    [1, 2, 3, 4, 9, 9, 9, 9, 9],
    [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5],
]


class LoadingMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = BlockAllocator(num_blocks=24, block_size=BS)
        self.sched = Scheduler(
            self.alloc,
            SchedulerConfig(
                max_batch_tokens=12, prefill_chunk=5, max_running=6, max_queue=100, max_load_share=0.7
            ),
            num_layers=LAYERS,
        )
        self.src = FakeSource()
        self.sched.sources.append(self.src)
        self.kv = [{b: [None] * BS for b in range(self.alloc.num_blocks)} for _ in range(LAYERS)]
        self.seqs: dict[str, Sequence] = {}
        self.loads: dict[int, KVLoad] = {}  # every load ever started, dead ones included
        self.n = 0

    @rule(p=st.sampled_from(PROMPTS), max_new=st.integers(1, 6), remote=st.booleans())
    def submit(self, p, max_new, remote):
        self.n += 1
        s = Sequence(f"r{self.n}", list(p), len(p), len(p) + max_new, may_load=remote)
        self.seqs[s.request_id] = s
        self.sched.add(s)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def cancel(self, i):
        s = list(self.seqs.values())[i % len(self.seqs)]
        self.sched.finish(s)
        del self.seqs[s.request_id]

    @precondition(lambda self: self.loads)
    @rule(i=st.integers(0, 1000), layer=st.integers(0, LAYERS - 1), a=st.integers(0, 20), n=st.integers(1, 8))
    def frame(self, i, layer, a, n):
        """A layer range of some load, live or long dead, arrives: written only where
        ``kv_target`` says, with that load's tokens."""
        load = list(self.loads.values())[i % len(self.loads)]
        span = load.end - load.start
        t0 = load.start + a % span
        t1 = min(t0 + n, load.end)
        target = self.sched.kv_target(load.load_id, layer, t0, t1)
        if target is None:
            return
        for t in range(target.t0, target.t1):
            b = target.blocks[t // BS]
            assert self.alloc.writable(b), f"a frame writes into block {b} that others hold or may match"
            self.kv[layer][b][t % BS] = load.tokens[t]
        self.sched.kv_landed(load.load_id, layer, t0, t1)

    @precondition(lambda self: self.sched.loading)
    @rule(i=st.integers(0, 100), layer=st.integers(0, LAYERS - 1), n=st.integers(1, 8))
    def next_frame(self, i, layer, n):
        """The next range of a live load in one layer arrives, in order (a stream)."""
        live = sorted({lid for s in self.sched.loading for lid in s.loads})
        load = self.loads[live[i % len(live)]]
        s = self.seqs[load.request_id]
        assert s.landed is not None
        t0 = max(load.start, s.landed.layers[layer].end_from(s.num_computed))
        if t0 < load.end:
            self.frame(list(self.loads).index(load.load_id), layer, t0 - load.start, n)

    @precondition(lambda self: self.sched.loading)
    @rule(i=st.integers(0, 100), fail=st.booleans())
    def end_load(self, i, fail):
        live = sorted({lid for s in self.sched.loading for lid in s.loads})
        self.sched.load_finished(live[i % len(live)], "injected" if fail else None)

    @rule()
    def step(self):
        step = self.sched.schedule()
        for sl in step.loads:
            self.loads[sl.load.load_id] = sl.load
            assert self.seqs[sl.load.request_id].status == LOADING
        assert sum(step.tokens.values()) <= self.sched.cfg.max_batch_tokens
        assert self.sched.num_active <= self.sched.cfg.max_running
        for src, dst in step.copies:
            for layer in range(LAYERS):
                self.kv[layer][dst] = list(self.kv[layer][src])
        for rid, n in step.tokens.items():
            s = self.seqs[rid]
            assert s.status == RUNNING
            for t in range(s.num_computed, s.num_computed + n):
                b = s.blocks[t // BS]
                assert self.alloc.writable(b), f"{rid} writes into block {b} that others hold or may match"
                for layer in range(LAYERS):
                    self.kv[layer][b][t % BS] = s.tokens[t]
        for rid in self.sched.advance(step):
            s = self.seqs[rid]
            s.tokens.append(1000 + int(rid[1:]))
            if len(s.tokens) >= s.max_total:
                self.sched.finish(s)
                del self.seqs[rid]

    @invariant()
    def every_sequence_reads_its_own_tokens_in_every_layer(self):
        for s in self.seqs.values():
            if s.status == FINISHED:
                continue
            for layer in range(LAYERS):
                got = [self.kv[layer][s.blocks[t // BS]][t % BS] for t in range(s.num_computed)]
                assert got == s.tokens[: s.num_computed], (s.request_id, layer)
        self.alloc.check_invariants()

    @invariant()
    def every_indexed_block_holds_its_tokens_in_every_layer(self):
        index = self.alloc.index
        for b in index.blocks():
            path = index.path_tokens(b)
            n = len(path) % BS or BS  # a part-full tail block: its first n tokens
            for layer in range(LAYERS):
                assert self.kv[layer][b][:n] == path[-n:], f"indexed block {b} is not (fully) loaded"

    def teardown(self):
        for s in list(self.seqs.values()):
            self.sched.finish(s)
        self.alloc.check_invariants()
        assert self.alloc.num_used == 0, "blocks leaked"
        assert not self.sched.loading


TestLoadingMachine = LoadingMachine.TestCase
TestLoadingMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
