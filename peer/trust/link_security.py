"""Which security a peer connection gets, decided per connection from the address it connected.

Both ends decide from the connection itself, never from a name looked up once: the decoder from
the address it reached (``getpeername``), the prefill peer from the address that reached it. A
loopback connection is this user's local authentication (``peer/trust/local_auth.py``); any other
is mutual TLS with a paired machine (``peer/trust/tls.py``), and a side with no paired machines
refuses it rather than talk plain TCP over a network. So a name that resolved to 127.0.0.1 when
the decoder started and to a LAN address later gets TLS (or a refusal), not a plain connection,
and the two ends agree without a word on the wire.

A decoder's security can also be pinned to one machine (``expect``, a certificate fingerprint):
a peer found over mDNS is pinned to the paired machine whose id its advert claims, and any other
peer to the machine it first authenticated as (another paired machine answering at that address
later is refused: one paired machine cannot stand in for another).
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from peer.trust.keys import PairedPeer, PairedPeers, short_id
from peer.trust.local_auth import LocalAuth
from peer.trust.tls import PeerAuthError, PeerTLS, tls_for_address


def is_loopback_ip(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.strip("[]").split("%")[0]).is_loopback
    except ValueError:
        return False


@dataclass
class PeerSecurity:
    """This side's guards: ``tls`` for network connections, ``local`` for loopback ones (either may
    be None; both None is a plain link, for tests and library use on loopback only)."""

    tls: PeerTLS | None = None
    local: LocalAuth | None = None
    expect: str | None = None  # the decoder's pin: the fingerprint the peer must present over TLS

    def guard_for(self, address: str | None) -> PeerTLS | LocalAuth | None:
        """The guard for a connection with ``address`` at the other end (None: a Unix-domain
        socket, which is local). ``PeerAuthError`` when a network connection has no TLS here."""
        if address is None or is_loopback_ip(address):
            return self.local or self.tls
        if self.tls is None:
            raise PeerAuthError(
                f"{address} is a network address and this side has paired with no machine: a peer "
                "link never runs plain TCP over a network (pair with duet peer pair)"
            )
        return self.tls

    def check_pin(self, peer: PairedPeer, who: str) -> None:
        """After a TLS handshake: the peer is the machine this side is pinned to."""
        if self.expect is not None and peer.fingerprint != self.expect:
            raise PeerAuthError(
                f"{who} presented the certificate of paired machine {peer.name} ({peer.short_id}), "
                f"not that of the machine it was reached as ({short_id(self.expect)}): refused"
            )

    def pin(self, peer: PairedPeer) -> None:
        """Remember the machine first authenticated over TLS (nothing to pin for a local peer)."""
        if self.expect is None and peer.fingerprint:
            self.expect = peer.fingerprint


def security_for(
    host: str, flag: str = "--host", directory: Path | None = None, link: str = "tls"
) -> PeerSecurity:
    """The command line's security for a peer at (or a server on) ``host``: mutual TLS with paired
    machines when this machine has any (required, ``ConfigError``, for a network ``host``), and this
    user's local authentication for loopback connections."""
    tls = tls_for_address(host, flag, directory, link)
    if tls is None:
        if PairedPeers(directory).load():  # a loopback name may resolve to a network address later
            tls = PeerTLS.load(directory, link)
    return PeerSecurity(tls=tls, local=LocalAuth.load(directory))


class PairingWatch:
    """Notices ``duet peer unpair`` (another process) through ``peers.json``'s change time: each
    side closes its open connections to a machine no longer paired, not only refuses the next."""

    def __init__(self, peers: PairedPeers):
        self.peers = peers
        self._seen = self._stamp()

    def _stamp(self) -> int | None:
        try:
            return os.stat(self.peers.path).st_mtime_ns
        except OSError:
            return None

    def unpaired(self, fingerprints: set[str]) -> set[str]:
        """Of ``fingerprints``, those no longer paired (empty, without reading, when nothing changed)."""
        stamp = self._stamp()
        if stamp == self._seen or not fingerprints:
            return set()
        self._seen = stamp
        paired = {p.fingerprint for p in self.peers.load().values()}
        return fingerprints - paired
