"""Loopback peers authenticate too: both sides prove they hold this user's local peer secret.

A prefill peer and its decoder on one machine talk over TCP loopback, and every local user can
reach a loopback port: without a check, anyone could connect (and read the peer's prefix-cache
hits from ACCEPT, a prompt oracle), hold its connection slots, or bind the port while the peer is
down and receive the decoder's prompts. So before the HELLO both sides prove, with HMAC-SHA256
over fresh nonces from each, that they hold the 32 random bytes of ``local-peer.key`` in this
user's config directory (0600, in a 0700 directory, made on first use with ``O_EXCL``):

    client -> DUETLOCL, version, nonce_c (32 bytes)
    server -> DUETLOCL, version, nonce_s, HMAC(secret, "server" nonce_c nonce_s)
    client    checks the server's proof (a listener without the secret gets nothing more)
    client -> HMAC(secret, "client" nonce_c nonce_s)
    server -> ACCEPTED, or closes (a client without the secret reaches no HELLO)

Why a secret rather than a Unix-domain socket or TLS on loopback: the secret keeps the link's TCP
addressing (``--peers 127.0.0.1:7611``, one code path, ports as on a network), its trust is exactly
the config directory's (whoever can read that directory already holds this machine's TLS key), it
needs no certificate or pairing between two processes of one user, and it authenticates the
server to the client as well, which a socket file's permissions do not do portably (a planted
socket at the path, BSD kernels that ignore socket-file modes). Frames after it are plain: a local
user cannot read or alter another's loopback TCP stream without root, and root is trusted anyway.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

from mlx_engine.private_files import private_dir
from peer.trust.keys import PairedPeer, config_dir
from peer.trust.tls import ACCEPTED, HANDSHAKE_TIMEOUT_S, HandshakeAbortedError, PeerAuthError

SECRET_FILE = "local-peer.key"
SECRET_BYTES = 32
MAGIC = b"DUETLOCL"
VERSION = 1
NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
LOCAL_PEER = PairedPeer("a process of this user", "", "")  # who a loopback peer is, for the logs


def _proof(secret: bytes, role: bytes, nonce_c: bytes, nonce_s: bytes) -> bytes:
    return hmac.new(secret, role + nonce_c + nonce_s, hashlib.sha256).digest()


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise HandshakeAbortedError("the other side closed the connection during local authentication")
        buf += chunk
    return bytes(buf)


def _check_header(head: bytes) -> None:
    if head[: len(MAGIC)] != MAGIC:
        raise PeerAuthError("not a Duet peer speaking local authentication (a loopback peer must be one)")
    if head[-1] != VERSION:
        raise PeerAuthError(f"local authentication version {head[-1]} (this side speaks {VERSION})")


def load_secret(directory: Path | None = None) -> bytes:
    """This user's local peer secret, made (0600) on first use. Two processes starting at once
    agree: each writes a candidate to its own temporary file (``mkstemp``: 0600, ``O_EXCL``) and
    links it into place, and a link never replaces a secret already there."""
    d = private_dir(directory or config_dir())
    path = d / SECRET_FILE
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{SECRET_FILE}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(SECRET_BYTES))
            with contextlib.suppress(FileExistsError):  # another process linked first: its secret holds
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    secret = path.read_bytes()
    if len(secret) != SECRET_BYTES:
        raise PeerAuthError(
            f"{path} is not a local peer secret ({len(secret)} bytes); delete it to make a new one"
        )
    return secret


class LocalAuth:
    """This user's side of loopback authentication, with ``PeerTLS``'s interface: ``wrap_server``
    and ``wrap_client`` on a connected socket return it (authenticated, plain) and who is there."""

    link = "local"

    def __init__(self, secret: bytes, timeout: float = HANDSHAKE_TIMEOUT_S):
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"a local peer secret is {SECRET_BYTES} bytes")
        self._secret, self.timeout = secret, timeout

    @classmethod
    def load(cls, directory: Path | None = None) -> LocalAuth:
        return cls(load_secret(directory))

    def describe(self) -> str:
        return "loopback, authenticated by this user's local peer secret"

    def wrap_server(self, sock: socket.socket) -> tuple[socket.socket, PairedPeer]:
        """Server side; ``PeerAuthError`` (socket closed) when the client does not hold the secret."""
        return _guarded(sock, self.timeout, self._serve, "a client", HandshakeAbortedError)

    def wrap_client(self, sock: socket.socket, who: str = "the peer") -> tuple[socket.socket, PairedPeer]:
        """Client side: nothing of the model or a prompt is sent before the server proved it holds
        the secret; ``PeerAuthError`` (socket closed) otherwise."""
        return _guarded(sock, self.timeout, lambda s: self._connect(s, who), who, PeerAuthError)

    def _serve(self, sock: socket.socket) -> None:
        _check_header(_read_exact(sock, len(MAGIC) + 1))
        nonce_c = _read_exact(sock, NONCE_BYTES)
        nonce_s = os.urandom(NONCE_BYTES)
        sock.sendall(MAGIC + bytes([VERSION]) + nonce_s + _proof(self._secret, b"server", nonce_c, nonce_s))
        theirs = _read_exact(sock, PROOF_BYTES)
        if not hmac.compare_digest(theirs, _proof(self._secret, b"client", nonce_c, nonce_s)):
            raise PeerAuthError(
                "refused a local client: it does not hold this user's local peer secret "
                "(another user's process, or another config directory)"
            )
        sock.sendall(ACCEPTED)

    def _connect(self, sock: socket.socket, who: str) -> None:
        nonce_c = os.urandom(NONCE_BYTES)
        sock.sendall(MAGIC + bytes([VERSION]) + nonce_c)
        _check_header(_read_exact(sock, len(MAGIC) + 1))
        nonce_s = _read_exact(sock, NONCE_BYTES)
        proof = _read_exact(sock, PROOF_BYTES)
        if not hmac.compare_digest(proof, _proof(self._secret, b"server", nonce_c, nonce_s)):
            raise PeerAuthError(
                f"{who} does not hold this user's local peer secret: not this user's prefill peer (another "
                "user's listener on the port, or a peer started with another DUET_CONFIG_DIR); nothing "
                "was sent to it"
            )
        sock.sendall(_proof(self._secret, b"client", nonce_c, nonce_s))
        if _read_exact(sock, 1) != ACCEPTED:
            raise PeerAuthError(f"{who} refused this process's local authentication")


def _guarded(
    sock: socket.socket,
    timeout: float,
    run: Callable[[socket.socket], None],
    who: str,
    io_error: type[PeerAuthError],
) -> tuple[socket.socket, PairedPeer]:
    """Run one side of the exchange within ``timeout`` per read; any failure closes the socket and
    raises a ``PeerAuthError`` (``io_error`` for a connection that broke)."""
    try:
        sock.settimeout(timeout)
        run(sock)
        sock.settimeout(None)
        return sock, LOCAL_PEER
    except PeerAuthError:
        sock.close()
        raise
    except OSError as e:
        sock.close()
        raise io_error(f"local authentication with {who} failed: {e}") from None
