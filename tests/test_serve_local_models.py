"""Issue 33's whole path as a user walks it: `duet pull` two models from a hub (a local one on
loopback, tests/hf_endpoint.py), `duet serve` with no --model serves every local model, loads each
on first use, answers both at once, and unloads each after its idle keep-alive, with /v1/models and
`duet ps` telling the truth at every step."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time

import httpx
import pytest

from mlx_engine.loading.resolve import BUNDLED_NAME, bundled_model_path
from tests.hf_endpoint import HubServer, subprocess_env
from tests.test_server_harness import ServerProcess
from tests.tiny_models import make_tiny_model_dir

pytestmark = pytest.mark.timeout(300)
GGUF_REPO, MLX_REPO = "owner/smol-GGUF", "owner/tiny-llama"
GGUF_NAME = f"{GGUF_REPO}:Q4_1"


def duet(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


def cards(base: str) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(base + "/v1/models", timeout=30).json()["data"]}


def wait_for(condition, what: str, timeout: float = 60):
    """Poll ``condition`` until it holds (the reaper runs on its own clock; nothing here races it)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture
def pulled(tmp_path):
    """An HF home holding a GGUF quant and an MLX-style model, both pulled through `duet pull`."""
    tiny = make_tiny_model_dir(tmp_path / "tiny", "llama")
    repos = {
        GGUF_REPO: {"smol.Q4_1.gguf": bundled_model_path(), "README.md": b"# smol\n"},
        MLX_REPO: {f.name: f for f in tiny.iterdir() if f.is_file()},
    }
    hf_home, data = tmp_path / "hf", tmp_path / "data"
    with HubServer(repos) as hub:
        env = subprocess_env(hub, hf_home, DUET_DATA_DIR=str(data))
        for spec in (f"hf.co/{GGUF_REPO}:q4_1", MLX_REPO):
            r = duet(env, "pull", spec)
            assert r.returncode == 0, r.stderr
    return {"HF_HOME": str(hf_home), "DUET_DATA_DIR": str(data)}


def test_serve_without_a_model_loads_each_local_model_on_first_use_and_unloads_it_when_idle(pulled, tmp_path):
    server = ServerProcess(
        None, tmp_path / "serve.log", "--cache-gb", "0.05", "--keep-alive", "10m", env=pulled
    )
    try:
        listed = cards(server.base)
        assert {BUNDLED_NAME, GGUF_NAME, MLX_REPO} <= set(listed)
        assert not any(c["loaded"] for c in listed.values())  # nothing loads before it is asked for
        assert listed[GGUF_NAME]["quant"] == "Q4_1" and listed[GGUF_NAME]["size_bytes"] > 90e6

        def ask(model: str) -> dict:
            body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
            r = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(ask, [GGUF_NAME, MLX_REPO]))
        assert [a["model"] for a in answers] == [GGUF_NAME, MLX_REPO]
        listed = cards(server.base)
        assert listed[GGUF_NAME]["loaded"] and listed[MLX_REPO]["loaded"]
        assert not listed[BUNDLED_NAME]["loaded"]

        env = {**pulled, "PATH": "/usr/bin:/bin"}
        ps = duet(env, "ps", "--server", server.base)
        assert ps.returncode == 0, ps.stderr
        assert GGUF_NAME in ps.stdout and MLX_REPO in ps.stdout and BUNDLED_NAME not in ps.stdout
        held = {
            m["name"]: m
            for m in json.loads(duet(env, "ps", "--server", server.base, "--json").stdout)["models"]
        }
        gguf = held[GGUF_NAME]  # memory as weights + the KV budget, the context, the idle time left
        assert gguf["weights_bytes"] > 50e6 and gguf["kv_budget_bytes"] > 0
        assert (
            gguf["size"] == gguf["weights_bytes"] + gguf["kv_budget_bytes"] and gguf["context_length"] == 8192
        )

        # a keep-alive of 3 s for both (the load route; Ollama's keep_alive or LM Studio's ttl on a
        # request does the same): once idle that long, each unloads (the reaper), and both listings say so
        for model in (GGUF_NAME, MLX_REPO):
            r = httpx.post(
                server.base + "/v1/models/load", json={"model": model, "keep_alive": "3s"}, timeout=60
            )
            assert r.status_code == 200 and r.json()["expires_in"] <= 3
        wait_for(
            lambda: not any(c["loaded"] for c in cards(server.base).values()), "the idle models to unload"
        )
        ps = duet(env, "ps", "--server", server.base)
        assert ps.returncode == 0 and GGUF_NAME not in ps.stdout and MLX_REPO not in ps.stdout
        assert "unloading model owner/tiny-llama (idle for 3 s)" in server.log()
        # and a request loads it again
        assert ask(MLX_REPO)["model"] == MLX_REPO
    finally:
        server.stop()
