"""Prometheus metrics: latency histograms and token counters from the server, gauges read
from ``engine.stats()`` at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mlx_engine.engine import Engine
from mlx_engine.request import Usage

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
            "duet_kv_cache_bytes": ("KV cache size in bytes", s.kv_bytes),
            "duet_prefix_cache_hit_rate": (
                "prompt tokens served from the prefix cache / prompt tokens looked up",
                s.prefix_hit_rate,
            ),
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


class Metrics:
    def __init__(self, engine: Engine):
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
        self.requests = Counter(
            "duet_requests",
            "finished requests by endpoint and finish reason",
            ["endpoint", "finish_reason"],
            registry=r,
        )
        r.register(_EngineCollector(engine))

    def observe_usage(self, u: Usage) -> None:
        self.prompt_tokens.inc(u.prompt_tokens)
        self.cached_tokens.inc(u.cached_tokens)
        self.generated_tokens.inc(u.completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
