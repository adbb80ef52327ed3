"""A decoder's link to one prefill peer: the connection's lifecycle and the peer's health.

``PeerLink`` connects in the background (the HELLO exchange happens at connect, never inside a
request's time to first token), reconnects when asked once a backoff has run out, and runs each
connection's two threads: the sender, which writes what is queued on ``Conn.out``, and the reader,
which waits for frames until the next deadline its ``LinkHandler`` names and hands each frame to
it. A failure marks the peer unhealthy for an exponentially growing backoff (one log line per
streak of the same reason); a lost connection fails every load on it through the handler. What the
frames mean is ``peer/client.py``'s business."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from peer.connection import Backoff, Conn, PeerTimeouts, open_connection
from peer.trust.link_security import PairingWatch
from peer.wire.framing import Frame, send_frame
from peer.wire.handshake import inexact_reasons
from peer.wire.kv_wire import KVFormat
from peer.wire.protocol import ErrorCode, Hello, ProtocolError

if TYPE_CHECKING:
    from peer.trust.link_security import PeerSecurity

log = logging.getLogger("duet.peer.client")


class IdleClosed(Exception):
    """The peer closed this connection for idleness (no load of ours was on it): not a failure,
    the link connects again at once."""


class LinkHandler(Protocol):
    """What a link's reader thread calls (``RemotePrefillSource`` is one)."""

    def handle_frame(self, conn: Conn, frame: Frame, read_s: float) -> None:
        """One frame read off ``conn`` in ``read_s`` seconds; raises ``ProtocolError`` (the
        connection is dropped) or ``IdleClosed``."""

    def expire(self, conn: Conn) -> float | None:
        """End what timed out on ``conn``; the wait until the next deadline (None: none)."""

    def connection_lost(self, conn: Conn, code: ErrorCode, message: str) -> None:
        """``conn`` is closed: end every load on it."""


class PeerLink:
    """The connection to ``host:port`` and the peer's health. ``lock`` guards the connection's
    state; a caller that must not race a drop (starting a load on the connection) holds it."""

    def __init__(
        self,
        host: str,
        port: int,
        name: str,
        handler: LinkHandler,
        *,
        timeouts: PeerTimeouts,
        backoff: Backoff,
        buffer_cap: int,
        security: PeerSecurity,
        clock: Callable[[], float],
    ):
        self.host, self.port, self.name, self.handler = host, port, name, handler
        self.timeouts, self.backoff, self.buffer_cap = timeouts, backoff, buffer_cap
        self.security, self.clock = security, clock
        self.local: Hello | None = None
        self.fmt: KVFormat | None = None
        self.remote: Hello | None = None
        self.inexact: list[str] = []
        self.lock = threading.RLock()
        self.conn: Conn | None = None
        self.connecting: threading.Thread | None = None
        self.connected_cond = threading.Condition(self.lock)
        self.closed = False
        self._failures = 0  # consecutive failures, for the backoff
        self._retry_at = 0.0
        self._busy_until = 0.0
        self._last_logged: str | None = None
        self.last_error: tuple[str, str] | None = None  # (code, message) of the latest failure
        self.failures: Counter[str] = Counter()  # times the peer was marked unhealthy, by ErrorCode value
        self._pairings = PairingWatch(security.tls.peers) if security.tls is not None else None

    def configure(self, local: Hello, fmt: KVFormat) -> None:
        self.local, self.fmt = local, fmt

    # --- health ----------------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        conn = self.conn
        return conn is not None and not conn.closed.is_set()

    @property
    def healthy(self) -> bool:
        now = self.clock()
        return self.connected and now >= self._retry_at and now >= self._busy_until

    def usable(self) -> Conn | None:
        """The live connection, unless the link is closed (call holding ``lock``)."""
        conn = self.conn
        return conn if conn is not None and not conn.closed.is_set() and not self.closed else None

    def mark_unhealthy(self, code: ErrorCode, message: str) -> None:
        """Back off (exponentially) and log the reason once per streak of the same reason."""
        with self.lock:
            self._failures += 1
            self.failures[code.value] += 1
            delay = self.backoff.delay(self._failures)
            self._retry_at = self.clock() + delay
            self.last_error = (code.value, message)
            first = self._last_logged != code.value
            self._last_logged = code.value
        line = f"peer {self.name}: {message} ({code.value}); prefilling locally, retrying the peer in {delay:g} s"
        if first:
            log.warning(line)
        else:
            log.debug(line)

    def succeeded(self) -> None:
        """A load ended well: the streak of failures is over."""
        with self.lock:
            self._failures = 0
            self._last_logged = None

    def busy_for(self, seconds: float) -> None:
        """The peer said it is busy: offer it nothing for ``seconds``."""
        with self.lock:
            self._busy_until = self.clock() + seconds

    # --- connecting ------------------------------------------------------------------------------
    def connect(self, wait_s: float | None = 0.0) -> bool:
        """Start connecting now (unless connected or connecting; a backoff does not hold it back); with
        ``wait_s`` wait that long for the HELLO exchange to end (None or 0: do not wait). Returns
        whether the peer is usable."""
        with self.lock:
            self.start_connect(force=True)
            if wait_s:
                deadline = self.clock() + wait_s
                while self.connecting is not None and (left := deadline - self.clock()) > 0:
                    self.connected_cond.wait(left)
            return self.healthy

    def start_connect(self, force: bool = False) -> None:
        """Connect in the background unless connected, connecting, closed or (without ``force``)
        backing off."""
        with self.lock:
            if self.closed or self.local is None or self.connecting is not None:
                return
            if self.conn is not None and not self.conn.closed.is_set():
                return
            if not force and self.clock() < self._retry_at:
                return
            t = threading.Thread(target=self._connect, name=f"duet-peer-connect {self.name}", daemon=True)
            self.connecting = t
            t.start()

    def _connect(self) -> None:
        assert self.local is not None and self.fmt is not None
        try:
            conn = open_connection(
                self.host,
                self.port,
                self.local,
                self.fmt,
                timeouts=self.timeouts,
                buffer_cap=self.buffer_cap,
                security=self.security,
                name=self.name,
            )
        except ProtocolError as e:
            with self.lock:
                self.connecting = None
                self.mark_unhealthy(e.code, str(e))
                self.connected_cond.notify_all()
            return
        remote = conn.remote
        inexact = inexact_reasons(self.local, remote)
        with self.lock:
            self.connecting = None
            if self.closed:
                conn.close()
                conn.sock.close()
                self.connected_cond.notify_all()
                return
            self.conn, self.remote, self.inexact = conn, remote, inexact
            if conn.peer is not None and self.security.tls is not None:
                self.security.pin(conn.peer)  # reconnects must reach the same machine
            self._retry_at = 0.0
            for target, what in ((self._read_loop, "read"), (self._send_loop, "send")):
                t = threading.Thread(
                    target=target, args=(conn,), name=f"duet-peer-{what} {self.name}", daemon=True
                )
                conn.threads.append(t)
                t.start()
            self.connected_cond.notify_all()
        if inexact:  # usable, but its KV will not be bit-exact with local prefill
            log.warning("peer %s connected; its results are approximate: %s", self.name, "; ".join(inexact))
        else:
            log.info("peer %s connected (bit-exact)", self.name)

    def close(self) -> None:
        """Drop the connection for good; loads still running fail with ``disconnected``."""
        with self.lock:
            self.closed = True
            conn = self.conn
        if conn is not None:
            self.drop(conn, ErrorCode.DISCONNECTED, "the decoder closed the peer connection", unhealthy=False)
            for t in conn.threads:
                if t is not threading.current_thread():
                    t.join(timeout=10)

    def drop_if_unpaired(self) -> None:
        """A machine unpaired (``duet peer unpair``) since its connection opened: nothing more goes
        to it (one stat of peers.json per call)."""
        conn = self.conn
        if self._pairings is None or conn is None or conn.peer is None or not conn.peer.fingerprint:
            return
        if conn.peer.fingerprint in self._pairings.unpaired({conn.peer.fingerprint}):
            self.drop(conn, ErrorCode.DISCONNECTED, f"{conn.peer.name} is no longer paired with this machine")

    def drop(self, conn: Conn, code: ErrorCode, message: str, *, unhealthy: bool = True) -> None:
        """The connection is unusable: close it and fail every load on it."""
        with self.lock:
            if conn.closed.is_set() and self.conn is not conn:
                return
            conn.close()
            if self.conn is conn:
                self.conn = None
        self.handler.connection_lost(conn, code, message)
        if unhealthy:
            self.mark_unhealthy(code, message)

    # --- the connection's threads ----------------------------------------------------------------
    def _send_loop(self, conn: Conn) -> None:
        while (buffers := conn.out.get()) is not None:
            try:
                send_frame(conn.sock, buffers)
            except OSError as e:
                self.drop(conn, ErrorCode.DISCONNECTED, f"connection lost while sending: {e}")
                return

    def _read_loop(self, conn: Conn) -> None:
        try:
            while not conn.closed.is_set():
                timeout = self.handler.expire(conn)
                pending = getattr(conn.sock, "pending", None)  # TLS may hold decrypted bytes already
                buffered = pending is not None and pending() > 0
                events = conn.selector.select(0 if buffered else timeout)
                if any(key.fileobj is conn.wake_r for key, _ in events):
                    conn.drain_wake()
                readable = buffered or any(key.fileobj is conn.sock for key, _ in events)
                if not readable or conn.closed.is_set():
                    continue
                t_ready = time.monotonic()
                frame = conn.reader.read()
                if frame is None:
                    self.drop(conn, ErrorCode.DISCONNECTED, "the peer closed the connection")
                    return
                self.handler.handle_frame(conn, frame, time.monotonic() - t_ready)
        except IdleClosed as e:  # not a failure: connect again now, without a backoff
            log.info("peer %s: %s; reconnecting", self.name, e)
            self.drop(
                conn, ErrorCode.DISCONNECTED, f"the peer closed an idle connection: {e}", unhealthy=False
            )
            self.start_connect(force=True)
        except ProtocolError as e:
            self.drop(conn, e.code, str(e))
        except Exception as e:  # a bug must not leave loads hanging
            log.exception("peer %s: reader failed", self.name)
            self.drop(conn, ErrorCode.INTERNAL, f"reader failed: {e}")
        finally:
            conn.selector.close()
            conn.wake_r.close()
            conn.wake_w.close()
            with contextlib.suppress(OSError):
                conn.sock.close()
