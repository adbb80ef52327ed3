"""Smoke test: `duet chat` in a real terminal (tmux), typed into with send-keys, read with capture-pane."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.tui.store import Store
from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.request import GenerationRequest, SamplingParams

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)"),
]


class Tmux:
    """One tmux server on a private socket, so the test never touches anyone else's sessions."""

    def __init__(self, name: str):
        self.socket = name
        self.target = f"{name}:0"

    def run(self, *args: str) -> str:
        return subprocess.run(
            ["tmux", "-L", self.socket, *args], check=True, capture_output=True, text=True
        ).stdout

    def alive(self) -> bool:
        """Whether `duet chat` still runs (the pane stays after it exits: remain-on-exit)."""
        return self.run("display-message", "-p", "-t", self.target, "#{pane_dead}").strip() == "0"

    def pane(self) -> str:
        return self.run("capture-pane", "-p", "-t", self.target)

    def send(self, *keys: str) -> None:
        self.run("send-keys", "-t", self.target, *keys)

    def type_line(self, text: str) -> None:
        self.send("-l", text)  # literally, no key-name lookup
        self.send("Enter")

    def wait_for(self, pattern: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.pane()
            if re.search(pattern, screen):
                return screen
            if not self.alive():
                break
            time.sleep(0.2)
        raise AssertionError(f"{pattern!r} never appeared; the screen was:\n{screen}")

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


def greedy_reply(model: Path, text: str, max_tokens: int) -> str:
    engine = Engine.load(str(model), config=EngineConfig(cache_gb=0.02))

    async def run():
        req = GenerationRequest(
            messages=[{"role": "user", "content": text}],
            max_tokens=max_tokens,
            sampling=SamplingParams(temperature=0.0),
        )
        return "".join([ev.text async for ev in engine.generate(req)])

    try:
        return asyncio.run(run())
    finally:
        engine.shutdown()


def test_duet_chat_in_tmux(tiny_dirs, tmp_path):
    model = tiny_dirs("llama")
    data = tmp_path / "data"
    env = {
        "DUET_DATA_DIR": str(data),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TERM": "xterm-256color",
        "PYTHONPATH": str(ROOT),
    }
    cmd = " ".join(
        [
            "env",
            *(f"{k}={shlex.quote(v)}" for k, v in env.items()),
            shlex.quote(sys.executable),
            "-m",
            "app.cli",
            "chat",
            "--model",
            shlex.quote(str(model)),
            "--cache-gb",
            "0.02",
        ]
    )
    tmux = Tmux(f"duet-test-{os.getpid()}")
    try:
        # start a shell first so remain-on-exit is set before `duet chat` can exit
        tmux.run("new-session", "-d", "-s", tmux.socket, "-x", "80", "-y", "24", "-c", str(ROOT), "sleep 600")
        tmux.run("set-option", "-t", tmux.socket, "remain-on-exit", "on")
        tmux.run("respawn-pane", "-k", "-t", tmux.target, cmd)
        tmux.wait_for(r"ctx 0/2,048", timeout=90)  # the status bar once the model has loaded
        tmux.type_line("/temp 0")
        tmux.type_line("/max 20")
        tmux.type_line("Hello from tmux")
        tmux.wait_for(r"reply tok", timeout=60)  # the usage line under the finished reply
        screen = tmux.wait_for(r"^(?![\s\S]*Sampling)", timeout=15)  # once the /temp, /max toasts are gone
        assert "Hello from tmux" in screen and "tok/s" in screen and "ctx " in screen
        tmux.send("C-c")
        deadline = time.monotonic() + 30
        while tmux.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not tmux.alive(), "Ctrl+C did not quit `duet chat`"
    finally:
        tmux.kill()
    (conv,) = Store(data).list()
    reply = conv.messages[-1].content
    assert [m.role for m in conv.messages] == ["user", "assistant"] and reply
    assert reply == greedy_reply(model, "Hello from tmux", 20)
    words = re.findall(r"[A-Za-z]{3,}", reply)
    assert not words or any(w in screen for w in words), (
        f"none of {words} from the reply was on screen:\n{screen}"
    )
