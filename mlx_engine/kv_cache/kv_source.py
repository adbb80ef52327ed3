"""KV that arrives from somewhere other than this engine's own forward pass: ``KVSource`` (the
base class of the disk tier, ``prefix_disk.PrefixDiskTier``, and of a remote prefill peer,
``peer.client.RemotePrefillSource``; vLLM's ``KVConnectorBase_V1``), the ``KVSink`` it delivers
through, a ``KVLoad``, and the per-layer landed-range bookkeeping (``RangeSet``, ``LandedKV``).

Invariants (kept by the scheduler and ``engine/kv_transfer.py``): a frame whose load id is no
longer live is dropped when it is *applied*, so late frames never touch freed blocks;
``num_computed`` advances only over tokens landed in *every* layer, and only then is a block
registered in the prefix index; a failed load keeps the landed prefix and the rest is computed
locally. How and why: docs/architecture.md ("KV sources").
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# parts of one layer's KV for a token range, in the receiving pool's format (KVPool.layer_arrays
# order: K, then V; or the two affine triplets with kv_bits): numpy arrays (bfloat16 as uint16
# views) or mx arrays
KVParts = Sequence[Any]


@dataclass
class KVLoad:
    """One load of KV for tokens ``[start, end)`` of a sequence."""

    load_id: int  # unique per engine; frames of another load id are dropped on the worker
    request_id: str
    tokens: list[int]  # the sequence's token ids through ``end``: ``len(tokens) == end + 1``
    start: int  # tokens the decoder already holds (memory/disk prefix hit, or an earlier load)
    end: int  # exclusive; normally the prompt's length - 1 (the decoder computes the last token)
    block_size: int  # the decoder's block size (the wire addresses tokens, not blocks)


class KVSink(Protocol):
    """Given by the engine to ``KVSource.start_load``. Thread-safe: every call posts to the
    engine worker's mailbox and returns at once."""

    def layer(
        self,
        load_id: int,
        layer: int,
        t0: int,
        t1: int,
        parts: KVParts,
        release: Callable[[], None] | None = None,
    ) -> None:
        """Layer ``layer``'s KV for tokens ``[t0, t1)``. Ownership of ``parts`` passes to the
        engine; ``release`` (if given) is called once the engine no longer needs their memory
        (applied or dropped), so a reader can return a pooled receive buffer."""
        ...

    def done(self, load_id: int, tokens_computed: int | None = None, compute_s: float | None = None) -> None:
        """Every frame of the load has been delivered (``tokens_computed``/``compute_s``: what the
        source spent, for usage)."""
        ...

    def failed(self, load_id: int, reason: str) -> None:
        """The load ends early; what landed is kept, the rest is computed locally."""
        ...


class KVSource:
    """Something that can fill a sequence's KV for a token range: subclass it.

    ``match``, ``start_load`` and ``cancel`` are what every source implements. The rest are
    optional hooks, declared here with no-op defaults (as vLLM's ``KVConnectorBase_V1`` declares
    its optional methods), so the engine calls them without probing:

    - ``is_cache`` (False): tokens it delivers count as prefix-cache hits (``usage.cached_tokens``);
      otherwise they are remote prefill (``usage.prefill_location``).
    - ``logs_failures`` (False): the source logs its own failed loads, so the engine logs them at
      debug level only (each failure is logged once).
    - ``attach(engine)``: called on the engine's worker when the source is added (a peer client
      builds its HELLO from the engine's pool and starts connecting).
    - ``request_finished(request_id, tokens, usage)``: called on the worker when a request ends,
      before its last event (``tokens``: the sequence's token list, the object ``match`` was
      given), e.g. for a planner to compare its prediction with the measured TTFT.
    - ``load_info(load_id)``: what the source knows about one of its loads (``{"exact": bool}``:
      whether its KV is bit-identical to local prefill), or None.
    - ``close()``: called once when the engine shuts down (connections, threads).
    """

    name: str = "kv-source"
    is_cache: bool = False
    logs_failures: bool = False

    def match(self, tokens: list[int], start: int, end: int) -> int:
        """How many tokens beyond ``start`` (up to ``end``) this source offers to load (0: none).
        Called on the engine's worker while scheduling: it must not block."""
        raise NotImplementedError

    def start_load(self, load: KVLoad, sink: KVSink) -> None:
        """Begin loading; must not block the worker (a source that has the data at hand may
        deliver everything before returning). Deliver with ``sink.layer`` / ``sink.done`` /
        ``sink.failed``."""
        raise NotImplementedError

    def cancel(self, load_id: int) -> None:
        """The engine no longer wants this load (its request was cancelled or finished). Frames
        that still arrive are dropped; a ``done``/``failed`` after it is ignored."""
        raise NotImplementedError

    def attach(self, engine: Any) -> None:  # noqa: B027 (an optional hook: a no-op by default)
        """The source was added to ``engine`` (its worker thread is calling)."""

    def request_finished(self, request_id: str, tokens: list[int], usage: Any) -> None:  # noqa: B027
        """A request ended (on the worker, before its last event)."""

    def load_info(self, load_id: int) -> dict[str, Any] | None:
        """What the source knows about load ``load_id`` (``{"exact": bool}``), or None."""
        return None

    def close(self) -> None:  # noqa: B027
        """The engine shut down."""


class RangeSet:
    """Disjoint half-open integer ranges, merged as they are added."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, t0: int, t1: int) -> None:
        if t0 >= t1:
            return
        i = bisect.bisect_left(self._ends, t0)  # first range ending at or after t0: may merge
        j = bisect.bisect_right(self._starts, t1)  # ranges starting after t1 stay apart
        if i < j:
            t0 = min(t0, self._starts[i])
            t1 = max(t1, self._ends[j - 1])
        self._starts[i:j] = [t0]
        self._ends[i:j] = [t1]

    def end_from(self, t: int) -> int:
        """The end of the range covering ``t`` (``t`` itself when none does)."""
        i = bisect.bisect_right(self._starts, t) - 1
        if i >= 0 and self._ends[i] > t:
            return self._ends[i]
        return t

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends, strict=True))


class LandedKV:
    """Which token ranges of a sequence's KV have landed, per layer."""

    def __init__(self, num_layers: int):
        self.layers = [RangeSet() for _ in range(num_layers)]

    def add(self, layer: int, t0: int, t1: int) -> None:
        self.layers[layer].add(t0, t1)

    def complete_from(self, t: int) -> int:
        """The end of the run of tokens from ``t`` that has landed in every layer."""
        return min(r.end_from(t) for r in self.layers)


__all__ = ["KVLoad", "KVParts", "KVSink", "KVSource", "LandedKV", "RangeSet"]
