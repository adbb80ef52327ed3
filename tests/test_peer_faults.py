"""The fault matrix of remote prefill over a loopback socket, with two real engines: the peer
killed after N frames, a truncated frame, a corrupted payload, a stall, a mismatched model or
protocol version, a busy peer. Every case ends with the request answered with local prefill's
tokens, the landed prefix kept (frames counted: they did arrive before the fault), one clear log
line, no leaked blocks on either side, no partly loaded block in the prefix index, and a follow-up
request that hits the prefix cache. Faults are injected on the real server's send path
(tests/peer_fakes.FaultConnection); nothing sleeps."""

from __future__ import annotations

import logging

import pytest

from peer.client import PeerTimeouts
from peer.server import ServerLimits
from tests.peer_fakes import fault_connection
from tests.peer_pair import Pair, tiny_cfg, two_models
from tests.test_engine_tiny import prompts
from tests.test_remote_prefill_engine import Capture, indexed_blocks_hold_the_reference, run

N = 300  # prompt tokens; chunks of 64 -> 5 chunks x 2 layers = 10 frames
CHUNK = 64


@pytest.fixture(scope="module")
def llama2(tiny_dirs):
    return two_models(tiny_dirs("llama"))


def client_lines(caplog, code: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "duet.peer.client" and r.levelno >= logging.WARNING and f"({code})" in r.getMessage()
    ]


def check_follow_up(pair: Pair, p: list[int], ref_tokens: list[int], ref_kv) -> None:
    """Only whole, correct blocks are in the decoder's prefix index, and the next request for the
    same prompt hits them and the part-full block after them, all of the prompt but its last token
    (the peer is backing off or refused: it is not offered)."""
    assert indexed_blocks_hold_the_reference(pair.dec, p, ref_kv) == (N - 1) // 16
    again, last = run(pair.dec, p)
    assert again == ref_tokens
    assert last.usage.cached_tokens == N - 1
    assert last.usage.prefill_location == "local"
    pair.assert_no_leaks()


@pytest.mark.parametrize(
    "fault, after, code",
    [
        ("kill", 1, "disconnected"),
        ("kill", 5, "disconnected"),
        ("truncate", 4, "truncated"),
        ("corrupt", 3, "checksum"),
        ("stall", 6, "timeout"),
    ],
)
def test_a_fault_mid_stream_keeps_the_landed_prefix(llama2, caplog, fault, after, code):
    (p,) = prompts(llama2[0].tokenizer.vocab_size, [N], seed=20 + after)
    conn_cls = fault_connection(fault, after)
    timeouts = PeerTimeouts(stall_s=1.0) if fault == "stall" else None
    pair = Pair(*llama2, tiny_cfg(), connection_class=conn_cls, timeouts=timeouts)
    try:
        ref_cap, dec_cap = Capture(pair.ref, p), Capture(pair.dec, p)
        ref_tokens, _ = run(pair.ref, p)
        with caplog.at_level(logging.WARNING):
            tokens, last = run(pair.dec, p)
        assert conn_cls.tripped.is_set()
        u = last.usage
        (info,) = pair.src.loads_of(last.request_id)
        assert info["frames"] == after and info["outcome"] == code  # frames arrived before the fault
        L = pair.dec.pool.num_layers
        landed = CHUNK * (after // L)  # chunks whose every layer arrived
        assert u.remote_tokens == landed and u.prompt_tokens_computed == N - landed
        assert u.prefill_location == (f"remote:{pair.peer_name}" if landed else "local")
        assert u.fallback_reason == f"{pair.peer_name}: {code}"
        assert tokens == ref_tokens
        assert dec_cap.kv == ref_cap.kv  # the rest was computed on the same grid: still exact
        lines = client_lines(caplog, code)
        assert any(f"after {after} frames" in line for line in lines), lines
        assert pair.src.fallbacks[code] == 1 and not pair.src.healthy
        if fault == "stall":
            conn_cls.release.set()  # the peer's stuck send goes out; its later frames never do
        pair.assert_no_leaks()
        check_follow_up(pair, p, ref_tokens, ref_cap.kv)
    finally:
        conn_cls.release.set()
        pair.close()


@pytest.mark.parametrize(
    "change, code",
    [
        ({"model_fingerprint": "xxh3-128:" + "0" * 32}, "fingerprint"),
        ({"protocol_min": 2, "protocol_max": 2}, "version"),
    ],
)
def test_a_mismatched_peer_is_refused_before_any_compute(llama2, caplog, change, code):
    (p,) = prompts(llama2[0].tokenizer.vocab_size, [N], seed=30)
    with caplog.at_level(logging.WARNING):
        pair = Pair(*llama2, tiny_cfg(), hello_change=change)
    try:
        assert not pair.src.healthy and pair.src.last_error[0] == code
        assert len(client_lines(caplog, code)) == 1  # the reason, once
        ref_cap = Capture(pair.ref, p)
        ref_tokens, _ = run(pair.ref, p)
        tokens, last = run(pair.dec, p)
        assert tokens == ref_tokens and last.usage.prefill_location == "local"
        assert "exports" not in pair.server.stats.counts  # no PREFILL reached the peer
        assert pair.peer.stats().steps == 0  # the peer computed nothing
        check_follow_up(pair, p, ref_tokens, ref_cap.kv)
    finally:
        pair.close()


def test_a_busy_peer_answers_busy_and_the_decoder_prefills_locally(llama2, caplog):
    (p,) = prompts(llama2[0].tokenizer.vocab_size, [N], seed=31)
    pair = Pair(*llama2, tiny_cfg(), limits=ServerLimits(max_exports=0))
    try:
        ref_cap = Capture(pair.ref, p)
        ref_tokens, _ = run(pair.ref, p)
        with caplog.at_level(logging.WARNING):
            tokens, last = run(pair.dec, p)
        u = last.usage
        assert tokens == ref_tokens and u.prefill_location == "local" and u.prompt_tokens_computed == N
        assert u.fallback_reason == f"{pair.peer_name}: busy"
        assert pair.server.stats.counts["busy"] == 1 and pair.src.fallbacks["busy"] == 1
        assert pair.peer.stats().steps == 0
        assert client_lines(caplog, "busy")
        check_follow_up(pair, p, ref_tokens, ref_cap.kv)
    finally:
        pair.close()
