"""A decoder's connection on the prefill peer, and the remote prefills (exports) it runs.

``Connection`` is one authenticated decoder: a reader (the thread that runs ``serve``: HELLO, then
PREFILL and CANCEL frames, an idle connection closed after ``ServerLimits.idle_timeout_s``) and a
sender thread that writes queued frames. ``ExportJob`` is one PREFILL being served: the engine's
worker hands it each layer's KV, which it converts to the decoder's wire format and queues for the
sender, pausing the export when its queued bytes reach the cap. ``PeerServer`` (``peer/server.py``)
accepts, authenticates and admits connections, and holds the limits and counts they share.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mlx_engine.errors import QueueFullError, RequestError
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
    from peer.server import PeerServer
    from peer.trust.keys import PairedPeer

log = logging.getLogger("duet.peer.server")


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
