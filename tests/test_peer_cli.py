"""The peer commands as a user runs them: `duet peer serve` in a process of its own, and
`duet generate` / `duet serve` with `--peers` and `--remote-prefill` in others, over loopback.

Option errors run `app.cli.main` in this process with the model loader replaced by a stand-in that
fails the test if called, so "refused before loading" is checked directly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app import cli
from tests.test_server_harness import ServerProcess, unlabelled


def env() -> dict[str, str]:
    """Read when a process starts, not at import: the suite's per-user directories (conftest) are set
    after collection, and a peer and its decoder must share one config directory (its local secret)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


WAIT = 180.0  # a deadline for hangs only
PROMPT = "The quick brown fox jumps over the lazy dog. " * 20


def duet(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(),
    )


class PeerProcess:
    """`duet peer serve --port 0` in a subprocess; ``port`` once it printed where it listens."""

    def __init__(self, model, *extra: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "peer", "serve", "--model", str(model), "--port", "0", *extra],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env(),
        )
        self.lines: list[str] = []
        self.port: int | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(WAIT) or self.port is None:
            self.stop()
            raise RuntimeError("duet peer serve did not come up:\n" + "".join(self.lines))

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # drained to the end, so the child never blocks on stderr
            self.lines.append(line)
            if "prefill peer serving" in line:
                self.port = int(line.rsplit(":", 1)[1])
                self._ready.set()
        self._ready.set()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def no_loading(monkeypatch):
    """Any model load fails the test."""
    from mlx_engine.engine import Engine

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(Engine, "load", refuse)
    import app.options

    monkeypatch.setattr(app.options, "check_model_args", lambda args: None)  # duet peer serve checks it


@pytest.mark.parametrize(
    "argv, message",
    [
        (["peer", "serve", "--host", "0.0.0.0"], "--host 0.0.0.0 is not a loopback address"),
        (["peer", "serve", "--host", "192.0.2.7"], "is not a loopback address"),
        (["peer", "serve", "--max-exports", "0"], "--max-exports must be at least 1"),
        (
            ["generate", "--prompt", "hi", "--remote-prefill", "always"],
            "--remote-prefill always needs --peers",
        ),
        (["generate", "--prompt", "hi", "--peers", "127.0.0.1"], "--peers '127.0.0.1' is not HOST:PORT"),
        (["serve", "--peers", "127.0.0.1:99999"], "is not HOST:PORT"),
        (["chat", "--peers", ":7611"], "is not HOST:PORT"),
    ],
)
def test_peer_options_are_checked_before_anything_loads(no_loading, capsys, argv, message):
    assert cli.main(argv) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("duet: error: ") and message in err


def test_generate_with_a_peer_process_matches_local_prefill(tiny_dirs, tmp_path):
    """`duet generate --peers ... --remote-prefill always --json` prefills on the peer process
    and gives the greedy tokens of `--remote-prefill never`; with the peer gone it says why and
    still answers, with the same tokens."""
    model = tiny_dirs("llama")
    common = ["generate", "--model", str(model), "--cache-gb", "0.05", "--raw", "--json"]
    common += ["--prompt", PROMPT, "--max-tokens", "8", "--temperature", "0"]
    peer = PeerProcess(model, "--cache-gb", "0.05")
    where = f"127.0.0.1:{peer.port}"
    try:
        remote = duet(*common, "--peers", where, "--remote-prefill", "always")
        local = duet(*common, "--peers", where, "--remote-prefill", "never")
    finally:
        assert peer.stop() == 0, "".join(peer.lines)  # SIGTERM: a clean exit
    assert remote.returncode == 0, remote.stderr
    assert local.returncode == 0, local.stderr
    r, lo = json.loads(remote.stdout), json.loads(local.stdout)
    u = r["usage"]
    assert u["prefill_location"] == f"remote:{where}"
    assert u["remote_tokens"] == u["prompt_tokens"] - 1 and u["prompt_tokens_computed"] == 1
    assert u["exact"] is True and u["fallback_reason"] is None
    (load,) = u["remote_loads"]
    assert load["outcome"] == "done" and load["frames"] > 0 and load["bytes"] == u["remote_bytes"] > 0
    assert lo["usage"]["prefill_location"] == "local" and "remote_loads" not in lo["usage"]
    assert r["token_ids"] == lo["token_ids"]
    # the peer is gone: the request is answered locally and says why
    gone = duet(*common, "--peers", where, "--remote-prefill", "always")
    assert gone.returncode == 0, gone.stderr
    g = json.loads(gone.stdout)
    assert g["usage"]["prefill_location"] == "local" and g["token_ids"] == r["token_ids"]
    assert g["usage"]["fallback_reason"] == f"{where}: disconnected"
    assert f"peer {where}: cannot connect" in gone.stderr and gone.stderr.count("(disconnected)") == 1


def test_serve_with_a_peer_counts_remote_prefills_in_metrics(tiny_dirs, tmp_path):
    model = tiny_dirs("llama")
    peer = PeerProcess(model, "--cache-gb", "0.05")
    where = f"127.0.0.1:{peer.port}"
    server = None
    try:
        server = ServerProcess(
            model,
            tmp_path / "serve.log",
            "--cache-gb",
            "0.05",
            "--peers",
            where,
            "--remote-prefill",
            "always",
        )
        body = {"model": str(model), "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        r = httpx.post(server.base + "/v1/completions", json=body, timeout=WAIT)
        assert r.status_code == 200, r.text
        samples = {
            (s.name, tuple(sorted(unlabelled(s.labels).items()))): s.value
            for fam in text_string_to_metric_families(httpx.get(server.base + "/metrics", timeout=30).text)
            for s in fam.samples
        }
        assert samples[("duet_remote_prefills_total", ())] == 1
        assert samples[("duet_peer_healthy", (("peer", where),))] == 1
        assert samples[("duet_remote_prefill_bytes_received_total", (("peer", where),))] > 0
        assert not any(name == "duet_remote_prefill_fallbacks_total" for name, _ in samples)
    finally:
        if server is not None:
            server.stop()
        peer.stop()


def test_chat_connects_its_engine_to_the_peers(tiny_dirs, monkeypatch):
    """The full-screen chat's engine gets the --peers too (here one that is not listening: it is
    tried, found unavailable, and the chat prefills locally)."""
    import socket

    import app.tui.main
    from peer.attach import sources_of

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    built: dict = {}
    monkeypatch.setattr(app.tui.main, "ChatApp", lambda model, **kw: built.update(kw, model=model))
    model = str(tiny_dirs("llama"))
    args = cli.build_parser().parse_args(
        ["chat", "--model", model, "--cache-gb", "0.05", "--peers", f"127.0.0.1:{port}"]
    )
    app.tui.main.build_app(args)
    backend = built["load_backend"](model)
    try:
        (src,) = sources_of(backend.engine)
        assert src.name == f"127.0.0.1:{port}" and src.policy == "auto"
        assert not src.healthy and src.last_error[0] == "disconnected"
    finally:
        backend.close()
