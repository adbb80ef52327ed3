"""Mutual TLS 1.3 with pinned certificates over real loopback sockets: paired peers connect and
exchange data; an unpaired client, an unpaired server, and a peer presenting another certificate
under a paired peer's name are refused with a clear message on both sides, before any application
byte."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading

import pytest

from peer.trust.keys import PairedPeers, load_identity
from peer.trust.tls import PeerAuthError, accept_tls, client_context, connect_tls, server_context

WAIT = 30.0


def machine(tmp_path, name, dirname=None):
    d = tmp_path / (dirname or name)
    return load_identity(d, name), PairedPeers(d)


def pair(x, y):
    x[1].add(y[0].name, y[0].cert_pem)
    y[1].add(x[0].name, x[0].cert_pem)


def connect(server, client, payload=b"prompt token ids"):
    """Server and client over a loopback TCP connection: (server outcome, client outcome); the
    server's outcome is what it received after the handshake, or the refusal."""
    listener = socket.create_server(("127.0.0.1", 0))
    out: dict[str, object] = {}

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            tls, peer = accept_tls(conn, server_context(*server), server[1])
        except PeerAuthError as e:
            out["server"] = e
            return
        with tls:
            assert tls.version() == "TLSv1.3"
            data = b""
            while len(data) < len(payload):
                chunk = tls.recv(1024)
                if not chunk:
                    break
                data += chunk
            out["server"] = (peer.name, data)
            tls.sendall(b"kv")

    t = threading.Thread(target=serve)
    t.start()
    sock = socket.create_connection(listener.getsockname())
    try:
        tls, peer = connect_tls(sock, client_context(*client), client[1], who="gpu")
    except PeerAuthError as e:
        out["client"] = e
    else:
        with tls:
            tls.sendall(payload)
            out["client"] = (peer.name, tls.recv(2))
    t.join(WAIT)
    assert not t.is_alive()
    listener.close()
    return out["server"], out["client"]


def test_paired_peers_connect_over_tls13(tmp_path):
    gpu, mac = machine(tmp_path, "gpu"), machine(tmp_path, "mac")
    pair(gpu, mac)
    s, c = connect(gpu, mac)
    assert s == ("mac", b"prompt token ids")
    assert c == ("gpu", b"kv")


def test_unpaired_client_refused_on_both_sides_before_any_data(tmp_path):
    gpu, mac, stranger = machine(tmp_path, "gpu"), machine(tmp_path, "mac"), machine(tmp_path, "stranger")
    pair(gpu, mac)
    stranger[1].add("gpu", gpu[0].cert_pem)  # it knows the server's certificate; the server not its
    s, c = connect(gpu, stranger)
    assert isinstance(s, PeerAuthError) and "not one this machine has paired with" in str(s)
    assert isinstance(c, PeerAuthError) and "gpu refused this machine" in str(c)


def test_unpaired_server_refused_by_the_client(tmp_path):
    gpu, mac, impostor = machine(tmp_path, "gpu"), machine(tmp_path, "mac"), machine(tmp_path, "impostor")
    pair(gpu, mac)
    impostor[1].add("mac", mac[0].cert_pem)  # it would accept the Mac; the Mac does not know it
    s, c = connect(impostor, mac)
    assert isinstance(c, PeerAuthError) and "refused gpu" in str(c) and "not one this machine" in str(c)
    assert isinstance(s, PeerAuthError) and "refused this machine" in str(s)


def test_another_certificate_under_a_paired_name_is_refused(tmp_path):
    gpu, mac = machine(tmp_path, "gpu"), machine(tmp_path, "mac")
    pair(gpu, mac)
    fake_gpu = machine(tmp_path, "gpu", "fake-gpu")  # same name and subject, another key
    fake_gpu[1].add("mac", mac[0].cert_pem)
    assert fake_gpu[0].fingerprint != gpu[0].fingerprint
    s, c = connect(fake_gpu, mac)
    assert isinstance(c, PeerAuthError) and isinstance(s, PeerAuthError)
    fake_mac = machine(tmp_path, "mac", "fake-mac")
    fake_mac[1].add("gpu", gpu[0].cert_pem)
    s, c = connect(gpu, fake_mac)
    assert isinstance(s, PeerAuthError) and "refused a client" in str(s)
    assert isinstance(c, PeerAuthError) and "refused this machine" in str(c)


def test_unpaired_after_unpair_and_no_peers(tmp_path):
    gpu, mac = machine(tmp_path, "gpu"), machine(tmp_path, "mac")
    pair(gpu, mac)
    gpu[1].remove("mac")
    with pytest.raises(PeerAuthError, match="no paired peers"):
        server_context(*gpu)
    ctx = client_context(*mac)
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3 and ctx.verify_mode == ssl.CERT_REQUIRED


def test_peer_tls_rereads_the_paired_set_per_connection(tmp_path):
    from peer.trust.tls import PeerTLS

    gpu, mac, other = machine(tmp_path, "gpu"), machine(tmp_path, "mac"), machine(tmp_path, "other")
    pair(gpu, mac)
    pair(gpu, other)  # the server keeps one paired peer after the Mac is unpaired
    server, client = PeerTLS.load(tmp_path / "gpu"), PeerTLS.load(tmp_path / "mac")
    assert server.identity.fingerprint == gpu[0].fingerprint

    def once():
        a, b = socket.socketpair()
        out: dict[str, object] = {}

        def srv() -> None:
            try:
                out["s"] = server.wrap_server(b)[1].name
            except PeerAuthError as e:
                out["s"] = e

        t = threading.Thread(target=srv)
        t.start()
        try:
            out["c"] = client.wrap_client(a, "gpu")[1].name
        except PeerAuthError as e:
            out["c"] = e
        t.join(WAIT)
        a.close()
        b.close()
        return out["s"], out["c"]

    assert once() == ("mac", "gpu")
    gpu[1].remove("mac")
    s, c = once()
    assert isinstance(s, PeerAuthError) and isinstance(c, PeerAuthError)


# --- the prefill connection over TLS (peer/server.py, peer/client.py) ---------------------------
N = 100
CHUNK = 32
TOKENS = [(7 * i + 3) % 397 + 100_000 for i in range(N)]


class Tap:
    """A TCP proxy between the decoder and the peer recording every byte in both directions."""

    def __init__(self, upstream_port: int, corrupt_at: int | None = None):
        self.corrupt_at = corrupt_at  # flip one bit of the peer's stream at this byte offset
        self.from_peer = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.upstream = upstream_port
        self.seen = bytearray()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream))
            for a, b, from_peer in ((down, up, False), (up, down, True)):
                threading.Thread(target=self._pump, args=(a, b, from_peer), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_peer: bool) -> None:
        try:
            while data := src.recv(65536):
                with self.lock:
                    self.seen += data
                    at = self.corrupt_at
                    if from_peer and at is not None and self.from_peer <= at < self.from_peer + len(data):
                        flipped = bytearray(data)
                        flipped[at - self.from_peer] ^= 0x01
                        data = bytes(flipped)
                    if from_peer:
                        self.from_peer += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


def _prefill_over(tmp_path, server_tls, client_tls, corrupt_at=None):
    from peer.client import RemotePrefillSource
    from peer.server import PeerServer
    from tests.peer_fakes import FakeBackend, KVLoad, RecordingSink, fake_hello

    backend = FakeBackend()
    server = PeerServer(backend, fake_hello(), "127.0.0.1", 0, tls=server_tls).start()
    tap = Tap(server.port, corrupt_at)
    src = RemotePrefillSource("127.0.0.1", tap.port, tls=client_tls, name="gpu")
    src.configure(fake_hello(), CHUNK)
    try:
        ok = src.connect(wait_s=WAIT)
        sink = RecordingSink(N)
        if ok:
            src.start_load(KVLoad(1, "req-1", list(TOKENS), 0, N - 1), sink)
            sink.wait_end(1)
        return ok, backend, server, src, sink, bytes(tap.seen)
    finally:
        src.close()
        server.close()
        tap.close()


def _token_bytes() -> bytes:
    import numpy as np

    return np.asarray(TOKENS[:8], "<u4").tobytes()


def _kv_bytes() -> bytes:
    from tests.peer_fakes import expected_kv

    return expected_kv(TOKENS, 0, 0, 4)[0].tobytes()[:64]


def test_prefill_stream_over_pinned_tls_lands_exactly_and_nothing_is_plaintext(tmp_path):
    import numpy as np

    from peer.trust.tls import PeerTLS
    from tests.peer_fakes import LAYERS, expected_kv

    gpu, mac = machine(tmp_path, "gpu"), machine(tmp_path, "mac")
    pair(gpu, mac)
    ok, backend, server, src, sink, wire = _prefill_over(tmp_path, PeerTLS(*gpu), PeerTLS(*mac))
    assert ok and sink.loads[1].done and src.remote_prefills == 1
    for layer in range(LAYERS):
        for got, want in zip(sink.loads[1].kv[layer], expected_kv(TOKENS, layer, 0, N - 1), strict=True):
            np.testing.assert_array_equal(got[: N - 1], want)
    assert len(wire) > LAYERS * (N - 1) * 64  # the KV went through the tap
    assert _token_bytes() not in wire and _kv_bytes() not in wire and b"prefill" not in wire
    # the same tap sees them in plaintext without TLS: the check above can fail
    ok, *_, plain = _prefill_over(tmp_path, None, None)
    assert ok and _token_bytes() in plain and _kv_bytes() in plain


def test_unpaired_decoder_gets_nothing_and_the_peer_computes_nothing(tmp_path, caplog):
    from peer.trust.tls import PeerTLS

    gpu, mac, stranger = machine(tmp_path, "gpu"), machine(tmp_path, "mac"), machine(tmp_path, "stranger")
    pair(gpu, mac)
    stranger[1].add("gpu", gpu[0].cert_pem)
    ok, backend, server, src, sink, wire = _prefill_over(tmp_path, PeerTLS(*gpu), PeerTLS(*stranger))
    assert not ok and backend.started == [] and server.stats.counts.get("connections", 0) == 0
    assert src.last_error is not None and "gpu refused this machine" in src.last_error[1]
    assert _token_bytes() not in wire and b"hello" not in wire


def test_loopback_stays_plain_and_a_network_address_needs_pairing(tmp_path):
    from mlx_engine.errors import ConfigError
    from peer.trust.tls import PeerTLS, tls_for_address

    d = tmp_path / "mac"
    for host in ("127.0.0.1", "::1", "localhost", "[::1]"):
        assert tls_for_address(host, directory=d) is None
    with pytest.raises(ConfigError, match="--peers 192.0.2.7 is not a loopback address.*paired first"):
        tls_for_address("192.0.2.7", "--peers", directory=d)
    assert not d.exists()  # refusing made nothing on disk
    gpu, mac = machine(tmp_path, "gpu"), machine(tmp_path, "mac")
    pair(gpu, mac)
    tls = tls_for_address("192.0.2.7", "--peers", directory=d)
    assert isinstance(tls, PeerTLS) and tls.identity.fingerprint == mac[0].fingerprint


def test_a_corrupted_tls_record_fails_the_load_and_keeps_what_landed(tmp_path):
    """A proxy flipping one bit of the peer's stream: the TLS record MAC catches it, the load
    ends failed (the decoder prefills the rest locally), and no corrupted KV is written."""
    import numpy as np

    from peer.trust.tls import PeerTLS
    from tests.peer_fakes import LAYERS, expected_kv

    gpu, mac = machine(tmp_path, "gpu"), machine(tmp_path, "mac")
    pair(gpu, mac)
    ok, backend, server, src, sink, wire = _prefill_over(
        tmp_path, PeerTLS(*gpu), PeerTLS(*mac), corrupt_at=12000
    )
    load = sink.loads[1]
    assert ok and not load.done and load.failed is not None and src.remote_prefills == 0
    assert 0 < load.frames < LAYERS * -(-(N - 1) // CHUNK)
    for layer, end in load.landed.items():  # every frame that landed is exact
        for got, want in zip(load.kv[layer], expected_kv(TOKENS, layer, 0, end), strict=True):
            np.testing.assert_array_equal(got[:end], want)
