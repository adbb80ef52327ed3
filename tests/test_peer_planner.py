"""The offload planner (peer/planner.py): its arithmetic on known profiles, when it declines and
when it offloads, how its profiles follow observed requests, `duet peer plan`, and the auto policy
over a real loopback peer (long prompt offloaded, short one kept local, tokens exact either way)."""

from __future__ import annotations

import json

import pytest

from app.cli import main
from peer.export_connection import Connection
from peer.planner import CostModel, Planner, PromptMemory, plan_table
from tests.peer_pair import Pair, tiny_cfg, two_models
from tests.test_engine_tiny import prompts
from tests.test_remote_prefill_engine import run

MB = 1e6


def planner(**seed) -> Planner:
    p = Planner("gpu", kv_bytes_per_token=100_000, num_layers=10, chunk=100)
    return p.seed(**{"setup_s": 0.01, "tail_s": 0.005, **seed})


def test_remote_estimate_is_setup_plus_overlapped_compute_and_transfer_plus_tail():
    p = planner(local_tps=1000, remote_tps=4000, bandwidth_Bps=100 * MB)
    e = p.estimate(1001, 0)
    # the peer computes 1000 tokens (4000 tok/s: 0.25 s) and sends 1000 x 100 kB (100 MB/s: 1 s)
    assert e.compute_s == pytest.approx(0.25) and e.transfer_s == pytest.approx(1.0)
    assert e.bytes == 100 * 1000 * 1000 and e.frames == 10 * 10  # layers x chunks
    # only one frame's worth of the smaller side is not hidden behind the larger one
    assert e.remote_s == pytest.approx(0.01 + 1.0 + 0.25 / 100 + 0.005)
    assert e.local_s == pytest.approx(1001 / 1000)
    # a decoder already holding 500 tokens: local computes the rest, the peer sends only the rest
    # but computes from its own hit (none here)
    e = p.estimate(1001, 500)
    assert e.local_s == pytest.approx(501 / 1000)
    assert e.bytes == 500 * 100_000 and e.compute_s == pytest.approx(0.25)
    # the peer's own prefix hit saves its compute; its running work for us queues in front
    e = p.estimate(1001, 0, hit=800, queue_s=0.5)
    assert e.compute_s == pytest.approx(200 / 4000) and e.queue_s == 0.5
    assert e.remote_s == pytest.approx(0.01 + 0.5 + 1.0 + 0.05 / 100 + 0.005)


def test_it_offloads_only_when_remote_is_predicted_faster():
    fast = planner(local_tps=1000, remote_tps=10_000, bandwidth_Bps=10_000 * MB)
    d = fast.decide(2048, 0)
    assert d.offload and d.predicted_remote_s < d.predicted_local_s
    # a slow link: the transfer (2047 x 100 kB at 10 MB/s = 20 s) dwarfs local prefill (2 s)
    assert not planner(local_tps=1000, remote_tps=10_000, bandwidth_Bps=10 * MB).decide(2048, 0).offload
    # a slow peer on a fast link
    assert not planner(local_tps=1000, remote_tps=500, bandwidth_Bps=10_000 * MB).decide(2048, 0).offload
    # a short prompt: the round trip costs more than computing it here
    short = planner(local_tps=1000, remote_tps=10_000, bandwidth_Bps=10_000 * MB, setup_s=0.05)
    assert not short.decide(16, 0).offload and short.decide(2048, 0).offload
    # no fixed threshold: the break-even length moves with the profiles
    slower_local = planner(local_tps=200, remote_tps=10_000, bandwidth_Bps=10_000 * MB, setup_s=0.05)
    assert slower_local.decide(16, 0).offload
    # --remote-prefill always offloads, still with both predictions
    d = planner(local_tps=1000, remote_tps=500, bandwidth_Bps=10 * MB).decide(2048, 0, policy="always")
    assert d.offload and d.predicted_local_s is not None and d.predicted_remote_s is not None


def test_a_side_never_measured_is_tried_once_peer_first():
    p = Planner("gpu", kv_bytes_per_token=1000)
    d = p.decide(500, 0)
    assert d.offload and d.predicted_remote_s is None and "not measured" in d.reason
    p.observe_remote(499, 0, 0.1)
    p.observe_transfer(499_000, 0.05)
    d = p.decide(500, 0)  # the peer is measured now, local prefill is not
    assert not d.offload and d.predicted_local_s is None
    p.observe_local(500, 0, 1.0)
    assert p.decide(500, 0).offload  # 0.1 s + transfer against 1 s


def test_cost_model_fits_per_token_and_attention_cost_from_observed_requests():
    truth_a, truth_b = 1e-3, 2e-4  # seconds per token, and per token per 1024 tokens of context
    m = CostModel()
    for n, ctx in [(512, 0), (2048, 0), (256, 1024), (1024, 512)]:
        m.observe(n, ctx, n * (truth_a + truth_b * (ctx + n / 2) / 1024))
    assert m.a == pytest.approx(truth_a, rel=1e-6) and m.b == pytest.approx(truth_b, rel=1e-6)
    assert m.predict(4096, 0) == pytest.approx(4096 * (truth_a + truth_b * 2))
    # a fixed cost per request (scheduling, the last token's step) shows in short prompts
    f = CostModel()
    for n, ctx in [(64, 0), (512, 0), (2048, 0), (256, 1024), (128, 0)]:
        f.observe(n, ctx, 0.25 + n * (truth_a + truth_b * (ctx + n / 2) / 1024))
    assert f.c == pytest.approx(0.25, rel=1e-6) and f.a == pytest.approx(truth_a, rel=1e-6)
    assert f.predict(32, 0) == pytest.approx(0.25 + 32 * (truth_a + truth_b * 16 / 1024))
    # one prompt length cannot tell the terms apart: a plain rate
    r = CostModel()
    r.observe(512, 0, 0.5)
    r.observe(512, 0, 0.5)
    assert r.b == 0 and r.predict(1024, 0) == pytest.approx(1.0)


def test_profiles_follow_the_latest_requests():
    p = planner(local_tps=1000, remote_tps=4000, bandwidth_Bps=100 * MB)
    before = p.estimate(1001, 0)
    for _ in range(8):  # the machine got twice as slow: EWMA, so the recent requests win
        p.observe_local(1000, 0, 2.0)
        p.observe_remote(1000, 0, 0.5)
        p.observe_transfer(100 * 1000 * 1000, 2.0)
    after = p.estimate(1001, 0)
    assert after.local_s == pytest.approx(2 * before.local_s, rel=0.1)
    assert after.compute_s == pytest.approx(2 * before.compute_s, rel=0.1)
    assert after.transfer_s == pytest.approx(2 * before.transfer_s, rel=0.1)
    p.observe_setup(0.2)
    p.observe_tail(0.3)
    assert 0.01 < p.setup_s < 0.2 and 0.005 < p.tail_s < 0.3
    prof = p.profile()
    assert prof["local_samples"] == 9 and prof["link_MBps"] == pytest.approx(50, rel=0.1)


def test_the_peers_hit_is_estimated_from_the_prompts_sent_to_it():
    mem = PromptMemory()
    base = list(range(100, 400))
    mem.remember(base)
    assert mem.hit(base[:250] + [1, 2, 3], 253, 16) == 240  # common prefix 250, whole blocks only
    assert mem.hit([5] + base, 300, 16) == 0


def test_decisions_are_recorded_with_their_measured_ttft():
    p = planner(local_tps=1000, remote_tps=10_000, bandwidth_Bps=10_000 * MB)
    tokens = list(range(2048))
    d = p.decide(2048, 0, record=tokens)
    assert p.assign(tokens[:2048], 0, "req-1") is d and d.request_id == "req-1"
    assert p.finish("req-1", tokens, "remote:gpu", 0.5) is d
    assert d.measured_ttft_s == 0.5 and d.location == "remote:gpu"
    assert p.counts["remote"] == 1 and p.finished["remote"] == 1
    assert p.measured_sum["remote"] == 0.5 and p.predicted_sum["remote"] == pytest.approx(
        d.predicted_remote_s
    )
    # a prompt kept local is named by its request when it finishes
    short = list(range(10))
    d2 = p.decide(10, 0, record=short)
    assert not d2.offload
    assert p.finish("req-2", short, "local", 0.01) is d2 and p.decision("req-2") is d2
    assert d2.as_dict()["measured_ttft_s"] == 0.01 and d2.as_dict()["offload"] is False


def test_plan_table_compares_streamed_and_send_after_prefill():
    p = planner(local_tps=1000, remote_tps=4000, bandwidth_Bps=400 * MB, setup_s=0.0, tail_s=0.0)
    (row,) = plan_table(p, [1001])
    assert row["remote_send_after_s"] == pytest.approx(0.25 + 0.25)  # compute, then transfer
    assert row["remote_s"] == pytest.approx(0.25 + 0.25 / 100)  # overlapped
    assert row["choice"] == "remote"


def test_duet_peer_plan_prints_the_table(capsys):
    argv = ["peer", "plan", "--local-tps", "1000", "--remote-tps", "4000", "--link-gbps", "10"]
    argv += ["--model-kv-bytes-per-token", "131072", "--prompt-tokens", "512,8192", "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["prompt_tokens"] for r in rows] == [512, 8192]
    assert rows[1]["kv_MB"] == pytest.approx(8191 * 131072 / 1e6)
    assert rows[1]["choice"] == "remote"
    assert main(argv[:-1]) == 0
    out = capsys.readouterr().out
    assert "send-after s" in out and "8192" in out
    with pytest.raises(SystemExit):
        main(["peer", "plan", "--local-tps", "1000"])  # the profiles are required


@pytest.fixture(scope="module")
def llama2(tiny_dirs):
    return two_models(tiny_dirs("llama"))


def test_auto_offloads_a_long_prompt_to_a_fast_peer_and_keeps_a_short_one_local(llama2):
    from app.server.metrics import Metrics
    from peer.attach import peer_usage

    short, long = prompts(llama2[0].tokenizer.vocab_size, [12, 300], seed=21)
    pair = Pair(*llama2, tiny_cfg(), policy="auto")
    planner = pair.src.planner

    def fast_peer() -> None:  # a peer 1000x faster than this machine, 50 ms away
        planner.seed(local_tps=1000, remote_tps=1e6, bandwidth_Bps=1e12, setup_s=0.05, tail_s=0.0)

    try:
        fast_peer()
        ref_long, _ = run(pair.ref, long)
        tokens, last = run(pair.dec, long)
        u = last.usage
        assert u.prefill_location == f"remote:{pair.peer_name}" and tokens == ref_long
        d = planner.decision(last.request_id)
        assert d is not None and d.offload and d.measured_ttft_s == pytest.approx(u.ttft_s)
        assert d.predicted_remote_s < d.predicted_local_s
        plan = peer_usage(u, pair.dec, last.request_id)["plan"]
        assert plan["offload"] and plan["measured_ttft_s"] == round(u.ttft_s, 4)

        fast_peer()  # the measured profiles moved; put the fake fast peer back
        ref_short, _ = run(pair.ref, short)
        tokens, last = run(pair.dec, short)
        u = last.usage
        assert u.prefill_location == "local" and u.prompt_tokens_computed == 12 and tokens == ref_short
        d = planner.decision(last.request_id)
        assert d is not None and not d.offload and d.measured_ttft_s == pytest.approx(u.ttft_s)
        assert d.predicted_local_s < d.predicted_remote_s
        assert planner.local.samples >= 2  # seeded, then the short request's own TTFT

        text = Metrics(pair.dec).render().decode()
        peer = pair.peer_name
        assert f'duet_planner_decisions_total{{path="remote",peer="{peer}"}} 1.0' in text
        assert f'duet_planner_decisions_total{{path="local",peer="{peer}"}} 1.0' in text
        pair.assert_no_leaks()
    finally:
        pair.close()


class RecordingConnection(Connection):
    """Records, for each LAYER_KV frame queued for the sender, whether its export had finished."""

    queued_after_done: list[bool] = []

    def queue_layer(self, job, layer, t0, t1, arrays, n):
        type(self).queued_after_done.append(job.finished)
        super().queue_layer(job, layer, t0, t1, arrays, n)


@pytest.mark.parametrize("send_after", [False, True])
def test_send_after_prefill_control_holds_every_frame_until_the_prefill_is_done(llama2, send_after):
    """bench/disagg.py's control (PeerServer(send_after_prefill=True), exo's released design): the
    same KV and tokens, but no frame is queued for sending before the peer's whole prefill is done,
    where the normal peer queues every frame while it is still computing."""
    (p,) = prompts(llama2[0].tokenizer.vocab_size, [300], seed=22)
    RecordingConnection.queued_after_done = []
    pair = Pair(*llama2, tiny_cfg(), connection_class=RecordingConnection)
    pair.server.send_after_prefill = send_after
    try:
        ref, _ = run(pair.ref, p)
        tokens, last = run(pair.dec, p)
        assert last.usage.prefill_location == f"remote:{pair.peer_name}" and tokens == ref
        (info,) = pair.src.loads_of(last.request_id)
        frames = pair.dec.pool.num_layers * -(-299 // pair.chunk)
        assert info["frames"] == frames
        assert RecordingConnection.queued_after_done == [send_after] * frames
        if send_after:
            assert info["wait_s"] > info["compute_s"] > 0  # the first frame left after the compute
        pair.assert_no_leaks()
    finally:
        pair.close()
