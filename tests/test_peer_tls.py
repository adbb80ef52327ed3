"""Mutual TLS 1.3 with pinned certificates over real loopback sockets: paired peers connect and
exchange data; an unpaired client, an unpaired server, and a peer presenting another certificate
under a paired peer's name are refused with a clear message on both sides, before any application
byte."""

from __future__ import annotations

import socket
import ssl
import threading

import pytest

from peer.keys import PairedPeers, load_identity
from peer.tls import PeerAuthError, accept_tls, client_context, connect_tls, server_context

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
    from peer.tls import PeerTLS

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
