"""When a decoder offers a prompt to its prefill peer: ``OffloadChoice`` holds the policy ("always"
or "auto"), the offload planner (``peer/planner.py``) that predicts which side gives the first token
sooner, what the peer's prefix cache likely holds (the prompts sent to it), and the local prefill
rate; it feeds the planner what each finished request measured."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from peer.planner import Planner, PromptMemory

POLICIES = ("auto", "always")


class OffloadChoice:
    def __init__(self, name: str, policy: str):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        self.name, self.policy = name, policy
        self.planner = Planner(name, local_rate_fn=self.local_rate)
        self.sent_prompts = PromptMemory()  # what the peer's prefix cache likely holds
        self._local_rate: float | None = None  # tokens/s of local prefill (EWMA, observe_local_prefill)
        self.local_rate_fn: Callable[[], float | None] | None = None  # the engine's, when attached

    def configure(self, kv_bytes_per_token: int, num_layers: int, chunk_size: int) -> None:
        self.planner.kv_bytes_per_token = kv_bytes_per_token
        self.planner.num_layers, self.planner.chunk = num_layers, max(chunk_size, 1)

    def observe_local_prefill(self, tokens: int, seconds: float) -> None:
        """The engine's local prefill rate, for the auto policy."""
        if tokens > 0 and seconds > 0:
            self._local_rate = _ewma(self._local_rate, tokens / seconds)

    def local_rate(self) -> float | None:
        if self.local_rate_fn is not None:
            rate = self.local_rate_fn()
            if rate:
                return rate
        return self._local_rate

    def worth_offloading(self, n: int, queue_s: float) -> bool:
        """Auto policy for ``n`` uncached tokens (none held by either side): the planner's decision
        (predicted remote TTFT below local; a side never measured is tried once, the peer first)."""
        return self.planner.decide(n + 1, 0, 0, queue_s).offload

    def offers(self, seq_tokens: list[int], start: int, end: int, queue_s: float, block: int) -> bool:
        """Whether to offer ``[start, end)`` of ``seq_tokens`` to the peer (the decision is recorded
        for the request); ``queue_s``: the peer's compute still ahead of it for this decoder's loads,
        ``block``: its prefix cache's block size."""
        hit = self.sent_prompts.hit(seq_tokens, end, block)
        d = self.planner.decide(end + 1, start, hit, queue_s, policy=self.policy, record=seq_tokens)
        return self.policy != "auto" or d.offload

    def request_finished(
        self, request_id: str, tokens: list[int], usage: Any, remote_loads: Callable[[], list[dict]]
    ) -> None:
        """The engine ended a request: the planner gets its measured TTFT, and the profiles the local
        TTFT (a request prefilled here) or what followed the peer's last frame (a request prefilled
        by this peer; ``remote_loads``: its loads' records)."""
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
            infos = [i for i in remote_loads() if i["outcome"] == "done"]
            if len(infos) == 1:
                self.planner.observe_tail(max(ttft - infos[0]["total_s"], 0.0))


def _ewma(old: float | None, new: float, weight: float = 0.3) -> float:
    if old is None or not math.isfinite(old):
        return new
    return (1 - weight) * old + weight * new
