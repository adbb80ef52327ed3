"""Test doubles for the peer network layer: an engine-less prefill backend whose KV is a known
function of (token, position, layer), a recording KV sink, and a connection that injects faults
on the real server's send path (kill, truncate, corrupt, stall) after a counted number of frames.

The peer tests never sleep to let something happen: they wait on events and conditions with
generous deadlines, which only bound a hang.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass, field

import numpy as np

from peer.export_connection import Connection, ExportJob
from peer.wire.kv_wire import KVFormat
from peer.wire.protocol import Hello, LayerSpec

WAIT = 60.0  # a deadline for hangs only
LAYERS, HEADS, DIM = 3, 2, 8


def fake_hello(**over) -> Hello:
    fields = dict(
        protocol_min=1,
        protocol_max=1,
        model_fingerprint="xxh3-128:" + "ab" * 16,
        backend="cpu",
        mlx_version="0.32.4",
        mlx_lm_version="0.32.2",
        weight_format="dense float32",
        dtype="float32",
        block_size=16,
        kv_bits=None,
        kv_group_size=32,
        num_layers=LAYERS,
        layers=[LayerSpec("full", HEADS, DIM, DIM)] * LAYERS,
        max_tokens=4096,
    )
    fields.update(over)
    return Hello(**fields)


def expected_kv(tokens: list[int], layer: int, t0: int, t1: int) -> list[np.ndarray]:
    """The KV the fake engine computes: K and V of every token a function of its id, position and
    layer (so a frame landing at the wrong place, layer or load shows)."""
    t = np.arange(t0, t1, dtype=np.float32)[:, None, None]
    ids = np.asarray(tokens[t0:t1], np.float32)[:, None, None]
    h = np.arange(HEADS, dtype=np.float32)[None, :, None]
    d = np.arange(DIM, dtype=np.float32)[None, None, :]
    k = ids * 1000 + t + layer * 0.25 + h * 0.01 + d * 0.0001
    return [np.ascontiguousarray(k, np.float32), np.ascontiguousarray(-k, np.float32)]


class FakeBackend:
    """Serves exports on a thread of its own, like the engine's worker: ACCEPT, then per chunk of
    ``chunk_size`` (grid anchored at token 0) one ``layer`` call per layer with all the chunk computed
    (tokens before the job's start too: ``ExportJob.layer`` cuts them), then DONE. It holds a
    prefix cache of ``cached`` tokens (its hit ``h``), pauses an export without room, and stops one
    on cancel. ``gate`` (a Semaphore), when given, lets one chunk be computed per release."""

    def __init__(self, cached: int = 0, gate: threading.Semaphore | None = None):
        self.kv_format = KVFormat.from_hello(fake_hello())
        self.cached = cached
        self.gate = gate
        self.started: list[ExportJob] = []
        self.cancelled: list[ExportJob] = []
        self.finished: list[ExportJob] = []
        self.paused = 0
        self.cv = threading.Condition()
        self._resume: dict[ExportJob, threading.Event] = {}

    def start_export(self, job: ExportJob) -> None:
        with self.cv:
            self.started.append(job)
            self._resume[job] = threading.Event()
        threading.Thread(target=self._run, args=(job,), daemon=True).start()

    def cancel_export(self, job: ExportJob) -> None:
        with self.cv:
            self.cancelled.append(job)
            self.cv.notify_all()
        self._resume[job].set()

    def resume(self, job: ExportJob) -> None:
        self._resume[job].set()

    def _stopped(self, job: ExportJob) -> bool:
        with self.cv:
            return job in self.cancelled

    def _run(self, job: ExportJob) -> None:
        hit = min(self.cached, job.end)
        job.accept(hit)
        c = job.chunk_size
        for c0 in range(hit - hit % c, job.end, c):
            c1 = min(c0 + c, job.end)
            if self.gate is not None:
                assert self.gate.acquire(timeout=WAIT)
            for layer in range(LAYERS):
                while not job.has_room() and not self._stopped(job):
                    with self.cv:
                        self.paused += 1
                    self._resume[job].wait(WAIT)
                    self._resume[job].clear()
                if self._stopped(job):
                    self._end(job)
                    return
                lo = max(c0, hit)  # what this chunk's pool write covers: the job sends what the decoder lacks
                if lo < c1:
                    job.layer(layer, lo, c1, expected_kv(job.tokens, layer, lo, c1))
        job.done(job.end - hit)
        self._end(job)

    def _end(self, job: ExportJob) -> None:
        with self.cv:
            self.finished.append(job)
            self.cv.notify_all()

    def wait_finished(self, n: int) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.finished) >= n, WAIT)


@dataclass
class SinkLoad:
    landed: dict[int, int] = field(default_factory=dict)  # layer -> contiguous end
    kv: dict[int, list[np.ndarray]] = field(default_factory=dict)  # layer -> [K, V] over [0, end)
    frames: int = 0
    done: bool = False
    failed: str | None = None
    finished: threading.Event = field(default_factory=threading.Event)


class RecordingSink:
    """A KVSink that writes frames into full-length arrays per layer, like a pool would. With
    ``hold``, frames are kept (their buffers not released) until ``release_held()``."""

    def __init__(self, n_tokens: int, hold: bool = False):
        self.n = n_tokens
        self.hold = hold
        self.loads: dict[int, SinkLoad] = {}
        self.held: list = []
        self.cv = threading.Condition()
        self.after_layer: list = []  # callables run after each frame (tests count frames)

    def _load(self, load_id: int) -> SinkLoad:
        return self.loads.setdefault(load_id, SinkLoad())

    def layer(self, load_id, layer, t0, t1, parts, release=None) -> None:
        with self.cv:
            s = self._load(load_id)
            assert not s.done and s.failed is None, "a frame after the load ended"
            kv = s.kv.setdefault(layer, [np.full((self.n, HEADS, DIM), np.nan, np.float32) for _ in range(2)])
            for dst, p in zip(kv, parts, strict=True):
                dst[t0:t1] = p
            s.landed[layer] = t1
            s.frames += 1
            if release is not None:
                if self.hold:
                    self.held.append(release)
                else:
                    release()
            self.cv.notify_all()
        for f in self.after_layer:
            f(load_id, layer, t0, t1)

    def done(self, load_id, tokens_computed=None, compute_s=None) -> None:
        with self.cv:
            s = self._load(load_id)
            assert s.failed is None and not s.done
            s.done = True
            s.finished.set()
            self.cv.notify_all()

    def failed(self, load_id, reason) -> None:
        with self.cv:
            s = self._load(load_id)
            assert s.failed is None and not s.done
            s.failed = reason
            s.finished.set()
            self.cv.notify_all()

    def release_held(self) -> None:
        with self.cv:
            held, self.held = self.held, []
        for r in held:
            r()

    def wait_end(self, load_id: int) -> SinkLoad:
        self.wait(lambda: load_id in self.loads and self.loads[load_id].finished.is_set())
        return self.loads[load_id]

    def wait(self, predicate) -> None:
        with self.cv:
            assert self.cv.wait_for(predicate, WAIT), "timed out waiting on the sink"


@dataclass
class KVLoad:
    """The engine's load descriptor (mlx_engine.kv_cache.kv_source.KVLoad's fields)."""

    load_id: int
    request_id: str
    tokens: list[int]
    start: int
    end: int
    block_size: int = 16


class FaultConnection(Connection):
    """The real server connection with a fault after ``after`` LAYER_KV frames: "kill" closes the
    socket, "truncate" sends half of the next frame and closes, "corrupt" flips a payload byte of
    the next frame (its checksum no longer matches), "stall" blocks the sender until ``release``.
    ``kind`` "done" stalls the DONE frame instead."""

    fault: str | None = None
    after: int = 0
    kind: str = "layer_kv"
    release = threading.Event()
    tripped = threading.Event()

    def send(self, buffers, kind, job) -> None:
        cls = type(self)
        if kind != cls.kind or cls.fault is None or job is None or job.frames < cls.after:
            return super().send(buffers, kind, job)
        cls.tripped.set()
        if cls.fault == "kill":
            self._abort()
            raise OSError("killed by the test")
        if cls.fault == "truncate":
            data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
            self.sock.sendall(data[: len(data) // 2])
            self._abort()
            raise OSError("truncated by the test")
        if cls.fault == "corrupt":
            payload = bytearray(memoryview(buffers[1]).cast("B"))
            payload[len(payload) // 2] ^= 0x40
            return super().send([buffers[0], bytes(payload), *buffers[2:]], kind, job)
        if cls.fault == "stall":
            cls.release.wait(WAIT)
            return super().send(buffers, kind, job)
        raise AssertionError(cls.fault)

    def _abort(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


def fault_connection(fault: str, after: int, kind: str = "layer_kv") -> type[FaultConnection]:
    """A FaultConnection class of its own (fresh events) for one test."""
    return type(
        "Fault_" + fault,
        (FaultConnection,),
        {
            "fault": fault,
            "after": after,
            "kind": kind,
            "release": threading.Event(),
            "tripped": threading.Event(),
        },
    )
