"""Mutual TLS 1.3 between paired peers, with the standard ``ssl`` module and pinned certificates.

Both sides present their self-signed certificate (``peer/keys.py``) and require the other's. The
trust anchors of a context are exactly the certificates of the paired peers (``cadata``, kept
next to their fingerprints in ``peers.json`` since pairing), with ``CERT_REQUIRED``: OpenSSL then
refuses any other certificate inside the handshake, and in TLS 1.3 a certificate is only accepted
with a CertificateVerify signature made by its private key, so a peer cannot present a paired
certificate it does not hold the key of. A self-signed certificate in the trust store is its own
trust anchor, so no CA is involved; host names are not checked (LAN addresses change), the
certificate is. After the handshake each side also checks the peer certificate's SHA-256
fingerprint against the paired set (defence in depth, and it names the peer) before any
application byte.

Why not ``CERT_NONE`` plus a fingerprint check: on a server context ``CERT_NONE`` does not request
a client certificate at all, so the client side could not be authenticated; pinning through the
trust store works on both sides with Python 3.11's ``ssl`` (no verify callback there).

In TLS 1.3 the client's handshake finishes before the server has checked the client's
certificate, so the server sends one byte, ``ACCEPTED``, after its checks, and the client waits for
it before sending anything: an unpaired client learns it was refused (from the server's TLS alert)
without ever having sent application data.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
from pathlib import Path

from mlx_engine.errors import ConfigError, DuetError
from peer.trust.keys import Identity, PairedPeer, PairedPeers, fingerprint, load_identity, short_id

ACCEPTED = b"\x01"
HANDSHAKE_TIMEOUT_S = 10.0


class PeerAuthError(DuetError):
    """A TLS peer was refused (unpaired, another certificate) or refused us."""


def _context(purpose: int, identity: Identity, peers: list[PairedPeer]) -> ssl.SSLContext:
    if not peers:
        raise PeerAuthError("no paired peers: pair this machine first (duet peer pair)")
    ctx = ssl.SSLContext(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_cert_chain(identity.cert_path, identity.key_path)
    ctx.load_verify_locations(cadata="".join(p.cert_pem for p in peers))
    return ctx


def server_context(identity: Identity, peers: PairedPeers) -> ssl.SSLContext:
    return _context(ssl.PROTOCOL_TLS_SERVER, identity, list(peers.load().values()))


def client_context(identity: Identity, peers: PairedPeers) -> ssl.SSLContext:
    return _context(ssl.PROTOCOL_TLS_CLIENT, identity, list(peers.load().values()))


def _pinned(tls: ssl.SSLSocket, peers: PairedPeers) -> PairedPeer:
    der = tls.getpeercert(binary_form=True)
    if not der:
        raise PeerAuthError("the peer presented no certificate")
    fp = fingerprint(der)
    peer = peers.by_fingerprint(fp)
    if peer is None:
        raise PeerAuthError(f"the peer's certificate {short_id(fp)} is not paired with this machine")
    return peer


def _refusal(e: ssl.SSLError, who: str) -> PeerAuthError:
    if isinstance(e, ssl.SSLCertVerificationError):
        return PeerAuthError(
            f"refused {who}: its certificate is not one this machine has paired with "
            f"(pair them with duet peer pair)"
        )
    if e.reason in ("TLSV1_ALERT_UNKNOWN_CA", "SSLV3_ALERT_BAD_CERTIFICATE", "TLSV1_ALERT_DECRYPT_ERROR"):
        return PeerAuthError(
            f"{who} refused this machine: it has not paired with this machine's certificate "
            f"(pair them with duet peer pair)"
        )
    if e.reason == "CERTIFICATE_VERIFY_FAILED":
        return PeerAuthError(f"refused {who}: certificate verification failed")
    return PeerAuthError(f"TLS handshake with {who} failed: {e.reason or e}")


def accept_tls(
    sock: socket.socket, ctx: ssl.SSLContext, peers: PairedPeers, *, timeout: float = HANDSHAKE_TIMEOUT_S
) -> tuple[ssl.SSLSocket, PairedPeer]:
    """Server side: TLS handshake on an accepted socket, the pin check, then ``ACCEPTED``.
    Returns the TLS socket and the paired peer; ``PeerAuthError`` (socket closed) if refused."""
    sock.settimeout(timeout)
    try:
        tls = ctx.wrap_socket(sock, server_side=True)
    except ssl.SSLError as e:
        sock.close()
        raise _refusal(e, "a client") from None
    except OSError as e:
        sock.close()
        raise PeerAuthError(f"TLS handshake with a client failed: {e}") from None
    try:
        peer = _pinned(tls, peers)
        tls.sendall(ACCEPTED)
    except (PeerAuthError, OSError):
        tls.close()
        raise
    tls.settimeout(None)
    return tls, peer


def connect_tls(
    sock: socket.socket,
    ctx: ssl.SSLContext,
    peers: PairedPeers,
    *,
    who: str = "the peer",
    timeout: float = HANDSHAKE_TIMEOUT_S,
) -> tuple[ssl.SSLSocket, PairedPeer]:
    """Client side: TLS handshake on a connected socket, the pin check, then wait for the server's
    ``ACCEPTED`` before any application byte. ``PeerAuthError`` (socket closed) if refused."""
    sock.settimeout(timeout)
    try:
        tls = ctx.wrap_socket(sock, server_side=False)
    except ssl.SSLError as e:
        sock.close()
        raise _refusal(e, who) from None
    except OSError as e:
        sock.close()
        raise PeerAuthError(f"TLS handshake with {who} failed: {e}") from None
    try:
        peer = _pinned(tls, peers)
        try:
            ok = tls.recv(1)
        except ssl.SSLError as e:
            raise _refusal(e, who) from None
        if ok != ACCEPTED:
            raise PeerAuthError(
                f"{who} closed the connection after the TLS handshake (it refused this machine)"
            )
    except (PeerAuthError, OSError):
        tls.close()
        raise
    tls.settimeout(None)
    return tls, peer


class PeerTLS:
    """This machine's side of peer TLS, for the prefill server and client: ``wrap_server`` /
    ``wrap_client`` on a connected socket. The paired set is re-read for every connection, so
    ``duet peer unpair`` takes effect for the next one."""

    def __init__(self, identity: Identity, peers: PairedPeers):
        self.identity, self.peers = identity, peers

    @classmethod
    def load(cls, directory: Path | None = None) -> PeerTLS:
        """From the config directory (``DUET_CONFIG_DIR`` or platformdirs'); the identity is made on
        first use."""
        return cls(load_identity(directory), PairedPeers(directory))

    def wrap_server(self, sock: socket.socket) -> tuple[ssl.SSLSocket, PairedPeer]:
        return accept_tls(sock, server_context(self.identity, self.peers), self.peers)

    def wrap_client(self, sock: socket.socket, who: str = "the peer") -> tuple[ssl.SSLSocket, PairedPeer]:
        return connect_tls(sock, client_context(self.identity, self.peers), self.peers, who=who)


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback one (False when it does not resolve)."""
    bare = host.strip("[]").split("%")[0]
    try:
        infos = socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)
        addrs = {ipaddress.ip_address(str(i[4][0]).split("%")[0]) for i in infos}
    except (OSError, ValueError):
        return False
    return bool(addrs) and all(a.is_loopback for a in addrs)


def tls_for_address(host: str, flag: str = "--host", directory: Path | None = None) -> PeerTLS | None:
    """The peer link's security for ``host``: loopback (this machine only) stays plain TCP; any
    other address is mutual TLS 1.3 with paired peers only, both for ``duet peer serve --host`` and
    for ``--peers HOST:PORT``. ``ConfigError`` (nothing made on disk) when this machine has paired
    with nobody yet."""
    if is_loopback(host):
        return None
    if not PairedPeers(directory).load():
        raise ConfigError(
            f"{flag} {host} is not a loopback address: machines on a network must be paired first "
            "(duet peer pair on the GPU box, then duet peer pair --code NNNN-NNNN HOST on the other)",
            flag.lstrip("-").replace("-", "_"),
        )
    return PeerTLS.load(directory)
