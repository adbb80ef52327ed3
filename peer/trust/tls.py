"""Mutual TLS 1.3 between paired peers, with the standard ``ssl`` module and pinned certificates.

Both sides present their self-signed certificate (``peer/trust/keys.py``) and require the other's. The
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

Then the link (``LINKS``): the client sends ``DUETLINK``, a version byte, the link it wants and 32
fresh random bytes; the server answers the same with the link it serves. Different links refuse the
connection on both sides with a clear message (never a silent downgrade). ``tls`` (the default)
keeps the TLS connection for everything. ``trusted`` (``duet peer serve --link trusted`` and
``--peer-link trusted`` on the decoder, both explicit) closes TLS (close_notify both ways) and
continues on the same TCP connection without encryption, every frame authenticated with a MAC keyed
from the two random secrets that crossed inside TLS (``peer/wire/frame_mac.py``): the handshake,
pinning and refusals are exactly those of ``tls``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import ssl
from pathlib import Path

from mlx_engine.errors import ConfigError, DuetError
from peer.trust.keys import Identity, PairedPeer, PairedPeers, fingerprint, load_identity, short_id
from peer.wire.frame_mac import SECRET_BYTES, MacSocket

ACCEPTED = b"\x01"
HANDSHAKE_TIMEOUT_S = 10.0
LINKS = ("tls", "trusted")  # tls: everything encrypted; trusted: authenticated frames, not encrypted
LINK_MAGIC = b"DUETLINK"
LINK_VERSION = 1
LINK_MSG_BYTES = len(LINK_MAGIC) + 2 + SECRET_BYTES
_LINK_WORDS = {"tls": "a tls link (encrypted)", "trusted": "a trusted link (authenticated, not encrypted)"}
_SAME_LINK = "choose the same link on both sides (duet peer serve --link, --peer-link on the decoder)"

PeerSocket = ssl.SSLSocket | MacSocket  # what a connection runs on once the link is set up


class PeerAuthError(DuetError):
    """A TLS peer was refused (unpaired, another certificate) or refused us."""


class LinkMismatchError(PeerAuthError):
    """Both sides are paired, but one asked for a trusted link and the other for TLS."""


class HandshakeAbortedError(PeerAuthError):
    """The TLS handshake ended before anyone was authenticated: the other side went away, or it
    ran past its deadline (a connection that never speaks)."""


def _link_message(link: str, secret: bytes) -> bytes:
    return LINK_MAGIC + bytes([LINK_VERSION, LINKS.index(link)]) + secret


def _read_link(tls: ssl.SSLSocket, who: str) -> tuple[str, bytes]:
    """The other side's link message (inside TLS): (its link, its secret)."""
    data = bytearray()
    while len(data) < LINK_MSG_BYTES:
        chunk = tls.recv(LINK_MSG_BYTES - len(data))
        if not chunk:
            raise PeerAuthError(f"{who} closed the connection while choosing the link")
        data += chunk
    head = len(LINK_MAGIC)
    if data[:head] != LINK_MAGIC or data[head] != LINK_VERSION or data[head + 1] >= len(LINKS):
        raise PeerAuthError(f"{who} sent no link message this version knows (upgrade the older side)")
    return LINKS[data[head + 1]], bytes(data[head + 2 :])


def _bare_tcp(tls: ssl.SSLSocket) -> socket.socket:
    """Close TLS on the connection (close_notify sent and received; the peer sends nothing inside
    TLS after the link message) and return the TCP socket it ran on, blocking."""
    plain = tls.unwrap()
    sock = socket.socket(fileno=plain.detach())
    sock.settimeout(None)
    return sock


def _check_link(link: str) -> None:
    if link not in LINKS:
        raise ValueError(f"link must be one of {', '.join(LINKS)}, got {link!r}")


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


def _setup_failed(tls: ssl.SSLSocket, who: str, e: OSError) -> PeerAuthError:
    """Close a connection whose set-up failed after the TLS handshake, and say why."""
    tls.close()
    why = e.reason if isinstance(e, ssl.SSLError) else e.strerror
    return PeerAuthError(f"setting up the link with {who} failed: {why or e}")


def accept_tls(
    sock: socket.socket,
    ctx: ssl.SSLContext,
    peers: PairedPeers,
    *,
    timeout: float = HANDSHAKE_TIMEOUT_S,
    link: str | None = None,
) -> tuple[PeerSocket, PairedPeer]:
    """Server side: TLS handshake on an accepted socket, the pin check, then ``ACCEPTED``; with
    ``link`` (a member of ``LINKS``) the link exchange follows. Returns the connection (the TLS
    socket, or a ``MacSocket`` for a trusted link) and the paired peer; ``PeerAuthError`` (socket
    closed) if refused (``LinkMismatchError`` when the client asked for another link)."""
    if link is not None:
        _check_link(link)
    sock.settimeout(timeout)
    try:
        tls = ctx.wrap_socket(sock, server_side=True)
    except ssl.SSLError as e:
        sock.close()
        raise _refusal(e, "a client") from None
    except OSError as e:
        sock.close()
        raise HandshakeAbortedError(f"TLS handshake with a client failed: {e}") from None
    name = "a client"
    try:
        peer = _pinned(tls, peers)
        name = peer.name
        tls.sendall(ACCEPTED)
        if link is None:
            tls.settimeout(None)
            return tls, peer
        theirs, client_secret = _read_link(tls, peer.name)
        server_secret = os.urandom(SECRET_BYTES)
        tls.sendall(_link_message(link, server_secret))  # the client learns why, too
        if theirs != link:
            raise LinkMismatchError(
                f"refused {peer.name}: it asked for {_LINK_WORDS[theirs]} and this peer serves "
                f"{_LINK_WORDS[link]}; {_SAME_LINK}"
            )
        if link == "tls":
            tls.settimeout(None)
            return tls, peer
        return MacSocket.server(_bare_tcp(tls), client_secret, server_secret), peer
    except PeerAuthError:
        tls.close()
        raise
    except OSError as e:  # ssl.SSLError too; a timeout or reset after the handshake is a refusal
        raise _setup_failed(tls, name, e) from None


def connect_tls(
    sock: socket.socket,
    ctx: ssl.SSLContext,
    peers: PairedPeers,
    *,
    who: str = "the peer",
    timeout: float = HANDSHAKE_TIMEOUT_S,
    link: str | None = None,
) -> tuple[PeerSocket, PairedPeer]:
    """Client side: TLS handshake on a connected socket, the pin check, then wait for the server's
    ``ACCEPTED`` before any application byte; with ``link`` the link exchange follows (see
    ``accept_tls``). ``PeerAuthError`` (socket closed) if refused."""
    if link is not None:
        _check_link(link)
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
        if link is None:
            tls.settimeout(None)
            return tls, peer
        client_secret = os.urandom(SECRET_BYTES)
        tls.sendall(_link_message(link, client_secret))
        theirs, server_secret = _read_link(tls, who)
        if theirs != link:
            raise LinkMismatchError(
                f"{who} refused this machine: it serves {_LINK_WORDS[theirs]} and this machine asked "
                f"for {_LINK_WORDS[link]}; {_SAME_LINK}"
            )
        if link == "tls":
            tls.settimeout(None)
            return tls, peer
        return MacSocket.client(_bare_tcp(tls), client_secret, server_secret), peer
    except PeerAuthError:
        tls.close()
        raise
    except OSError as e:  # ssl.SSLError too; a timeout or reset after the handshake is a refusal
        raise _setup_failed(tls, who, e) from None


class PeerTLS:
    """This machine's side of peer TLS, for the prefill server and client: ``wrap_server`` /
    ``wrap_client`` on a connected socket. The paired set is re-read for every connection, so
    ``duet peer unpair`` takes effect for the next one."""

    def __init__(self, identity: Identity, peers: PairedPeers, link: str = "tls"):
        _check_link(link)
        self.identity, self.peers, self.link = identity, peers, link

    @classmethod
    def load(cls, directory: Path | None = None, link: str = "tls") -> PeerTLS:
        """From the config directory (``DUET_CONFIG_DIR`` or platformdirs'); the identity is made on
        first use. ``link``: ``tls`` or ``trusted`` (see the module docstring)."""
        return cls(load_identity(directory), PairedPeers(directory), link)

    def wrap_server(self, sock: socket.socket) -> tuple[PeerSocket, PairedPeer]:
        return accept_tls(sock, server_context(self.identity, self.peers), self.peers, link=self.link)

    def wrap_client(self, sock: socket.socket, who: str = "the peer") -> tuple[PeerSocket, PairedPeer]:
        return connect_tls(
            sock, client_context(self.identity, self.peers), self.peers, who=who, link=self.link
        )


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback one (False when it does not resolve)."""
    bare = host.strip("[]").split("%")[0]
    try:
        infos = socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)
        addrs = {ipaddress.ip_address(str(i[4][0]).split("%")[0]) for i in infos}
    except (OSError, ValueError):
        return False
    return bool(addrs) and all(a.is_loopback for a in addrs)


def tls_for_address(
    host: str, flag: str = "--host", directory: Path | None = None, link: str = "tls"
) -> PeerTLS | None:
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
    return PeerTLS.load(directory, link)
