"""`/metrics` (app/server/metrics.py) for remote prefill, with two real engines over a loopback
socket: one remote prefill that completes, then one that fails mid-stream (a corrupted payload
injected on the real server's send path) and falls back locally for the rest. The scrape counts
both requests as remote prefills (the second partly), the fallback by its reason, the KV bytes
received and the peer's health."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.peer_fakes import fault_connection
from tests.peer_pair import Pair, tiny_cfg, two_models
from tests.test_engine_tiny import prompts
from tests.test_remote_prefill_engine import run


def scrape(engine) -> dict[tuple[str, tuple], float]:
    from app.server.metrics import Metrics

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(Metrics(engine).render().decode())
        for s in fam.samples
    }


def test_metrics_count_remote_prefills_fallbacks_by_reason_and_bytes(tiny_dirs):
    models = two_models(tiny_dirs("llama"))
    # frames of a load past the 3rd are corrupted: a 40-token prompt (2 frames) goes through
    pair = Pair(*models, tiny_cfg(), connection_class=fault_connection("corrupt", 3))
    try:
        short, long = prompts(models[0].tokenizer.vocab_size, [40, 300], seed=3)
        _, ok = run(pair.dec, short)
        assert ok.usage.prefill_location == f"remote:{pair.peer_name}"
        _, failed = run(pair.dec, long)
        assert failed.usage.fallback_reason == f"{pair.peer_name}: checksum"
        assert 0 < failed.usage.remote_tokens < 299  # a chunk landed before the fault: partly remote
        m = scrape(pair.dec)
        peer = (("peer", pair.peer_name),)
        assert m[("duet_remote_prefills_total", ())] == 2  # requests with KV from the peer, partly too
        assert m[("duet_kv_load_failures_total", ())] == 1
        assert m[("duet_remote_prefill_fallbacks_total", (*peer, ("reason", "checksum")))] == 1
        assert m[("duet_peer_failures_total", (*peer, ("reason", "checksum")))] == 1
        assert m[("duet_remote_prefill_bytes_received_total", peer)] == pair.src.bytes_received
        assert pair.src.bytes_received >= ok.usage.remote_bytes + failed.usage.remote_bytes > 0
        assert m[("duet_peer_healthy", peer)] == 0  # backing off after the failure
        pair.assert_no_leaks()
    finally:
        pair.close()
