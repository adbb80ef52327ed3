"""The prefill peer: ``duet peer serve`` answers PREFILL requests by streaming KV, layer by layer.

One thread per connection reads frames (``FrameReader``); a sender thread per connection writes
them (``send_frame``: ``sendmsg`` of memoryviews, no copies). The engine's worker thread computes
each remote prefill like any request and hands every layer's KV to an ``ExportJob``, which converts
it to the decoder's wire format and queues it for the sender: the worker never waits on the
network. A job whose queued bytes reach the per-request cap reports ``has_room() == False`` so the
engine pauses that export alone; the sender wakes the backend when it has room again.

Conversation per connection (docs/peer-protocol.md): the decoder's HELLO, this side's HELLO
(refusals go out as an ERROR with a typed code, before any compute), then PREFILL -> ACCEPT(h, eta)
or BUSY -> LAYER_KV ... -> DONE. CANCEL, or the connection closing, cancels the export and frees
its blocks. On loopback it serves this machine over plain TCP; on a network address, paired
decoders only, over mutual TLS (``peer/trust/tls.py``).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import socket
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from mlx_engine.errors import ConfigError
from peer.export_connection import Connection, ExportJob
from peer.trust.link_security import PairingWatch, PeerSecurity
from peer.wire.frame_mac import MacSocket
from peer.wire.framing import encode_message, send_frame
from peer.wire.kv_wire import KVFormat
from peer.wire.protocol import (
    Error,
    ErrorCode,
    Hello,
)

if TYPE_CHECKING:
    from peer.trust.keys import PairedPeer
    from peer.trust.tls import PeerTLS

log = logging.getLogger("duet.peer.server")

MiB = 1 << 20


@dataclass
class ServerLimits:
    max_connections: int = 16
    max_exports: int = 8  # remote prefills at once over all connections; more get BUSY
    max_exports_per_client: int = 4  # per connection
    queued_bytes_per_export: int = 256 * MiB  # frames waiting for the sender: above this the export pauses
    hello_timeout_s: float = 10.0  # the decoder's HELLO must arrive within this
    stall_timeout_s: float = 30.0  # inside a frame from the decoder
    receive_cap_bytes: int = 64 * MiB  # PREFILL payloads being read
    max_handshakes: int = 32  # TLS handshakes in progress at once (before anyone is authenticated)
    max_handshakes_per_address: int = 4
    handshake_deadline_s: float = 15.0  # a whole TLS handshake, not each of its reads
    # PREFILL chunk_size at most this: a decoder's grid piece is one forward pass here (alone it may
    # exceed the step's token budget), so an unbounded one is a whole-context pass preempting others
    max_chunk_tokens: int = 2048
    # after HELLO: a connection with no export running and no frame for this long is closed (a
    # decoder that slept or vanished without a FIN holds a slot no more; a live one reconnects)
    idle_timeout_s: float = 300.0


# accept() errors that say "not now" (out of descriptors or memory, a connection reset while it
# queued): the loop waits a moment and accepts again instead of ending
TRANSIENT_ACCEPT_ERRORS = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EPROTO, errno.EINTR}
)
ACCEPT_RETRY_S = 0.1
PAIRING_POLL_S = 1.0  # how often the server looks for an unpairing (one stat of peers.json)


class PrefillBackend(Protocol):
    """What the server needs from an engine (``EngineBackend`` adapts ``mlx_engine.Engine``).

    ``start_export`` must not block: it queues the job (or raises ``QueueFullError``, answered with
    BUSY) and later calls the job's ``accept``, ``layer``..., then ``done`` or ``failed``, from any
    one thread. After ``cancel_export`` it may still call the job, whose calls are then ignored."""

    kv_format: KVFormat  # this side's pool format (the KV ``layer`` hands over)

    def start_export(self, job: ExportJob) -> None: ...

    def cancel_export(self, job: ExportJob) -> None: ...

    def resume(self, job: ExportJob) -> None:
        """The job had no room (``has_room()`` was False) and has some again."""


class EngineBackend:
    """``PrefillBackend`` over an ``mlx_engine.Engine``: each export is the engine's
    ``prefill_for_peer`` request (scheduled beside local users, grouped per decoder connection so
    the scheduler shares the chunk budget fairly between decoders)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.kv_format: KVFormat = engine.run_on_worker(
            lambda: KVFormat.from_pool(engine.pool, max(1, engine.context_length)), 60
        )

    def start_export(self, job: ExportJob) -> None:
        job.engine_handle = self.engine.prefill_for_peer(
            job.tokens,
            job.start,
            job.chunk_size,
            job.layer,
            on_accept=job.accept,
            on_done=job.done,
            on_error=job.failed,
            can_send=job.has_room,
            request_id=f"peer/{job.conn.name}/{job.request_id}/{job.load_id}",
            group=f"peer/{job.conn.name}",
        )

    def cancel_export(self, job: ExportJob) -> None:
        if job.engine_handle is not None:
            self.engine.cancel(job.engine_handle)

    def resume(self, job: ExportJob) -> None:
        self.engine.poke()


# --- the server ---------------------------------------------------------------------------------


def check_loopback(host: str) -> None:
    """Until pairing and TLS exist, a peer serves this machine only (one-line ConfigError)."""
    bare = host.strip("[]")
    try:
        infos = socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)
        addrs = {ipaddress.ip_address(str(i[4][0]).split("%")[0]) for i in infos}
    except (socket.gaierror, ValueError):
        raise ConfigError(f"cannot listen on --host {host}: not a known address", "host") from None
    if not addrs or not all(a.is_loopback for a in addrs):
        raise ConfigError(
            f"--host {host} is not a loopback address: a prefill peer serves this machine only "
            "(127.0.0.1, ::1, localhost) until peer pairing and TLS exist",
            "host",
        )


@dataclass
class ServerStats:
    counts: dict[str, int] = field(default_factory=dict)


class PeerServer:
    """Serve ``backend`` to decoders on ``host:port`` (loopback only, unless ``tls`` is given: then
    any address, paired decoders only, over mutual TLS 1.3). ``start()`` listens and
    accepts in a thread; ``close()`` stops it and drops every connection (their exports are
    cancelled)."""

    def __init__(
        self,
        backend: PrefillBackend,
        hello: Hello,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        limits: ServerLimits | None = None,
        connection_class: type[Connection] = Connection,
        sock: socket.socket | None = None,
        tls: PeerTLS | None = None,
        security: PeerSecurity | None = None,
        send_after_prefill: bool = False,
    ):
        self.backend, self.hello = backend, hello
        # a benchmark control (bench/disagg.py), off by default: hold every export's frames until its
        # whole prefill is done, then send them (exo's released design), instead of each layer as
        # soon as it is computed
        self.send_after_prefill = send_after_prefill
        # per connection, from the address that connected (peer/trust/link_security.py): mutual TLS
        # 1.3 with a paired decoder from a network, this user's local secret from loopback
        self.security = security or PeerSecurity(tls=tls)
        self.tls = self.security.tls
        self.limits = limits or ServerLimits()
        self.connection_class = connection_class
        self.host, self.port = host, port
        self._listener = sock
        self._conns: set[Connection] = set()
        self._lock = threading.RLock()
        self._active_exports: set[ExportJob] = set()
        self._rate: float | None = None  # tokens per second of finished exports (EWMA)
        self.stats = ServerStats()
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._handshakes: dict[str, int] = {}  # address -> TLS handshakes in progress
        self._accept_errors_logged: set[int] = set()
        self.idle = threading.Condition(
            self._lock
        )  # notified when an export or connection ends, or a count moves

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> PeerServer:
        if self._listener is None and self.tls is None:
            check_loopback(self.host)
        if self._listener is None:
            self._listener = listen(self.host, self.port)
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name="duet-peer-accept", daemon=True)
        self._thread.start()
        if self.security.tls is not None:
            threading.Thread(target=self._watch_pairings, name="duet-peer-pairings", daemon=True).start()
        return self

    def _watch_pairings(self) -> None:
        """Close the connections of a decoder that was unpaired (``duet peer unpair``) while connected."""
        assert self.security.tls is not None
        watch = PairingWatch(self.security.tls.peers)
        while not self._closing.wait(PAIRING_POLL_S):
            with self._lock:
                conns = [c for c in self._conns if c.peer is not None and c.peer.fingerprint]
            gone = watch.unpaired({c.peer.fingerprint for c in conns if c.peer is not None})
            for c in conns:
                if c.peer is not None and c.peer.fingerprint in gone:
                    log.warning("peer: %s was unpaired: closing its connection %s", c.peer.name, c.name)
                    self.count("connections_closed_unpaired")
                    c.close()

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def close(self) -> None:
        self._closing.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.close()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> PeerServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept_loop(self) -> None:
        """Accept until ``close()``: an accept error that says "not now" (EMFILE, ENFILE,
        ECONNABORTED, ...) waits a moment and accepts again (logged once per kind), so a flood of
        connections can slow this server down but never stop it."""
        assert self._listener is not None
        while not self._closing.is_set():
            try:
                sock, addr = self._listener.accept()
            except OSError as e:
                if self._closing.is_set():
                    return
                if e.errno not in TRANSIENT_ACCEPT_ERRORS:
                    log.error("peer: accepting connections failed, no longer serving: %s", e)
                    return
                self.count("accept_errors")
                if e.errno not in self._accept_errors_logged:
                    self._accept_errors_logged.add(e.errno)
                    log.warning("peer: accept failed (%s); retrying", e.strerror or e)
                self._closing.wait(ACCEPT_RETRY_S)
                continue
            try:
                if sock.family != socket.AF_UNIX:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.security.tls or self.security.local:  # handshakes on their own threads, capped
                    self._start_handshake(sock, addr)
                else:
                    self._admit(sock, addr)
            except Exception as e:  # one connection's trouble never ends the loop
                log.warning("peer: dropped a connection from %s: %s", addr, e)
                with contextlib.suppress(OSError):
                    sock.close()

    def _start_handshake(self, sock: socket.socket, addr: Any) -> None:
        """A TLS handshake on its own thread, within the caps: ``max_handshakes`` at once over all
        addresses, ``max_handshakes_per_address`` from one address, each ended after
        ``handshake_deadline_s`` whatever its reads do."""
        who = addr[0] if isinstance(addr, tuple) else str(addr)
        lim = self.limits
        with self._lock:
            busy = sum(self._handshakes.values()) >= lim.max_handshakes
            busy = busy or self._handshakes.get(who, 0) >= lim.max_handshakes_per_address
            if not busy:
                self._handshakes[who] = self._handshakes.get(who, 0) + 1
        if busy:
            sock.close()
            self.count("handshakes_refused")
            return
        timer = threading.Timer(lim.handshake_deadline_s, _shut, args=(sock,))
        timer.daemon = True

        def run() -> None:
            try:
                self._authenticate(sock, addr, timer)
            except Exception as e:  # logged once, never an uncaught thread error
                log.warning("peer: the TLS handshake with %s failed: %s", who, e)
                with contextlib.suppress(OSError):
                    sock.close()
            finally:
                timer.cancel()
                with self._lock:
                    left = self._handshakes.get(who, 1) - 1
                    if left:
                        self._handshakes[who] = left
                    else:
                        self._handshakes.pop(who, None)

        timer.start()
        threading.Thread(target=run, name=f"duet-peer-handshake {who}", daemon=True).start()

    def _authenticate(self, sock: socket.socket, addr: Any, deadline: threading.Timer | None = None) -> None:
        """Authenticate before anything of the peer protocol, as ``self.security`` says for the
        address that connected: mutual TLS and the pin check from a network, this user's local
        secret from loopback. A refused decoder (both sides say why) never reaches ``Connection``."""
        from peer.trust.tls import HandshakeAbortedError, LinkMismatchError, PeerAuthError

        who = addr[0] if isinstance(addr, tuple) else str(addr)
        try:
            guard = self.security.guard_for(addr[0] if isinstance(addr, tuple) else None)
            if guard is None:  # loopback with neither guard: a plain link (tests, library use)
                self._admit(sock, addr)
                return
            authed, peer = guard.wrap_server(sock)
        except HandshakeAbortedError as e:  # the deadline shut it, or the decoder went away
            log.info("peer: %s (from %s)", e, who)
            self.count("handshakes_failed")
            return
        except PeerAuthError as e:
            log.warning("peer: %s (from %s)", e, who)
            with contextlib.suppress(OSError):
                sock.close()
            self.count(
                "connections_link_mismatch" if isinstance(e, LinkMismatchError) else "connections_unpaired"
            )
            return
        if deadline is not None:
            deadline.cancel()  # authenticated: the connection's own timeouts apply from here
        if self._closing.is_set():
            authed.close()
            return
        if guard.link == "trusted":
            log.info(
                "peer: %s is paired decoder %s (TLS 1.3 handshake; trusted link: frames authenticated, "
                "not encrypted)",
                who,
                peer.name,
            )
        elif guard.link == "local":
            log.info("peer: %s is %s (local peer secret)", who, peer.name)
        else:
            log.info("peer: %s is paired decoder %s (TLS 1.3)", who, peer.name)
        self._admit(authed, addr, peer)

    def _admit(self, sock: socket.socket | MacSocket, addr: Any, peer: PairedPeer | None = None) -> None:
        conn = self.connection_class(self, sock, addr)
        conn.peer = peer
        with self._lock:
            full = len(self._conns) >= self.limits.max_connections
            if not full:
                self._conns.add(conn)
        if full:
            with contextlib.suppress(OSError):
                send_frame(sock, encode_message(Error(ErrorCode.BUSY, "too many decoders are connected")))
            sock.close()
            self.count("connections_refused")
            return
        self.count("connections")
        threading.Thread(target=conn.serve, name=f"duet-peer-conn {conn.name}", daemon=True).start()

    # --- bookkeeping ----------------------------------------------------------------------------
    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.stats.counts[name] = self.stats.counts.get(name, 0) + n
            self.idle.notify_all()  # a waiter may be watching a count (tests)

    def reserve(self, job: ExportJob) -> bool:
        with self._lock:
            if len(self._active_exports) >= self.limits.max_exports:
                return False
            self._active_exports.add(job)
            return True

    def job_ended(self, job: ExportJob) -> None:
        with self._lock:
            self._active_exports.discard(job)
            self.idle.notify_all()

    def connection_ended(self, conn: Connection) -> None:
        with self._lock:
            self._conns.discard(conn)
            self.idle.notify_all()

    @property
    def active_exports(self) -> int:
        with self._lock:
            return len(self._active_exports)

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def observe_rate(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        with self._lock:
            self._rate = rate if self._rate is None else 0.7 * self._rate + 0.3 * rate

    def estimate_eta(self, tokens: int) -> float:
        """Seconds until an export of ``tokens`` new tokens would finish behind the live queue, from
        the measured rate of finished exports (0 before any: unknown)."""
        with self._lock:
            rate = self._rate
            queued = sum(max(j.end - (j.hit or 0), 0) for j in self._active_exports)
        if not rate:
            return 0.0
        return (queued + tokens) / rate


def _shut(sock: socket.socket) -> None:
    """End a handshake that ran past its deadline: its blocked read returns."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def listen(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be between 0 and 65535, got {port}", "port")
    bare = host.strip("[]")
    family, kind, proto, _, addr = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(64)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}", "port") from None
    return sock
