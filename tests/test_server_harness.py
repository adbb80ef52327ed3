"""Helpers for the server tests: run `duet serve` as a subprocess on a free loopback port.

(No tests here; the name only keeps the file among the server tests.)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.tiny_models import make_tiny_model_dir

# A ChatML template that renders tools and tool turns the way Qwen2.5 / Hermes templates do.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    'Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n'
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and tools and loop.first %}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_model(path: Path, arch: str = "llama", tools_template: bool = False) -> Path:
    path = make_tiny_model_dir(path, arch)
    if tools_template:
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        cfg["chat_template"] = TOOLS_TEMPLATE
        (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def unlabelled(labels: dict[str, str]) -> dict[str, str]:
    """A sample's labels without ``model`` (every model's metrics carry the model's name)."""
    return {k: v for k, v in labels.items() if k != "model"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``extra``: more `duet serve` options (an ``--api-key`` among them is sent by ``headers``);
    ``env``: more environment; ``preexec_fn``: run in the child before it starts (e.g. setrlimit);
    ``port``: the loopback port to serve on (default: a free one)."""

    live: weakref.WeakSet[ServerProcess] = weakref.WeakSet()  # started and not stopped: see conftest

    def __init__(
        self,
        model: str | Path | None,
        log_path: Path,
        *extra: str,
        timeout: float = 180,
        env: dict[str, str] | None = None,
        preexec_fn=None,
        port: int | None = None,
    ):
        ServerProcess.live.add(self)
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.api_key = extra[extra.index("--api-key") + 1] if "--api-key" in extra else None
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(self.port), *extra]
        if model is not None:
            cmd += ["--model", str(model)]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=Path(__file__).resolve().parent.parent,
            preexec_fn=preexec_fn,
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"duet serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"duet serve did not come up in {timeout}s:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def diagnose(self) -> str:
        """The log's tail with every server thread's stack (`duet serve` dumps them on SIGUSR1):
        what a failing test shows of a server that is still running, a stuck one above all."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            size, deadline = -1, time.monotonic() + 5
            while (
                self.log_path.stat().st_size != size and time.monotonic() < deadline
            ):  # until it stops growing
                size = self.log_path.stat().st_size
                time.sleep(0.5)
        return self.log_path.read_text(errors="replace")[-20000:]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.base + "/metrics", headers=self.headers, timeout=10).text
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if not unlabelled(s.labels):  # summed over the loaded models
                    out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    def stop(self) -> int:
        ServerProcess.live.discard(self)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
