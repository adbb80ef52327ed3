"""KV that crosses the engine's boundary: loads arriving from KV sources (the disk tier, a remote
prefill peer) and exports to a decoder elsewhere (``Engine.prefill_for_peer``).

Arriving frames are queued in mailbox order and applied at the top of a worker iteration, up to
``apply_budget`` bytes of layers per iteration (so other sequences' inter-token latency stays
bounded while a load arrives), with every touched pool array evaluated once. A frame of a load
that is no longer live is dropped when it is applied, so late frames of a cancelled load never
touch blocks that were freed and reused. A frame that does not fit fails its load; the sequence
keeps what landed and computes the rest (kv_cache/kv_source.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_engine.engine.messages import KVDone, KVFailed, KVLayer, KVMessage, MailboxSink
from mlx_engine.engine.outputs import RequestState
from mlx_engine.kv_cache.kv_pool import KVPool
from mlx_engine.kv_cache.kv_source import KVSource
from mlx_engine.scheduler import Scheduler, Sequence, StartLoad

log = logging.getLogger("mlx_engine.engine")

OnLayer = Callable[[int, int, int, list[mx.array]], None]


@dataclass(eq=False)
class Export:
    """A prompt computed for a decoder elsewhere (``Engine.prefill_for_peer``)."""

    seq: Sequence
    start: int  # tokens the decoder holds: export [start, N - 1)
    on_layer: OnLayer
    on_accept: Callable[[int], None] | None
    on_done: Callable[[int, float], None] | None
    on_error: Callable[[str], None] | None
    can_send: Callable[[], bool] | None = None  # False: the receiver's queue is full, wait
    t_start: float = field(default_factory=time.perf_counter)
    accepted: bool = False
    error: str | None = None  # an on_layer callback raised: ends the export after the step
    done: bool = False

    def hook(self) -> OnLayer:
        """``on_layer``, guarded: a callback that raises ends this export after the step."""

        def on_layer(layer: int, t0: int, t1: int, parts: list[mx.array]) -> None:
            if self.error is None:
                try:
                    self.on_layer(layer, t0, t1, parts)
                except Exception as e:  # the receiver's side broke
                    self.error = f"on_layer failed: {e}"

        return on_layer

    def accept(self, pool: KVPool) -> None:
        """On (re)admission: report the prefix hit once, then hand out ``[start, h)`` from the
        pool, chunk by chunk on the grid, layer by layer within a chunk."""
        seq, h = self.seq, self.seq.num_computed
        if not self.accepted:
            self.accepted = True
            if self.on_accept is not None:
                try:
                    self.on_accept(h)
                except Exception as e:
                    self.error = f"on_accept failed: {e}"
        chunk = seq.chunk or 1
        t = self.start
        hook = self.hook()
        while t < h and self.error is None:
            t1 = min(h, (t // chunk + 1) * chunk)
            for layer in range(pool.num_layers):
                hook(layer, t, t1, pool.read_tokens(layer, seq.blocks, t, t1))
            t = t1

    def report(self, error: str | None) -> None:
        """The export ended: ``on_done`` or ``on_error``, exactly once."""
        try:
            if error is None:
                if self.on_done is not None:
                    self.on_done(self.seq.prompt_computed, time.perf_counter() - self.t_start)
            elif self.on_error is not None:
                self.on_error(error)
        except Exception as e:
            log.warning("peer prefill %s: a callback failed: %s", self.seq.request_id, e)


@dataclass
class _LoadMeta:
    request_id: str
    source: KVSource
    t_start: float = field(default_factory=time.perf_counter)
    bytes: int = 0


class KVTransfer:
    """Loads from KV sources, on the worker thread: starting them, applying what arrives, and
    their bookkeeping (bytes, wait, the source's own compute time) for each request's usage."""

    def __init__(self, scheduler: Scheduler, pool: KVPool, sink: MailboxSink, apply_budget: int):
        self.scheduler = scheduler
        self.pool = pool
        self.sink = sink
        self.apply_budget = apply_budget  # bytes of layers applied per iteration (at least one frame)
        self.backlog: deque[KVMessage] = deque()
        self._meta: dict[int, _LoadMeta] = {}
        self.bytes_loaded = 0
        self.frames_dropped = 0  # arriving layer ranges of dead loads (cancelled, failed, finished)

    def start(self, sl: StartLoad, requests: dict[str, RequestState]) -> None:
        load = sl.load
        self._meta[load.load_id] = _LoadMeta(load.request_id, sl.source)
        try:
            sl.source.start_load(load, self.sink)
        except Exception as e:  # a broken source costs the load, never the engine
            log.warning("KV source %s failed to start load %d: %s", sl.source.name, load.load_id, e)
            self.ended(load.load_id, f"start_load failed: {e}", requests)

    def apply(self, requests: dict[str, RequestState]) -> None:
        """Apply queued KV messages in order, up to ``apply_budget`` bytes of layers (at least
        one), then evaluate every touched pool array once."""
        budget, touched = self.apply_budget, set()
        while self.backlog:
            m = self.backlog[0]
            if isinstance(m, KVLayer) and budget <= 0:
                break
            self.backlog.popleft()
            if isinstance(m, KVLayer):
                budget -= max(m.nbytes, 1)
                try:
                    if self._apply_layer(m, requests):
                        touched.add(m.layer)
                finally:
                    if m.release is not None:
                        m.release()
            elif isinstance(m, KVDone):
                meta = self._meta.get(m.load_id)
                if meta is not None and m.compute_s is not None and meta.request_id in requests:
                    requests[meta.request_id].remote.compute_s += m.compute_s
                self.ended(m.load_id, None, requests)
            else:
                assert isinstance(m, KVFailed)
                self.ended(m.load_id, m.reason, requests)
        if touched:
            mx.eval([a for layer in sorted(touched) for a in self.pool.layer_arrays(layer)])

    def _apply_layer(self, m: KVLayer, requests: dict[str, RequestState]) -> bool:
        """Write one arriving layer range into the pool; False when it was dropped."""
        try:
            target = self.scheduler.kv_target(m.load_id, m.layer, m.t0, m.t1)
            if target is None:  # a dead load (cancelled, failed, finished), or complete already
                self.frames_dropped += self.scheduler.source_of(m.load_id) is None
                return False
            pool = self.pool.layer_arrays(m.layer)
            if len(m.parts) != len(pool):
                raise ValueError(f"{len(m.parts)} KV parts for a pool layer of {len(pool)} arrays")
            if any(p.shape[0] != m.t1 - m.t0 for p in m.parts):
                raise ValueError(f"KV parts of {[p.shape[0] for p in m.parts]} tokens for [{m.t0}, {m.t1})")
            lo, hi = target.t0 - m.t0, target.t1 - m.t0
            parts = [_to_pool(p[lo:hi], ref) for p, ref in zip(m.parts, pool, strict=True)]
            self.pool.write_tokens(m.layer, target.blocks, target.t0, parts)
        except (ValueError, TypeError) as e:  # a frame that does not fit: the load fails
            src = self.scheduler.source_of(m.load_id)
            self.ended(m.load_id, f"bad KV frame: {e}", requests)
            if src is not None:
                self.cancel_at_source(src, m.load_id)
            return False
        self.scheduler.kv_landed(m.load_id, m.layer, m.t0, m.t1)
        self.bytes_loaded += m.nbytes
        meta = self._meta.get(m.load_id)
        if meta is not None:
            meta.bytes += m.nbytes
        return True

    def ended(self, load_id: int, reason: str | None, requests: dict[str, RequestState]) -> None:
        """Load ``load_id`` is done (``reason`` None) or failed: the scheduler hears it, the
        request's usage is charged."""
        meta = self._meta.pop(load_id, None)
        seq = self.scheduler.load_finished(load_id, reason)
        if seq is None or meta is None:
            return  # a load that was cancelled (its late DONE or failure is dropped)
        if reason is not None:  # logged once: by the source itself when it logs its own failures
            log.log(
                logging.DEBUG if meta.source.logs_failures else logging.WARNING,
                "KV load %d from %s for %s ended early: %s",
                load_id,
                meta.source.name,
                meta.request_id,
                reason,
            )
        st = requests.get(meta.request_id)
        if st is not None and not meta.source.is_cache:
            st.remote.bytes += meta.bytes
            st.remote.wait_s += time.perf_counter() - meta.t_start
            info = meta.source.load_info(load_id)
            if isinstance(info, dict) and info.get("exact") is not None:
                st.remote.exact = bool(info["exact"]) and st.remote.exact is not False

    def cancel_at_source(self, source: KVSource, load_id: int) -> None:
        self._meta.pop(load_id, None)
        try:
            source.cancel(load_id)
        except Exception as e:
            log.warning("KV source %s failed to cancel load %d: %s", source.name, load_id, e)

    def drop_backlog(self) -> None:
        """At shutdown: release every queued frame's buffer."""
        for m in self.backlog:
            if isinstance(m, KVLayer) and m.release is not None:
                m.release()
        self.backlog.clear()


def _to_pool(part: Any, ref: mx.array) -> mx.array:
    """An arriving part as an mx array of the pool array ``ref``'s dtype (bf16 from uint16 bits)."""
    if isinstance(part, mx.array):
        a = part
    else:
        a = mx.array(np.ascontiguousarray(part))
        if ref.dtype == mx.bfloat16 and a.dtype == mx.uint16:
            a = a.view(mx.bfloat16)
    if a.dtype != ref.dtype:
        raise ValueError(f"a KV part of dtype {a.dtype} for a pool of {ref.dtype}")
    return a
