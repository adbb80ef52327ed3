"""Code pairing over real loopback sockets: the right code pairs both sides and stores each other's
certificate (0600), a wrong code is refused on both sides, an expired code and a spent attempt
budget refuse further attempts, the code never appears in the bytes on the wire, and keys are 0600."""

from __future__ import annotations

import socket
import stat
import threading
from pathlib import Path
from typing import cast

import pytest

from peer.trust.keys import PairedPeers, fingerprint, load_identity
from peer.trust.pairing import (
    PairingCode,
    PairingError,
    accept_pairing,
    join_pairing,
    parse_code,
    serve_pairing,
)

WAIT = 30.0


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Capture:
    """A socket wrapper recording every byte sent through it."""

    def __init__(self, sock: socket.socket, sink: bytearray):
        self._sock, self._sink = sock, sink

    def sendall(self, data: bytes) -> None:
        self._sink += bytes(data)
        self._sock.sendall(data)

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


def wrap(sock: socket.socket, wire: bytearray | None) -> socket.socket:
    return sock if wire is None else cast(socket.socket, Capture(sock, wire))


def side(tmp_path: Path, name: str):
    d = tmp_path / name
    return load_identity(d, name), PairedPeers(d)


def attempt(shower, joiner, pcode: PairingCode, typed: str, wire: bytearray | None = None):
    """One attempt over a loopback connection: (shower's result or error, joiner's result or error)."""
    (sid, speers), (jid, jpeers) = shower, joiner
    a, b = socket.socketpair()
    out: dict[str, object] = {}

    def run_shower() -> None:
        try:
            out["shower"] = accept_pairing(wrap(b, wire), pcode, sid, speers)
        except PairingError as e:
            out["shower"] = e

    t = threading.Thread(target=run_shower)
    t.start()
    try:
        out["joiner"] = join_pairing(wrap(a, wire), typed, jid, jpeers)
    except PairingError as e:
        out["joiner"] = e
    t.join(WAIT)
    assert not t.is_alive()
    a.close()
    b.close()
    return out["shower"], out["joiner"]


def test_right_code_pairs_both_sides_and_stores_fingerprints_0600(tmp_path):
    gpu, mac = side(tmp_path, "gpu"), side(tmp_path, "mac")
    pcode = PairingCode(clock=Clock())
    s, j = attempt(gpu, mac, pcode, pcode.code)
    assert s.name == "mac" and s.fingerprint == mac[0].fingerprint
    assert j.name == "gpu" and j.fingerprint == gpu[0].fingerprint
    assert gpu[1].by_fingerprint(mac[0].fingerprint).name == "mac"
    assert mac[1].by_fingerprint(gpu[0].fingerprint).name == "gpu"
    for d in ("gpu", "mac"):
        for f in ("peers.json", "peer-key.pem", "peer-cert.pem"):
            assert stat.S_IMODE((tmp_path / d / f).stat().st_mode) == 0o600, f
        assert stat.S_IMODE((tmp_path / d).stat().st_mode) == 0o700
    assert pcode.refusal() == "used"  # single use
    s2, j2 = attempt(gpu, side(tmp_path, "other"), pcode, pcode.code)
    assert s2.reason == "used" and j2.reason == "used" and "already used" in str(j2)


def test_wrong_code_refused_on_both_sides_and_nothing_stored(tmp_path):
    gpu, mac = side(tmp_path, "gpu"), side(tmp_path, "mac")
    pcode = PairingCode("1234-5678", clock=Clock())
    s, j = attempt(gpu, mac, pcode, "1234-5679")
    assert isinstance(s, PairingError) and s.reason == "wrong_code" and "wrong pairing code" in str(s)
    assert isinstance(j, PairingError) and j.reason == "wrong_code" and "wrong pairing code" in str(j)
    assert gpu[1].load() == {} and mac[1].load() == {}
    assert pcode.failures == 1
    s, j = attempt(gpu, mac, pcode, "1234-5678")  # a later right attempt still pairs
    assert s.name == "mac" and j.name == "gpu"


def test_expired_code_refused_on_both_sides(tmp_path):
    gpu, mac = side(tmp_path, "gpu"), side(tmp_path, "mac")
    clock = Clock()
    pcode = PairingCode(clock=clock)
    clock.t += 299.0
    assert pcode.refusal() is None
    clock.t += 1.0
    s, j = attempt(gpu, mac, pcode, pcode.code)
    assert s.reason == "expired" and j.reason == "expired" and "expired" in str(j)
    assert gpu[1].load() == {} and mac[1].load() == {}


def test_attempt_limit_then_refused_even_with_the_right_code(tmp_path):
    gpu, mac = side(tmp_path, "gpu"), side(tmp_path, "mac")
    pcode = PairingCode("1111-2222", clock=Clock())
    for i in range(3):
        s, j = attempt(gpu, mac, pcode, f"1111-222{3 + i}")
        assert s.reason == j.reason == "wrong_code"
    s, j = attempt(gpu, mac, pcode, "1111-2222")
    assert s.reason == j.reason == "too_many_attempts" and "too many" in str(j)
    assert gpu[1].load() == {} and mac[1].load() == {}


def test_code_never_on_the_wire(tmp_path):
    gpu, mac = side(tmp_path, "gpu"), side(tmp_path, "mac")
    pcode = PairingCode("8642-9753", clock=Clock())
    wire = bytearray()
    s, j = attempt(gpu, mac, pcode, "8642-9753", wire)
    assert s.name == "mac" and j.name == "gpu"
    assert len(wire) > 200  # the exchange went through the wrappers
    for needle in (b"8642-9753", b"86429753", b"8642", b"9753", (86429753).to_bytes(4, "big")):
        assert needle not in wire
    # the certificates travel sealed: neither side's certificate is readable on the wire
    assert gpu[0].cert_der not in wire and mac[0].cert_der not in wire
    assert b"BEGIN CERTIFICATE" not in wire and b"duet peer" not in wire


def test_serve_pairing_accepts_until_paired_and_ends_when_expired(tmp_path):
    gpu, mac = side(tmp_path, "gpu"), side(tmp_path, "mac")
    clock = Clock()
    pcode = PairingCode("5555-0000", clock=clock)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    failures: list[PairingError] = []
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["peer"] = serve_pairing(
                listener, pcode, *gpu, on_attempt_failed=failures.append, poll_s=0.05
            )
        except PairingError as e:
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    with socket.create_connection(("127.0.0.1", port)) as c, pytest.raises(PairingError):
        join_pairing(c, "5555-0001", *mac)
    with socket.create_connection(("127.0.0.1", port)) as c:
        assert join_pairing(c, "5555-0000", *mac).fingerprint == gpu[0].fingerprint
    t.join(WAIT)
    assert result["peer"].fingerprint == mac[0].fingerprint and [e.reason for e in failures] == ["wrong_code"]

    pcode2 = PairingCode(clock=clock)
    clock.t += 301.0
    with pytest.raises(PairingError) as e:
        serve_pairing(listener, pcode2, *gpu, poll_s=0.05)
    assert e.value.reason == "expired"
    listener.close()


def test_codes_and_identity(tmp_path):
    assert parse_code("12345678") == "1234-5678" and parse_code(" 1234-5678 ") == "1234-5678"
    for bad in ("1234-567", "abcd-efgh", "1234_5678", ""):
        with pytest.raises(PairingError):
            parse_code(bad)
    codes = {PairingCode().code for _ in range(50)}
    assert len(codes) > 45 and all(len(c) == 9 and c[4] == "-" for c in codes)
    ident = load_identity(tmp_path / "x", "box")
    again = load_identity(tmp_path / "x")
    assert again.cert_der == ident.cert_der and again.name == "box"  # made once, then reused
    assert ident.fingerprint == fingerprint(ident.cert_der) and len(ident.short_id) == 16
    peers = PairedPeers(tmp_path / "x")
    peers.add("mac", load_identity(tmp_path / "y", "mac").cert_pem)
    assert list(peers.load()) == ["mac"]
    peers.remove("mac")
    assert peers.load() == {}


def test_processes_starting_at_once_make_one_matching_key_pair(tmp_path):
    import subprocess
    import sys

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    root = Path(__file__).resolve().parent.parent
    script = "import sys; from pathlib import Path; from peer.trust.keys import load_identity; print(load_identity(Path(sys.argv[1])).fingerprint)"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path / "c")], cwd=root, stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    fps = {p.communicate(timeout=WAIT)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(fps) == 1
    ident = load_identity(tmp_path / "c")
    assert fps == {ident.fingerprint}
    key = serialization.load_pem_private_key(ident.key_path.read_bytes(), None)
    cert = x509.load_der_x509_certificate(ident.cert_der)
    raw = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    assert key.public_key().public_bytes(*raw) == cert.public_key().public_bytes(*raw)
