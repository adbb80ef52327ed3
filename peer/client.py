"""The decoder's side of remote prefill: ``RemotePrefillSource``, a KV source backed by one peer.

One persistent connection per peer (the HELLO exchange happens at connect, never inside a
request's time to first token). ``start_load`` queues a PREFILL for the connection's sender thread
and returns; the connection's reader thread ``recv_into``s frames into a byte-capped buffer pool,
checks them (checksum, shapes and token ranges against this side's pool format) and hands each
layer to the engine's ``KVSink``, which posts it to the worker. The pooled buffer goes back when the
worker has copied the frame (``release``), so ingest memory stays within the cap: when it is full,
the reader stops reading and TCP pushes back on the peer.

Every wait has a deadline on the monotonic clock: connect, HELLO, the first byte after a PREFILL,
and an inter-frame stall per load (never a total for the transfer, which would kill slow but
healthy links). Any failure ends the load with ``sink.failed(load_id, code)`` (the engine keeps what
landed and computes the rest locally), marks the peer unhealthy for an exponentially growing
backoff, logs one line and counts the reason.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from mlx_engine.kv_cache.kv_source import KVLoad, KVSink, KVSource, LandedKV
from peer.connection import Backoff, Conn, PeerTimeouts, open_connection
from peer.planner import Decision, Planner, PromptMemory
from peer.trust.link_security import PairingWatch, PeerSecurity
from peer.wire.framing import Frame, encode_message, encode_prefill, send_frame
from peer.wire.handshake import inexact_reasons
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
POLICIES = ("auto", "always")


@dataclass
class LoadInfo:
    """What one remote load did (``RemotePrefillSource.load_info``), for usage and logs."""

    peer: str
    request_id: str
    load_id: int
    start: int
    end: int
    exact: bool
    hit: int | None = None  # the peer's own prefix-cache hit
    eta_s: float | None = None
    frames: int = 0
    bytes: int = 0  # payload bytes received
    tokens_computed: int = 0  # by the peer
    compute_s: float = 0.0  # the peer's time from PREFILL to DONE
    wait_s: float = 0.0  # PREFILL sent -> first LAYER_KV
    transfer_s: float = 0.0  # first LAYER_KV -> DONE
    total_s: float = 0.0  # PREFILL sent -> DONE (or the failure)
    accept_s: float | None = None  # PREFILL sent -> ACCEPT
    link_s: float = 0.0  # time spent reading LAYER_KV frames off the socket
    predicted_s: float | None = None  # the planner's predicted remote TTFT
    outcome: str = "running"  # running, done, cancelled, or the failure's ErrorCode value

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(eq=False)
class _Load:
    load: KVLoad
    sink: KVSink
    info: LoadInfo
    conn: Conn
    deadline: float
    landed: LandedKV  # per layer: the token ranges received (a peer may re-send a range)
    t_sent: float = field(default_factory=time.monotonic)
    t_first: float | None = None
    predicted_compute_s: float = 0.0  # the planner's estimate of the peer's compute (its queue)
    hard_deadline: float = float("inf")  # the whole load's (PeerTimeouts.load_deadline_s)


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
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        self.host, self.port, self.policy = host, port, policy
        self.name = name or (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        self.timeouts = timeouts or PeerTimeouts()
        self.backoff = backoff or Backoff()
        self.buffer_cap = buffer_cap_bytes
        self.clock = clock
        # per connection, from the address reached (peer/trust/link_security.py): mutual TLS 1.3 with
        # a paired peer over a network, this user's local secret on loopback; ``tls`` alone: TLS only
        self.security = security or PeerSecurity(tls=tls)
        self.tls = self.security.tls
        self.local: Hello | None = None
        self.remote: Hello | None = None
        self.fmt: KVFormat | None = None
        self.chunk_size = 0
        self.inexact: list[str] = []
        self._lock = threading.RLock()
        self._conn: Conn | None = None
        self._connecting: threading.Thread | None = None
        self._connected = threading.Condition(self._lock)
        self._loads: dict[int, _Load] = {}
        self._infos: OrderedDict[int, LoadInfo] = OrderedDict()
        self._failures = 0  # consecutive failures, for the backoff
        self._retry_at = 0.0
        self._busy_until = 0.0
        self._last_logged: str | None = None
        self.last_error: tuple[str, str] | None = None  # (code, message) of the latest failure
        self.fallbacks: Counter[str] = Counter()  # loads that ended early, by ErrorCode value
        self.failures: Counter[str] = Counter()  # times the peer was marked unhealthy, by ErrorCode value
        self.remote_prefills = 0  # loads completed
        self.bytes_received = 0
        self.frames_received = 0
        self.late_frames = 0  # frames of loads already ended (dropped)
        self.planner = Planner(self.name, local_rate_fn=self.local_rate)
        self._sent_prompts = PromptMemory()  # what the peer's prefix cache likely holds
        self._local_rate: float | None = None  # tokens/s of local prefill (EWMA, observe_local_prefill)
        self._local_rate_fn: Callable[[], float | None] | None = None
        self._closed = False
        self._pairings = PairingWatch(self.tls.peers) if self.tls is not None else None

    # --- set-up ------------------------------------------------------------------------------
    def attach(self, engine: Engine) -> None:
        """This side's HELLO and chunk grid from an engine, then connect (in the background). The
        engine calls it on its worker when the source is added; it does not block there."""
        from peer.identity import local_hello

        c = engine.config
        hello = engine.run_on_worker(lambda: local_hello(engine), 120)  # the pool is the worker's
        self.configure(hello, c.prefill_grid)
        self._local_rate_fn = engine.local_prefill_rate
        self.connect(wait_s=None)

    def configure(self, hello: Hello, chunk_size: int) -> None:
        self.local, self.chunk_size = hello, chunk_size
        self.fmt = KVFormat.from_hello(hello)
        self.planner.kv_bytes_per_token = self.fmt.nbytes(1) * self.fmt.num_layers
        self.planner.num_layers, self.planner.chunk = self.fmt.num_layers, max(chunk_size, 1)

    def connect(self, wait_s: float | None = 0.0) -> bool:
        """Start connecting now (unless connected or connecting; a backoff does not hold it back); with
        ``wait_s`` wait that long for the HELLO exchange to end (None or 0: do not wait). Returns
        whether the peer is usable."""
        with self._lock:
            self._start_connect(force=True)
            if wait_s:
                deadline = self.clock() + wait_s
                while self._connecting is not None and (left := deadline - self.clock()) > 0:
                    self._connected.wait(left)
            return self.healthy

    def _start_connect(self, force: bool = False) -> None:
        if self._closed or self.local is None or self._connecting is not None:
            return
        if self._conn is not None and not self._conn.closed.is_set():
            return
        if not force and self.clock() < self._retry_at:
            return
        t = threading.Thread(target=self._connect, name=f"duet-peer-connect {self.name}", daemon=True)
        self._connecting = t
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
            with self._lock:
                self._connecting = None
                self._mark_unhealthy(e.code, str(e))
                self._connected.notify_all()
            return
        remote = conn.remote
        inexact = inexact_reasons(self.local, remote)
        with self._lock:
            self._connecting = None
            if self._closed:
                conn.close()
                conn.sock.close()
                self._connected.notify_all()
                return
            self._conn, self.remote, self.inexact = conn, remote, inexact
            if conn.peer is not None and self.security.tls is not None:
                self.security.pin(conn.peer)  # reconnects must reach the same machine
            self._retry_at = 0.0
            for target, what in ((self._read_loop, "read"), (self._send_loop, "send")):
                t = threading.Thread(
                    target=target, args=(conn,), name=f"duet-peer-{what} {self.name}", daemon=True
                )
                conn.threads.append(t)
                t.start()
            self._connected.notify_all()
        if inexact:  # usable, but its KV will not be bit-exact with local prefill
            log.warning("peer %s connected; its results are approximate: %s", self.name, "; ".join(inexact))
        else:
            log.info("peer %s connected (bit-exact)", self.name)

    def close(self) -> None:
        """Drop the connection; loads still running fail with ``disconnected``."""
        with self._lock:
            self._closed = True
            conn = self._conn
        if conn is not None:
            self._drop(
                conn, ErrorCode.DISCONNECTED, "the decoder closed the peer connection", unhealthy=False
            )
            for t in conn.threads:
                if t is not threading.current_thread():
                    t.join(timeout=10)

    # --- health and policy -------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        conn = self._conn
        return conn is not None and not conn.closed.is_set()

    @property
    def healthy(self) -> bool:
        now = self.clock()
        return self.connected and now >= self._retry_at and now >= self._busy_until

    @property
    def exact(self) -> bool:
        return not self.inexact

    def status(self) -> str:
        """One line for logs and UIs."""
        if self.healthy:
            return f"peer {self.name}: connected" + ("" if self.exact else " (approximate)")
        why = f" ({self.last_error[0]}: {self.last_error[1]})" if self.last_error else ""
        return f"peer {self.name}: unavailable{why}"

    def observe_local_prefill(self, tokens: int, seconds: float) -> None:
        """The engine's local prefill rate, for the auto policy."""
        if tokens > 0 and seconds > 0:
            self._local_rate = _ewma(self._local_rate, tokens / seconds)

    def local_rate(self) -> float | None:
        if self._local_rate_fn is not None:
            rate = self._local_rate_fn()
            if rate:
                return rate
        return self._local_rate

    def worth_offloading(self, n: int) -> bool:
        """Auto policy for ``n`` uncached tokens (none held by either side): the planner's decision
        (predicted remote TTFT below local; a side never measured is tried once, the peer first)."""
        return self.planner.decide(n + 1, 0, 0, self._queue_s()).offload

    def _queue_s(self) -> float:
        """The peer's predicted compute still ahead of it for this decoder's running loads."""
        now = self.clock()
        with self._lock:
            return sum(max(s.predicted_compute_s - (now - s.t_sent), 0.0) for s in self._loads.values())

    def _decide(self, seq_tokens: list[int], start: int, end: int) -> Decision:
        block = self.remote.block_size if self.remote is not None else 1
        hit = self._sent_prompts.hit(seq_tokens, end, block)
        return self.planner.decide(
            end + 1, start, hit, self._queue_s(), policy=self.policy, record=seq_tokens
        )

    def request_finished(self, request_id: str, tokens: list[int], usage: Any) -> None:
        """The engine ended a request (``KVSource.request_finished``): the planner gets its measured
        TTFT, and the profiles the local TTFT (a request prefilled here) or what followed the
        peer's last frame (a request prefilled by this peer)."""
        loc = str(getattr(usage, "prefill_location", "local"))
        ttft = float(getattr(usage, "ttft_s", 0.0) or 0.0)
        d = self.planner.finish(request_id, tokens, loc, ttft)
        if d is None or ttft <= 0 or getattr(usage, "fallback_reason", None):
            return
        if loc == "local":
            computed = int(getattr(usage, "prompt_tokens_computed", 0))
            if computed == d.n_tokens - d.start:  # no recompute: a clean sample of local prefill
                self.planner.observe_local(computed, d.start, ttft)
        elif loc == f"remote:{self.name}":
            infos = [i for i in self.loads_of(request_id) if i["outcome"] == "done"]
            if len(infos) == 1:
                self.planner.observe_tail(max(ttft - infos[0]["total_s"], 0.0))

    # --- KVSource ----------------------------------------------------------------------------
    def match(self, seq_tokens: list[int], start: int, end: int) -> int:
        """Tokens beyond ``start`` (up to ``end``) this peer offers to prefill: all of them when it
        is connected, healthy and (auto) worth it, else 0."""
        n = end - start
        with self._lock:
            if n <= 0 or self._closed:
                return 0
            if not self.healthy:
                self._start_connect()  # reconnect in the background once the backoff ran out
                return 0
            assert self.remote is not None
            if end + 1 > self.remote.max_tokens:
                return 0
        decision = self._decide(seq_tokens, start, end)
        if self.policy == "auto" and not decision.offload:
            return 0
        return n

    def start_load(self, load: KVLoad, sink: KVSink) -> None:
        """Send the PREFILL (on the sender thread) and return; the layers arrive on the sink."""
        assert self.local is not None
        self._drop_if_unpaired()
        with self._lock:
            conn = self._conn
            usable = conn is not None and not conn.closed.is_set() and not self._closed
            info = LoadInfo(self.name, load.request_id, load.load_id, load.start, load.end, self.exact)
            decision = self.planner.assign(load.tokens, load.start, load.request_id)
            if decision is not None:
                info.predicted_s = decision.predicted_remote_s
            self._remember(info)
            if not usable or load.end <= load.start:
                code = ErrorCode.DISCONNECTED if not usable else ErrorCode.BAD_FRAME
                msg = "the peer is not connected" if not usable else "nothing to load"
                info.outcome = code.value
            else:
                assert conn is not None
                now = self.clock()
                state = _Load(
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
                self._loads[load.load_id] = state
                self._sent_prompts.remember(load.tokens[: load.end])
        if not usable or load.end <= load.start:
            self.fallbacks[code.value] += 1
            self.last_error = (code.value, msg)
            sink.failed(load.load_id, code.value)
            return
        assert conn is not None
        msg_ = Prefill(load.request_id, load.load_id, load.end + 1, load.start, self.chunk_size)
        conn.out.put(encode_prefill(msg_, load.tokens[: load.end + 1]))
        conn.wake()  # the reader's deadline changed

    def _drop_if_unpaired(self) -> None:
        """A machine unpaired (``duet peer unpair``) since its connection opened: nothing more goes
        to it (one stat of peers.json per load)."""
        conn = self._conn
        if self._pairings is None or conn is None or conn.peer is None or not conn.peer.fingerprint:
            return
        if conn.peer.fingerprint in self._pairings.unpaired({conn.peer.fingerprint}):
            self._drop(
                conn, ErrorCode.DISCONNECTED, f"{conn.peer.name} is no longer paired with this machine"
            )

    def cancel(self, load_id: int) -> None:
        """The engine no longer wants this load: CANCEL it; no sink call follows."""
        with self._lock:
            state = self._loads.pop(load_id, None)
        if state is None:
            return
        state.info.outcome = "cancelled"
        state.info.total_s = self.clock() - state.t_sent
        self._send_cancel(state)

    def loads_of(self, request_id: str) -> list[dict[str, Any]]:
        """What this peer's loads for ``request_id`` did (the latest 1024 loads are kept)."""
        with self._lock:
            return [i.as_dict() for i in self._infos.values() if i.request_id == request_id]

    def load_info(self, load_id: int) -> dict[str, Any] | None:
        with self._lock:
            info = self._infos.get(load_id)
            return None if info is None else info.as_dict()

    # --- internals ----------------------------------------------------------------------------
    def _remember(self, info: LoadInfo) -> None:
        self._infos[info.load_id] = info
        while len(self._infos) > 1024:
            self._infos.popitem(last=False)

    def _send_cancel(self, state: _Load) -> None:
        if not state.conn.closed.is_set():
            state.conn.out.put(encode_message(Cancel(state.load.request_id, state.load.load_id)))

    def _mark_unhealthy(self, code: ErrorCode, message: str) -> None:
        """Back off (exponentially) and log the reason once per streak of the same reason."""
        with self._lock:
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

    def _fail(self, state: _Load, code: ErrorCode, message: str, *, cancel: bool, unhealthy: bool) -> None:
        """End one load with a failure (if it is still running): the sink keeps what landed."""
        with self._lock:
            if self._loads.get(state.load.load_id) is not state:
                return
            del self._loads[state.load.load_id]
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
            self._mark_unhealthy(code, message)
        else:
            self.last_error = (code.value, message)
        state.sink.failed(state.load.load_id, code.value)

    def _drop(self, conn: Conn, code: ErrorCode, message: str, *, unhealthy: bool = True) -> None:
        """The connection is unusable: close it and fail every load on it."""
        with self._lock:
            if conn.closed.is_set() and self._conn is not conn:
                return
            conn.close()
            if self._conn is conn:
                self._conn = None
            states = [s for s in self._loads.values() if s.conn is conn]
        for s in states:
            self._fail(s, code, message, cancel=False, unhealthy=False)
        if unhealthy:
            self._mark_unhealthy(code, message)

    def _send_loop(self, conn: Conn) -> None:
        while (buffers := conn.out.get()) is not None:
            try:
                send_frame(conn.sock, buffers)
            except OSError as e:
                self._drop(conn, ErrorCode.DISCONNECTED, f"connection lost while sending: {e}")
                return

    def _read_loop(self, conn: Conn) -> None:
        try:
            while not conn.closed.is_set():
                timeout = self._expire(conn)
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
                    self._drop(conn, ErrorCode.DISCONNECTED, "the peer closed the connection")
                    return
                self.frames_received += 1
                self._handle(conn, frame, time.monotonic() - t_ready)
        except _IdleClosed as e:  # not a failure: connect again now, without a backoff
            log.info("peer %s: %s; reconnecting", self.name, e)
            self._drop(
                conn, ErrorCode.DISCONNECTED, f"the peer closed an idle connection: {e}", unhealthy=False
            )
            with self._lock:
                self._start_connect(force=True)
        except ProtocolError as e:
            self._drop(conn, e.code, str(e))
        except Exception as e:  # a bug must not leave loads hanging
            log.exception("peer %s: reader failed", self.name)
            self._drop(conn, ErrorCode.INTERNAL, f"reader failed: {e}")
        finally:
            conn.selector.close()
            conn.wake_r.close()
            conn.wake_w.close()
            with contextlib.suppress(OSError):
                conn.sock.close()

    def _expire(self, conn: Conn) -> float | None:
        """Fail the loads whose deadline passed; returns the wait until the next deadline."""
        now = self.clock()
        with self._lock:
            states = [s for s in self._loads.values() if s.conn is conn]
        nxt = None
        for s in states:
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

    def _state(self, load_id: int, request_id: str) -> _Load | None:
        with self._lock:
            s = self._loads.get(load_id)
        if s is not None and s.load.request_id != request_id:
            raise ProtocolError(ErrorCode.BAD_FRAME, f"load {load_id} is not request {request_id!r}")
        return s

    def _handle(self, conn: Conn, frame: Frame, read_s: float = 0.0) -> None:
        """``read_s``: the time from the socket turning readable to the whole frame read (for the
        planner's link bandwidth)."""
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
                with self._lock:
                    self._busy_until = now + min(max(msg.retry_after_s, 0.5), 60.0)
                self._fail(s, ErrorCode.BUSY, "the peer is busy", cancel=False, unhealthy=False)
        elif isinstance(msg, Done):
            s = self._state(msg.load_id, msg.request_id)
            if s is not None:
                self._done(s, msg, now)
        elif isinstance(msg, Error):
            if msg.request_id is None:
                with self._lock:
                    mine = any(st.conn is conn for st in self._loads.values())
                if msg.code is ErrorCode.TIMEOUT and not mine:  # the peer closed an idle connection
                    raise _IdleClosed(msg.message)
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

    def _done(self, s: _Load, msg: Done, now: float) -> None:
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
        with self._lock:
            if self._loads.get(s.load.load_id) is not s:
                return
            del self._loads[s.load.load_id]
            self._failures = 0
            self._last_logged = None
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


class _IdleClosed(Exception):
    """The peer closed this connection for idleness (no load of ours was on it)."""


def _ewma(old: float | None, new: float, weight: float = 0.3) -> float:
    if old is None or not math.isfinite(old):
        return new
    return (1 - weight) * old + weight * new
