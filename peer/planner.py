"""The offload planner: per request, is remote prefill faster than local prefill, and by how much?

Predicted time to first token on each path, from profiles measured on real requests:

- **local**: ``local.predict(N - start, start)``, a prefill cost model fitted to this engine's own
  TTFTs (before the first one: the engine's step rate, ``Engine.local_prefill_rate``);
- **remote**: ``setup + queue + max(C, T) + min(C, T) / K + tail``, where
  ``C = remote.predict(N - 1 - h, h)`` is the peer's compute for the tokens it must compute from its
  own prefix hit ``h`` (estimated from the prompts this decoder sent it), ``T = bytes / bandwidth``
  the transfer of ``[start, N - 1)`` in the decoder's KV format, ``K`` the number of frames
  (layers x chunks: the peer sends each layer of each chunk as soon as it is computed, so only one
  frame's worth of the smaller side is not overlapped), ``setup`` the PREFILL -> ACCEPT round trip,
  ``queue`` the peer's work still running for this decoder, and ``tail`` what follows the last frame
  (the decoder's last-token step).

Profiles: the two cost models are exponentially weighted least-squares fits (forgetting factor
``FORGET``: an EWMA over requests) of ``t = c + n * (a + b * (ctx + n / 2))`` (a fixed cost per
request, a per-token cost and attention over the context); bandwidth is bytes / reading time of LAYER_KV frames; setup and tail are
EWMAs. A side never measured is tried once (the peer first); after that the planner offloads only
when the predicted remote TTFT is below the local one: there is no fixed threshold.

Every decision is kept (``Decision``: offloaded or not, why, predicted local and remote TTFT and,
once the request finished, the measured TTFT) for ``duet generate --json`` and ``/metrics``.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

FORGET = 0.7  # weight kept by older observations at each new one (EWMA weight 0.3)
CTX_SCALE = 1024.0  # keeps the two least-squares features of comparable size


def _ewma(old: float | None, new: float, weight: float = 1 - FORGET) -> float:
    if old is None or not math.isfinite(old):
        return new
    return (1 - weight) * old + weight * new


class CostModel:
    """Prefill seconds for ``n`` new tokens after ``ctx`` cached ones:
    ``c + n * (a + b * (ctx + n / 2))``: a fixed cost per request (scheduling, the last token's step,
    sampling), a cost per token, and attention over the context.

    Fitted by exponentially weighted least squares over observed requests. Terms the observations
    cannot tell apart yet (too few prompt lengths), or that the fit would make negative, are left out,
    in this order: ``c``, then ``b`` (a plain rate). ``seed_rate`` stands for one observation of a
    known rate."""

    def __init__(self, forget: float = FORGET):
        self.forget = forget
        self._sxx = np.zeros((3, 3))
        self._sxy = np.zeros(3)
        self.samples = 0
        self.a: float | None = None  # seconds per token
        self.b = 0.0  # seconds per token per CTX_SCALE tokens of context
        self.c = 0.0  # seconds per request

    @staticmethod
    def _features(n: float, ctx: float) -> np.ndarray:
        return np.array([n, n * (ctx + n / 2) / CTX_SCALE, 1.0], dtype=np.float64)

    def observe(self, n: int, ctx: int, seconds: float) -> None:
        if n <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        x = self._features(n, max(ctx, 0))
        # scale each observation to unit weight on its own size, so one huge prompt does not
        # drown the others: fit seconds/n against x/n
        x, y = x / n, seconds / n
        self._sxx = self.forget * self._sxx + np.outer(x, x)
        self._sxy = self.forget * self._sxy + x * y
        self.samples += 1
        self._solve()

    def seed_rate(self, tokens_per_s: float) -> None:
        if tokens_per_s > 0:
            self.observe(1, 0, 1.0 / tokens_per_s)
            self.a, self.b, self.c = 1.0 / tokens_per_s, 0.0, 0.0

    def _solve(self) -> None:
        s, r = self._sxx, self._sxy
        for terms in ([0, 1, 2], [0, 1]):  # (a, b, c), then (a, b)
            if self.samples < len(terms):
                continue
            sub = s[np.ix_(terms, terms)]
            if np.linalg.det(sub) <= 1e-6 * np.prod(np.diag(sub)):
                continue  # not enough distinct prompts to tell these terms apart
            coef = np.linalg.solve(sub, r[terms])
            if coef[0] > 0 and (coef[1:] >= 0).all():
                self.a, self.b = float(coef[0]), float(coef[1])
                self.c = float(coef[2]) if len(terms) == 3 else 0.0
                return
        self.a, self.b, self.c = (float(r[0] / s[0, 0]) if s[0, 0] > 0 else None), 0.0, 0.0

    def predict(self, n: int, ctx: int) -> float | None:
        if self.a is None:
            return None
        if n <= 0:
            return 0.0
        return float(self._features(n, max(ctx, 0)) @ np.array([self.a, self.b, self.c]))

    def rate(self, n: int = 512, ctx: int = 0) -> float | None:
        t = self.predict(n, ctx)
        return None if not t else n / t


@dataclass
class Estimate:
    """Predicted seconds for one prompt on each path (None: that side is not measured yet)."""

    n_tokens: int  # the prompt's length N
    start: int  # tokens the decoder holds already
    hit: int  # the peer's prefix hit assumed (tokens it need not compute)
    bytes: int  # KV bytes the peer would send: [start, N - 1)
    local_s: float | None
    remote_s: float | None
    compute_s: float | None = None  # the peer's compute
    transfer_s: float | None = None  # bytes / bandwidth
    setup_s: float = 0.0  # PREFILL -> ACCEPT
    queue_s: float = 0.0  # the peer's work for this decoder still running
    tail_s: float = 0.0  # last frame -> first token (the decoder's last-token step)
    frames: int = 1

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


@dataclass
class Decision:
    """One planned request: where its prefill ran, why, and predicted against measured TTFT."""

    peer: str
    n_tokens: int
    start: int
    offload: bool
    reason: str
    predicted_local_s: float | None
    predicted_remote_s: float | None
    estimate: Estimate
    request_id: str | None = None
    location: str | None = None  # where the prefill ran in the end (usage.prefill_location)
    measured_ttft_s: float | None = None
    t: float = field(default_factory=time.monotonic)

    @property
    def predicted_s(self) -> float | None:
        """The prediction for the path taken."""
        remote = (self.location or "").startswith("remote:") if self.location else self.offload
        return self.predicted_remote_s if remote else self.predicted_local_s

    def as_dict(self) -> dict[str, Any]:
        r = lambda v: None if v is None else round(v, 4)  # noqa: E731
        return {
            "peer": self.peer,
            "offload": self.offload,
            "reason": self.reason,
            "predicted_local_ttft_s": r(self.predicted_local_s),
            "predicted_remote_ttft_s": r(self.predicted_remote_s),
            "measured_ttft_s": r(self.measured_ttft_s),
            "location": self.location,
            "estimate": self.estimate.as_dict(),
        }


class PromptMemory:
    """The prompts this decoder sent a peer (the latest ``size``): the peer's prefix cache likely
    still holds them, so its hit ``h`` for a new prompt is estimated as the longest common prefix,
    rounded down to the peer's block size."""

    def __init__(self, size: int = 32):
        self._prompts: deque[np.ndarray] = deque(maxlen=size)

    def remember(self, tokens: list[int]) -> None:
        self._prompts.append(np.asarray(tokens, dtype=np.int64))

    def hit(self, tokens: list[int], end: int, block_size: int) -> int:
        if not self._prompts or end <= 0:
            return 0
        q = np.asarray(tokens[:end], dtype=np.int64)
        best = 0
        for p in self._prompts:
            m = min(len(p), len(q))
            same = p[:m] == q[:m]
            best = max(best, m if same.all() else int(np.argmin(same)))
        return best // max(block_size, 1) * max(block_size, 1)


class Planner:
    """Offload decisions for one peer, from profiles measured on real requests (module docstring).

    Thread-safe. ``kv_bytes_per_token`` (all layers, the decoder's wire format), ``num_layers`` and
    ``chunk`` describe the transfer; ``local_rate_fn`` gives the engine's step rate, used for local
    prefill until this planner has seen a local request."""

    def __init__(
        self,
        peer: str = "peer",
        *,
        kv_bytes_per_token: int = 0,
        num_layers: int = 1,
        chunk: int = 512,
        local_rate_fn: Callable[[], float | None] | None = None,
        history: int = 256,
    ):
        self.peer = peer
        self.kv_bytes_per_token = kv_bytes_per_token
        self.num_layers = max(num_layers, 1)
        self.chunk = max(chunk, 1)
        self.local_rate_fn = local_rate_fn
        self.local = CostModel()
        self.remote = CostModel()
        self.bandwidth: float | None = None  # bytes/s of LAYER_KV frames (EWMA)
        self.setup_s: float | None = None  # PREFILL sent -> ACCEPT (EWMA)
        self.tail_s: float | None = None  # last frame -> first token (EWMA)
        self._lock = threading.Lock()
        self._pending: OrderedDict[int, tuple[list[int], Decision]] = OrderedDict()
        self._by_request: OrderedDict[str, Decision] = OrderedDict()
        self._history = history
        self.counts = {"remote": 0, "local": 0}  # decisions taken
        self.finished = {"remote": 0, "local": 0}  # ... whose request finished (measured)
        self.predicted_sum = {"remote": 0.0, "local": 0.0}  # sum of the taken path's prediction
        self.measured_sum = {"remote": 0.0, "local": 0.0}  # sum of measured TTFT
        self.abs_error_sum = {"remote": 0.0, "local": 0.0}  # sum of |predicted / measured - 1|

    # --- profiles ------------------------------------------------------------------------------
    def seed(
        self,
        *,
        local_tps: float | None = None,
        remote_tps: float | None = None,
        bandwidth_Bps: float | None = None,
        setup_s: float | None = None,
        tail_s: float | None = None,
    ) -> Planner:
        """Known profiles (``duet peer plan``, tests) instead of measured ones."""
        with self._lock:
            if local_tps:
                self.local.seed_rate(local_tps)
            if remote_tps:
                self.remote.seed_rate(remote_tps)
            if bandwidth_Bps:
                self.bandwidth = bandwidth_Bps
            if setup_s is not None:
                self.setup_s = setup_s
            if tail_s is not None:
                self.tail_s = tail_s
        return self

    def observe_local(self, n: int, ctx: int, seconds: float) -> None:
        """A local prefill of ``n`` tokens after ``ctx`` cached ones took ``seconds`` (to first token)."""
        with self._lock:
            self.local.observe(n, ctx, seconds)

    def observe_remote(self, n: int, hit: int, seconds: float) -> None:
        """The peer computed ``n`` tokens after its own hit ``hit`` in ``seconds`` (its DONE)."""
        with self._lock:
            self.remote.observe(n, hit, seconds)

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        """LAYER_KV frames of ``nbytes`` in all took ``seconds`` to read off the socket."""
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self.bandwidth = _ewma(self.bandwidth, nbytes / seconds)

    def observe_setup(self, seconds: float) -> None:
        if seconds >= 0:
            with self._lock:
                self.setup_s = _ewma(self.setup_s, seconds)

    def observe_tail(self, seconds: float) -> None:
        if seconds >= 0:
            with self._lock:
                self.tail_s = _ewma(self.tail_s, seconds)

    def profile(self) -> dict[str, Any]:
        """The measured profiles, as plain data (for UIs and --json)."""
        r = lambda v: None if v is None else round(v, 6)  # noqa: E731
        local_rate = self.local.rate()
        if local_rate is None and self.local_rate_fn is not None:
            local_rate = self.local_rate_fn()
        return {
            "local_tps": r(local_rate),
            "remote_tps": r(self.remote.rate()),
            "link_MBps": r(self.bandwidth / 1e6 if self.bandwidth else None),
            "setup_s": r(self.setup_s),
            "tail_s": r(self.tail_s),
            "local_samples": self.local.samples,
            "remote_samples": self.remote.samples,
        }

    # --- prediction ----------------------------------------------------------------------------
    def _local_s(self, n: int, start: int) -> float | None:
        t = self.local.predict(n - start, start)
        if t is None and self.local_rate_fn is not None:
            rate = self.local_rate_fn()
            if rate:
                t = (n - start) / rate
        return t

    def estimate(self, n_tokens: int, start: int, hit: int = 0, queue_s: float = 0.0) -> Estimate:
        """Predicted TTFT of a prompt of ``n_tokens`` of which the decoder holds ``start`` and the
        peer (presumably) ``hit``, on each path."""
        with self._lock:
            return self._estimate(n_tokens, start, hit, queue_s)

    def _estimate(self, n_tokens: int, start: int, hit: int, queue_s: float) -> Estimate:
        end = n_tokens - 1
        hit = max(min(hit, end), 0)
        nbytes = max(end - start, 0) * self.kv_bytes_per_token
        local = self._local_s(n_tokens, start)
        est = Estimate(n_tokens, start, hit, nbytes, local, None)
        compute = self.remote.predict(end - hit, hit)
        if compute is None or not self.bandwidth:
            return est
        transfer = nbytes / self.bandwidth
        frames = self.num_layers * max(-(-(end - min(hit, start)) // self.chunk), 1)
        tail = self.tail_s
        if tail is None:  # before any remote request finished: one local step of one token
            tail = self.local.predict(1, end) or 0.0
        est.compute_s, est.transfer_s, est.frames = compute, transfer, frames
        est.setup_s, est.queue_s, est.tail_s = self.setup_s or 0.0, max(queue_s, 0.0), tail
        est.remote_s = (
            est.setup_s + est.queue_s + max(compute, transfer) + min(compute, transfer) / frames + tail
        )
        return est

    def decide(
        self,
        n_tokens: int,
        start: int,
        hit: int = 0,
        queue_s: float = 0.0,
        *,
        policy: str = "auto",
        record: list[int] | None = None,
    ) -> Decision:
        """Offload or not (``policy`` "always": offload, still predicted and recorded). With
        ``record`` (the sequence's token list, as the scheduler holds it) the decision is kept until
        ``assign`` / ``finish`` name its request."""
        with self._lock:
            est = self._estimate(n_tokens, start, hit, queue_s)
            if policy == "always":
                offload, why = True, "--remote-prefill always"
            elif est.remote_s is None:
                offload, why = True, "the peer is not measured yet: trying it"
            elif est.local_s is None:
                offload, why = False, "local prefill is not measured yet: trying it"
            else:
                offload = est.remote_s < est.local_s
                why = (
                    f"predicted remote {est.remote_s:.3f} s {'<' if offload else '>='} "
                    f"local {est.local_s:.3f} s"
                )
            d = Decision(self.peer, n_tokens, start, offload, why, est.local_s, est.remote_s, est)
            if record is not None:
                self._pending[id(record)] = (record, d)
                while len(self._pending) > self._history:
                    self._pending.popitem(last=False)
                self.counts["remote" if offload else "local"] += 1
            return d

    # --- the decisions' requests ---------------------------------------------------------------
    def assign(self, tokens: list[int], start: int, request_id: str) -> Decision | None:
        """A load for ``request_id`` started: name the pending decision of that prompt."""
        with self._lock:
            for key, (ref, d) in reversed(self._pending.items()):
                if d.start == start and len(ref) >= len(tokens) and ref[: len(tokens)] == tokens:
                    del self._pending[key]
                    return self._keep(request_id, d)
        return None

    def _keep(self, request_id: str, d: Decision) -> Decision:
        d.request_id = request_id
        self._by_request[request_id] = d
        while len(self._by_request) > self._history:
            self._by_request.popitem(last=False)
        return d

    def finish(self, request_id: str, tokens: list[int], location: str, ttft_s: float) -> Decision | None:
        """The request ended with its first token after ``ttft_s`` (0: none), its prefill at
        ``location``; returns its decision, now with the measured TTFT."""
        with self._lock:
            d = self._by_request.get(request_id)
            if d is None:
                item = self._pending.pop(id(tokens), None)
                if item is None or item[0] is not tokens:
                    return None
                d = self._keep(request_id, item[1])
            if d.measured_ttft_s is not None:
                return d
            d.location = location
            if ttft_s > 0:
                d.measured_ttft_s = ttft_s
                path = "remote" if location.startswith("remote:") else "local"
                predicted = d.predicted_remote_s if path == "remote" else d.predicted_local_s
                if predicted is not None:
                    self.finished[path] += 1
                    self.predicted_sum[path] += predicted
                    self.measured_sum[path] += ttft_s
                    self.abs_error_sum[path] += abs(predicted / ttft_s - 1)
            return d

    def decision(self, request_id: str) -> Decision | None:
        with self._lock:
            return self._by_request.get(request_id)

    def decisions(self) -> list[Decision]:
        """The latest decisions with a request, oldest first."""
        with self._lock:
            return list(self._by_request.values())


def plan_table(planner: Planner, prompt_tokens: list[int]) -> list[dict[str, Any]]:
    """Rows for ``duet peer plan``: predicted TTFT local against remote for each prompt length,
    with the remote path overlapped (layer-streamed) and sent only after the whole prefill."""
    rows = []
    for n in prompt_tokens:
        e = planner.estimate(n, 0)
        after = None
        if e.compute_s is not None and e.transfer_s is not None:
            after = e.setup_s + e.compute_s + e.transfer_s + e.tail_s
        rows.append(
            {
                "prompt_tokens": n,
                "local_s": e.local_s,
                "remote_compute_s": e.compute_s,
                "transfer_s": e.transfer_s,
                "kv_MB": e.bytes / 1e6,
                "remote_s": e.remote_s,
                "remote_send_after_s": after,
                "choice": "remote"
                if e.remote_s is not None and e.local_s is not None and e.remote_s < e.local_s
                else "local",
            }
        )
    return rows


def format_plan(rows: list[dict[str, Any]]) -> str:
    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    head = (
        "prompt",
        "local s",
        "peer compute s",
        "transfer s",
        "KV MB",
        "remote s",
        "send-after s",
        "choice",
    )
    body = [
        (
            str(r["prompt_tokens"]),
            s(r["local_s"]),
            s(r["remote_compute_s"]),
            s(r["transfer_s"]),
            f"{r['kv_MB']:.1f}",
            s(r["remote_s"]),
            s(r["remote_send_after_s"]),
            r["choice"],
        )
        for r in rows
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    return "\n".join(
        "  ".join(x.rjust(w) for x, w in zip(line, widths, strict=True)) for line in [head, *body]
    )


__all__ = ["CostModel", "Decision", "Estimate", "Planner", "PromptMemory", "format_plan", "plan_table"]
