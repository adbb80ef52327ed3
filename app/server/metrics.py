"""Prometheus metrics: latency histograms and token counters from the server, gauges read
from ``engine.stats()`` at scrape time."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mlx_engine.engine import Engine, EngineStats
from mlx_engine.request import Usage

if TYPE_CHECKING:
    from .registry import ModelRegistry

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30, 60)


class _EngineCollector:
    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        gauges = {
            "duet_requests_running": ("requests being generated", s.running),
            "duet_requests_waiting": ("requests waiting for a slot", s.waiting),
            "duet_kv_blocks_total": ("KV cache blocks", s.kv_blocks_total),
            "duet_kv_blocks_used": ("KV cache blocks held by requests", s.kv_blocks_used),
            "duet_kv_blocks_free": (
                "KV cache blocks not held by requests",
                s.kv_blocks_total - s.kv_blocks_used,
            ),
            "duet_kv_blocks_cached": ("free KV blocks kept for prefix reuse", s.kv_blocks_cached),
            "duet_kv_cache_bytes": ("KV cache bytes allocated now (it grows as blocks are used)", s.kv_bytes),
            "duet_kv_cache_budget_bytes": (
                "KV cache bytes once grown to its budget",
                s.kv_blocks_total * s.kv_block_bytes,
            ),
            "duet_prefix_cache_hit_rate": (
                "prompt tokens served from the prefix cache / prompt tokens looked up",
                s.prefix_hit_rate,
            ),
            # MLX's allocator: what arrays hold now, the freed buffers it keeps for reuse (the
            # cache, which grows to the largest working set seen), and the most ever held at once
            "duet_mlx_active_bytes": ("bytes MLX arrays hold now", mx.get_active_memory()),
            "duet_mlx_cache_bytes": ("freed bytes MLX keeps for reuse", mx.get_cache_memory()),
            "duet_mlx_peak_bytes": ("the most bytes MLX arrays held at once", mx.get_peak_memory()),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "duet_prefix_cache_query_tokens": (
                "prompt tokens looked up in the prefix cache",
                s.prefix_query_tokens,
            ),
            "duet_prefix_cache_hit_tokens": ("prompt tokens found in the prefix cache", s.prefix_hit_tokens),
            "duet_preemptions": ("requests preempted for KV space", s.preemptions),
            "duet_engine_steps": ("engine steps run", s.steps),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        yield from _peer_metrics(self.engine, s)


def _peer_metrics(engine: Engine, s: EngineStats):
    """Remote prefill (docs/peer-protocol.md): requests prefilled by a peer, loads that fell back to
    local prefill by peer and reason, KV bytes received, and whether each peer is usable now."""
    from peer.attach import sources_of

    yield CounterMetricFamily(
        "duet_remote_prefills", "requests whose prompt KV came from a prefill peer", value=s.remote_prefills
    )
    yield CounterMetricFamily(
        "duet_kv_load_failures",
        "KV loads that ended early (the rest was prefilled locally)",
        value=s.kv_load_failures,
    )
    sources = sources_of(engine)
    received = CounterMetricFamily(
        "duet_remote_prefill_bytes_received", "KV payload bytes received from a peer", labels=["peer"]
    )
    fallbacks = CounterMetricFamily(
        "duet_remote_prefill_fallbacks",
        "remote prefills that fell back to local prefill",
        labels=["peer", "reason"],
    )
    failures = CounterMetricFamily(
        "duet_peer_failures",
        "times a peer was marked unhealthy (and backed off), by reason",
        labels=["peer", "reason"],
    )
    healthy = GaugeMetricFamily(
        "duet_peer_healthy", "1 when the peer is connected and usable", labels=["peer"]
    )
    decisions = CounterMetricFamily(
        "duet_planner_decisions",
        "offload planner decisions, by peer and chosen path",
        labels=["peer", "path"],
    )
    predicted = CounterMetricFamily(
        "duet_planner_predicted_ttft_seconds",
        "sum of the planner's predicted TTFT for the path taken, over finished requests",
        labels=["peer", "path"],
    )
    measured = CounterMetricFamily(
        "duet_planner_measured_ttft_seconds",
        "sum of the measured TTFT over the same requests",
        labels=["peer", "path"],
    )
    for src in sources:
        planner = src.planner
        for path in ("local", "remote"):
            decisions.add_metric([src.name, path], planner.counts[path])
            predicted.add_metric([src.name, path], planner.predicted_sum[path])
            measured.add_metric([src.name, path], planner.measured_sum[path])
        received.add_metric([src.name], src.bytes_received)
        healthy.add_metric([src.name], 1 if src.healthy else 0)
        for reason, n in sorted(src.fallbacks.items()):
            fallbacks.add_metric([src.name, reason], n)
        for reason, n in sorted(src.failures.items()):
            failures.add_metric([src.name, reason], n)
    yield from (received, fallbacks, failures, healthy, decisions, predicted, measured)


class Metrics:
    """One model's metrics (``engine``'s gauges read at scrape time; None: the embedding model's
    counters only)."""

    def __init__(self, engine: Engine | None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "duet_time_to_first_token_seconds",
            "request arrival to first token",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.itl = Histogram(
            "duet_inter_token_latency_seconds",
            "time between streamed tokens",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "duet_request_duration_seconds",
            "request arrival to last token",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.prompt_tokens = Counter("duet_prompt_tokens", "prompt tokens processed", registry=r)
        self.cached_tokens = Counter(
            "duet_cached_prompt_tokens", "prompt tokens served from the prefix cache", registry=r
        )
        self.generated_tokens = Counter("duet_generation_tokens", "tokens generated", registry=r)
        self.embedding_tokens = Counter(
            "duet_embedding_tokens", "input tokens embedded (/v1/embeddings)", registry=r
        )
        self.spec_proposed = Counter(
            "duet_speculative_proposed_tokens",
            "tokens proposed by speculative decoding and verified",
            registry=r,
        )
        self.spec_accepted = Counter(
            "duet_speculative_accepted_tokens", "proposed tokens kept (equal to what was sampled)", registry=r
        )
        self.requests = Counter(
            "duet_requests",
            "finished requests by endpoint and finish reason",
            ["endpoint", "finish_reason"],
            registry=r,
        )
        if engine is not None:
            r.register(_EngineCollector(engine))

    def observe_usage(self, u: Usage) -> None:
        self.prompt_tokens.inc(u.prompt_tokens)
        self.cached_tokens.inc(u.cached_tokens)
        self.generated_tokens.inc(u.completion_tokens)
        if u.speculative:
            self.spec_proposed.inc(u.speculative["proposed"])
            self.spec_accepted.inc(u.speculative["accepted"])

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LabelledModels:
    """Every loaded model's metrics in one exposition, each sample labelled ``model="NAME"``
    (families of the same name merged across models, as Prometheus wants them once)."""

    def __init__(self, models: ModelRegistry, embedding: Metrics | None, embedding_name: str | None):
        self.models, self.embedding, self.embedding_name = models, embedding, embedding_name

    def collect(self):
        merged: dict[str, Metric] = {}
        sources = [(m.model.name, m.state.metrics.registry) for m in self.models.loaded()]
        if self.embedding is not None and self.embedding_name:
            sources.append((self.embedding_name, self.embedding.registry))
        for name, registry in sources:
            for family in registry.collect():
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(family.name, family.documentation, family.type)
                for sample in family.samples:
                    labels = {"model": name, **sample.labels}
                    out.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
        loaded = GaugeMetricFamily("duet_model_loaded", "1 for each model loaded now", labels=["model"])
        for m in self.models.loaded():
            loaded.add_metric([m.model.name], 1)
        yield from merged.values()
        yield loaded


class ModelMetrics:
    """The server's /metrics: per model, labelled; ``embedding`` the embedding model's counters."""

    def __init__(
        self, models: ModelRegistry, embedding: Metrics | None = None, embedding_name: str | None = None
    ):
        self.embedding = embedding
        self.registry = CollectorRegistry()
        self.registry.register(_LabelledModels(models, embedding, embedding_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)
