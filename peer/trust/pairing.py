"""Pairing two machines with a one-time code: ``duet peer pair`` (the GPU box, which shows the
code) and ``duet peer pair --code NNNN-NNNN HOST[:PORT]`` (the Mac, which types it).

The code never crosses the wire. Both sides run SPAKE2 (``spake2``: the joiner is side A, the box
showing the code side B) with the code's 8 digits as the password, which gives both the same key
only when both used the same code; an eavesdropper learns nothing, and an active attacker gets one
guess per attempt. SPAKE2 has no key confirmation, so each side proves it holds the key:

    joiner -> shower : HELLO  {spake: A's message}
    shower -> joiner : REPLY  {spake: B's message, confirm: HMAC(k_confirm_B, transcript)}
    joiner -> shower : PROVE  {confirm: HMAC(k_confirm_A, transcript), sealed: AEAD(joiner's name + cert)}
    shower -> joiner : PAIRED {sealed: AEAD(shower's name + cert)}

``transcript`` = SHA-256 over a label and both SPAKE2 messages; the confirmation and sealing keys
come from the SPAKE2 key with HKDF-SHA256 (distinct labels per key and direction); confirmations are
compared with ``hmac.compare_digest``; the certificates travel sealed with ChaCha20-Poly1305 (the
transcript as associated data), so they are both secret and bound to this exchange. A side that
finds a wrong confirmation sends REFUSED and raises ``PairingError``; the other side reports the same.

The shower's code is single use, expires after ``CODE_TTL_S`` (5 minutes) and allows
``MAX_ATTEMPTS`` (3) failed attempts; it takes one joiner at a time. Frames: u32 big-endian length
then a msgpack map, at most ``MAX_MESSAGE`` bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from spake2 import SPAKE2_A, SPAKE2_B
from spake2.spake2 import SPAKEError

from mlx_engine.errors import DuetError
from peer.ports import PAIR_PORT
from peer.trust.keys import Identity, PairedPeer, PairedPeers

CODE_TTL_S = 300.0
MAX_ATTEMPTS = 3
MAX_MESSAGE = 64 << 10
IO_TIMEOUT_S = 30.0
VERSION = 1
ID_JOINER = b"duet-pair-joiner"
ID_SHOWER = b"duet-pair-shower"
_CODE_RE = re.compile(r"^(\d{4})-?(\d{4})$")
_NONCE_JOINER = b"\x00" * 11 + b"\x01"
_NONCE_SHOWER = b"\x00" * 11 + b"\x02"


class PairingError(DuetError):
    """Pairing failed; ``reason`` is one of: wrong_code, expired, too_many_attempts, used, protocol,
    disconnected, timeout."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


MESSAGES = {
    "wrong_code": "wrong pairing code",
    "expired": "the pairing code has expired (run `duet peer pair` again for a new one)",
    "too_many_attempts": "too many wrong attempts: the pairing code is no longer valid "
    "(run `duet peer pair` again for a new one)",
    "used": "the pairing code was already used (run `duet peer pair` again for a new one)",
}


def new_code() -> str:
    n = secrets.randbelow(10**8)
    return f"{n // 10**4:04d}-{n % 10**4:04d}"


def parse_code(text: str) -> str:
    """``NNNN-NNNN`` (or 8 digits) -> the canonical ``NNNN-NNNN``; ``PairingError`` otherwise."""
    m = _CODE_RE.match(text.strip())
    if not m:
        raise PairingError("protocol", f"pairing code {text!r} is not NNNN-NNNN (8 digits)")
    return f"{m.group(1)}-{m.group(2)}"


# --- frames ------------------------------------------------------------------------------------
def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    body = msgpack.packb(msg, use_bin_type=True)
    sock.sendall(struct.pack(">I", len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            raise PairingError("timeout", "the other side stopped answering during pairing") from None
        except OSError as e:
            raise PairingError("disconnected", f"pairing connection failed: {e}") from None
        if not chunk:
            raise PairingError("disconnected", "the other side closed the pairing connection")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket, expect: str) -> dict[str, Any]:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if not 0 < n <= MAX_MESSAGE:
        raise PairingError("protocol", f"pairing message of {n} bytes (at most {MAX_MESSAGE})")
    try:
        msg = msgpack.unpackb(_recv_exact(sock, n), raw=False)
    except ValueError as e:
        raise PairingError("protocol", f"unreadable pairing message: {e}") from None
    if not isinstance(msg, dict):
        raise PairingError("protocol", "pairing message is not a map")
    kind = msg.get("type")
    if kind == "refused":
        reason = str(msg.get("reason", "protocol"))
        raise PairingError(reason, f"pairing refused by the other side: {MESSAGES.get(reason, reason)}")
    if kind != expect:
        raise PairingError("protocol", f"expected a {expect!r} pairing message, got {kind!r}")
    return msg


def _field(msg: dict[str, Any], key: str, kind: type) -> Any:
    v = msg.get(key)
    if not isinstance(v, kind):
        raise PairingError("protocol", f"pairing message field {key!r} is missing or not {kind.__name__}")
    return v


def _refuse(sock: socket.socket, reason: str) -> None:
    try:
        _send(sock, {"type": "refused", "reason": reason})
    except OSError:
        pass


# --- keys --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Keys:
    transcript: bytes
    confirm_joiner: bytes
    confirm_shower: bytes
    seal: bytes

    def mac(self, key: bytes) -> bytes:
        return hmac.new(key, self.transcript, hashlib.sha256).digest()

    def seal_msg(self, nonce: bytes, obj: dict[str, Any]) -> bytes:
        return ChaCha20Poly1305(self.seal).encrypt(nonce, msgpack.packb(obj), self.transcript)

    def open_msg(self, nonce: bytes, data: bytes) -> dict[str, Any]:
        try:
            obj = msgpack.unpackb(
                ChaCha20Poly1305(self.seal).decrypt(nonce, data, self.transcript), raw=False
            )
        except Exception:  # InvalidTag or a malformed body: either way not from the key holder
            raise PairingError("protocol", "the peer's sealed certificate failed authentication") from None
        if not (
            isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("cert"), str)
        ):
            raise PairingError("protocol", "the peer's sealed identity is malformed")
        return obj


def _derive(key: bytes, msg_a: bytes, msg_b: bytes) -> _Keys:
    h = hashlib.sha256(b"duet pairing v1\0")
    for part in (ID_JOINER, ID_SHOWER, msg_a, msg_b):
        h.update(struct.pack(">I", len(part)) + part)
    transcript = h.digest()

    def hkdf(label: bytes) -> bytes:
        return HKDF(hashes.SHA256(), 32, salt=transcript, info=b"duet pairing " + label).derive(key)

    return _Keys(transcript, hkdf(b"confirm joiner"), hkdf(b"confirm shower"), hkdf(b"seal"))


def _password(code: str) -> bytes:
    return parse_code(code).replace("-", "").encode()


def _identity_msg(identity: Identity) -> dict[str, Any]:
    return {"name": identity.name, "cert": identity.cert_pem}


# --- the side that shows the code (the GPU box) ------------------------------------------------
@dataclass
class PairingCode:
    """A code's state: single use, expires ``ttl_s`` after it was made (by ``clock``), at most
    ``max_attempts`` failed attempts."""

    code: str = field(default_factory=new_code)
    clock: Callable[[], float] = time.monotonic
    ttl_s: float = CODE_TTL_S
    max_attempts: int = MAX_ATTEMPTS
    created: float = 0.0
    failures: int = 0
    used: bool = False

    def __post_init__(self) -> None:
        self.code = parse_code(self.code)
        self.created = self.clock()

    def refusal(self) -> str | None:
        """Why the code takes no attempt now, or None while it does."""
        if self.used:
            return "used"
        if self.failures >= self.max_attempts:
            return "too_many_attempts"
        if self.clock() - self.created >= self.ttl_s:
            return "expired"
        return None

    def remaining_s(self) -> float:
        return max(0.0, self.ttl_s - (self.clock() - self.created))


def accept_pairing(
    sock: socket.socket, code: PairingCode, identity: Identity, peers: PairedPeers
) -> PairedPeer:
    """Run the shower's side of one attempt on a connected socket. Returns the peer paired with
    (stored in ``peers``); raises ``PairingError`` (the attempt is counted unless the code was
    already unusable)."""
    sock.settimeout(IO_TIMEOUT_S)
    hello = _recv(sock, "hello")
    gone = code.refusal()
    if gone is not None:
        _refuse(sock, gone)
        raise PairingError(gone, f"refused a pairing attempt: {MESSAGES[gone]}")
    try:
        if hello.get("version") != VERSION:
            _refuse(sock, "protocol")
            raise PairingError("protocol", f"pairing version {hello.get('version')!r} is not {VERSION}")
        msg_a = _field(hello, "spake", bytes)
        b = SPAKE2_B(_password(code.code), idA=ID_JOINER, idB=ID_SHOWER)
        msg_b = b.start()
        try:
            key = b.finish(msg_a)
        except SPAKEError as e:
            _refuse(sock, "protocol")
            raise PairingError("protocol", f"bad SPAKE2 message: {e}") from None
        keys = _derive(key, msg_a, msg_b)
        _send(sock, {"type": "reply", "spake": msg_b, "confirm": keys.mac(keys.confirm_shower)})
        prove = _recv(sock, "prove")
        if not hmac.compare_digest(_field(prove, "confirm", bytes), keys.mac(keys.confirm_joiner)):
            _refuse(sock, "wrong_code")
            raise PairingError("wrong_code", "refused a pairing attempt: wrong pairing code")
        joiner = keys.open_msg(_NONCE_JOINER, _field(prove, "sealed", bytes))
        code.used = True
        paired = peers.add(joiner["name"], joiner["cert"])
        _send(sock, {"type": "paired", "sealed": keys.seal_msg(_NONCE_SHOWER, _identity_msg(identity))})
        return paired
    except PairingError:
        if not code.used:
            code.failures += 1
        raise
    except OSError as e:
        if not code.used:
            code.failures += 1
        raise PairingError("disconnected", f"pairing connection failed: {e}") from None


def serve_pairing(
    listener: socket.socket,
    code: PairingCode,
    identity: Identity,
    peers: PairedPeers,
    *,
    on_attempt_failed: Callable[[PairingError], None] | None = None,
    poll_s: float = 0.5,
) -> PairedPeer:
    """Accept joiners one at a time on ``listener`` until one pairs (returned) or the code stops
    being usable (``PairingError``: expired, too_many_attempts)."""
    while True:
        gone = code.refusal()
        if gone is not None:
            raise PairingError(gone, MESSAGES[gone])
        listener.settimeout(max(0.01, min(poll_s, code.remaining_s())))
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        with conn:
            try:
                return accept_pairing(conn, code, identity, peers)
            except PairingError as e:
                if on_attempt_failed is not None:
                    on_attempt_failed(e)


# --- the side that types the code (the Mac) ----------------------------------------------------
def join_pairing(sock: socket.socket, code: str, identity: Identity, peers: PairedPeers) -> PairedPeer:
    """Run the joiner's side on a socket connected to ``duet peer pair``. Returns the peer paired
    with (stored in ``peers``); raises ``PairingError``."""
    sock.settimeout(IO_TIMEOUT_S)
    a = SPAKE2_A(_password(code), idA=ID_JOINER, idB=ID_SHOWER)
    msg_a = a.start()
    try:
        _send(sock, {"type": "hello", "version": VERSION, "spake": msg_a})
        reply = _recv(sock, "reply")
        msg_b = _field(reply, "spake", bytes)
        try:
            key = a.finish(msg_b)
        except SPAKEError as e:
            _refuse(sock, "protocol")
            raise PairingError("protocol", f"bad SPAKE2 message: {e}") from None
        keys = _derive(key, msg_a, msg_b)
        if not hmac.compare_digest(_field(reply, "confirm", bytes), keys.mac(keys.confirm_shower)):
            _refuse(sock, "wrong_code")
            raise PairingError("wrong_code", "wrong pairing code (the other side's proof did not match)")
        sealed = keys.seal_msg(_NONCE_JOINER, _identity_msg(identity))
        _send(sock, {"type": "prove", "confirm": keys.mac(keys.confirm_joiner), "sealed": sealed})
        done = _recv(sock, "paired")
        shower = keys.open_msg(_NONCE_SHOWER, _field(done, "sealed", bytes))
    except OSError as e:
        raise PairingError("disconnected", f"pairing connection failed: {e}") from None
    return peers.add(shower["name"], shower["cert"])


def parse_target(text: str | None) -> tuple[str, int]:
    """``HOST[:PORT]`` of the machine showing a code (default port ``PAIR_PORT``); ConfigError else."""
    from mlx_engine.errors import ConfigError

    if not text:
        raise ConfigError(
            "--code needs the other machine: duet peer pair --code NNNN-NNNN HOST[:PORT]", "code"
        )
    host, sep, port = text.rpartition(":")
    if not sep or "]" in port or (host.count(":") and not host.startswith("[")):
        host, port = text, str(PAIR_PORT)
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{text!r} is not HOST[:PORT]", "target")
    return host, int(port)


def pair_with_code(code: str, target: str | None, name: str | None = None) -> tuple[PairedPeer, Identity]:
    """The side that types the code (``duet peer pair --code``, the chat's ``/peers pair``): pair with
    the machine at ``target`` (HOST[:PORT]) showing ``code``. Returns (the PairedPeer stored, this
    machine's Identity); raises ``PairingError`` or ``ConfigError`` with a one-line message."""
    from peer.trust.keys import load_identity

    canonical = parse_code(code)
    host, port = parse_target(target)
    identity = load_identity(name=name)
    try:
        sock = socket.create_connection((host, port), timeout=IO_TIMEOUT_S)
    except OSError as e:
        raise PairingError("disconnected", f"cannot reach {host}:{port} to pair: {e}") from None
    with sock:
        return join_pairing(sock, canonical, identity, PairedPeers()), identity
