"""The remote loads a decoder has running on one peer, and what each did: ``LoadInfo`` (the record
kept for usage, logs and the planner), ``RemoteLoad`` (one running load's state: its sink, deadlines
and the token ranges landed) and ``LoadTable`` (the running loads and the latest records, safe to
use from the engine's worker and the connection's reader thread at once)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from mlx_engine.kv_cache.kv_source import KVLoad, KVSink, LandedKV

if TYPE_CHECKING:
    from peer.connection import Conn

KEPT_INFOS = 1024  # records of ended loads kept for ``loads_of`` / ``load_info``


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
class RemoteLoad:
    """One load running on the peer: ends exactly once, by whoever pops it from the table."""

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


class LoadTable:
    """The running loads by load id, and the records of the latest ``KEPT_INFOS`` loads. Every
    method takes the table's own lock and calls nothing outside it, so a caller may hold its own
    lock around one (never the other way round)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[int, RemoteLoad] = {}
        self._infos: OrderedDict[int, LoadInfo] = OrderedDict()

    def remember(self, info: LoadInfo) -> None:
        """Keep a load's record (started or refused)."""
        with self._lock:
            self._infos[info.load_id] = info
            while len(self._infos) > KEPT_INFOS:
                self._infos.popitem(last=False)

    def add(self, state: RemoteLoad) -> None:
        with self._lock:
            self._running[state.load.load_id] = state

    def get(self, load_id: int) -> RemoteLoad | None:
        with self._lock:
            return self._running.get(load_id)

    def pop(self, load_id: int) -> RemoteLoad | None:
        with self._lock:
            return self._running.pop(load_id, None)

    def end(self, state: RemoteLoad) -> bool:
        """Take ``state`` out if it is still the running load of its id: True for exactly one caller,
        which then ends it (a failure, DONE and a cancel may race for the same load)."""
        with self._lock:
            if self._running.get(state.load.load_id) is not state:
                return False
            del self._running[state.load.load_id]
            return True

    def on(self, conn: Conn) -> list[RemoteLoad]:
        """The loads running on ``conn``."""
        with self._lock:
            return [s for s in self._running.values() if s.conn is conn]

    def queue_s(self, now: float) -> float:
        """The peer's predicted compute still ahead of it for the running loads."""
        with self._lock:
            return sum(max(s.predicted_compute_s - (now - s.t_sent), 0.0) for s in self._running.values())

    def infos_of(self, request_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [i.as_dict() for i in self._infos.values() if i.request_id == request_id]

    def info(self, load_id: int) -> dict[str, Any] | None:
        with self._lock:
            info = self._infos.get(load_id)
            return None if info is None else info.as_dict()
