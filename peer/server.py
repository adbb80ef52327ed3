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
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from mlx_engine.errors import ConfigError, QueueFullError, RequestError
from peer.trust.link_security import PairingWatch, PeerSecurity
from peer.wire.frame_mac import MacSocket
from peer.wire.framing import BufferPool, Frame, FrameReader, IdleTimeout, encode_message, send_frame
from peer.wire.handshake import check_peer
from peer.wire.kv_wire import KVFormat, encode_layer, to_wire
from peer.wire.protocol import (
    Accept,
    Busy,
    Cancel,
    Done,
    Error,
    ErrorCode,
    Hello,
    Message,
    Prefill,
    ProtocolError,
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


# --- wire format conversion -------------------------------------------------------------------


def convert_parts(parts: list, src: KVFormat, dst: KVFormat) -> list:
    """One layer's KV parts from this pool's format to the decoder's (a quantized decoder gets the
    affine triplets its own pool write would make; a dtype change casts). Runs on the engine's
    worker thread (MLX graphs belong to the thread that builds them). Identity when they match."""
    if (src.dtype, src.kv_bits, src.group_size) == (dst.dtype, dst.kv_bits, dst.group_size) or (
        src.kv_bits is None and dst.kv_bits is None and src.dtype == dst.dtype
    ):
        return parts
    import mlx.core as mx

    from peer.wire.kv_wire import MX_DTYPES

    act = MX_DTYPES[dst.dtype]
    step = 2 if src.kv_bits is None else 6
    half = step // 2
    out = []
    for i in range(0, step, half):
        mine = parts[i : i + half]
        if src.kv_bits is None:
            x = mine[0]
        else:
            q, scales, biases = mine
            x = mx.dequantize(q, scales, biases, group_size=src.group_size, bits=src.kv_bits)
        if dst.kv_bits is None:
            out.append(x.astype(act))
        else:
            q, s, b = mx.quantize(x.astype(act), group_size=dst.group_size, bits=dst.kv_bits)
            out += [q, s.astype(act), b.astype(act)]
    mx.eval(out)
    return out


# --- one remote prefill ---------------------------------------------------------------------------


class ExportJob:
    """One PREFILL being served: what the engine computes, and where its frames go.

    The engine calls ``accept(hit)`` before computing, ``layer(layer, t0, t1, parts)`` after each
    layer's pool write of each chunk (owned arrays in its pool format), then ``done(tokens_computed)``
    or ``failed(reason)``. None of them blocks. Calls after a cancel, or after the end, are ignored."""

    def __init__(self, conn: Connection, msg: Prefill, tokens: list[int], wire: KVFormat, cap: int):
        self.conn = conn
        self.request_id, self.load_id = msg.request_id, msg.load_id
        self.tokens, self.start, self.chunk_size = tokens, msg.start, msg.chunk_size
        self.end = msg.n_tokens - 1  # exclusive: the decoder computes the last prompt token itself
        self.wire = wire
        self.cap = cap
        self.t_start = time.monotonic()
        self.hit: int | None = None
        self.queued_bytes = 0
        self.paused = False
        self.cancelled = False  # by the decoder (CANCEL) or the connection's end
        self.finished = False  # the engine called done() or failed()
        self.frames = 0
        self.bytes = 0
        self.engine_handle: Any = None  # for the backend's own bookkeeping
        # the server's send-after-prefill control (a benchmark's baseline): frames held until done
        self.held: list[tuple[int, int, int, list[np.ndarray], int]] | None = (
            [] if conn.server.send_after_prefill else None
        )
        self._lock = threading.Lock()

    @property
    def key(self) -> tuple[str, int]:
        return self.request_id, self.load_id

    @property
    def live(self) -> bool:
        """Whether the engine is still working on it (its calls are still wanted)."""
        return not (self.cancelled or self.finished)

    def has_room(self) -> bool:
        """False while this export's frames waiting for the sender reach the byte cap: the engine
        schedules no further chunk of it until ``PrefillBackend.resume``."""
        with self._lock:
            room = self.queued_bytes < self.cap
            if not room:
                self.paused = True
            return room

    def accept(self, hit: int, eta_s: float | None = None) -> None:
        if not self.live:
            return
        self.hit = hit
        eta = self.conn.server.estimate_eta(self.end - hit) if eta_s is None else eta_s
        self.conn.queue_message(Accept(self.request_id, self.load_id, hit, max(eta, 0.0)), self)

    def layer(self, layer: int, t0: int, t1: int, parts: list) -> None:
        if not self.live:
            return
        lo, hi = max(t0, self.start), min(t1, self.end)  # tokens the decoder holds are never sent
        if lo >= hi:
            return
        if (lo, hi) != (t0, t1):
            parts = [p[lo - t0 : hi - t0] for p in parts]
        parts = convert_parts(parts, self.conn.server.backend.kv_format, self.wire)
        t0, t1 = lo, hi
        arrays = [to_wire(p) for p in parts]
        nbytes = sum(a.nbytes for a in arrays)
        if self.held is not None:  # send-after-prefill: not counted against the cap, never paused
            self.held.append((layer, t0, t1, arrays, nbytes))
            return
        with self._lock:
            self.queued_bytes += nbytes
        self.conn.queue_layer(self, layer, t0, t1, arrays, nbytes)

    def done(self, tokens_computed: int, compute_s: float | None = None) -> None:
        if not self.live:
            return
        self.finished = True
        if compute_s is None:
            compute_s = time.monotonic() - self.t_start
        self.conn.server.observe_rate(tokens_computed, compute_s)
        for layer, t0, t1, arrays, nbytes in self.held or ():  # send-after-prefill: everything now
            with self._lock:
                self.queued_bytes += nbytes
            self.conn.queue_layer(self, layer, t0, t1, arrays, nbytes)
        self.held = None
        log.info(
            "peer: prefilled %d tokens for %s (%s; the cache here held %d) in %.2f s",
            tokens_computed,
            self.conn.name,
            self.request_id,
            self.hit or 0,
            compute_s,
        )
        # the job stays on the connection until DONE is sent: a CANCEL before that drops the
        # frames still queued, DONE included
        self.conn.queue_message(Done(self.request_id, self.load_id, tokens_computed, compute_s), self)

    def failed(self, reason: str) -> None:
        if not self.live:
            return
        self.finished = True
        log.warning("peer: remote prefill %s failed: %s", self.request_id, reason)
        self.conn.queue_message(Error(ErrorCode.INTERNAL, reason, self.request_id, self.load_id), self)

    def _sent(self, nbytes: int) -> None:
        """The sender wrote (or dropped) ``nbytes`` of this job's queued frames."""
        with self._lock:
            self.queued_bytes -= nbytes
            wake = self.paused and self.queued_bytes < self.cap
            if wake:
                self.paused = False
        if wake and self.live:
            self.conn.server.backend.resume(self)


# --- one connection --------------------------------------------------------------------------------


@dataclass
class _Out:
    job: ExportJob | None
    build: Callable[[], list]  # the frame's buffers, built on the sender thread
    nbytes: int = 0  # bytes counted against the job's cap
    kind: str = ""  # message type, for fault injection and stats


class Connection:
    """One decoder's connection: a reader (the thread that runs ``serve``) and a sender thread.
    Tests wrap ``send`` to inject faults on the real send path."""

    def __init__(self, server: PeerServer, sock: socket.socket | MacSocket, addr: Any):
        self.server, self.sock, self.addr = server, sock, addr
        self.name = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr or "unix")
        self.jobs: dict[tuple[str, int], ExportJob] = {}
        self.remote: Hello | None = None
        self.peer: PairedPeer | None = None  # who authenticated (None on a plain link)
        self.wire: KVFormat | None = None
        self._out: queue.Queue[_Out | None] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.frames_sent = 0
        self.bytes_sent = 0
        self._sender = threading.Thread(
            target=self._send_loop, name=f"duet-peer-send {self.name}", daemon=True
        )

    # --- send path --------------------------------------------------------------------------
    def send(self, buffers: list, kind: str, job: ExportJob | None) -> None:
        """Write one frame (sender thread only). The fault-injection seam of the tests."""
        send_frame(self.sock, buffers)

    def queue_message(self, msg: Message, job: ExportJob | None = None) -> None:
        self._out.put(_Out(job, lambda: encode_message(msg), 0, msg.TYPE.value))

    def queue_layer(
        self, job: ExportJob, layer: int, t0: int, t1: int, arrays: list[np.ndarray], n: int
    ) -> None:
        wire = self.wire
        assert wire is not None

        def build() -> list:
            return encode_layer(wire, job.request_id, job.load_id, layer, t0, t1, arrays)

        self._out.put(_Out(job, build, n, "layer_kv"))

    def _send_loop(self) -> None:
        broken = False
        while (item := self._out.get()) is not None:
            job = item.job
            try:
                if broken or (job is not None and job.cancelled):
                    continue  # frames of a cancelled export never leave
                buffers = item.build()
                self.send(buffers, item.kind, job)
                size = sum(memoryview(b).nbytes for b in buffers)
                self.frames_sent += 1
                self.bytes_sent += size
                self.server.count("frames_sent")
                if job is not None and item.kind == "layer_kv":
                    job.frames += 1
                    job.bytes += size
                elif job is not None and item.kind in ("done", "error"):
                    self.forget(job)  # its last frame is out: a later CANCEL is a no-op
            except OSError as e:
                broken = True
                log.info("peer: connection %s lost while sending: %s", self.name, e)
                self.close()
            except Exception as e:  # a part that does not fit the wire format: this export fails
                log.exception("peer: cannot send a frame to %s", self.name)
                if job is not None and not job.cancelled:
                    self.forget(job)
                    self._cancel(job)
                    with contextlib.suppress(Exception):
                        send_frame(self.sock, encode_message(Error(ErrorCode.INTERNAL, str(e), *job.key)))
            finally:
                if job is not None and item.nbytes:
                    job._sent(item.nbytes)

    # --- bookkeeping ------------------------------------------------------------------------
    def forget(self, job: ExportJob) -> None:
        with self._lock:
            if self.jobs.get(job.key) is job:
                del self.jobs[job.key]
        self.server.job_ended(job)

    def cancel_all(self) -> None:
        with self._lock:
            jobs, self.jobs = list(self.jobs.values()), {}
        for job in jobs:
            self._cancel(job)

    def _cancel(self, job: ExportJob) -> None:
        """Drop the job's queued frames; stop the engine's export if it is still computing."""
        if job.cancelled:
            return
        computing = job.live
        job.cancelled = True
        self.server.count("cancelled")
        self.server.job_ended(job)
        if computing:
            self.server.backend.cancel_export(job)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    # --- read path ----------------------------------------------------------------------------
    def serve(self) -> None:
        self._sender.start()
        limits = self.server.limits
        reader = FrameReader(
            self.sock,
            BufferPool(limits.receive_cap_bytes),
            max_prompt_tokens=self.server.hello.max_tokens,
            stall_timeout=limits.stall_timeout_s,
        )
        try:
            if self._handshake(reader):
                while (frame := self._next_frame(reader)) is not None:
                    with frame:
                        self._handle(frame)
        except ProtocolError as e:
            if not self._closed.is_set():
                log.info("peer: connection %s dropped: %s (%s)", self.name, e, e.code.value)
                if e.code in (ErrorCode.BAD_FRAME, ErrorCode.TIMEOUT):
                    self.queue_message(Error(e.code, str(e)))
        except OSError as e:  # the decoder went away mid-frame (reset, broken pipe)
            log.info("peer: connection %s dropped: %s", self.name, e)
        except Exception as e:  # a bug here ends this connection only, logged once with its trace
            log.exception("peer: connection %s failed: %s", self.name, e)
            self.server.count("connection_errors")
            self.queue_message(Error(ErrorCode.INTERNAL, f"the peer failed: {e}"))
        finally:
            self.cancel_all()
            self._out.put(None)
            self._sender.join(timeout=30)
            self.close()
            with contextlib.suppress(OSError):
                self.sock.close()
            reader.buffers.close()
            self.server.connection_ended(self)
            if self.remote is not None:
                log.info("peer: decoder %s disconnected", self.name)

    def _next_frame(self, reader: FrameReader) -> Frame | None:
        """The decoder's next frame; a connection idle past ``idle_timeout_s`` with nothing of its
        own running ends (``ProtocolError``: the decoder is told, and reconnects when it wants)."""
        limit = self.server.limits.idle_timeout_s
        while True:
            try:
                return reader.read(idle_timeout=limit)
            except IdleTimeout:
                with self._lock:
                    busy = bool(self.jobs)
                if not busy:
                    self.server.count("connections_idle_closed")
                    raise ProtocolError(
                        ErrorCode.TIMEOUT, f"idle for {limit:g} s with no prefill running: closing"
                    ) from None

    def _handshake(self, reader: FrameReader) -> bool:
        frame = reader.read(idle_timeout=self.server.limits.hello_timeout_s)
        if frame is None:
            return False
        with frame:
            hello = frame.msg
        if not isinstance(hello, Hello):
            raise ProtocolError(ErrorCode.BAD_FRAME, f"expected HELLO first, got {hello.TYPE.value}")
        self.queue_message(self.server.hello)
        try:
            check_peer(self.server.hello, hello)
            wire = KVFormat.from_hello(hello)
        except ProtocolError as e:
            log.warning("peer: refusing %s: %s (%s)", self.name, e, e.code.value)
            self.server.count(f"refused_{e.code.value}")
            self.queue_message(Error(e.code, str(e)))
            return False
        self.remote, self.wire = hello, wire
        reader.kv_format = wire  # bounds any LAYER_KV (which a peer never accepts anyway)
        log.info("peer: decoder %s connected", self.name)
        return True

    def _handle(self, frame: Frame) -> None:
        msg = frame.msg
        if isinstance(msg, Prefill):
            self._prefill(msg, frame.token_ids().tolist())
        elif isinstance(msg, Cancel):
            with self._lock:
                job = self.jobs.pop((msg.request_id, msg.load_id), None)
            if job is not None:  # after DONE (or for an unknown load): nothing to do
                self._cancel(job)
        else:
            raise ProtocolError(ErrorCode.BAD_FRAME, f"a prefill peer does not take {msg.TYPE.value} frames")

    def _prefill(self, msg: Prefill, tokens: list[int]) -> None:
        server = self.server
        assert self.wire is not None
        if msg.n_tokens - 1 > self.wire.max_tokens:
            self.queue_message(
                Error(ErrorCode.BAD_FRAME, "the prompt is longer than the decoder takes", *_key(msg))
            )
            return
        if msg.chunk_size > server.limits.max_chunk_tokens:
            server.count("refused_chunk_size")
            self.queue_message(
                Error(
                    ErrorCode.BAD_FRAME,
                    f"chunk_size {msg.chunk_size} is over this peer's limit of {server.limits.max_chunk_tokens} "
                    "tokens",
                    *_key(msg),
                )
            )
            return
        with self._lock:
            if (msg.request_id, msg.load_id) in self.jobs:
                self.queue_message(Error(ErrorCode.BAD_FRAME, "this load is already running", *_key(msg)))
                return
            busy = len(self.jobs) >= server.limits.max_exports_per_client
        job = ExportJob(self, msg, tokens, self.wire, server.limits.queued_bytes_per_export)
        if busy or not server.reserve(job):
            self._busy(msg)
            return
        with self._lock:
            self.jobs[job.key] = job
        try:
            server.backend.start_export(job)
        except QueueFullError:
            self.forget(job)
            self._busy(msg)
        except Exception as e:  # a prompt the engine refuses (token ids, length): this load only
            self.forget(job)
            code = ErrorCode.BAD_FRAME if isinstance(e, RequestError) else ErrorCode.INTERNAL
            log.warning("peer: refusing prefill %s from %s: %s", msg.request_id, self.name, e)
            self.queue_message(Error(code, str(e), *_key(msg)))
        else:
            server.count("exports")

    def _busy(self, msg: Prefill) -> None:
        self.server.count("busy")
        retry = self.server.estimate_eta(0)
        self.queue_message(Busy(msg.request_id, msg.load_id, retry))


def _key(msg: Prefill) -> tuple[str, int]:
    return msg.request_id, msg.load_id


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
                self._admit_tls(sock, addr, timer)
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

    def _admit_tls(self, sock: socket.socket, addr: Any, deadline: threading.Timer | None = None) -> None:
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
