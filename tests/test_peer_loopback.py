"""Remote prefill between two engines over a real loopback socket: the peer (``PeerServer`` over an
``Engine``) and the decoder (an ``Engine`` with a ``RemotePrefillSource``), every byte through the
framing, checksums, sender and reader threads and the byte-capped receive pool.

- exactness: the decoder's pool bytes for the prompt, the first token's logits and the greedy tokens
  equal a local prefill's (also with another block size on the peer); a quantized decoder with an
  unquantized peer is reported approximate, and its first layer is still bit-exact;
- prefix semantics: a warm decoder is sent only [start, N-1) (byte count); a warm peer computes from
  its own hit and reports it;
- streaming: the peer's worker waits after computing layer 0 until the decoder has written it into
  its pool: only a sender that streams and a reader that applies on arrival get past it;
- two concurrent remote prefills into one decoder over one connection.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from mlx_engine.kv_cache.kv_pool import KVPool
from mlx_engine.request import GenerationRequest
from peer.export_connection import ExportJob
from peer.server import EngineBackend
from tests.peer_pair import WAIT, Pair, tiny_cfg, two_models
from tests.test_engine_tiny import pool_dtype, prompts
from tests.test_remote_prefill_engine import GREEDY, Capture, collect, run, split_tokens


@pytest.fixture(scope="module")
def llama2(tiny_dirs):
    return two_models(tiny_dirs("llama"))


def per_token_bytes(engine) -> int:
    p = engine.pool
    return KVPool.bytes_per_token_per_layer(p.n_kv_heads, p.head_dim, p.dtype, p.kv_bits, p.group_size)


def assert_exact_remote(pair: Pair, prompt: list[int], n_new: int = 6):
    ref_cap, dec_cap = Capture(pair.ref, prompt), Capture(pair.dec, prompt)
    ref_tokens, _ = run(pair.ref, prompt, n_new)
    tokens, last = run(pair.dec, prompt, n_new)
    u = last.usage
    assert u.prefill_location == f"remote:{pair.peer_name}", u.fallback_reason
    assert u.remote_tokens == len(prompt) - 1 and u.prompt_tokens_computed == 1
    assert dec_cap.kv == ref_cap.kv, "the decoder's pool differs from local prefill's"
    assert np.array_equal(dec_cap.logits, ref_cap.logits)
    assert tokens == ref_tokens
    pair.assert_no_leaks()
    return last


@pytest.mark.parametrize("length", [2, 40, 300])
def test_remote_prefill_over_loopback_is_exact(llama2, length):
    (p,) = prompts(llama2[0].tokenizer.vocab_size, [length], seed=length)
    pair = Pair(*llama2, tiny_cfg())
    try:
        assert pair.src.exact
        last = assert_exact_remote(pair, p)
        (info,) = pair.src.loads_of(last.request_id)
        L = pair.dec.pool.num_layers
        assert info["outcome"] == "done" and (info["start"], info["end"]) == (0, length - 1)
        assert info["frames"] == L * -(-(length - 1) // pair.chunk)  # a frame per layer per chunk
        assert last.usage.remote_bytes == info["bytes"] == (length - 1) * per_token_bytes(pair.dec) * L
        assert pair.src.bytes_received == info["bytes"]
        assert pair.src.link.conn.reader.buffers.in_use == 0  # every receive buffer went back
    finally:
        pair.close()


def test_remote_prefill_is_exact_with_another_block_size_on_the_peer(llama2):
    (p,) = prompts(llama2[0].tokenizer.vocab_size, [170], seed=5)
    pair = Pair(*llama2, tiny_cfg(block_size=16), tiny_cfg(block_size=8))
    try:
        assert_exact_remote(pair, p)
    finally:
        pair.close()


def test_a_quantized_decoder_gets_its_own_format_and_is_told_it_is_approximate(llama2):
    """The peer's pool is float32, the decoder's 8-bit: the peer quantizes each layer on export as
    the decoder's own pool write would. Layer 0's KV does not depend on attention, so it is
    bit-exact; the later layers attended over unquantized KV on the peer (approximate)."""
    (p,) = prompts(llama2[0].tokenizer.vocab_size, [150], seed=11)
    pair = Pair(*llama2, tiny_cfg(kv_bits=8), tiny_cfg(kv_dtype="float32"))
    try:
        assert not pair.src.exact and any("kv_bits" in r for r in pair.src.inexact)
        ref_cap, dec_cap = Capture(pair.ref, p), Capture(pair.dec, p)
        run(pair.ref, p)
        tokens, last = run(pair.dec, p)
        assert last.usage.prefill_location == f"remote:{pair.peer_name}" and len(tokens) == 6
        assert dec_cap.kv[0] == ref_cap.kv[0]
        assert last.usage.remote_bytes == 149 * per_token_bytes(pair.dec) * pair.dec.pool.num_layers
        pair.assert_no_leaks()
    finally:
        pair.close()


def test_a_warm_decoder_is_sent_only_what_it_lacks(llama2):
    (p,) = prompts(llama2[0].tokenizer.vocab_size, [300], seed=6)
    pair = Pair(*llama2, tiny_cfg())
    try:
        ref_cap = Capture(pair.ref, p)
        ref_tokens, _ = run(pair.ref, p)
        pair.dec.remove_kv_source(pair.src)
        run(pair.dec, p[:40])  # the decoder caches the prompt's first 40 tokens (2 blocks and 8)
        pair.dec.add_kv_source(pair.src)
        dec_cap = Capture(pair.dec, p)
        tokens, last = run(pair.dec, p)
        u = last.usage
        assert (u.cached_tokens, u.remote_tokens, u.prompt_tokens_computed) == (40, 259, 1)
        (info,) = pair.src.loads_of(last.request_id)
        assert (info["start"], info["end"]) == (40, 299)
        assert info["bytes"] == 259 * per_token_bytes(pair.dec) * pair.dec.pool.num_layers
        assert split_tokens(dec_cap.kv, pair.dec.pool, 40, 299) == split_tokens(
            ref_cap.kv, pair.ref.pool, 40, 299
        )
        assert tokens == ref_tokens
        pair.assert_no_leaks()
    finally:
        pair.close()


def test_a_warm_peer_reports_its_hit_and_computes_only_the_rest(llama2):
    (p,) = prompts(llama2[0].tokenizer.vocab_size, [300], seed=7)
    pair = Pair(*llama2, tiny_cfg())
    try:
        ref_tokens, _ = run(pair.ref, p)
        run(pair.peer, p[:70])  # the peer caches the prompt's first 70 tokens (4 blocks and 6)
        tokens, last = run(pair.dec, p)
        (info,) = pair.src.loads_of(last.request_id)
        assert info["hit"] == 70 and info["tokens_computed"] == 299 - 70
        assert last.usage.remote_tokens == 299 and tokens == ref_tokens
        pair.assert_no_leaks()
    finally:
        pair.close()


def test_kv_streams_over_the_socket_layer_by_layer(llama2):
    """The peer's worker, right after handing out layer 0 of the first chunk, waits until the
    decoder has written that layer into its pool. A peer that sends after the whole prefill, or a
    decoder that buffers until DONE, never gets there (the wait times out and the test fails)."""
    written = threading.Event()
    waited: list[bool] = []

    class WaitingBackend(EngineBackend):
        def start_export(self, job: ExportJob) -> None:
            hand_out = job.layer

            def layer(ly, t0, t1, parts):
                hand_out(ly, t0, t1, parts)
                if (ly, t0) == (0, 0):
                    waited.append(written.wait(WAIT))

            job.layer = layer  # type: ignore[method-assign]
            super().start_export(job)

    (p,) = prompts(llama2[0].tokenizer.vocab_size, [200], seed=8)
    pair = Pair(*llama2, tiny_cfg(), backend_class=WaitingBackend)
    try:
        write = pair.dec.pool.write_tokens

        def recording_write(layer, table, t0, parts):
            write(layer, table, t0, parts)
            if (layer, t0) == (0, 0):
                written.set()

        pair.dec.pool.write_tokens = recording_write
        tokens, last = run(pair.dec, p)
        assert waited == [True], "the decoder wrote no KV while the peer was still computing"
        assert last.usage.prefill_location.startswith("remote:") and last.usage.prompt_tokens_computed == 1
        pair.assert_no_leaks()
    finally:
        pair.close()


def test_two_concurrent_remote_prefills_into_one_decoder(llama2):
    a, b = prompts(llama2[0].tokenizer.vocab_size, [260, 190], seed=12)
    pair = Pair(*llama2, tiny_cfg())
    try:
        want = [run(pair.ref, x)[0] for x in (a, b)]

        async def both():
            reqs = [
                GenerationRequest(prompt=list(x), max_tokens=6, sampling=GREEDY, ignore_eos=True)
                for x in (a, b)
            ]
            return await asyncio.gather(*(collect(pair.dec, r) for r in reqs))

        results = asyncio.run(both())
        for evs, x, w in zip(results, (a, b), want, strict=True):
            u = evs[-1].usage
            assert u.prefill_location == f"remote:{pair.peer_name}" and u.remote_tokens == len(x) - 1
            assert [t for ev in evs for t in ev.token_ids] == w
        assert pair.src.remote_prefills == 2 and pair.server.connections == 1
        pair.assert_no_leaks()
    finally:
        pair.close()


class GatedBackend(EngineBackend):
    """Holds the peer's worker after it hands out the first layer of the second chunk, until
    ``gate`` is set (``reached`` tells the test it is there)."""

    def __init__(self, engine):
        super().__init__(engine)
        self.gate, self.reached = threading.Event(), threading.Event()
        self.jobs: list[ExportJob] = []

    def start_export(self, job: ExportJob) -> None:
        hand_out = job.layer

        def layer(ly, t0, t1, parts):
            hand_out(ly, t0, t1, parts)
            if t0 >= 64 and not self.reached.is_set():
                self.reached.set()
                assert self.gate.wait(WAIT)

        job.layer = layer  # type: ignore[method-assign]
        self.jobs.append(job)
        super().start_export(job)


@pytest.mark.parametrize("how", ["cancel", "disconnect"])
def test_the_peer_stops_and_frees_its_blocks_on_cancel_or_disconnect(llama2, how):
    (p,) = prompts(llama2[0].tokenizer.vocab_size, [300], seed=13)
    pair = Pair(*llama2, tiny_cfg(), backend_class=GatedBackend)
    backend = pair.backend
    assert isinstance(backend, GatedBackend)
    try:
        ref_tokens, _ = run(pair.ref, p)

        async def scenario():
            agen = pair.dec.generate(
                GenerationRequest(prompt=list(p), max_tokens=6, sampling=GREEDY, ignore_eos=True)
            )
            task = asyncio.ensure_future(agen.__anext__())
            assert await asyncio.to_thread(backend.reached.wait, WAIT)
            if how == "cancel":  # the client went away: the decoder cancels the load
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await agen.aclose()
                return None
            pair.src.close()  # the connection drops: the decoder computes the rest itself
            first = await task
            return [first, *[ev async for ev in agen]]

        evs = asyncio.run(scenario())
        with pair.server.idle:  # the peer saw the CANCEL (or the end of the connection)
            assert pair.server.idle.wait_for(lambda: pair.server.stats.counts.get("cancelled") == 1, WAIT)
        backend.gate.set()
        pair.assert_no_leaks()  # the peer's worker dropped the export and freed its blocks
        (job,) = backend.jobs
        assert job.cancelled and not job.finished  # it never computed to the end
        assert job.frames < 2 * 5  # 5 chunks x 2 layers were never all sent
        if evs is not None:
            assert [t for ev in evs for t in ev.token_ids] == ref_tokens
            assert evs[-1].usage.fallback_reason == f"{pair.peer_name}: disconnected"
    finally:
        backend.gate.set()
        pair.close()


def test_ingest_stays_within_a_small_receive_buffer(llama2):
    """A receive pool of two frames: the reader stops reading while the decoder's worker has not
    applied what it holds, the peer is pushed back, and the result is still exact."""
    (p,) = prompts(llama2[0].tokenizer.vocab_size, [600], seed=14)
    # one layer of one chunk: 64 tokens x 2 heads x 32 dims x K,V in the pool's dtype
    frame = 64 * 2 * 32 * 2 * pool_dtype(llama2[0]).size
    pair = Pair(*llama2, tiny_cfg(), buffer_cap_bytes=2 * frame)
    try:
        assert per_token_bytes(pair.dec) * 64 == frame
        assert_exact_remote(pair, p)
        assert 0 < pair.src.link.conn.reader.buffers.peak <= 2 * frame
    finally:
        pair.close()


def test_auto_tries_each_side_then_follows_the_measured_rates(llama2):
    """--remote-prefill auto: the peer first (never measured), then local prefill (never measured:
    the engine's own rate, Engine.local_prefill_rate), then whichever the estimate says is faster."""
    p1, p2, p3 = prompts(llama2[0].tokenizer.vocab_size, [200, 210, 220], seed=15)
    pair = Pair(*llama2, tiny_cfg(), policy="auto")
    try:
        assert pair.dec.local_prefill_rate() is None
        _, first = run(pair.dec, p1)
        assert first.usage.prefill_location == f"remote:{pair.peer_name}"
        _, second = run(pair.dec, p2)
        assert second.usage.prefill_location == "local" and second.usage.prompt_tokens_computed == 210
        rate = pair.dec.local_prefill_rate()
        assert rate is not None and pair.src.offload.local_rate() == rate  # the engine's measured rate
        remote = pair.src.worth_offloading(len(p3) - 1)
        _, third = run(pair.dec, p3)
        assert third.usage.prefill_location == (f"remote:{pair.peer_name}" if remote else "local")
        pair.assert_no_leaks()
    finally:
        pair.close()
