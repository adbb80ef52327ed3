"""Faults over a real network link: two network namespaces joined by a veth pair (made by
``tests/test_peer_discovery.py``'s ``netns_pair``: unique names, deleted with every process in them
even on failure), ``duet peer serve`` in one, a decoder in the other, paired, mutual TLS.

The peer is SIGKILLed while the KV layers stream: the decoder (a script on the Engine API, run with
``ip netns exec``) stops reading after the first LAYER_KV frame has landed and says so on stdout;
the test kills the peer then, and lets the decoder go on. TCP buffers in both namespaces are kept
small (namespaced ``tcp_rmem`` / ``tcp_wmem``), so most of the prompt's KV is still in the peer's
process, not in flight, when it dies. The decoder's request still returns the greedy tokens of a
local prefill, reports the fallback, and no KV block stays held.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest

from tests.test_peer_discovery import DUET, TLS_CLIENT_HELLO, WAIT, VethCapture, _in_ns, _pair
from tests.test_peer_discovery import netns_pair as netns_pair  # the fixture

PROMPT_TOKENS = 1800  # ~0.9 MB of KV on the tiny model: far more than the shrunken TCP buffers hold

DECODER = r"""
import json, sys
from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.loading.loader import load_model
from peer.client import Backoff, PeerTimeouts, RemotePrefillSource
from peer.trust.tls import PeerTLS
from peer.wire.protocol import LayerKV
from tests.test_engine_tiny import assert_no_leaks, prompts
from tests.test_remote_prefill_engine import NoPeer, run

host, port, model_dir, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])


class HoldAtFirstLayer(RemotePrefillSource):
    # once the first chunk has landed in every layer, stop reading until the test has killed the peer
    held = False

    def handle_frame(self, conn, frame, *args, **kw):
        msg = frame.msg
        first = isinstance(msg, LayerKV) and msg.layer == self.local.num_layers - 1 and not self.held
        super().handle_frame(conn, frame, *args, **kw)
        if first:
            self.held = True
            print("streaming", flush=True)
            sys.stdin.readline()


model = load_model(model_dir)
cfg = EngineConfig(cache_gb=0.05)
ref = Engine(model, cfg)
ref.add_kv_source(NoPeer())  # local prefill on the same grid (the last prompt token alone)
dec = Engine(model, cfg)
long = PeerTimeouts(first_byte_s=300, stall_s=300)  # the hold must not read as a stall
src = HoldAtFirstLayer(host, port, policy="always", tls=PeerTLS.load(), name="gpu", timeouts=long,
                       backoff=Backoff(initial_s=300))
dec.add_kv_source(src)
dec.run_on_worker(lambda: None, 300)
assert src.connect(wait_s=60), src.status()
(prompt,) = prompts(model.tokenizer.vocab_size, [n], seed=7)
tokens, last = run(dec, prompt, 8)
ref_tokens, _ = run(ref, prompt, 8)
dec.run_on_worker(lambda: None, 300)
assert_no_leaks(dec)
stats = dec.stats()
u = last.usage
print(json.dumps({
    "tokens": tokens, "ref_tokens": ref_tokens, "held": src.held,
    "fallback_reason": u.fallback_reason, "remote_tokens": u.remote_tokens,
    "remote_bytes": u.remote_bytes, "computed": u.prompt_tokens_computed,
    "fallbacks": dict(src.fallbacks), "blocks_used": stats.kv_blocks_used,
}), flush=True)
for e in (dec, ref):
    e.shutdown()
"""


def _small_tcp_buffers(ns: str) -> None:
    for key in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
        subprocess.run(
            ["ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}=4096 16384 65536"],
            check=True,
            capture_output=True,
            timeout=WAIT,
        )


@pytest.mark.slow
def test_peer_killed_mid_stream_over_the_namespace_link(netns_pair, tmp_path, tiny_dirs):
    ns_a, ip_a, ns_b, ip_b, _, _ = netns_pair
    gpu_dir, mac_dir = tmp_path / "gpu", tmp_path / "mac"
    _pair(ns_a, ip_a, ns_b, gpu_dir, mac_dir)
    for ns in (ns_a, ns_b):
        _small_tcp_buffers(ns)
    model = str(tiny_dirs("llama"))
    serve = _in_ns(
        ns_a,
        gpu_dir,
        *DUET,
        "peer",
        "serve",
        "--model",
        model,
        "--cache-gb",
        "0.05",
        "--host",
        ip_a,
        "--port",
        "0",
        "--no-advertise",
    )
    decoder = None
    try:
        assert serve.stderr is not None
        port = None
        for line in serve.stderr:
            if m := re.search(r"prefill peer serving .* at [0-9.]+:(\d+), mutual TLS", line):
                port = int(m.group(1))
                break
        assert port is not None, "duet peer serve did not come up"
        script = tmp_path / "decoder.py"
        script.write_text(DECODER)
        decoder = _in_ns(
            ns_b,
            mac_dir,
            sys.executable,
            str(script),
            ip_a,
            str(port),
            model,
            str(PROMPT_TOKENS),
            stdin=subprocess.PIPE,
        )
        assert decoder.stdout is not None and decoder.stdin is not None
        line = decoder.stdout.readline()  # a chunk landed in every layer; the decoder reads no further
        assert line.strip() == "streaming", decoder.stderr.read() if decoder.stderr else line
        serve.send_signal(signal.SIGKILL)
        assert serve.wait(WAIT) == -signal.SIGKILL
        decoder.stdin.write("go\n")
        decoder.stdin.flush()
        out, err = decoder.communicate(timeout=300)
        assert decoder.returncode == 0, err
    finally:
        for p in (serve, decoder):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(WAIT)
    r = json.loads(out.strip().splitlines()[-1])
    assert r["held"] and r["tokens"] == r["ref_tokens"]
    assert 0 < r["remote_tokens"] < PROMPT_TOKENS - 1 and r["remote_bytes"] > 0  # killed mid-stream
    assert r["computed"] == PROMPT_TOKENS - r["remote_tokens"]  # the rest was prefilled here
    reason = r["fallback_reason"] or ""
    assert reason.startswith("gpu: ") and reason.split(": ")[1] in ("truncated", "disconnected"), reason
    assert sum(r["fallbacks"].values()) == 1 and r["blocks_used"] == 0
    assert "peer gpu: remote prefill of" in err and "prefilling the rest locally" in err


@pytest.mark.slow
def test_trusted_link_between_two_namespaces_needs_both_sides(netns_pair, tmp_path, tiny_dirs):
    """`duet peer serve --link trusted` and `duet generate --peer-link trusted`: remote prefill with
    the greedy tokens of local prefill; a decoder asking for TLS is refused on both sides (no silent
    downgrade) and answers locally."""
    ns_a, ip_a, ns_b, ip_b, _, veth_b = netns_pair
    gpu_dir, mac_dir = tmp_path / "gpu", tmp_path / "mac"
    _pair(ns_a, ip_a, ns_b, gpu_dir, mac_dir)
    model = str(tiny_dirs("llama"))
    serve = _in_ns(
        ns_a, gpu_dir, *DUET, "peer", "serve", "--model", model, "--cache-gb", "0.05", "--host", ip_a,
        "--port", "0", "--no-advertise", "--link", "trusted",
    )  # fmt: skip
    try:
        assert serve.stderr is not None
        port = None
        for line in serve.stderr:
            if m := re.search(
                r"at [0-9.]+:(\d+), mutual TLS .*then a trusted link: frames authenticated", line
            ):
                port = int(m.group(1))
                break
        assert port is not None, "duet peer serve --link trusted did not come up"
        common = ["generate", "--model", model, "--cache-gb", "0.05", "--raw", "--json", "--temperature", "0"]
        common += ["--prompt", "The quick brown fox jumps over the lazy dog. " * 8, "--max-tokens", "6"]
        common += ["--peers", f"{ip_a}:{port}"]

        def generate(*extra: str) -> tuple[dict, str]:
            p = _in_ns(ns_b, mac_dir, *DUET, *common, *extra)
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            return json.loads(out), err

        capture = VethCapture(ns_b, veth_b, tmp_path / "veth.cap")
        try:
            trusted, _ = generate("--peer-link", "trusted", "--remote-prefill", "always")
        finally:
            wire = capture.stop()
        local, _ = generate("--remote-prefill", "never")
        refused, err = generate("--remote-prefill", "always")  # the default link: tls
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            _, serve_err = serve.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            serve.kill()
            _, serve_err = serve.communicate()
    assert trusted["usage"]["prefill_location"] == f"remote:{ip_a}:{port}"
    assert trusted["usage"]["remote_bytes"] > 0 and trusted["token_ids"] == local["token_ids"]
    assert refused["usage"]["prefill_location"] == "local" and refused["token_ids"] == local["token_ids"]
    assert "refused this machine: it serves a trusted link (authenticated, not encrypted)" in err
    assert "refused mac: it asked for a tls link (encrypted)" in serve_err
    assert "paired decoder mac (TLS 1.3 handshake; trusted link" in serve_err
    # on the veth: a TLS handshake first, then the peer protocol in plaintext (authenticated only)
    assert TLS_CLIENT_HELLO in wire and b"DUETLINK" not in wire
    assert wire.index(TLS_CLIENT_HELLO) < wire.index(b"model_fingerprint") and b"layer_kv" in wire
