"""The `duet` command as a user runs it (subprocesses, no network)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def duet(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def test_version():
    r = duet("--version")
    assert r.returncode == 0 and r.stdout.startswith("duet ")


def test_generate_json_with_tiny_model(tiny_dirs):
    r = duet(
        "generate",
        "--model",
        str(tiny_dirs("llama")),
        "--prompt",
        "Hello world",
        "--max-tokens",
        "6",
        "--json",
        "--seed",
        "3",
        "--temperature",
        "0.8",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == out["usage"]["completion_tokens"] <= 6
    assert out["finish_reason"] in ("stop", "length")
    assert out["usage"]["prompt_tokens"] > 0
    again = json.loads(
        duet(
            "generate",
            "--model",
            str(tiny_dirs("llama")),
            "--prompt",
            "Hello world",
            "--max-tokens",
            "6",
            "--json",
            "--seed",
            "3",
            "--temperature",
            "0.8",
        ).stdout
    )
    assert again["token_ids"] == out["token_ids"]  # same seed, same request -> same tokens


def test_generate_reports_blas_and_weight_format(tiny_dirs):
    r = duet("generate", "--model", str(tiny_dirs("llama")), "--prompt", "Hi", "--max-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert "weights dense float32" in r.stderr and "BLAS" in r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/model.gguf"], "not found"),
        (["--model", "nobody/no-such-model-xyz"], "nobody/no-such-model-xyz"),
        (["--max-tokens", "0"], "max_tokens"),
    ],
)
def test_bad_input_is_a_clear_error(tiny_dirs, args, message):
    if "--model" not in args:
        args = ["--model", str(tiny_dirs("llama")), *args]
    r = duet("generate", "--prompt", "hi", *args)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


def test_models_lists_the_bundled_model():
    r = duet("models")
    assert r.returncode == 0 and "SmolLM2-135M-Instruct" in r.stdout and "bundled" in r.stdout
