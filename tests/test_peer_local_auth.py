"""Issue 30, findings 2-4: a loopback peer authenticates both ways with this user's local peer secret,
the TLS-or-local choice is made per connection from the address reached, and a decoder is pinned
to the machine it means (the one an mDNS advert claims to be, or the one it first reached).

Each test fails on c174304: there a loopback link was plain TCP (any local user could connect, fill
the slots or squat the port and receive prompts), a name was judged loopback once, discovered
loopback addresses were used as they came, and any paired certificate passed for any machine."""

from __future__ import annotations

import socket
import threading

import pytest

from peer.client import RemotePrefillSource
from peer.connection import PeerTimeouts
from peer.discovery import DiscoveredPeer
from peer.server import PeerServer, ServerLimits
from peer.trust.link_security import PeerSecurity, security_for
from peer.trust.local_auth import SECRET_FILE, LocalAuth
from peer.trust.tls import PeerAuthError, PeerTLS
from tests.peer_fakes import FakeBackend, KVLoad, RecordingSink, fake_hello
from tests.test_peer_tls import machine, pair

WAIT = 30.0
N, CHUNK = 48, 16
TOKENS = [(3 * i + 11) % 397 for i in range(N)]


def prefill(port: int, security: PeerSecurity, name: str = "gpu") -> tuple[bool, RemotePrefillSource]:
    src = RemotePrefillSource(
        "127.0.0.1", port, security=security, name=name, timeouts=PeerTimeouts(hello_s=5)
    )
    src.configure(fake_hello(), CHUNK)
    try:
        if not src.connect(wait_s=WAIT):
            return False, src
        sink = RecordingSink(N)
        src.start_load(KVLoad(1, "req-1", list(TOKENS), 0, N - 1), sink)
        return sink.wait_end(1).done, src
    finally:
        src.close()


class Listener:
    """A plain TCP listener on loopback that records what one connection sends (``answer``: what it
    says back to the first bytes)."""

    def __init__(self, answer=None):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.got = bytearray()
        self.answer = answer
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.settimeout(5)
            try:
                while chunk := conn.recv(4096):
                    if self.answer is not None and not self.got:
                        conn.sendall(self.answer(chunk))
                    self.got.extend(chunk)
            except OSError:
                pass

    def close(self) -> bytes:
        self.thread.join(WAIT)
        self.sock.close()
        return bytes(self.got)


def local(tmp_path, who: str) -> PeerSecurity:
    return PeerSecurity(local=LocalAuth.load(tmp_path / who))


def test_a_loopback_peer_serves_processes_holding_the_users_secret_only(tmp_path):
    backend = FakeBackend()
    server = PeerServer(backend, fake_hello(), security=local(tmp_path, "me")).start()
    try:
        ok, _ = prefill(server.port, local(tmp_path, "me"))
        assert ok and backend.started  # the same user's decoder: served
        started = len(backend.started)
        ok, src = prefill(server.port, local(tmp_path, "another-user"))
        assert not ok and len(backend.started) == started  # no HELLO, no prompt reached the peer
        assert src.last_error is not None and "local peer secret" in src.last_error[1]
        # a client without the secret that goes on after the server's proof: refused by the server
        raw = socket.create_connection(("127.0.0.1", server.port))
        raw.settimeout(WAIT)
        raw.sendall(b"DUETLOCL\x01" + b"\x07" * 32)
        assert len(raw.recv(8 + 1 + 32 + 32, socket.MSG_WAITALL)) == 73
        raw.sendall(b"\x00" * 32)  # a forged proof
        assert raw.recv(1) == b""  # closed, no ACCEPTED
        raw.close()
        with server.idle:
            assert server.idle.wait_for(lambda: server.stats.counts.get("connections_unpaired", 0) == 1, WAIT)
        assert server.stats.counts.get("connections", 0) == 1  # only the first decoder got a slot
    finally:
        server.close()
    secret = tmp_path / "me" / SECRET_FILE
    assert secret.stat().st_mode & 0o777 == 0o600 and (tmp_path / "me").stat().st_mode & 0o777 == 0o700


def test_a_listener_squatting_the_port_gets_no_prompt(tmp_path):
    """Another local user binds the peer's port while it is down: the decoder sends only its
    authentication header (magic, version, a random nonce) and refuses what comes back."""
    squatter = Listener(lambda head: head[:9] + b"\0" * 64)  # echoes the header, forges nonce and proof
    ok, src = prefill(squatter.port, local(tmp_path, "me"))
    got = squatter.close()
    assert (
        not ok
        and src.last_error is not None
        and "does not hold this user's local peer secret" in src.last_error[1]
    )
    assert len(got) == 8 + 1 + 32  # DUETLOCL, the version, the nonce: nothing of the model or prompt
    assert bytes(TOKENS[:4]) not in got and b"hello" not in got.lower()


def test_idle_local_connections_cannot_lock_the_real_decoder_out(tmp_path):
    """A local user opens more connections than the peer has slots and says nothing: they wait in
    the capped, deadlined authentication step, never in a decoder's slot."""
    limits = ServerLimits(
        max_connections=2, max_handshakes=4, max_handshakes_per_address=4, handshake_deadline_s=1.0
    )
    server = PeerServer(FakeBackend(), fake_hello(), security=local(tmp_path, "me"), limits=limits).start()
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(6)]
    try:
        with server.idle:  # past the cap at once, or shut at the deadline
            assert server.idle.wait_for(
                lambda: (
                    server.stats.counts.get("handshakes_refused", 0)
                    + server.stats.counts.get("handshakes_failed", 0)
                    >= 6
                ),
                WAIT,
            )
        assert server.connections == 0
        assert prefill(server.port, local(tmp_path, "me"))[0]
    finally:
        for s in idle:
            s.close()
        server.close()


def test_the_choice_is_made_per_connection_from_the_address_reached(tmp_path, monkeypatch):
    """A name that was loopback when the decoder started now reaches a network address: the
    decoder needs TLS there (it has none: refused, nothing sent), not the plain or local link."""
    import peer.connection as connection

    listener = Listener()
    real = socket.create_connection

    class Elsewhere(socket.socket):
        def getpeername(self):  # what the kernel would say had the name resolved to 192.0.2.7
            return ("192.0.2.7", super().getpeername()[1])

    def create_connection(address, timeout=None):
        s = real(address, timeout=timeout)
        return Elsewhere(fileno=s.detach())

    monkeypatch.setattr(connection.socket, "create_connection", create_connection)
    ok, src = prefill(listener.port, local(tmp_path, "me"))
    assert (
        not ok and src.last_error is not None and "never runs plain TCP over a network" in src.last_error[1]
    )
    assert listener.close() == b""
    with pytest.raises(PeerAuthError, match="network address"):  # the server side decides the same way
        local(tmp_path, "me").guard_for("192.0.2.7")
    assert local(tmp_path, "me").guard_for("127.0.0.1") is not None
    assert local(tmp_path, "me").guard_for(None) is not None  # a Unix-domain socket is local


def test_discovery_never_connects_to_a_loopback_address():
    forged = DiscoveredPeer("gpu", ["127.0.0.1", "::1", "0.0.0.0", "224.0.0.251"], 7611, {"id": "abcd"})
    assert forged.best_address() is None
    mixed = DiscoveredPeer("gpu", ["127.0.0.1", "192.168.1.20"], 7611, {"id": "abcd"})
    assert mixed.best_address() == "192.168.1.20"


def test_a_decoder_is_pinned_to_the_machine_it_means(tmp_path):
    """Two machines paired with the Mac: one answering where the other was reached (or was
    advertised) is refused, although its certificate is a paired one."""
    gpu, other, mac = machine(tmp_path, "gpu"), machine(tmp_path, "other"), machine(tmp_path, "mac")
    pair(gpu, mac)
    pair(other, mac)
    mac_tls = PeerTLS(*mac)
    server = PeerServer(FakeBackend(), fake_hello(), tls=PeerTLS(*other)).start()
    try:  # the advert claimed gpu's id; other's listener answers
        ok, src = prefill(server.port, PeerSecurity(tls=mac_tls, expect=gpu[0].fingerprint))
        assert (
            not ok
            and src.last_error is not None
            and "presented the certificate of paired machine other" in src.last_error[1]
        )
    finally:
        server.close()
    gpu_server = PeerServer(FakeBackend(), fake_hello(), tls=PeerTLS(*gpu)).start()
    security = PeerSecurity(tls=mac_tls)
    ok, _ = prefill(gpu_server.port, security)
    port = gpu_server.port
    gpu_server.close()
    assert ok and security.expect == gpu[0].fingerprint  # pinned to the machine first reached
    impostor = PeerServer(FakeBackend(), fake_hello(), "127.0.0.1", port, tls=PeerTLS(*other)).start()
    try:
        ok, src = prefill(port, security)
        assert (
            not ok
            and src.last_error is not None
            and "not that of the machine it was reached as" in src.last_error[1]
        )
    finally:
        impostor.close()


def test_the_command_line_gives_loopback_the_local_secret(tmp_path):
    d = tmp_path / "cfg"
    s = security_for("127.0.0.1", "--peers", directory=d)
    assert s.tls is None and s.local is not None  # unpaired: loopback only, authenticated
    gpu, mac = machine(tmp_path, "gpu"), machine(tmp_path, "cfg")
    pair(gpu, mac)
    s = security_for("localhost", "--peers", directory=d)
    assert s.tls is not None and s.local is not None  # paired: TLS ready should the name move


def test_processes_starting_at_once_agree_on_one_secret(tmp_path):
    """A peer and its decoder started together for the first time must not each make their own."""
    from concurrent.futures import ThreadPoolExecutor

    from peer.trust.local_auth import load_secret

    with ThreadPoolExecutor(8) as pool:
        secrets = set(pool.map(lambda _: load_secret(tmp_path / "fresh"), range(32)))
    assert len(secrets) == 1 and [p.name for p in (tmp_path / "fresh").iterdir()] == [SECRET_FILE]
