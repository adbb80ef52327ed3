"""The decoder's side of remote prefill: ``RemotePrefillSource``, a KV source backed by one peer.

One persistent connection per peer (``peer/peer_link.py``: the HELLO exchange happens at connect,
never inside a request's time to first token; the peer's health and backoff). The running loads
and their records are a ``LoadTable`` (``peer/remote_loads.py``). ``start_load`` queues a PREFILL
for the connection's sender thread and returns; the connection's reader thread ``recv_into``s
frames into a byte-capped buffer pool, checks them (checksum, shapes and token ranges against this
side's pool format) and hands each layer to the engine's ``KVSink``, which posts it to the worker.
The pooled buffer goes back when the worker has copied the frame (``release``), so ingest memory
stays within the cap: when it is full, the reader stops reading and TCP pushes back on the peer.

Every wait has a deadline on the monotonic clock: connect, HELLO, the first byte after a PREFILL,
and an inter-frame stall per load (never a total for the transfer, which would kill slow but
healthy links). Any failure ends the load with ``sink.failed(load_id, code)`` (the engine keeps what
landed and computes the rest locally), marks the peer unhealthy for an exponentially growing
backoff, logs one line and counts the reason.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mlx_engine.kv_cache.kv_source import KVLoad, KVSink, KVSource, LandedKV
from peer.connection import Backoff, Conn, PeerTimeouts
from peer.offload import OffloadChoice
from peer.peer_link import IdleClosed, PeerLink
from peer.planner import Planner
from peer.remote_loads import LoadInfo, LoadTable, RemoteLoad
from peer.trust.link_security import PeerSecurity
from peer.wire.framing import Frame, encode_message, encode_prefill
from peer.wire.kv_wire import KVFormat, decode_layer, nonfinite_part
from peer.wire.protocol import (
    Accept,
    Busy,
    Cancel,
    Done,
    Error,
    ErrorCode,
    Hello,
    LayerKV,
    Prefill,
    ProtocolError,
)

if TYPE_CHECKING:
    from mlx_engine.engine import Engine
    from peer.trust.tls import PeerTLS

log = logging.getLogger("duet.peer.client")

MiB = 1 << 20


class RemotePrefillSource(KVSource):
    """A ``KVSource`` (mlx_engine.kv_cache.kv_source) that prefills on a peer (``duet peer serve``).

    ``policy`` "always" offers every prompt's uncached part to a healthy peer; "auto" offers it when
    the offload planner (``peer/planner.py``, ``self.planner``) predicts the peer gives the first
    token sooner; every decision is recorded there with its predicted and measured TTFT.
    ``attach(engine)`` (the engine calls it on its worker when the source is added, with
    ``add_kv_source`` or ``EngineConfig.kv_sources``) builds this side's HELLO from the engine and
    starts connecting; tests without an engine call ``configure(hello, chunk_size)`` instead."""

    logs_failures = True  # the engine logs a failed load at debug level: this source logs it once

    def __init__(
        self,
        host: str,
        port: int,
        *,
        policy: str = "always",
        timeouts: PeerTimeouts | None = None,
        backoff: Backoff | None = None,
        buffer_cap_bytes: int = 64 * MiB,
        name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        tls: PeerTLS | None = None,
        security: PeerSecurity | None = None,
    ):
        self.host, self.port = host, port
        self.name = name or (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        self.timeouts = timeouts or PeerTimeouts()
        self.clock = clock
        # per connection, from the address reached (peer/trust/link_security.py): mutual TLS 1.3 with
        # a paired peer over a network, this user's local secret on loopback; ``tls`` alone: TLS only
        security = security or PeerSecurity(tls=tls)
        self.tls = security.tls
        self.link = PeerLink(
            host,
            port,
            self.name,
            self,
            timeouts=self.timeouts,
            backoff=backoff or Backoff(),
            buffer_cap=buffer_cap_bytes,
            security=security,
            clock=clock,
        )
        self.chunk_size = 0
        self.loads = LoadTable()
        self.fallbacks: Counter[str] = Counter()  # loads that ended early, by ErrorCode value
        self.remote_prefills = 0  # loads completed
        self.bytes_received = 0
        self.frames_received = 0
        self.late_frames = 0  # frames of loads already ended (dropped)
        self.offload = OffloadChoice(self.name, policy)

    # --- set-up ------------------------------------------------------------------------------
    def attach(self, engine: Engine) -> None:
        """This side's HELLO and chunk grid from an engine, then connect (in the background). The
        engine calls it on its worker when the source is added; it does not block there."""
        from peer.identity import local_hello

        c = engine.config
        hello = engine.run_on_worker(lambda: local_hello(engine), 120)  # the pool is the worker's
        self.configure(hello, c.prefill_grid)
        self.offload.local_rate_fn = engine.local_prefill_rate
        self.connect(wait_s=None)

    def configure(self, hello: Hello, chunk_size: int) -> None:
        fmt = KVFormat.from_hello(hello)
        self.link.configure(hello, fmt)
        self.chunk_size = chunk_size
        self.offload.configure(fmt.nbytes(1) * fmt.num_layers, fmt.num_layers, chunk_size)

    def connect(self, wait_s: float | None = 0.0) -> bool:
        """Start connecting now (unless connected or connecting; a backoff does not hold it back); with
        ``wait_s`` wait that long for the HELLO exchange to end (None or 0: do not wait). Returns
        whether the peer is usable."""
        return self.link.connect(wait_s)

    def close(self) -> None:
        """Drop the connection; loads still running fail with ``disconnected``."""
        self.link.close()

    # --- health and policy -------------------------------------------------------------------
    @property
    def local(self) -> Hello | None:
        return self.link.local

    @property
    def fmt(self) -> KVFormat | None:
        return self.link.fmt

    @property
    def remote(self) -> Hello | None:
        return self.link.remote

    @property
    def inexact(self) -> list[str]:
        return self.link.inexact

    @property
    def connected(self) -> bool:
        return self.link.connected

    @property
    def healthy(self) -> bool:
        return self.link.healthy

    @property
    def last_error(self) -> tuple[str, str] | None:
        """(code, message) of the latest failure."""
        return self.link.last_error

    @property
    def failures(self) -> Counter[str]:
        """Times the peer was marked unhealthy, by ErrorCode value."""
        return self.link.failures

    @property
    def exact(self) -> bool:
        return not self.inexact

    def status(self) -> str:
        """One line for logs and UIs."""
        if self.healthy:
            return f"peer {self.name}: connected" + ("" if self.exact else " (approximate)")
        why = f" ({self.last_error[0]}: {self.last_error[1]})" if self.last_error else ""
        return f"peer {self.name}: unavailable{why}"

    # --- offload decisions (OffloadChoice) ------------------------------------------------------
    @property
    def planner(self) -> Planner:
        return self.offload.planner

    @property
    def policy(self) -> str:
        return self.offload.policy

    def observe_local_prefill(self, tokens: int, seconds: float) -> None:
        """The engine's local prefill rate, for the auto policy."""
        self.offload.observe_local_prefill(tokens, seconds)

    def worth_offloading(self, n: int) -> bool:
        """Auto policy for ``n`` uncached tokens (none held by either side)."""
        return self.offload.worth_offloading(n, self.loads.queue_s(self.clock()))

    def request_finished(self, request_id: str, tokens: list[int], usage: Any) -> None:
        """The engine ended a request (``KVSource.request_finished``): the planner learns from it."""
        self.offload.request_finished(request_id, tokens, usage, lambda: self.loads_of(request_id))

    # --- KVSource ----------------------------------------------------------------------------
    def match(self, seq_tokens: list[int], start: int, end: int) -> int:
        """Tokens beyond ``start`` (up to ``end``) this peer offers to prefill: all of them when it
        is connected, healthy and (auto) worth it, else 0."""
        n = end - start
        with self.link.lock:
            if n <= 0 or self.link.closed:
                return 0
            if not self.healthy:
                self.link.start_connect()  # reconnect in the background once the backoff ran out
                return 0
            assert self.remote is not None
            if end + 1 > self.remote.max_tokens:
                return 0
        block = self.remote.block_size if self.remote is not None else 1
        return (
            n if self.offload.offers(seq_tokens, start, end, self.loads.queue_s(self.clock()), block) else 0
        )

    def start_load(self, load: KVLoad, sink: KVSink) -> None:
        """Send the PREFILL (on the sender thread) and return; the layers arrive on the sink."""
        assert self.local is not None
        self.link.drop_if_unpaired()
        info = LoadInfo(self.name, load.request_id, load.load_id, load.start, load.end, self.exact)
        decision = self.planner.assign(load.tokens, load.start, load.request_id)
        if decision is not None:
            info.predicted_s = decision.predicted_remote_s
        with self.link.lock:  # a drop closes the connection holding it: a load added here is failed
            conn = self.link.usable()
            if conn is not None and load.end > load.start:
                now = self.clock()
                state = RemoteLoad(
                    load,
                    sink,
                    info,
                    conn,
                    now + self.timeouts.first_byte_s,
                    LandedKV(self.local.num_layers),
                    t_sent=now,
                    hard_deadline=now + self.timeouts.load_deadline_s(load.end - load.start),
                )
                if decision is not None and decision.estimate.compute_s is not None:
                    state.predicted_compute_s = decision.estimate.compute_s
                self.loads.remember(info)
                self.loads.add(state)
                self.offload.sent_prompts.remember(load.tokens[: load.end])
        if conn is None or load.end <= load.start:
            code = ErrorCode.DISCONNECTED if conn is None else ErrorCode.BAD_FRAME
            info.outcome = code.value
            self.loads.remember(info)  # with its outcome: never seen running
            self.fallbacks[code.value] += 1
            self.link.last_error = (
                code.value,
                "the peer is not connected" if conn is None else "nothing to load",
            )
            sink.failed(load.load_id, code.value)
            return
        msg = Prefill(load.request_id, load.load_id, load.end + 1, load.start, self.chunk_size)
        conn.out.put(encode_prefill(msg, load.tokens[: load.end + 1]))
        conn.wake()  # the reader's deadline changed

    def cancel(self, load_id: int) -> None:
        """The engine no longer wants this load: CANCEL it; no sink call follows."""
        state = self.loads.pop(load_id)
        if state is None:
            return
        state.info.outcome = "cancelled"
        state.info.total_s = self.clock() - state.t_sent
        self._send_cancel(state)

    def loads_of(self, request_id: str) -> list[dict[str, Any]]:
        """What this peer's loads for ``request_id`` did (the latest 1024 loads are kept)."""
        return self.loads.infos_of(request_id)

    def load_info(self, load_id: int) -> dict[str, Any] | None:
        return self.loads.info(load_id)

    # --- ending loads --------------------------------------------------------------------------
    def _send_cancel(self, state: RemoteLoad) -> None:
        if not state.conn.closed.is_set():
            state.conn.out.put(encode_message(Cancel(state.load.request_id, state.load.load_id)))

    def _fail(
        self, state: RemoteLoad, code: ErrorCode, message: str, *, cancel: bool, unhealthy: bool
    ) -> None:
        """End one load with a failure (if it is still running): the sink keeps what landed."""
        if not self.loads.end(state):
            return
        info = state.info
        info.outcome = code.value
        info.total_s = self.clock() - state.t_sent
        self.fallbacks[code.value] += 1
        landed = state.landed.complete_from(state.load.start) - state.load.start
        log.warning(
            "peer %s: remote prefill of %s failed after %d frames, %d of %d tokens landed in every layer: "
            "%s (%s); prefilling the rest locally",
            self.name,
            info.request_id,
            info.frames,
            landed,
            info.end - info.start,
            message,
            code.value,
        )
        if cancel:
            self._send_cancel(state)
        if unhealthy:
            self.link.mark_unhealthy(code, message)
        else:
            self.link.last_error = (code.value, message)
        state.sink.failed(state.load.load_id, code.value)

    # --- LinkHandler: what the connection's reader thread calls ----------------------------------
    def connection_lost(self, conn: Conn, code: ErrorCode, message: str) -> None:
        for s in self.loads.on(conn):
            self._fail(s, code, message, cancel=False, unhealthy=False)

    def expire(self, conn: Conn) -> float | None:
        """Fail the loads whose deadline passed; returns the wait until the next deadline."""
        now = self.clock()
        nxt = None
        for s in self.loads.on(conn):
            if s.hard_deadline <= now:
                limit = s.hard_deadline - s.t_sent
                message = f"the load did not finish within its {limit:g} s deadline"
            elif s.deadline <= now:
                what = "no frame" if s.t_first is not None else "no reply"
                limit = self.timeouts.stall_s if s.t_first is not None else self.timeouts.first_byte_s
                message = f"{what} from the peer for {limit:g} s"
            else:
                due = min(s.deadline, s.hard_deadline)
                nxt = due if nxt is None else min(nxt, due)
                continue
            self._fail(s, ErrorCode.TIMEOUT, message, cancel=True, unhealthy=True)
        return None if nxt is None else max(nxt - now, 0.0)

    def _state(self, load_id: int, request_id: str) -> RemoteLoad | None:
        s = self.loads.get(load_id)
        if s is not None and s.load.request_id != request_id:
            raise ProtocolError(ErrorCode.BAD_FRAME, f"load {load_id} is not request {request_id!r}")
        return s

    def handle_frame(self, conn: Conn, frame: Frame, read_s: float = 0.0) -> None:
        """``read_s``: the time from the socket turning readable to the whole frame read (for the
        planner's link bandwidth)."""
        self.frames_received += 1
        msg = frame.msg
        if isinstance(msg, LayerKV):
            self._layer(frame, msg, read_s)
            return
        frame.release()
        now = self.clock()
        if isinstance(msg, Accept):
            s = self._state(msg.load_id, msg.request_id)
            if s is not None:
                s.info.hit, s.info.eta_s = msg.hit, msg.eta_s
                if s.info.accept_s is None:  # only the first ACCEPT moves the deadline (by its ETA)
                    s.info.accept_s = now - s.t_sent
                    self.planner.observe_setup(s.info.accept_s)
                    if s.t_first is None:
                        s.deadline = now + self.timeouts.first_byte_s + min(max(msg.eta_s, 0.0), 3600.0)
        elif isinstance(msg, Busy):
            s = self._state(msg.load_id, msg.request_id)
            if s is not None:
                self.link.busy_for(min(max(msg.retry_after_s, 0.5), 60.0))
                self._fail(s, ErrorCode.BUSY, "the peer is busy", cancel=False, unhealthy=False)
        elif isinstance(msg, Done):
            s = self._state(msg.load_id, msg.request_id)
            if s is not None:
                self._done(s, msg, now)
        elif isinstance(msg, Error):
            if msg.request_id is None:
                if msg.code is ErrorCode.TIMEOUT and not self.loads.on(conn):
                    raise IdleClosed(msg.message)  # the peer closed an idle connection
                raise ProtocolError(msg.code, f"the peer reported: {msg.message}")
            s = self._state(msg.load_id or 0, msg.request_id)
            if s is not None:
                self._fail(s, msg.code, f"the peer reported: {msg.message}", cancel=False, unhealthy=True)
        else:
            raise ProtocolError(ErrorCode.BAD_FRAME, f"a decoder does not take {msg.TYPE.value} frames")

    def _layer(self, frame: Frame, msg: LayerKV, read_s: float = 0.0) -> None:
        assert self.fmt is not None and frame.payload is not None
        try:
            s = self._state(msg.load_id, msg.request_id)
        except ProtocolError:
            frame.release()
            raise
        if s is None:  # a load that ended (cancelled, failed): its late frames are dropped
            frame.release()
            self.late_frames += 1
            return
        if msg.t0 < s.load.start or msg.t1 > s.load.end:
            frame.release()
            raise ProtocolError(
                ErrorCode.BAD_FRAME,
                f"layer {msg.layer} tokens [{msg.t0}, {msg.t1}) are outside the load's "
                f"[{s.load.start}, {s.load.end})",
            )
        parts = decode_layer(frame, self.fmt)
        if (bad := nonfinite_part(parts, self.fmt)) is not None:  # never into the pool, cache or disk
            frame.release()
            self._fail(
                s,
                ErrorCode.BAD_FRAME,
                f"layer {msg.layer} tokens [{msg.t0}, {msg.t1}) hold NaN or Inf (part {bad})",
                cancel=True,
                unhealthy=True,
            )
            return
        now = self.clock()
        s.landed.add(msg.layer, msg.t0, msg.t1)
        s.deadline = now + self.timeouts.stall_s
        if s.t_first is None:
            s.t_first = now
        s.info.frames += 1
        s.info.bytes += frame.payload.nbytes
        s.info.link_s += read_s
        self.bytes_received += frame.payload.nbytes
        s.sink.layer(msg.load_id, msg.layer, msg.t0, msg.t1, parts, release=frame.release)

    def _done(self, s: RemoteLoad, msg: Done, now: float) -> None:
        landed = s.landed.complete_from(s.load.start)
        if landed < s.load.end:
            self._fail(
                s,
                ErrorCode.BAD_FRAME,
                f"DONE with every layer landed only up to token {landed} of {s.load.end}",
                cancel=False,
                unhealthy=True,
            )
            return
        if not self.loads.end(s):
            return
        self.link.succeeded()
        self.remote_prefills += 1
        info = s.info
        info.outcome = "done"
        info.tokens_computed, info.compute_s = msg.tokens_computed, msg.compute_s
        info.total_s = now - s.t_sent
        t_first = s.t_first if s.t_first is not None else now
        info.wait_s, info.transfer_s = t_first - s.t_sent, now - t_first
        if msg.tokens_computed > 0 and msg.compute_s > 0:
            self.planner.observe_remote(msg.tokens_computed, info.hit or 0, msg.compute_s)
        if info.bytes > 0:
            self.planner.observe_transfer(info.bytes, max(info.link_s, 1e-6))
        s.sink.done(s.load.load_id, msg.tokens_computed, msg.compute_s)
