"""The scheduler's record of KV loads in flight (``LiveLoads``): which sequence each load fills,
where each arriving frame goes, what landed in every layer, and how each load ended; and
``ask_sources``, which asks the KV sources in order what they offer of a prompt. The scheduler
(``mlx_engine/scheduler.py``) decides when a sequence loads and moves it between its queues."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from mlx_engine.kv_cache.kv_source import KVLoad, KVSource
from mlx_engine.sequence import KVTarget, Sequence, StartLoad


@dataclass(eq=False)
class LiveLoad:
    load: KVLoad
    source: KVSource
    seq: Sequence
    done: bool = False


def ask_sources(
    sources: list[KVSource], tokens: list[int], start: int, end: int
) -> list[tuple[KVSource, int, int]]:
    """What the sources offer of tokens ``[start, end)``, asked in order, each one continuing
    where the one before stopped: ``(source, a, b)`` per offer."""
    pos, offers = start, []
    for src in sources:
        if pos >= end:
            break
        n = max(min(int(src.match(tokens, pos, end)), end - pos), 0)
        if n:
            offers.append((src, pos, pos + n))
            pos += n
    return offers


class LiveLoads:
    """The scheduler's record of KV loads in flight, by load id (unique per engine)."""

    def __init__(self) -> None:
        self._loads: dict[int, LiveLoad] = {}
        self._ids = itertools.count(1)
        self.started = 0
        self.failed = 0  # ended early (their landed prefix was kept)

    def start(
        self, seq: Sequence, offers: list[tuple[KVSource, int, int]], block_size: int
    ) -> list[StartLoad]:
        """One load per offer ``(source, a, b)`` of tokens ``[a, b)`` of ``seq``."""
        out = []
        for src, a, b in offers:
            load = KVLoad(next(self._ids), seq.request_id, seq.tokens[: b + 1], a, b, block_size)
            self._loads[load.load_id] = LiveLoad(load, src, seq)
            seq.loads.add(load.load_id)
            seq.load_ranges.append((src.name, bool(src.is_cache), a, b))
            out.append(StartLoad(src, load))
            self.started += 1
        return out

    def get(self, load_id: int) -> LiveLoad | None:
        return self._loads.get(load_id)

    def pop(self, load_id: int) -> LiveLoad | None:
        return self._loads.pop(load_id, None)

    def landed(self, load_id: int, layer: int, t0: int, t1: int) -> tuple[Sequence | None, int]:
        """Layer ``layer`` of tokens ``[t0, t1)`` of load ``load_id`` is in the pool: the load's
        sequence with ``num_computed`` advanced over what every layer holds now, and how many of
        those new tokens came from a cache source; None when the load is no longer live or no
        token is new in every layer."""
        st = self._loads.get(load_id)
        if st is None:
            return None, 0
        seq = st.seq
        assert seq.landed is not None
        seq.landed.add(layer, t0, t1)
        a, b = seq.num_computed, seq.landed.complete_from(seq.num_computed)
        if b <= a:
            return None, 0  # nothing new in every layer
        cached = seq.credit_sources(a, b)
        seq.num_computed = b
        return seq, cached

    def end(self, load_id: int, reason: str | None) -> Sequence | None:
        """Load ``load_id`` ended (``reason`` None: done, else why it failed; a load done with
        tokens missing in some layer failed too): out of the record and of its sequence's loads,
        counted and noted on the sequence when it failed. Returns the sequence (None: the load
        was no longer live)."""
        st = self._loads.pop(load_id, None)
        if st is None:
            return None
        seq, load = st.seq, st.load
        seq.loads.discard(load_id)
        assert seq.landed is not None
        got = seq.landed.complete_from(load.start)
        if reason is None and got < load.end:
            reason = f"done with tokens [{load.start}, {got}) of [{load.start}, {load.end}) in every layer"
        if reason is not None:
            self.failed += 1
            seq.load_failures.append(f"{st.source.name}: {reason}")
        return seq

    def target(self, load_id: int, layer: int, t0: int, t1: int, num_layers: int) -> KVTarget | None:
        st = self._loads.get(load_id)
        if st is None:
            return None
        load, seq = st.load, st.seq
        if not (0 <= layer < num_layers and load.start <= t0 < t1 <= load.end):
            raise ValueError(
                f"KV frame for layer {layer}, tokens [{t0}, {t1}) is outside load {load_id}'s "
                f"{num_layers} layers and tokens [{load.start}, {load.end})"
            )
        # tokens below num_computed have landed in every layer already (and may be registered,
        # shared blocks): never written again
        lo = max(t0, seq.num_computed)
        if lo >= t1:
            return None
        return KVTarget(seq, seq.blocks, lo, t1)
