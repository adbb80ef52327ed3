"""A prefill peer's accept loop under pressure (issue 30, finding 1): running out of descriptors,
connections reset while they queue, and a flood of unauthenticated TLS connections slow the peer
down but never stop it; a paired decoder still gets its prefill afterwards."""

from __future__ import annotations

import contextlib
import errno
import socket

from peer.client import RemotePrefillSource
from peer.server import PeerServer, ServerLimits, listen
from peer.trust.tls import PeerTLS
from tests.peer_fakes import FakeBackend, KVLoad, RecordingSink, fake_hello
from tests.test_peer_tls import machine, pair

WAIT = 30.0
N, CHUNK = 64, 16
TOKENS = [(5 * i + 7) % 397 for i in range(N)]


class FlakyListener:
    """A listening socket whose first accepts fail as an exhausted or reset one does."""

    def __init__(self, sock: socket.socket, errors: list[int]):
        self.sock, self.errors = sock, list(errors)

    def accept(self):
        if self.errors:
            code = self.errors.pop(0)
            raise OSError(code, errno.errorcode[code])
        return self.sock.accept()

    def __getattr__(self, name):
        return getattr(self.sock, name)


def prefill(server: PeerServer, tls: PeerTLS | None = None) -> bool:
    src = RemotePrefillSource("127.0.0.1", server.port, tls=tls, name="gpu")
    src.configure(fake_hello(), CHUNK)
    try:
        if not src.connect(wait_s=WAIT):
            return False
        sink = RecordingSink(N)
        src.start_load(KVLoad(1, "req-1", list(TOKENS), 0, N - 1), sink)
        return sink.wait_end(1).done
    finally:
        src.close()


def test_the_accept_loop_survives_descriptor_exhaustion_and_resets():
    errors = [errno.EMFILE, errno.ENFILE, errno.ECONNABORTED, errno.EMFILE]
    sock = FlakyListener(listen("127.0.0.1", 0), errors)
    server = PeerServer(FakeBackend(), fake_hello(), "127.0.0.1", 0, sock=sock).start()  # type: ignore[arg-type]
    try:
        assert prefill(server)  # the first connection waited out every failing accept
        assert not sock.errors and server.stats.counts.get("accept_errors") == 4
        assert server._thread is not None and server._thread.is_alive()
    finally:
        server.close()


def test_a_flood_of_unauthenticated_connections_is_capped_and_timed_out(tmp_path):
    gpu, mac = machine(tmp_path, "gpu"), machine(tmp_path, "mac")
    pair(gpu, mac)
    limits = ServerLimits(max_handshakes=8, max_handshakes_per_address=3, handshake_deadline_s=0.5)
    server = PeerServer(FakeBackend(), fake_hello(), "127.0.0.1", 0, tls=PeerTLS(*gpu), limits=limits).start()
    idle = []
    try:
        for _ in range(10):  # TCP connections that never start a TLS handshake
            idle.append(socket.create_connection(("127.0.0.1", server.port)))
        with server.idle:
            assert server.idle.wait_for(lambda: server.stats.counts.get("handshakes_refused", 0) >= 7, WAIT)
        for s in idle:  # refused at once, or shut when the handshake deadline passed
            s.settimeout(WAIT)
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(1) == b""
        with server.idle:
            assert server.idle.wait_for(lambda: server.stats.counts.get("handshakes_failed", 0) >= 3, WAIT)
        assert prefill(server, PeerTLS(*mac))  # the paired decoder still gets its prefill
    finally:
        for s in idle:
            s.close()
        server.close()


def test_a_bug_in_one_connection_ends_that_connection_only(caplog):
    from peer.export_connection import Connection

    class Broken(Connection):
        def _handle(self, frame):
            if not getattr(self.server, "broke", False):
                self.server.broke = True  # type: ignore[attr-defined]
                raise RuntimeError("a bug in the frame handler")
            super()._handle(frame)

    server = PeerServer(FakeBackend(), fake_hello(), connection_class=Broken).start()
    try:
        assert not prefill(server)  # the first connection hits the bug: the decoder is told
        with server.idle:
            assert server.idle.wait_for(lambda: server.connections == 0, WAIT)
        assert server.stats.counts.get("connection_errors") == 1
        assert caplog.text.count("a bug in the frame handler") >= 1
        assert prefill(server)  # and the server serves the next one
    finally:
        server.close()
