"""Remote prefill between two engines in one process, no network (issue 12, engine side).

A ``RelaySource`` is a ``KVSource`` whose KV comes from a second ``Engine``'s
``prefill_for_peer``: the peer's worker converts each exported layer to wire arrays
(``peer.wire.kv_wire.to_wire``, bf16 as uint16) and queues it; a relay thread (standing in for the
network) posts it to the decoder's sink. The decoder's result is compared with a third engine
that prefills the same prompt locally:

- exactness: the decoder's pool bytes for the prompt, the first token's logits and the greedy
  tokens equal local prefill's (tiny models, sliding-window layers, kv_bits=8 on both sides,
  different block sizes, and the bundled SmolLM2), and the decoder computed one prompt token;
- prefix semantics: a warm decoder loads only ``[start, N - 1)``; a warm peer computes from its own
  hit and exports the cached tokens from its pool first;
- streaming: the decoder writes the first layer into its pool before the peer has computed the
  next layer (the peer waits for it: a send-after-prefill peer or a buffer-until-done decoder
  would hang there and fail), and before ``done``;
- faults and races: a load that fails after k frames keeps the landed prefix, computes only the
  rest, leaks no block, indexes no half-loaded block, and a follow-up request hits the prefix
  cache; cancel racing done; late frames of a cancelled load dropped while its blocks are reused.

Every wait is on an event with a deadline that only bounds a hang.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest

from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.kv_cache.kv_pool import KVPool
from mlx_engine.kv_cache.kv_source import KVLoad, KVSink, KVSource, RangeSet
from mlx_engine.loading.loader import LoadedModel, load_model
from mlx_engine.request import GenerationEvent, GenerationRequest, SamplingParams
from peer.wire.kv_wire import to_wire
from tests.test_engine_tiny import assert_no_leaks, kv_token_bytes, prompts

WAIT = 120.0  # a deadline for hangs only
GREEDY = SamplingParams(temperature=0.0)


# --- the in-process peer ---------------------------------------------------------------------


class RelaySource(KVSource):
    """A KVSource backed by another engine's ``prefill_for_peer``, through a relay thread.

    ``fail_after``: after that many relayed layer frames of a load, report it failed (and cancel
    the peer's work), as a peer killed mid-stream would. ``pause_after``: after that many frames
    the relay waits for ``resume`` (``paused`` is set then). ``hold_done``: the relay waits for it
    before posting a load's done (``at_done`` is set then). ``stop_on_cancel`` False: frames keep
    coming after the decoder cancelled the load, as late frames from the network would."""

    name = "peer"

    def __init__(
        self,
        peer: Engine,
        chunk: int,
        fail_after: int | None = None,
        stop_on_cancel: bool = True,
        cap_frames: int | None = None,
    ):
        self.peer, self.chunk, self.cap_frames = peer, chunk, cap_frames
        self.fail_after, self.stop_on_cancel = fail_after, stop_on_cancel
        self.enabled = True
        self.pause_after: int | None = None
        self.resume, self.paused = threading.Event(), threading.Event()
        self.hold_done: threading.Event | None = None
        self.at_done = threading.Event()
        self.on_export: Callable[[int, int, int], None] | None = None  # peer worker, per exported layer
        self.loads: list[KVLoad] = []
        self.frames: list[tuple[int, int, int, int, int]] = []  # relayed: (load, layer, t0, t1, nbytes)
        self.accepts: dict[int, int] = {}  # load id -> the peer's prefix hit
        self.peer_done: dict[int, tuple[int, float]] = {}
        self.cancelled: list[int] = []
        self.events: list[tuple] = []  # ordered record of what happened, across threads
        self.ended = threading.Event()  # the relay delivered a load's done or failure
        self.peer_finished = threading.Event()  # the peer's engine reported done
        self.send_blocked = threading.Event()  # can_send said no at least once
        self.min_tokens = 0  # offer only prompts at least this long
        self._lock = threading.Lock()
        self._peer_rids: dict[int, str] = {}
        self._failed: set[int] = set()
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._relay, daemon=True)
        self._thread.start()

    def record(self, *event) -> None:
        with self._lock:
            self.events.append(event)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(WAIT)

    # KVSource
    def match(self, tokens: list[int], start: int, end: int) -> int:
        return end - start if self.enabled and len(tokens) >= self.min_tokens else 0

    def start_load(self, load: KVLoad, sink: KVSink) -> None:
        self.loads.append(load)
        lid = load.load_id

        def on_layer(layer: int, t0: int, t1: int, parts: list[mx.array]) -> None:
            self.record("export", lid, layer, t0, t1)
            self._q.put(("layer", lid, sink, layer, t0, t1, [to_wire(p) for p in parts]))
            if self.on_export is not None:  # after the frame is on its way
                self.on_export(layer, t0, t1)

        self._peer_rids[lid] = self.peer.prefill_for_peer(
            load.tokens,
            load.start,
            self.chunk,
            on_layer,
            on_accept=lambda h: self.accepts.__setitem__(lid, h),
            on_done=lambda n, s: (self._q.put(("done", lid, sink, n, s)), self.peer_finished.set()),
            on_error=lambda reason: self._q.put(("error", lid, sink, reason)),
            can_send=None if self.cap_frames is None else self._can_send,
        )

    def _can_send(self) -> bool:  # the peer's worker asks before each step
        if self._q.qsize() < (self.cap_frames or 0):
            return True
        self.send_blocked.set()
        return False

    def cancel(self, load_id: int) -> None:
        self.record("cancel", load_id)
        self.cancelled.append(load_id)
        if self.stop_on_cancel:
            self.peer.cancel(self._peer_rids[load_id])

    # the "network"
    def _relay(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            if self.cap_frames is not None:
                self.peer.poke()  # room in the send queue again
            kind, lid, sink = item[:3]
            if lid in self._failed:
                continue  # the connection is gone: nothing more of this load arrives
            if kind == "layer":
                _, _, _, layer, t0, t1, parts = item
                sent = sum(1 for f in self.frames if f[0] == lid)
                if self.pause_after is not None and sent >= self.pause_after and not self.resume.is_set():
                    self.paused.set()
                    assert self.resume.wait(WAIT), "the test never resumed the relay"
                if self.fail_after is not None and sent >= self.fail_after:
                    self._failed.add(lid)
                    self.peer.cancel(self._peer_rids[lid])
                    self.record("failed", lid)
                    sink.failed(lid, "injected: the peer died")
                    self.ended.set()
                    continue
                self.frames.append((lid, layer, t0, t1, sum(p.nbytes for p in parts)))
                self.record("sent", lid, layer, t0, t1)
                sink.layer(lid, layer, t0, t1, parts)
            elif kind == "done":
                if self.hold_done is not None:
                    self.at_done.set()
                    assert self.hold_done.wait(WAIT), "the test never let the done through"
                self.peer_done[lid] = item[3], item[4]
                self.record("done", lid)
                sink.done(lid, item[3], item[4])
                self.ended.set()
            else:
                self.record("error", lid, item[3])
                sink.failed(lid, item[3])
                self.ended.set()

    def ranges(self, load_id: int, layer: int) -> list[tuple[int, int]]:
        r = RangeSet()
        for lid, ly, t0, t1, _ in self.frames:
            if (lid, ly) == (load_id, layer):
                r.add(t0, t1)
        return r.ranges()


# --- capturing what an engine computed --------------------------------------------------------


def wire_bytes(parts: list[mx.array]) -> list[bytes]:
    return [to_wire(p).tobytes() for p in parts]


class Capture:
    """Wraps an engine's model runner: when a row computes up to the prompt's last token, records
    the pool's KV bytes for the tokens before it (every layer) and that row's logits (the first
    token's)."""

    def __init__(self, engine: Engine, prompt: list[int]):
        self.kv: list[list[bytes]] | None = None
        self.logits: np.ndarray | None = None
        self.blocks: list[int] = []
        n, fwd, pool = len(prompt), engine.runner.forward, engine.pool

        def forward(rows):
            logits = fwd(rows)
            for i, r in enumerate(rows):
                if self.kv is None and r.start + len(r.tokens) == n and r.tokens == prompt[r.start :]:
                    self.blocks = list(r.blocks)
                    self.kv = [
                        wire_bytes(pool.read_tokens(ly, r.blocks, 0, n - 1)) for ly in range(pool.num_layers)
                    ]
                    self.logits = np.array(logits[i])
            return logits

        engine.runner.forward = forward


async def collect(engine: Engine, r: GenerationRequest) -> list[GenerationEvent]:
    return [ev async for ev in engine.generate(r)]


def run(engine: Engine, prompt: list[int], n: int = 6) -> tuple[list[int], GenerationEvent]:
    evs = asyncio.run(
        collect(
            engine, GenerationRequest(prompt=list(prompt), max_tokens=n, sampling=GREEDY, ignore_eos=True)
        )
    )
    assert evs[-1].finish_reason == "length", evs[-1].error
    return [t for ev in evs for t in ev.token_ids], evs[-1]


def pool_kv(engine: Engine, blocks: list[int], t0: int, t1: int) -> list[list[bytes]]:
    """Tokens [t0, t1) of every layer through ``blocks``, read on the engine's worker."""
    pool = engine.pool
    return engine.run_on_worker(
        lambda: [wire_bytes(pool.read_tokens(ly, blocks, t0, t1)) for ly in range(pool.num_layers)], WAIT
    )


def split_tokens(kv: list[list[bytes]], pool: KVPool, t0: int, t1: int, base: int = 0) -> list[list[bytes]]:
    """Tokens [t0, t1) of captured bytes that start at token ``base``."""
    out = []
    for layer in kv:
        parts = []
        for raw, a in zip(layer, pool.layer_arrays(0), strict=True):
            per = _row_bytes(a)
            parts.append(raw[(t0 - base) * per : (t1 - base) * per])
        out.append(parts)
    return out


def _row_bytes(a: mx.array) -> int:
    return int(np.prod(a.shape[1:])) * a.dtype.size


class NoPeer(KVSource):
    """A remote source that never offers anything: a decoder with a peer that prefills locally."""

    name = "nobody"

    def match(self, tokens: list[int], start: int, end: int) -> int:
        return 0

    def start_load(self, load: KVLoad, sink: KVSink) -> None:
        raise AssertionError("never offered a load")

    def cancel(self, load_id: int) -> None:
        pass


class Trio:
    """A decoder with a relay source to a peer engine, and a reference engine configured the
    same (with a peer that is never used) that prefills locally. The engines share one loaded
    model (read-only weights; each engine's worker builds and evaluates its own graphs)."""

    def __init__(
        self, loaded: LoadedModel, dec_cfg: EngineConfig, peer_cfg: EngineConfig | None = None, **source
    ):
        self.ref = Engine(loaded, dec_cfg)
        self.ref.add_kv_source(NoPeer())
        self.dec = Engine(loaded, dec_cfg)
        self.peer = Engine(loaded, peer_cfg or dec_cfg)
        self.peer.add_kv_source(NoPeer())  # a peer that has peers of its own exports on the grid all the same
        self.chunk = min(dec_cfg.prefill_chunk, dec_cfg.max_batch_tokens)
        self.src = RelaySource(self.peer, self.chunk, **source)
        self.dec.add_kv_source(self.src)

    def peer_settled(self) -> Engine:
        """The peer, once its worker has handled every cancel sent to it so far (the relay cancels
        a failed load's export from its own thread: the cancel and this barrier share the peer's
        mailbox, first in first out)."""
        self.peer.run_on_worker(lambda: None, WAIT)
        return self.peer

    def close(self) -> None:
        for e in (self.ref, self.dec, self.peer):
            e.shutdown()
        self.src.close()


@pytest.fixture(scope="module")
def llama(tiny_dirs):
    return load_model(str(tiny_dirs("llama")))


def tiny_cfg(**kw) -> EngineConfig:
    return EngineConfig(**{"cache_gb": 0.02, "prefill_chunk": 64, "max_batch_tokens": 128, **kw})


def assert_exact(trio: Trio, prompt: list[int], n_new: int = 6) -> GenerationEvent:
    """Remote prefill on the decoder equals local prefill on the reference engine, bit for bit."""
    ref_cap, dec_cap = Capture(trio.ref, prompt), Capture(trio.dec, prompt)
    ref_tokens, _ = run(trio.ref, prompt, n_new)
    frames_before = len(trio.src.frames)
    tokens, last = run(trio.dec, prompt, n_new)
    usage = last.usage
    assert len(trio.src.frames) > frames_before, "no KV came from the peer"
    assert usage.prefill_location == "remote:peer" and usage.remote_tokens == len(prompt) - 1
    assert usage.prompt_tokens_computed == 1  # the decoder computed only the last prompt token
    assert dec_cap.kv is not None and ref_cap.kv is not None
    for layer, (got, want) in enumerate(zip(dec_cap.kv, ref_cap.kv, strict=True)):
        assert got == want, f"layer {layer}: the decoder's pool differs from local prefill's"
    assert np.array_equal(dec_cap.logits, ref_cap.logits)
    assert tokens == ref_tokens
    assert_no_leaks(trio.dec)
    assert_no_leaks(trio.peer_settled())
    return last


# --- exactness ------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [2, 40, 300])
def test_remote_prefill_is_exact_on_a_tiny_model(llama, length):
    (p,) = prompts(llama.tokenizer.vocab_size, [length], seed=length)
    trio = Trio(llama, tiny_cfg())
    try:
        usage = assert_exact(trio, p).usage
        # every layer of [0, N - 1) arrived, and the bytes are what the pool holds for it
        (load,) = trio.src.loads
        assert (load.start, load.end) == (0, length - 1)
        assert usage.remote_bytes == (length - 1) * kv_token_bytes(llama)
        for layer in range(llama.num_layers):
            assert trio.src.ranges(load.load_id, layer) == [(0, length - 1)]
    finally:
        trio.close()


def test_remote_prefill_is_exact_with_sliding_window_layers(tiny_dirs):
    loaded = load_model(str(tiny_dirs("gemma3_text")))
    (p,) = prompts(loaded.tokenizer.vocab_size, [150], seed=3)
    trio = Trio(loaded, tiny_cfg())
    try:
        assert_exact(trio, p)
    finally:
        trio.close()


def test_remote_prefill_is_exact_with_8_bit_kv_on_both_sides(llama):
    (p,) = prompts(llama.tokenizer.vocab_size, [200], seed=4)
    trio = Trio(llama, tiny_cfg(kv_bits=8))
    try:
        assert_exact(trio, p)
    finally:
        trio.close()


@pytest.mark.parametrize("peer_block", [8, 32])
def test_remote_prefill_is_exact_with_another_block_size_on_the_peer(llama, peer_block):
    (p,) = prompts(llama.tokenizer.vocab_size, [170], seed=5)
    trio = Trio(llama, tiny_cfg(block_size=16), tiny_cfg(block_size=peer_block))
    try:
        assert_exact(trio, p)
    finally:
        trio.close()


@pytest.fixture(scope="module")
def bundled():
    return load_model(None)


@pytest.mark.parametrize("length", [40, 600])
def test_remote_prefill_is_exact_on_the_bundled_model(bundled, length):
    ids = bundled.tokenizer.encode(
        " ".join(f"item {i}: the quick brown fox, number {i * 7}." for i in range(200))
    )
    assert len(ids) >= length
    cfg = EngineConfig(cache_gb=0.1, prefill_chunk=256, max_batch_tokens=512)
    trio = Trio(bundled, cfg)
    try:
        assert_exact(trio, ids[:length], n_new=4)
    finally:
        trio.close()


# --- prefix semantics -----------------------------------------------------------------------------


def test_a_warm_decoder_loads_only_what_it_lacks(llama):
    (p,) = prompts(llama.tokenizer.vocab_size, [300], seed=6)
    trio = Trio(llama, tiny_cfg())
    try:
        ref_cap = Capture(trio.ref, p)
        ref_tokens, _ = run(trio.ref, p)
        trio.src.enabled = False
        run(trio.dec, p[:40])  # the decoder caches the prompt's first 40 tokens (2 blocks of 16 and 8)
        trio.src.enabled = True
        dec_cap = Capture(trio.dec, p)
        tokens, last = run(trio.dec, p)
        (load,) = trio.src.loads
        assert (load.start, load.end) == (40, 299)  # mid-block: into a copy of the cached block
        for layer in range(llama.num_layers):
            assert trio.src.ranges(load.load_id, layer) == [(40, 299)]
        u = last.usage
        assert (u.cached_tokens, u.remote_tokens, u.prompt_tokens_computed) == (40, 259, 1)
        assert u.remote_bytes == 259 * kv_token_bytes(llama)
        # the loaded tokens are bit for bit what local prefill computes for them
        assert split_tokens(dec_cap.kv, trio.dec.pool, 40, 299) == split_tokens(
            ref_cap.kv, trio.ref.pool, 40, 299
        )
        assert tokens == ref_tokens
        assert_no_leaks(trio.dec)
    finally:
        trio.close()


def test_a_warm_peer_computes_from_its_own_hit_and_exports_its_cached_tokens_first(llama):
    (p,) = prompts(llama.tokenizer.vocab_size, [300], seed=7)
    trio = Trio(llama, tiny_cfg())
    try:
        ref_tokens, _ = run(trio.ref, p)
        run(trio.peer, p[:70])  # the peer caches the prompt's first 70 tokens (4 blocks and 6)
        tokens, last = run(trio.dec, p)
        (load,) = trio.src.loads
        assert trio.src.accepts[load.load_id] == 70
        computed, _ = trio.src.peer_done[load.load_id]
        assert computed == 299 - 70  # the peer computed from its own hit
        L = llama.num_layers
        # its cached tokens went first, from its pool, layer by layer; then the computed chunks; all
        # on the grid anchored at 0 (chunks of 64)
        sent = [(ly, t0, t1) for lid, ly, t0, t1, _ in trio.src.frames if lid == load.load_id]
        assert sent[:L] == [(ly, 0, 64) for ly in range(L)]
        assert sent[L : 2 * L] == [(ly, 64, 70) for ly in range(L)]
        assert sent[2 * L : 3 * L] == [(ly, 70, 128) for ly in range(L)]
        assert last.usage.remote_tokens == 299 and last.usage.prompt_tokens_computed == 1
        assert tokens == ref_tokens
        assert_no_leaks(trio.dec)
        assert_no_leaks(trio.peer_settled())
    finally:
        trio.close()


# --- streaming --------------------------------------------------------------------------------------


def test_kv_streams_layer_by_layer(llama):
    """The peer's worker waits, after exporting layer 0 of the first chunk, until the decoder has
    written that layer into its pool: only a peer that sends each layer as it is computed and a
    decoder that applies it on arrival get past that wait."""
    (p,) = prompts(llama.tokenizer.vocab_size, [200], seed=8)
    trio = Trio(llama, tiny_cfg())
    written = threading.Event()
    waited: list[bool] = []
    try:
        write = trio.dec.pool.write_tokens

        def recording_write(layer, table, t0, parts):
            write(layer, table, t0, parts)
            trio.src.record("dec_write", layer, t0)
            written.set()

        trio.dec.pool.write_tokens = recording_write

        def on_export(layer, t0, t1):
            if (layer, t0) == (0, 0):
                waited.append(written.wait(WAIT))

        trio.src.on_export = on_export
        tokens, last = run(trio.dec, p)
        assert waited == [True], "the decoder wrote no KV while the peer was still computing"
        ev = trio.src.events
        first_write = ev.index(("dec_write", 0, 0))
        next_layer = next(i for i, e in enumerate(ev) if e[0] == "export" and e[2:4] == (1, 0))
        last_layer = max(i for i, e in enumerate(ev) if e[0] == "export")
        done = ev.index(("done", trio.src.loads[0].load_id))
        assert ev[last_layer][2:] == (llama.num_layers - 1, 192, 199)
        assert first_write < next_layer <= last_layer < done
        assert last.usage.prompt_tokens_computed == 1
        assert_no_leaks(trio.dec)
    finally:
        trio.close()


def test_a_full_send_queue_pauses_only_that_export(llama):
    """The relay stops reading after 2 frames; with a 3-frame send queue the peer's export pauses
    (its worker is not blocked: a local request on the peer completes meanwhile), and it resumes
    when the queue drains, with the exact result."""
    (p,) = prompts(llama.tokenizer.vocab_size, [300], seed=13)
    trio = Trio(llama, tiny_cfg(), cap_frames=3)
    try:
        ref_tokens, _ = run(trio.ref, p)
        trio.src.pause_after = 2

        async def scenario():
            task = asyncio.ensure_future(
                collect(
                    trio.dec,
                    GenerationRequest(prompt=list(p), max_tokens=6, sampling=GREEDY, ignore_eos=True),
                )
            )
            assert await asyncio.to_thread(trio.src.paused.wait, WAIT)
            # the peer's worker was told its send queue is full (a peer that never asks hangs here)
            assert await asyncio.to_thread(trio.src.send_blocked.wait, WAIT)
            (other,) = prompts(llama.tokenizer.vocab_size, [50], seed=14)
            local = await collect(
                trio.peer, GenerationRequest(prompt=other, max_tokens=3, sampling=GREEDY, ignore_eos=True)
            )
            assert local[-1].finish_reason == "length"
            exported = sum(e[0] == "export" for e in trio.src.events)
            # 2 relayed, 3 queued, and at most one step's layers past the cap; not finished
            assert exported <= 2 + 3 + llama.num_layers and not trio.src.peer_finished.is_set()
            trio.src.resume.set()
            return exported, await task

        exported, evs = asyncio.run(scenario())
        assert exported < 2 * 5  # far from the 10 frames of the whole prompt: it did pause
        assert [t for ev in evs for t in ev.token_ids] == ref_tokens
        assert evs[-1].usage.prompt_tokens_computed == 1
        assert_no_leaks(trio.dec)
        assert_no_leaks(trio.peer_settled())
    finally:
        trio.close()


def test_a_local_stream_decodes_every_iteration_while_a_load_arrives(llama):
    """All of a load's frames reach the decoder's mailbox at once (its worker is held meanwhile);
    with a budget of one frame per iteration, the local stream's decode step runs between any
    two frames applied."""
    vocab = llama.tokenizer.vocab_size
    local, remote = prompts(vocab, [8, 300], seed=15)
    trio = Trio(llama, tiny_cfg())
    try:
        trio.src.min_tokens = 100  # the short local prompt is never offered
        trio.dec.kv_apply_budget = 1  # bytes: one frame per iteration
        log: list[str] = []
        write, fwd = trio.dec.pool.write_tokens, trio.dec.runner.forward

        def logged_write(layer, table, t0, parts):
            write(layer, table, t0, parts)
            log.append("apply")

        def logged_forward(rows):
            log.append("step")
            return fwd(rows)

        trio.dec.pool.write_tokens, trio.dec.runner.forward = logged_write, logged_forward
        trio.src.pause_after = 0
        held, release = threading.Event(), threading.Event()

        def hold_worker():
            held.set()
            assert release.wait(WAIT)

        async def scenario():
            stream = trio.dec.generate(
                GenerationRequest(prompt=local, max_tokens=None, sampling=GREEDY, ignore_eos=True)
            )
            await stream.__anext__()  # decoding
            task = asyncio.ensure_future(
                collect(trio.dec, GenerationRequest(prompt=remote, max_tokens=3, sampling=GREEDY))
            )
            assert await asyncio.to_thread(
                trio.src.peer_finished.wait, WAIT
            )  # every frame is queued in the relay
            blocker = asyncio.ensure_future(asyncio.to_thread(trio.dec.run_on_worker, hold_worker, WAIT))
            assert await asyncio.to_thread(held.wait, WAIT)
            trio.src.resume.set()
            assert await asyncio.to_thread(trio.src.ended.wait, WAIT)  # all in the decoder's mailbox
            release.set()
            await blocker
            evs = await task
            await stream.aclose()
            return evs

        evs = asyncio.run(scenario())
        assert evs[-1].usage.remote_tokens == 299
        applies = [i for i, e in enumerate(log) if e == "apply"]
        assert len(applies) == 10  # 5 chunks x 2 layers
        between = log[applies[0] : applies[-1] + 1]
        # the stream decoded between every two frames
        assert not any(a == b == "apply" for a, b in zip(between, between[1:], strict=False))
        trio.dec.run_on_worker(lambda: None, WAIT)  # the stream's cancel has been handled
        assert_no_leaks(trio.dec)
    finally:
        trio.close()


# --- faults and races ---------------------------------------------------------------------------------


def indexed_blocks_hold_the_reference(engine: Engine, prompt: list[int], ref_kv: list[list[bytes]]) -> int:
    """Every block of the decoder's prefix index along ``prompt`` holds exactly local prefill's
    KV in every layer; returns how many there are."""
    index, bs = engine.allocator.index, engine.allocator.block_size
    blocks = index.match(prompt, len(prompt) - 1)
    for k, b in enumerate(blocks):
        got = pool_kv(engine, [b], 0, bs)
        want = split_tokens(ref_kv, engine.pool, k * bs, (k + 1) * bs)
        assert got == want, f"indexed block {k} does not hold the prompt's KV"
    return len(blocks)


@pytest.mark.parametrize("fail_after", [1, 3, 6])
def test_a_load_that_fails_keeps_the_landed_prefix(llama, fail_after, caplog):
    (p,) = prompts(llama.tokenizer.vocab_size, [300], seed=9)
    trio = Trio(llama, tiny_cfg(), fail_after=fail_after)
    try:
        ref_cap, dec_cap = Capture(trio.ref, p), Capture(trio.dec, p)
        ref_tokens, _ = run(trio.ref, p)
        tokens, last = run(trio.dec, p)
        L = llama.num_layers
        assert len(trio.src.frames) == fail_after  # frames did arrive before the fault
        landed = 64 * (fail_after // L)  # chunks whose every layer arrived (chunk 64, 2 layers)
        u = last.usage
        assert u.remote_tokens == landed and u.prompt_tokens_computed == 300 - landed
        assert u.fallback_reason is not None and "injected" in u.fallback_reason
        assert tokens == ref_tokens
        # the rest was computed on the same grid: still bit-exact
        assert dec_cap.kv == ref_cap.kv and np.array_equal(dec_cap.logits, ref_cap.logits)
        assert_no_leaks(trio.dec)
        assert trio.dec.stats().kv_load_failures == 1
        logged = [r for r in caplog.records if r.name == "mlx_engine.engine" and "injected" in r.getMessage()]
        assert len(logged) == 1 and logged[0].levelname == "WARNING"  # the reason, logged once
        assert indexed_blocks_hold_the_reference(trio.dec, p, ref_cap.kv) == 299 // 16
        # a follow-up request hits the prefix cache, with the same result
        trio.src.enabled = False
        again, last2 = run(trio.dec, p)
        assert again == ref_tokens and last2.usage.cached_tokens == 299  # all but the last token
        assert_no_leaks(trio.dec)
        assert_no_leaks(trio.peer_settled())
    finally:
        trio.close()


class Writes:
    """Counts the decoder's pool writes from KV sources (on its worker) and keeps the last table."""

    def __init__(self, engine: Engine):
        self.count, self.table = 0, []
        self.reached: dict[int, threading.Event] = {}
        write = engine.pool.write_tokens

        def counting(layer, table, t0, parts):
            write(layer, table, t0, parts)
            self.count += 1
            self.table = list(table)
            for n, ev in self.reached.items():
                if self.count >= n:
                    ev.set()

        engine.pool.write_tokens = counting

    def at(self, n: int) -> threading.Event:
        return self.reached.setdefault(n, threading.Event())


async def start(engine: Engine, prompt: list[int], max_tokens: int):
    """A generation running in the background: (its async generator, the task awaiting its first event)."""
    agen = engine.generate(
        GenerationRequest(prompt=list(prompt), max_tokens=max_tokens, sampling=GREEDY, ignore_eos=True)
    )
    return agen, asyncio.ensure_future(agen.__anext__())


async def cancel(agen, task) -> None:
    """Leave the generation early (the engine gets a cancel, as for a client that went away)."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await agen.aclose()


def test_a_cancel_mid_load_indexes_only_blocks_landed_in_every_layer(llama):
    """Cancelled when chunk 0 has landed in both layers and chunk 1 in layer 0 only: exactly chunk
    0's 4 blocks are indexed, holding the prompt's KV; the frames still on the way are dropped."""
    (p,) = prompts(llama.tokenizer.vocab_size, [300], seed=10)
    trio = Trio(llama, tiny_cfg())
    try:
        ref_cap = Capture(trio.ref, p)
        run(trio.ref, p)
        trio.src.pause_after = 3
        writes = Writes(trio.dec)

        async def scenario():
            agen, task = await start(trio.dec, p, 4)
            assert await asyncio.to_thread(writes.at(3).wait, WAIT)
            await cancel(agen, task)

        asyncio.run(scenario())
        trio.dec.run_on_worker(lambda: None, WAIT)  # the cancel has been handled
        (load,) = trio.src.loads
        assert load.load_id in trio.src.cancelled
        assert_no_leaks(trio.dec)
        assert indexed_blocks_hold_the_reference(trio.dec, p, ref_cap.kv) == 4
        trio.src.resume.set()
        trio.src.close()  # every frame still queued has been posted
        trio.dec.run_on_worker(lambda: None, WAIT)
        assert indexed_blocks_hold_the_reference(trio.dec, p, ref_cap.kv) == 4
        assert_no_leaks(trio.dec)
        trio.peer.run_on_worker(lambda: None, WAIT)
        assert_no_leaks(trio.peer_settled())  # the peer dropped its work on the cancel
    finally:
        trio.close()


@pytest.mark.parametrize("order", ["done-then-cancel", "cancel-then-done", "cancel-after-done-applied"])
def test_cancel_racing_done(llama, order):
    """The decoder's worker is held while the load's done and the request's cancel are posted, in
    either order: the cancel wins, the dead load's done is dropped. A cancel after the done was
    applied cancels nothing at the source. Either way nothing leaks and the engine serves on."""
    (p,) = prompts(llama.tokenizer.vocab_size, [150], seed=11)
    trio = Trio(llama, tiny_cfg())
    try:
        ref_tokens, _ = run(trio.ref, p)
        trio.src.hold_done = threading.Event()
        held, release = threading.Event(), threading.Event()

        def hold_worker():
            held.set()
            assert release.wait(WAIT)

        async def scenario():
            agen, task = await start(trio.dec, p, 50)
            assert await asyncio.to_thread(trio.src.at_done.wait, WAIT)
            if order == "cancel-after-done-applied":
                trio.src.hold_done.set()
                await task  # the first token: the done was applied, the request decodes
                await cancel(agen, task)
                return
            blocker = asyncio.ensure_future(asyncio.to_thread(trio.dec.run_on_worker, hold_worker, WAIT))
            assert await asyncio.to_thread(held.wait, WAIT)
            if order == "cancel-then-done":
                await cancel(agen, task)
            trio.src.hold_done.set()
            assert await asyncio.to_thread(trio.src.ended.wait, WAIT)  # the done is in the mailbox
            if order == "done-then-cancel":
                await cancel(agen, task)
            release.set()
            await blocker

        asyncio.run(scenario())
        trio.dec.run_on_worker(lambda: None, WAIT)
        (load,) = trio.src.loads
        assert ("done", load.load_id) in trio.src.events
        assert (load.load_id in trio.src.cancelled) == (order != "cancel-after-done-applied")
        assert_no_leaks(trio.dec)
        assert trio.dec.stats().kv_load_failures == 0
        tokens, _ = run(trio.dec, p)  # served normally afterwards
        assert tokens == ref_tokens
        assert_no_leaks(trio.dec)
    finally:
        trio.close()


def test_late_frames_of_a_cancelled_load_never_touch_reused_blocks(llama):
    """A's load is cancelled after chunk 0 landed, but its peer keeps sending; B then takes the
    freed blocks, and while B decodes, the rest of A's frames arrive: they are dropped, and B's
    tokens are those of local prefill."""
    vocab = llama.tokenizer.vocab_size
    a_prompt, b_prompt = prompts(vocab, [300, 260], seed=12)
    per_block = 16 * kv_token_bytes(llama)
    # 25 usable blocks: A's load takes 19; B needs 17, more than the 6 never used
    trio = Trio(llama, tiny_cfg(cache_gb=26 * per_block / 2**30), stop_on_cancel=False)
    try:
        assert trio.dec.allocator.num_blocks == 26
        trio.dec.scheduler.cfg.max_load_share = 1.0  # set before any request: A loads whole
        ref_tokens, _ = run(trio.ref, b_prompt, 8)
        trio.src.pause_after = 2
        writes = Writes(trio.dec)

        async def cancel_a():
            agen, task = await start(trio.dec, a_prompt, 4)
            assert await asyncio.to_thread(writes.at(2).wait, WAIT)
            await cancel(agen, task)

        asyncio.run(cancel_a())
        trio.dec.run_on_worker(lambda: None, WAIT)
        a_blocks = writes.table
        assert len(a_blocks) == 19
        assert_no_leaks(trio.dec)
        trio.src.enabled = False
        b_blocks: list[int] = []
        fwd = trio.dec.runner.forward

        def forward(rows):
            out = fwd(rows)
            if not b_blocks and rows[0].start == len(b_prompt):  # B's first decode step
                b_blocks.extend(rows[0].blocks)
                trio.src.resume.set()  # A's late frames and its done go to the decoder now
                assert trio.src.ended.wait(WAIT)
            return out

        trio.dec.runner.forward = forward
        dropped = trio.dec.stats().kv_frames_dropped
        b_tokens, _ = run(trio.dec, b_prompt, 8)
        late = len(trio.src.frames) - 2
        assert set(a_blocks) & set(b_blocks), "B did not reuse A's blocks"
        assert late > 0 and trio.dec.stats().kv_frames_dropped - dropped == late
        assert b_tokens == ref_tokens
        assert_no_leaks(trio.dec)
    finally:
        trio.close()


def test_bad_peer_prefills_are_clear_errors_and_a_broken_receiver_ends_only_its_export(llama):
    from mlx_engine.errors import EngineShutDownError, RequestError

    (p,) = prompts(llama.tokenizer.vocab_size, [150], seed=16)
    peer = Engine(llama, tiny_cfg())
    try:

        def nothing(*args) -> None:
            pass

        for tokens, start, chunk in (
            (p, 149, 64),
            (p, -1, 64),
            ([5], 0, 64),
            (p, 0, 0),
            ([10**6] + p, 0, 64),
        ):
            with pytest.raises(RequestError):
                peer.prefill_for_peer(tokens, start, chunk, nothing)
        errors: list[str] = []
        ended = threading.Event()

        def broken(layer, t0, t1, parts):
            raise ConnectionResetError("the receiver went away")

        peer.prefill_for_peer(
            p,
            0,
            64,
            broken,
            on_done=lambda n, s: ended.set(),
            on_error=lambda r: (errors.append(r), ended.set()),
        )
        assert ended.wait(WAIT)
        assert len(errors) == 1 and "the receiver went away" in errors[0]
        peer.run_on_worker(lambda: None, WAIT)
        assert_no_leaks(peer)
        assert len(run(peer, p)[0]) == 6  # the engine serves on
    finally:
        peer.shutdown()
    with pytest.raises(EngineShutDownError):
        peer.prefill_for_peer(p, 0, 64, nothing)


class Attached(NoPeer):
    """A source given in EngineConfig.kv_sources: attached on the worker, closed at shutdown;
    its loads report whether they were exact."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self.asked = 0

    def attach(self, engine: Engine) -> None:
        self.calls.append(("attach", threading.current_thread().name))
        self.pool_layers = engine.pool.num_layers  # the pool exists by now

    def match(self, tokens: list[int], start: int, end: int) -> int:
        self.asked += 1
        return 0

    def close(self) -> None:
        self.calls.append(("close", threading.current_thread().name))


def test_sources_in_the_config_are_attached_asked_and_closed(llama):
    from mlx_engine.errors import ConfigError

    with pytest.raises(ConfigError):
        EngineConfig(kv_sources="peer:1234").validate()  # type: ignore[arg-type]
    src = Attached()
    engine = Engine(llama, tiny_cfg(kv_sources=[src]))
    try:
        assert engine.local_prefill_rate() is None
        (p,) = prompts(llama.tokenizer.vocab_size, [100], seed=17)
        _, last = run(engine, p)
        assert src.asked >= 1 and src.pool_layers == llama.num_layers
        assert last.usage.prefill_location == "local" and last.usage.prefill_exact is None
        assert last.usage.prompt_tokens_computed == 100
        assert engine.local_prefill_rate() > 0
    finally:
        engine.shutdown()
    assert src.calls == [("attach", "duet-engine"), ("close", "MainThread")]


def test_usage_says_whether_remote_kv_was_exact(llama):
    (p,) = prompts(llama.tokenizer.vocab_size, [100], seed=18)
    for exact in (True, False):
        trio = Trio(llama, tiny_cfg())
        trio.src.load_info = lambda load_id, exact=exact: {"exact": exact}
        try:
            _, last = run(trio.dec, p)
            assert last.usage.prefill_location == "remote:peer" and last.usage.prefill_exact is exact
        finally:
            trio.close()
