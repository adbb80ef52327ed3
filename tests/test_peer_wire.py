"""The peer network layer over real loopback sockets, with an engine-less backend (tests/peer_fakes):
HELLO refusals before any PREFILL, the streamed KV landing where it belongs, the prefix rule
(only [start, N-1) is sent), BUSY, cancel, deadlines, faults on the real send path, backoff and the
receive byte cap. The same matrix with two real engines is in test_peer_faults.py."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

from mlx_engine.errors import ConfigError
from peer.client import Backoff, PeerTimeouts, RemotePrefillSource
from peer.export_connection import Connection
from peer.server import PeerServer, ServerLimits
from peer.wire.protocol import LayerSpec
from tests.peer_fakes import (
    DIM,
    HEADS,
    LAYERS,
    WAIT,
    FakeBackend,
    KVLoad,
    RecordingSink,
    SinkLoad,
    expected_kv,
    fake_hello,
    fault_connection,
)

N = 100  # prompt tokens; the peer sends [start, N - 1)
CHUNK = 32
TOKENS = [(7 * i + 3) % 397 for i in range(N)]
FRAME_BYTES = 2 * HEADS * DIM * 4  # one token of one layer, K and V in float32


def serve(backend=None, hello=None, **kw) -> PeerServer:
    return PeerServer(backend or FakeBackend(), hello or fake_hello(), "127.0.0.1", 0, **kw).start()


def source(server: PeerServer, hello=None, **kw) -> RemotePrefillSource:
    src = RemotePrefillSource("127.0.0.1", server.port, **kw)
    src.configure(hello or fake_hello(), CHUNK)
    return src


def load(load_id=1, start=0, end=N - 1, tokens=TOKENS) -> KVLoad:
    return KVLoad(load_id, f"req-{load_id}", list(tokens), start, end)


def connected(closing, server: PeerServer) -> tuple[RemotePrefillSource, RecordingSink]:
    """A source connected to ``server`` (both closed after the test) and a sink for its loads."""
    closing(server)
    src = source(server)
    closing(src)
    assert src.connect(wait_s=WAIT)
    return src, RecordingSink(N)


def one_load(closing, server: PeerServer) -> tuple[RemotePrefillSource, SinkLoad]:
    """The load of the whole prompt from a source connected to ``server``, run to its end."""
    src, sink = connected(closing, server)
    src.start_load(load(), sink)
    sink.wait_end(1)
    return src, sink.loads[1]


def check_landed(sink: RecordingSink, load_id: int, start: int, end: int) -> None:
    s = sink.loads[load_id]
    for layer in range(LAYERS):
        assert s.landed[layer] == end
        want = expected_kv(TOKENS, layer, start, end)
        for got, w in zip(s.kv[layer], want, strict=True):
            np.testing.assert_array_equal(got[start:end], w)
            assert np.isnan(got[:start]).all() and np.isnan(got[end:]).all()  # nothing outside the range


@pytest.fixture
def closing():
    things = []
    yield things.append
    for t in reversed(things):
        t.close()


def test_stream_lands_every_layer_of_the_range(closing):
    backend = FakeBackend()
    server = serve(backend)
    closing(server)
    src = source(server)
    closing(src)
    assert src.connect(wait_s=WAIT) and src.exact
    assert src.match(TOKENS, 0, N - 1) == N - 1
    sink = RecordingSink(N)
    src.start_load(load(), sink)
    assert sink.wait_end(1).done
    check_landed(sink, 1, 0, N - 1)
    info = src.load_info(1)
    assert info["outcome"] == "done" and info["hit"] == 0 and info["tokens_computed"] == N - 1
    assert info["frames"] == LAYERS * -(-(N - 1) // CHUNK)  # one frame per layer per chunk
    assert info["bytes"] == src.bytes_received == LAYERS * (N - 1) * FRAME_BYTES
    assert src.remote_prefills == 1 and not src.fallbacks
    backend.wait_finished(1)
    assert backend.started[0].chunk_size == CHUNK  # the decoder's chunk grid travels with PREFILL


def test_only_tokens_the_decoder_lacks_are_sent_and_the_peer_computes_from_its_own_hit(closing):
    """start = 40 (the decoder's prefix hit), the peer's own cache holds 16: it computes [16, 99)
    on the grid anchored at 0 and sends only [40, 99)."""
    backend = FakeBackend(cached=16)
    server = serve(backend)
    src, sink = connected(closing, server)
    src.start_load(load(start=40), sink)
    sink.wait_end(1)
    check_landed(sink, 1, 40, N - 1)
    info = src.load_info(1)
    assert info["hit"] == 16 and info["tokens_computed"] == N - 1 - 16
    assert info["bytes"] == LAYERS * (N - 1 - 40) * FRAME_BYTES
    # chunks [32, 64) and [64, 96) and [96, 99): the first is cut at 40
    assert info["frames"] == LAYERS * 3


@pytest.mark.parametrize(
    "change, code",
    [
        ({"model_fingerprint": "xxh3-128:" + "cd" * 16}, "fingerprint"),
        ({"protocol_min": 2, "protocol_max": 2}, "version"),
        ({"layers": [LayerSpec("ssm", HEADS, DIM, DIM)] * LAYERS}, "unsupported_model"),
    ],
)
def test_hello_mismatch_is_refused_before_any_prefill(closing, caplog, change, code):
    backend = FakeBackend()
    server = serve(backend, hello=fake_hello(**change))
    closing(server)
    src = source(server)
    closing(src)
    with caplog.at_level(logging.WARNING, "duet.peer"):
        assert not src.connect(wait_s=WAIT)
    assert src.last_error[0] == code
    assert src.match(TOKENS, 0, N - 1) == 0
    sink = RecordingSink(N)
    src.start_load(load(), sink)  # an engine that asks anyway gets an immediate failure
    assert sink.loads[1].failed == "disconnected"
    assert not backend.started
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "duet.peer.client" and f"({code})" in r.getMessage()
    ]
    assert len(lines) == 1, lines  # the reason, once


def test_a_done_before_every_layer_landed_fails_the_load_and_keeps_what_did(closing):
    """A peer that says DONE with a layer of the range missing: the load fails (the engine computes
    the rest itself), it is never done with unwritten KV in the pool."""

    class DropsOneLayer(Connection):
        dropped = threading.Event()

        def send(self, buffers, kind, job) -> None:
            if kind == "layer_kv" and not self.dropped.is_set():
                self.dropped.set()  # layer 0 of the first chunk never leaves
                return
            super().send(buffers, kind, job)

    src, got = one_load(closing, serve(connection_class=DropsOneLayer))
    assert DropsOneLayer.dropped.is_set()
    assert got.failed == "bad_frame" and not got.done
    assert src.fallbacks["bad_frame"] == 1 and src.remote_prefills == 0
    assert got.frames == LAYERS * 4 - 1  # 4 chunks of 3 layers, less the one dropped
    assert np.isnan(got.kv[0][0][:CHUNK]).all() and not np.isnan(got.kv[1][0][:CHUNK]).any()


def test_busy_peer_answers_busy_and_the_decoder_backs_off(closing):
    backend = FakeBackend()
    server = serve(backend, limits=ServerLimits(max_exports=0))
    src, got = one_load(closing, server)
    assert got.failed == "busy" and got.frames == 0
    assert src.fallbacks["busy"] == 1 and server.stats.counts["busy"] == 1
    assert src.match(TOKENS, 0, N - 1) == 0  # until retry_after has passed
    assert not backend.started


def test_cancel_stops_the_export_and_late_frames_are_dropped(closing):
    gate = threading.Semaphore(0)  # the peer computes one chunk per release
    backend = FakeBackend(gate=gate)
    server = serve(backend)
    src, sink = connected(closing, server)
    src.start_load(load(), sink)
    gate.release()
    sink.wait(lambda: 1 in sink.loads and sink.loads[1].frames == LAYERS)
    src.cancel(1)
    with backend.cv:
        assert backend.cv.wait_for(lambda: backend.cancelled, WAIT)  # the peer freed the export
    gate.release(10)
    backend.wait_finished(1)
    src.cancel(1)  # a second cancel is a no-op
    s = sink.loads[1]
    assert not s.done and s.failed is None and s.frames == LAYERS  # no sink call after the cancel
    assert src.load_info(1)["outcome"] == "cancelled"
    with server.idle:
        assert server.idle.wait_for(lambda: server.active_exports == 0, WAIT)
    # the connection is still good for the next load
    sink2 = RecordingSink(N)
    src.start_load(load(2), sink2)
    gate.release(10)
    assert sink2.wait_end(2).done


@pytest.mark.parametrize(
    "fault, code",
    [("kill", "disconnected"), ("truncate", "truncated"), ("corrupt", "checksum")],
)
def test_fault_mid_stream_fails_the_load_after_frames_landed(closing, caplog, fault, code):
    after = 4
    conn_cls = fault_connection(fault, after)
    backend = FakeBackend()
    server = serve(backend, connection_class=conn_cls)
    closing(server)
    src = source(server, backoff=Backoff(initial_s=30))
    closing(src)
    assert src.connect(wait_s=WAIT)
    sink = RecordingSink(N)
    with caplog.at_level(logging.WARNING, "duet.peer"):
        src.start_load(load(), sink)
        sink.wait_end(1)
    s = sink.loads[1]
    assert conn_cls.tripped.is_set()
    assert s.failed == code and s.frames == after  # frames did arrive before the fault
    for layer, end in s.landed.items():  # what landed is intact
        want = expected_kv(TOKENS, layer, 0, end)
        np.testing.assert_array_equal(s.kv[layer][0][:end], want[0])
    assert src.fallbacks[code] == 1 and not src.healthy
    assert src.match(TOKENS, 0, N - 1) == 0  # backing off
    assert any(f"({code})" in r.getMessage() and "4 frames" in r.getMessage() for r in caplog.records)
    with server.idle:  # the peer freed the export when the connection went
        assert server.idle.wait_for(lambda: server.active_exports == 0, WAIT)
    assert backend.cancelled or backend.finished


def test_stall_times_out_and_cancels(closing):
    conn_cls = fault_connection("stall", 2)
    backend = FakeBackend()
    server = serve(backend, connection_class=conn_cls)
    closing(server)
    src = source(server, timeouts=PeerTimeouts(stall_s=0.5), backoff=Backoff(initial_s=30))
    closing(src)
    assert src.connect(wait_s=WAIT)
    sink = RecordingSink(N)
    src.start_load(load(), sink)
    sink.wait_end(1)
    s = sink.loads[1]
    assert s.failed == "timeout" and s.frames == 2
    assert not src.healthy and src.connected  # the connection stays; the peer backs off
    with server.idle:  # the CANCEL reached the peer, which drops the frames still queued
        assert server.idle.wait_for(lambda: server.stats.counts.get("cancelled") == 1, WAIT)
    conn_cls.release.set()  # the frame stuck in send() goes out and is dropped as late
    with server.idle:
        assert server.idle.wait_for(lambda: server.active_exports == 0, WAIT)
    backend.wait_finished(1)
    job = backend.started[0]
    assert job.frames in (2, 3)  # two before the stall, the one inside send(); none after the CANCEL
    assert not s.done and s.frames == 2


def test_backoff_then_reconnect(closing):
    """A peer that went away is retried after its backoff, in the background: the request that
    notices gets 0 (local prefill), a later one the peer again."""
    now = [1000.0]
    backend = FakeBackend()
    server = serve(backend, connection_class=fault_connection("kill", 1))
    closing(server)
    src = source(server, backoff=Backoff(initial_s=5, max_s=40), clock=lambda: now[0])
    closing(src)
    assert src.connect(wait_s=WAIT)
    sink = RecordingSink(N)
    src.start_load(load(), sink)
    sink.wait_end(1)
    assert not src.connected and src.match(TOKENS, 0, N - 1) == 0
    now[0] += 4.9
    assert src.match(TOKENS, 0, N - 1) == 0 and src.link.connecting is None  # still backing off
    now[0] += 0.2
    assert src.match(TOKENS, 0, N - 1) == 0  # starts reconnecting in the background
    with src.link.lock:
        assert src.link.connected_cond.wait_for(lambda: src.link.connecting is None, WAIT)
    assert src.match(TOKENS, 0, N - 1) == N - 1


def test_a_completed_load_ends_the_failure_streak(closing):
    """The backoff grows with consecutive failures only: after a load that completed, the next
    failure waits the initial backoff again, not twice it."""
    now = [1000.0]
    faults = fault_connection("kill", 1)
    server = serve(FakeBackend(), connection_class=faults)
    closing(server)
    src = source(server, backoff=Backoff(initial_s=5, max_s=40), clock=lambda: now[0])
    closing(src)
    sink = RecordingSink(N)

    def run(load_id: int) -> SinkLoad:
        src.start_load(load(load_id), sink)
        sink.wait_end(load_id)
        return sink.loads[load_id]

    def reconnects_after(seconds: float) -> bool:
        now[0] += seconds
        assert src.match(TOKENS, 0, N - 1) == 0  # starts reconnecting in the background, if it may
        with src.link.lock:
            assert src.link.connected_cond.wait_for(lambda: src.link.connecting is None, WAIT)
        return src.match(TOKENS, 0, N - 1) == N - 1

    assert src.connect(wait_s=WAIT)
    assert run(1).failed is not None  # the connection is killed mid-stream: a 5 s backoff
    faults.fault = None
    assert reconnects_after(5.1)
    assert run(2).done
    faults.fault = "kill"
    assert run(3).failed is not None  # a new streak of one failure
    assert reconnects_after(5.1)


def test_receive_buffer_cap_bounds_ingest_and_pauses_the_export(closing):
    """A decoder that does not apply frames: the reader stops at the buffer cap, TCP fills, the
    peer's per-export byte cap pauses the export (its worker never blocks), and everything flows
    once frames are applied."""
    frame = CHUNK * FRAME_BYTES
    backend = FakeBackend()
    server = serve(backend, limits=ServerLimits(queued_bytes_per_export=2 * frame))
    closing(server)
    src = source(server, buffer_cap_bytes=3 * frame)
    closing(src)
    assert src.connect(wait_s=WAIT)
    tokens = [(5 * i + 1) % 397 for i in range(40 * CHUNK + 1)]
    sink = RecordingSink(len(tokens), hold=True)
    src.start_load(KVLoad(1, "big", tokens, 0, len(tokens) - 1), sink)
    with backend.cv:
        assert backend.cv.wait_for(lambda: backend.paused > 0, WAIT)
    sink.wait(lambda: len(sink.held) == 3)
    assert src.link.conn.reader.buffers.in_use <= 3 * frame
    while not (1 in sink.loads and sink.loads[1].finished.is_set()):
        sink.wait(lambda: sink.held or sink.loads[1].finished.is_set())
        sink.release_held()
    assert sink.loads[1].done
    assert src.link.conn.reader.buffers.peak <= 3 * frame


def test_two_concurrent_loads_on_one_connection(closing):
    backend = FakeBackend()
    server = serve(backend)
    src, sink = connected(closing, server)
    src.start_load(load(1), sink)
    src.start_load(load(2, start=16), sink)
    sink.wait(lambda: all(i in sink.loads and sink.loads[i].finished.is_set() for i in (1, 2)))
    check_landed(sink, 1, 0, N - 1)
    check_landed(sink, 2, 16, N - 1)
    assert server.connections == 1


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1", "example.invalid"])
def test_non_loopback_host_is_refused(host):
    with pytest.raises(ConfigError, match="loopback|not a known address"):
        PeerServer(FakeBackend(), fake_hello(), host, 0).start()


def test_unreachable_peer_is_a_clear_fallback(closing):
    server = serve()
    port = server.port
    server.close()
    src = RemotePrefillSource("127.0.0.1", port)
    src.configure(fake_hello(), CHUNK)
    closing(src)
    assert not src.connect(wait_s=WAIT)
    assert src.last_error[0] == "disconnected" and "cannot connect" in src.status()
    assert src.match(TOKENS, 0, N - 1) == 0


def test_a_done_racing_a_cancel_is_dropped(closing):
    """The peer's DONE is on its way (stuck in send) when the decoder cancels: the CANCEL is a
    no-op at the peer, and the DONE that still arrives is dropped, never reaching the sink."""
    conn_cls = fault_connection("stall", 0, kind="done")
    backend = FakeBackend()
    server = serve(backend, connection_class=conn_cls)
    src, sink = connected(closing, server)
    src.start_load(load(), sink)
    assert conn_cls.tripped.wait(WAIT)  # every layer was sent, the DONE is in send()
    sink.wait(lambda: 1 in sink.loads and sink.loads[1].frames == LAYERS * 4)
    src.cancel(1)
    with server.idle:
        assert server.idle.wait_for(lambda: server.stats.counts.get("cancelled") == 1, WAIT)
    assert not backend.cancelled  # the export had finished: nothing to stop
    conn_cls.release.set()
    sink2 = RecordingSink(N)  # the connection goes on: the next load is served after the DONE
    src.start_load(load(2), sink2)
    assert sink2.wait_end(2).done
    s = sink.loads[1]
    assert not s.done and s.failed is None and src.load_info(1)["outcome"] == "cancelled"


def test_auto_offloads_when_the_measured_rates_say_the_peer_is_faster(closing):
    server = serve()
    closing(server)
    src = source(server, policy="auto")
    closing(src)
    assert src.connect(wait_s=WAIT)
    assert src.match(TOKENS, 0, N - 1) == N - 1  # the peer was never measured: try it
    sink = RecordingSink(N)
    src.start_load(load(), sink)
    assert sink.wait_end(1).done
    assert src.match(TOKENS, 0, N - 1) == 0  # local prefill was never measured: try that
    src.observe_local_prefill(1, 1000.0)  # a very slow decoder
    assert src.match(TOKENS, 0, N - 1) == N - 1
    src.observe_local_prefill(10**15, 1.0)  # and now a very fast one
    assert src.match(TOKENS, 0, N - 1) == 0
