"""The peers the chat shows in its peers panel, one row per machine: its own prefill peers
(``--peers``, with their connection and health), the machines paired with this one (the paired-peers
store of ``duet peer pair``), and the peers advertised over mDNS (browsed with ``--peers auto`` only,
on its ``--interface`` addresses). ``/peers pair`` and ``/peers unpair`` go through the same code as
``duet peer pair --code`` and ``duet peer unpair``.

Everything here is plain data read from the peer layer; ``rows`` is cheap enough for the status
timer (the paired-peers file is re-read only when it changes)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlx_engine.errors import DuetError

if TYPE_CHECKING:
    from peer.discovery import Browser, DiscoveredPeer
    from peer.trust.keys import PairedPeer

log = logging.getLogger("duet.chat")


@dataclass
class PeerRow:
    """One machine in the peers panel."""

    name: str
    address: str = ""
    backend: str = ""
    attached: bool = False  # one of this chat's prefill peers (--peers)
    connected: bool = False
    healthy: bool = False
    paired: bool | None = None  # None: a loopback peer, which needs no pairing
    discovered: bool = False  # advertised over mDNS and seen
    prefill_tps: float | None = None
    measured: bool = False  # prefill_tps measured on this chat's remote prefills (else advertised)
    error: str = ""  # why an attached peer is unavailable

    @property
    def state(self) -> str:
        if self.attached:
            if self.healthy:
                return "connected, healthy"
            return "connected, backing off" if self.connected else "not connected"
        return "advertised" if self.discovered else "not seen"

    @property
    def pairing(self) -> str:
        return "loopback" if self.paired is None else "paired" if self.paired else "unpaired"


def address_of(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class PeerDirectory:
    """Gathers the rows; ``browse_on`` (a list of interface addresses, empty for every interface)
    starts an mDNS browser (``start_browsing``, blocking: run it in a thread); None browses nothing."""

    def __init__(self, browse_on: list[str] | None = None):
        self.browse_on = browse_on
        self.browser: Browser | None = None
        self.ready = False  # prepare() ran: until then rows() reads no paired-peers store
        self._paired: tuple[tuple[int, ...], dict[str, PairedPeer]] | None = None  # (file stamp, peers)
        self._lock = threading.Lock()
        self._closed = False

    def prepare(self) -> None:
        """Blocking, for a thread: import the key store (``cryptography``, ~0.1 s, kept off the UI's
        first paint), read the paired peers, and start the mDNS browser when asked (raises OSError,
        or ConfigError for a bad --interface)."""
        try:
            self.paired()
        finally:
            self.ready = True
            self.start_browsing()

    # --- discovery -----------------------------------------------------------------------------
    def start_browsing(self) -> None:
        if self.browse_on is None:
            return
        from peer.discovery import Browser, local_ip_for

        interfaces = [local_ip_for(i) for i in self.browse_on]
        browser = Browser(interfaces or None)
        with self._lock:
            if self._closed:
                browser.close()
                return
            self.browser = browser

    def discovered(self) -> list[DiscoveredPeer]:
        browser = self.browser
        if browser is None:
            return []
        return browser.wait_until(lambda _: True, 0)  # the peers seen so far, read under its lock

    def close(self) -> None:
        with self._lock:
            self._closed = True
            browser, self.browser = self.browser, None
        if browser is not None:
            browser.close()

    # --- pairing -------------------------------------------------------------------------------
    def paired(self) -> dict[str, PairedPeer]:
        """The paired machines by name; the store is re-read when its file changes."""
        from peer.trust.keys import PairedPeers

        store = PairedPeers()
        try:
            st = store.path.stat()
        except OSError:
            return {}
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)  # the store rewrites the file on a change
        if self._paired is None or self._paired[0] != stamp:
            self._paired = (stamp, {})  # an unreadable file raises once, then reads as empty
            self._paired = (stamp, store.load())
        return self._paired[1]

    def pair(self, code: str, target: str) -> PairedPeer:
        """``/peers pair CODE HOST[:PORT]``: blocking (the exchange takes a round trip or a few);
        raises ``DuetError`` (``PairingError``, ``ConfigError``) with a one-line message."""
        from peer.trust.pairing import pair_with_code

        peer, _ = pair_with_code(code, target)
        self._paired = None
        return peer

    def unpair(self, name: str) -> PairedPeer:
        from peer.trust.keys import PairedPeers

        gone = PairedPeers().remove(name)  # ConfigError when no peer has that name
        self._paired = None
        return gone

    # --- rows ----------------------------------------------------------------------------------
    def rows(self, sources: Iterable[Any] = ()) -> list[PeerRow]:
        """One row per machine: the chat's prefill peers first, then the others by name."""
        from peer.trust.tls import is_loopback

        paired: dict[str, PairedPeer] = {}
        if self.ready:
            try:
                paired = self.paired()
            except DuetError as e:  # an unreadable paired-peers file
                log.warning("chat: %s", e)
        by_id = {p.short_id: p.name for p in paired.values()}
        rows: dict[str, PeerRow] = {}
        for src in sources:
            remote = src.remote
            rows[src.name] = PeerRow(
                src.name,
                address=address_of(src.host, src.port),
                backend=remote.backend if remote is not None else "",
                attached=True,
                connected=src.connected,
                healthy=src.healthy,
                # pairing is for network peers: a loopback one is this user's (local peer secret)
                paired=(src.name in paired) if src.tls is not None and not is_loopback(src.host) else None,
                error="" if src.healthy or src.last_error is None else src.last_error[1],
            )
            profile = src.planner.profile()  # the offload planner's profiles, measured on real requests
            if profile.get("remote_samples") and profile.get("remote_tps"):
                rows[src.name].prefill_tps, rows[src.name].measured = profile["remote_tps"], True
        for d in self.discovered():
            name = by_id.get(d.short_id, d.name)
            row = rows.setdefault(name, PeerRow(name))
            row.discovered = True
            # what it advertises (--peers auto connects only to a non-loopback one: best_address)
            shown = d.best_address() or (d.addresses[0] if d.addresses else "?")
            row.address = row.address or address_of(shown, d.port)
            row.backend = row.backend or d.txt.get("backend", "")
            row.paired = d.short_id in by_id
            try:
                row.prefill_tps = float(d.txt["tps"])
            except (KeyError, ValueError):
                pass
        for p in paired.values():
            rows.setdefault(p.name, PeerRow(p.name)).paired = True
        attached = [r for r in rows.values() if r.attached]
        return attached + sorted((r for r in rows.values() if not r.attached), key=lambda r: r.name)
