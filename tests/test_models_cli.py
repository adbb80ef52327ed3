"""``duet pull``, ``duet models``, ``duet rm``, ``duet show`` and ``duet ps`` as a user runs them,
against a local hub (tests/hf_endpoint.py) and a stand-in server for /api/ps."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mlx_engine.loading.resolve import bundled_model_path
from tests.hf_endpoint import HubServer, subprocess_env

REPO = "owner/smol-GGUF"


@pytest.fixture
def hub():
    repos = {REPO: {"smol.Q4_1.gguf": bundled_model_path(), "smol.Q8_0.gguf": b"tiny", "README.md": b"hi"}}
    with HubServer(repos) as server:
        yield server


def duet(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_pull_models_rm(hub, tmp_path):
    env = subprocess_env(
        hub, tmp_path / "hf", DUET_DATA_DIR=str(tmp_path / "data"), DUET_SERVER="http://127.0.0.1:9"
    )
    r = duet(env, "pull", f"hf.co/{REPO}:q4_1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("smol.Q4_1.gguf") and "98.4 MB downloaded" in r.stdout
    assert "smol.Q4_1.gguf" in r.stderr and "100%" in r.stderr  # the progress bar

    r = duet(env, "models")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith(f"{REPO}:Q4_1"))
    assert line.split()[1:5] == ["gguf", "Q4_1", "98.4", "MB"] and "8192" in line and "never" in line
    assert "bundled" in r.stdout

    listed = json.loads(duet(env, "models", "--json").stdout)
    entry = next(e for e in listed if e["name"] == f"{REPO}:Q4_1")
    assert entry["size"] == bundled_model_path().stat().st_size and entry["architecture"] == "llama"
    assert entry["loaded"] is None  # no server answered

    r = duet(env, "rm", f"{REPO}:Q4_1")
    assert r.returncode == 0 and f"deleted {REPO}:Q4_1" in r.stdout, r.stderr
    assert f"{REPO}:Q4_1" not in duet(env, "models").stdout
    assert not list((tmp_path / "hf" / "hub").glob("models--owner--smol-GGUF/blobs/*"))

    r = duet(env, "rm", f"{REPO}:Q4_1")
    assert r.returncode == 2 and "no model" in r.stderr and "SmolLM2-135M-Instruct" in r.stderr
    r = duet(env, "rm", "default")
    assert r.returncode == 2 and "bundled model" in r.stderr and "cannot be removed" in r.stderr


def test_pull_errors_are_one_line(hub, tmp_path):
    env = subprocess_env(hub, tmp_path / "hf")
    r = duet(env, "pull", "owner/missing:Q4_0")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no such model repository" in r.stderr
    r = duet(env, "pull", f"{REPO}:Q5_K_M")
    assert r.returncode == 2 and "available quants: Q4_1, Q8_0" in r.stderr


def test_show_bundled_model():
    r = subprocess.run(
        [sys.executable, "-m", "app.cli", "show", "--json"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["bundled"] and info["architecture"] == "llama" and info["context_length"] == 8192
    assert info["parameters"] > 100_000_000 and info["tensor_types"]["Q4_1"] > 0
    assert info["chat_template"] == "chatml" and info["reasoning_format"] is None


class _PsHandler(BaseHTTPRequestHandler):
    seen: list[str] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        type(self).seen.append(self.headers.get("Authorization", ""))
        body = json.dumps(
            {
                "models": [
                    {
                        "name": "SmolLM2-135M-Instruct-Q4_1",
                        "model": "SmolLM2-135M-Instruct-Q4_1",
                        "size": 98362432,
                        "size_vram": 0,
                        "expires_at": "2999-01-01T00:00:00Z",
                        "context_length": 8192,
                    }
                ]
            }
        ).encode()
        self.send_response(200 if self.path == "/api/ps" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def ps_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _PsHandler)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_ps_lists_what_the_server_holds(ps_server):
    env = _base_env()
    r = duet(env, "ps", "--server", ps_server + "/v1", "--api-key", "sekrit")
    assert r.returncode == 0, r.stderr
    assert "SmolLM2-135M-Instruct-Q4_1" in r.stdout and "98.4 MB" in r.stdout and "8192" in r.stdout
    assert _PsHandler.seen[-1] == "Bearer sekrit"
    r = duet({**env, "DUET_SERVER": ps_server}, "models")
    assert "LOADED" in r.stdout and "yes" in r.stdout


def test_ps_without_a_server_is_a_clear_error():
    r = duet(_base_env(), "ps", "--server", "http://127.0.0.1:9")
    assert r.returncode == 2 and "no Duet server answers at http://127.0.0.1:9" in r.stderr


def _base_env() -> dict[str, str]:
    import os

    return dict(os.environ)
