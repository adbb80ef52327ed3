"""The worker's mailbox: every message a caller thread or a KV source posts to the engine's
worker, and the ``KVSink`` that sources post arriving KV through.

The worker blocks on the mailbox whenever no step can run; KV messages (``KVLayer``, ``KVDone``,
``KVFailed``) are queued in order and applied at the top of an iteration (``kv_transfer.py``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mlx_engine.kv_cache.kv_source import KVParts, KVSource

if TYPE_CHECKING:
    from mlx_engine.engine.kv_transfer import Export
    from mlx_engine.engine.outputs import RequestState


@dataclass
class Submit:
    """A generation request, prepared (``inputs.py``), to admit."""

    state: RequestState


@dataclass
class SubmitExport:
    """A prompt to compute for a decoder elsewhere (``Engine.prefill_for_peer``)."""

    export: Export


@dataclass
class Cancel:
    request_id: str


@dataclass
class KVLayer:
    load_id: int
    layer: int
    t0: int
    t1: int
    parts: KVParts
    release: Callable[[], None] | None
    nbytes: int


@dataclass
class KVDone:
    load_id: int
    tokens_computed: int | None = None
    compute_s: float | None = None


@dataclass
class KVFailed:
    load_id: int
    reason: str


@dataclass
class AddSource:
    source: KVSource


@dataclass
class RemoveSource:
    source: KVSource


@dataclass
class Wake:
    """Schedule again (an export's ``can_send`` may have changed)."""


@dataclass
class Call:
    """Run ``fn`` on the worker between two steps (``Engine.run_on_worker``)."""

    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


@dataclass
class Shutdown:
    pass


Message = (
    Submit
    | SubmitExport
    | Cancel
    | KVLayer
    | KVDone
    | KVFailed
    | AddSource
    | RemoveSource
    | Wake
    | Call
    | Shutdown
)
KVMessage = KVLayer | KVDone | KVFailed
Mailbox = queue.SimpleQueue[Message]


class MailboxSink:
    """The ``KVSink`` every source gets: posts to the worker's mailbox from any thread."""

    def __init__(self, mailbox: Mailbox):
        self._mailbox = mailbox

    def layer(
        self,
        load_id: int,
        layer: int,
        t0: int,
        t1: int,
        parts: KVParts,
        release: Callable[[], None] | None = None,
    ) -> None:
        nbytes = sum(int(p.nbytes) for p in parts)
        self._mailbox.put(KVLayer(load_id, layer, t0, t1, parts, release, nbytes))

    def done(self, load_id: int, tokens_computed: int | None = None, compute_s: float | None = None) -> None:
        self._mailbox.put(KVDone(load_id, tokens_computed, compute_s))

    def failed(self, load_id: int, reason: str) -> None:
        self._mailbox.put(KVFailed(load_id, reason))
