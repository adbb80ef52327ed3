"""What a paired peer can do to a decoder, and a decoder to a peer, is bounded (issue 30, finding 5,
and the peer bugs of its list that the suite let pass):

- a load has one deadline for the whole of it: re-sent ACCEPTs or re-sent layers never keep it alive;
- the stall deadline moves with each frame that arrives (a slow, healthy peer finishes);
- NaN/Inf KV is refused before it reaches the pool, the prefix cache or the disk tier;
- frames below a load's start are refused and the peer is backed off;
- PREFILL's chunk_size is bounded by the peer's own limit; one decoder runs at most
  ``max_exports_per_client`` exports at once;
- ``duet peer unpair`` closes the open connections of the machine it unpairs, on either side.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from peer.client import RemotePrefillSource
from peer.connection import PeerTimeouts
from peer.export_connection import ExportJob
from peer.server import PeerServer, ServerLimits
from peer.trust.tls import PeerTLS
from peer.wire.kv_wire import to_wire
from tests.peer_fakes import LAYERS, FakeBackend, KVLoad, RecordingSink, expected_kv, fake_hello
from tests.test_peer_tls import machine, pair

WAIT = 30.0
CHUNK = 16
TOKENS = [(7 * i + 3) % 397 for i in range(129)]


class EvilBackend(FakeBackend):
    """A paired peer that misbehaves in one way (``mode``) on every export, until cancelled."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode

    def _run(self, job: ExportJob) -> None:
        kv = expected_kv(job.tokens, 0, job.start, job.start + CHUNK)
        if self.mode == "nan":
            job.accept(0)
            kv[1][3, 1, 5] = np.nan
            job.layer(0, job.start, job.start + CHUNK, kv)
            return
        if self.mode == "below":  # straight to the connection: ExportJob.layer would clip it
            job.accept(0)
            arrays = [to_wire(p) for p in expected_kv(job.tokens, 0, 0, CHUNK)]
            job.conn.queue_layer(job, 0, 0, CHUNK, arrays, sum(a.nbytes for a in arrays))
            return
        while not self._stopped(job):  # "accepts" or "resend": something every 50 ms, for ever
            if self.mode == "accepts":
                job.accept(0, eta_s=0.0)
            else:
                job.layer(0, job.start, job.start + CHUNK, kv)
            with self.cv:
                self.cv.wait_for(lambda: job in self.cancelled, 0.05)
        self._end(job)


def source(
    port: int, timeouts: PeerTimeouts | None = None, tls: PeerTLS | None = None
) -> RemotePrefillSource:
    src = RemotePrefillSource("127.0.0.1", port, timeouts=timeouts, tls=tls, name="gpu")
    src.configure(fake_hello(), CHUNK)
    assert src.connect(wait_s=WAIT)
    return src


def load(src: RemotePrefillSource, load_id: int = 1, start: int = 16, end: int = 128) -> RecordingSink:
    sink = RecordingSink(len(TOKENS))
    src.start_load(KVLoad(load_id, f"req-{load_id}", list(TOKENS), start, end), sink)
    return sink


def test_re_sent_accepts_do_not_keep_a_load_alive():
    server = PeerServer(EvilBackend("accepts"), fake_hello()).start()
    src = source(server.port, PeerTimeouts(first_byte_s=1.0))
    try:
        ended = load(src).wait_end(1)
        assert ended.failed == "timeout" and src.last_error is not None and "no reply" in src.last_error[1]
    finally:
        src.close()
        server.close()


def test_re_sent_layers_do_not_keep_a_load_alive():
    server = PeerServer(EvilBackend("resend"), fake_hello()).start()
    src = source(server.port, PeerTimeouts(stall_s=5.0, load_s=1.0, min_rate_tps=1e9))
    try:
        ended = load(src).wait_end(1)
        assert ended.failed == "timeout" and src.last_error is not None
        assert "did not finish within its 1 s deadline" in src.last_error[1]
        assert not src.healthy  # backed off
    finally:
        src.close()
        server.close()


def test_each_frame_pushes_the_stall_deadline_back():
    """A healthy peer slower than the stall deadline overall, each frame well inside it, finishes."""
    gate = threading.Semaphore(0)
    server = PeerServer(FakeBackend(gate=gate), fake_hello()).start()
    src = source(server.port, PeerTimeouts(first_byte_s=2.0, stall_s=2.0))
    try:
        sink = load(src, start=0)
        t0 = time.monotonic()
        for chunk in range(8):  # one chunk (every layer) each 0.5 s: 4 s in all, twice the deadline
            gate.release()
            sink.wait(lambda c=chunk: 1 in sink.loads and sink.loads[1].frames >= (c + 1) * LAYERS)
            if chunk < 7:
                time.sleep(0.5)
        ended = sink.wait_end(1)
        assert ended.done and ended.failed is None, ended.failed
        assert time.monotonic() - t0 > 2.0
    finally:
        src.close()
        server.close()


def test_nan_or_inf_kv_is_refused_before_it_lands():
    server = PeerServer(EvilBackend("nan"), fake_hello()).start()
    src = source(server.port)
    try:
        ended = load(src).wait_end(1)
        assert ended.failed == "bad_frame" and ended.frames == 0  # nothing reached the pool
        assert src.last_error is not None and "NaN or Inf" in src.last_error[1] and not src.healthy
    finally:
        src.close()
        server.close()


def test_frames_below_the_loads_start_are_refused_and_the_peer_backed_off():
    server = PeerServer(EvilBackend("below"), fake_hello()).start()
    src = source(server.port)
    try:
        ended = load(src, start=16).wait_end(1)
        assert ended.failed == "bad_frame" and ended.frames == 0
        assert src.failures["bad_frame"] == 1 and not src.healthy  # retried only after a backoff
    finally:
        src.close()
        server.close()


def test_chunk_size_is_bounded_by_the_peers_limit():
    backend = FakeBackend()
    server = PeerServer(backend, fake_hello(), limits=ServerLimits(max_chunk_tokens=64)).start()
    src = RemotePrefillSource("127.0.0.1", server.port, name="gpu")
    src.configure(fake_hello(), 4096)  # one forward pass over the whole prompt, were it allowed
    assert src.connect(wait_s=WAIT)
    try:
        ended = load(src).wait_end(1)
        assert ended.failed == "bad_frame" and backend.started == []
        assert src.last_error is not None and "over this peer's limit of 64" in src.last_error[1]
    finally:
        src.close()
        server.close()


def test_one_decoder_runs_at_most_max_exports_per_client():
    gate = threading.Semaphore(0)  # exports hold until released
    backend = FakeBackend(gate=gate)
    limits = ServerLimits(max_exports=8, max_exports_per_client=2)
    server = PeerServer(backend, fake_hello(), limits=limits).start()
    src = source(server.port)
    try:
        sinks = [load(src, load_id=i) for i in (1, 2, 3)]
        assert sinks[2].wait_end(3).failed == "busy"
        assert len(backend.started) == 2
        for _ in range(2 * 8):
            gate.release()
        assert all(s.wait_end(i).done for i, s in ((1, sinks[0]), (2, sinks[1])))
    finally:
        src.close()
        server.close()


def test_unpairing_closes_open_connections_on_both_sides(tmp_path):
    gpu, mac = machine(tmp_path, "gpu"), machine(tmp_path, "mac")
    pair(gpu, mac)
    server = PeerServer(FakeBackend(), fake_hello(), tls=PeerTLS(*gpu)).start()
    src = source(server.port, tls=PeerTLS(*mac))
    other = source(server.port, tls=PeerTLS(*mac))
    try:
        assert load(src).wait_end(1).done
        gpu[1].remove("mac")  # duet peer unpair mac, on the GPU box
        with server.idle:
            assert server.idle.wait_for(lambda: server.connections == 0, WAIT)
        assert server.stats.counts.get("connections_closed_unpaired") == 2
        mac[1].remove("gpu")  # and on the Mac: nothing more goes to gpu from a live source
        src2 = source_unconnected(server.port, PeerTLS(*mac))
        assert not src2.connect(wait_s=WAIT)
        src2.close()
    finally:
        src.close()
        other.close()
        server.close()


def test_the_decoder_drops_a_machine_it_unpaired(tmp_path, caplog):
    gpu, mac = machine(tmp_path, "gpu"), machine(tmp_path, "mac")
    pair(gpu, mac)
    server = PeerServer(FakeBackend(), fake_hello(), tls=PeerTLS(*gpu)).start()
    src = source(server.port, tls=PeerTLS(*mac))
    try:
        mac[1].remove("gpu")
        ended = load(src).wait_end(1)
        assert ended.failed == "disconnected" and "gpu is no longer paired with this machine" in caplog.text
    finally:
        src.close()
        server.close()


def source_unconnected(port: int, tls: PeerTLS) -> RemotePrefillSource:
    src = RemotePrefillSource("127.0.0.1", port, tls=tls, name="gpu")
    src.configure(fake_hello(), CHUNK)
    return src


def test_an_idle_connection_is_closed_and_the_decoder_reconnects_quietly():
    """After HELLO, a connection with nothing running is closed after idle_timeout_s (a decoder that
    vanished holds no slot); a live decoder reconnects at once, without a backoff or a failure."""
    server = PeerServer(FakeBackend(), fake_hello(), limits=ServerLimits(idle_timeout_s=0.5)).start()
    src = source(server.port)
    try:
        with server.idle:
            assert server.idle.wait_for(lambda: server.stats.counts.get("connections", 0) >= 2, WAIT)
        assert server.stats.counts.get("connections_idle_closed", 0) >= 1
        assert src.connect(wait_s=WAIT) and not src.failures  # reconnected: no failure, no backoff
    finally:
        src.close()
        server.close()


def test_a_connection_with_an_export_running_is_never_idle():
    gate = threading.Semaphore(0)
    server = PeerServer(FakeBackend(gate=gate), fake_hello(), limits=ServerLimits(idle_timeout_s=1.0)).start()
    src = source(server.port)
    try:
        sink = load(src, start=0)  # sent right after HELLO: well inside the idle timeout
        time.sleep(3.5)  # the export held past three idle timeouts
        for _ in range(8):
            gate.release()
        assert sink.wait_end(1).done
        assert server.stats.counts.get("connections_idle_closed", 0) == 0
    finally:
        src.close()
        server.close()
