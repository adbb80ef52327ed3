"""The first GPU run, prepared: what a CUDA machine's few minutes should measure, as a markdown report.

    make gpu-check                      # .venv/bin/python bench/gpu_check.py [--budget-s 420]

Sections, each under its own share of ``--budget-s`` (the device machine lends minutes, not hours):

1. **Device**: MLX's version and backend, the device's name and memory.
2. **Tests on this backend**: the engine's equivalence tests (``tests/test_engine_tiny.py``: the paged
   engine alone and batched against mlx-lm's own loop) run on whatever device MLX defaults to.
3. **Prefill** tok/s at 2K and 8K tokens on a Llama-3.1-8B-shaped model (hidden 4096, 32 layers, 32
   heads, 8 KV heads, FFN 14336; random weights made on the device, no file), bf16 and 4-bit
   (``nn.quantize``, groups of 64), in chunks of 2048 through mlx-lm's KV cache: the remote prefill
   rate the offload planner needs. Without CUDA (a rehearsal on the CPU) the same code runs on a
   4-layer model of that width, 2K tokens, bf16 skipped, so the script itself is exercised; the
   report says which.
4. **The planner's profile**: the inputs of ``duet peer plan`` from what was measured here (remote
   prefill rate; this machine's CPU prefill rate on the 4-bit model's first layers, scaled to 32;
   loopback TCP throughput; the 8B model's KV bytes per token) and the plan it gives for 512, 2K and
   8K-token prompts.

Not done here (docs/BENCHMARKS.md says so): a ``duet peer serve`` on the GPU with a decoder on the
same machine's CPU over loopback. Bringing MLX's CUDA backend is the machine's part: ``pip install
mlx[cuda13]`` needs ``mlx-cuda-13`` (90 MB, more than the device tool carries) and NVIDIA's
``nvidia-*-cu13`` wheels, which this workplace's package mirror does not hold.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
# Llama-3.1-8B's body
SHAPE = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "intermediate_size": 14336, "vocab_size": 128256, "rope_theta": 500000.0}  # fmt: skip


def device_section() -> tuple[str, bool]:
    import mlx.core as mx

    from mlx_engine.backend import backend_name, total_memory_bytes

    backend = backend_name()
    try:
        name = str(mx.device_info().get("device_name", platform.processor() or platform.machine()))
    except Exception:
        name = platform.processor() or platform.machine()
    lines = [
        f"- MLX {mx.__version__}, backend **{backend}**, device {name}, "
        f"{total_memory_bytes() / 2**30:.0f} GiB",
        f"- Python {platform.python_version()}, {platform.platform()}",
    ]
    return "\n".join(lines), backend == "cuda"


def tests_section(timeout_s: float) -> str:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "tests/test_engine_tiny.py"]
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
        return "```\n" + "\n".join(tail) + "\n```"
    except subprocess.TimeoutExpired:
        return f"(stopped after {timeout_s:.0f} s)"


def _model(layers: int, quantized: bool):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        **(SHAPE | {"num_hidden_layers": layers}),
    )
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    if quantized:
        nn.quantize(model, group_size=64, bits=4)
    if mx.default_device() == mx.cpu:
        from cpu_kernels.modules import use_cpu_kernels

        use_cpu_kernels(model)  # as Duet runs on a CPU
    mx.eval(model.parameters())
    return model


def prefill_tps(model, tokens: int, chunk: int = 2048) -> float:
    """Prefill tok/s of ``tokens`` random tokens in chunks, through mlx-lm's KV cache (best of 2); the
    model's body only (a prefill needs one row of logits, not 2048 x 128K)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    ids = mx.random.randint(0, SHAPE["vocab_size"], (1, tokens))
    best = float("inf")
    for _ in range(2):
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        for i in range(0, tokens, chunk):
            y = model.model(ids[:, i : i + chunk], cache=cache)
            mx.eval(y, [c.state for c in cache])
        best = min(best, time.perf_counter() - t0)
    return tokens / best


def prefill_section(cuda: bool, deadline: float) -> tuple[str, dict[str, float]]:
    layers = 32 if cuda else 4
    rows, measured = [], {}
    for label, quantized in (("bf16", False), ("4-bit", True)):
        if not cuda and not quantized:
            rows.append(
                f"| {label} | — | — | skipped (no CUDA: bf16 matmuls on this CPU are not the question) |"
            )
            continue
        model = _model(layers, quantized)
        cells = []
        for n in (2048, 8192) if cuda else (2048,):
            if time.monotonic() > deadline:
                cells.append("(out of time)")
                continue
            tps = prefill_tps(model, n) * layers / 32  # per 32-layer model
            measured[f"{label}_{n}"] = tps
            cells.append(f"{tps:,.0f}")
        cells += ["—"] * (2 - len(cells))
        note = "32 layers" if cuda else f"rehearsal: {layers} layers, scaled to 32"
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {note} |")
        del model
    head = "| weights | 2K tokens (tok/s) | 8K tokens (tok/s) | |\n|---|---:|---:|---|"
    return head + "\n" + "\n".join(rows), measured


def loopback_gbps(nbytes: int = 256 << 20) -> float:
    """TCP throughput over 127.0.0.1, Gbit/s (the link of a decoder on the same machine)."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    got = [0]

    def sink() -> None:
        conn, _ = srv.accept()
        with conn:
            while n := len(conn.recv(1 << 20)):
                got[0] += n

    t = threading.Thread(target=sink)
    t.start()
    buf = bytes(1 << 20)
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as c:
        for _ in range(nbytes >> 20):
            c.sendall(buf)
    t.join()
    srv.close()
    return got[0] * 8 / (time.perf_counter() - t0) / 1e9


def planner_section(measured: dict[str, float], cuda: bool) -> str:
    import mlx.core as mx

    from peer.planner import Planner, format_plan, plan_table

    remote = measured.get("4-bit_2048") or measured.get("bf16_2048")
    if not remote:
        return "(no prefill rate measured)"
    device = mx.default_device()
    mx.set_default_device(mx.cpu)  # this machine's CPU as the decoder's: the 4-bit model, 2 layers, scaled
    try:
        local = prefill_tps(_model(2, True), 512, chunk=512) * 2 / 32
    finally:
        mx.set_default_device(device)
    link = loopback_gbps()
    kv = 2 * SHAPE["num_hidden_layers"] * SHAPE["num_key_value_heads"] * 128 * 2  # fp16 K and V
    planner = Planner(kv_bytes_per_token=kv, num_layers=32, chunk=512)
    planner.seed(
        local_tps=local, remote_tps=remote, bandwidth_Bps=link * 1e9 / 8, setup_s=0.001, tail_s=1 / local
    )
    cmd = (
        f"duet peer plan --local-tps {local:.0f} --remote-tps {remote:.0f} --link-gbps {link:.1f} "
        f"--model-kv-bytes-per-token {kv}"
    )
    where = "" if cuda else " (rehearsal: remote = this CPU)"
    return f"`{cmd}`{where}\n\n```\n{format_plan(plan_table(planner, [512, 2048, 8192]))}\n```"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=420.0, help="whole run, seconds (default 420)")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--out", default=str(OUT / "gpu_check.md"))
    a = ap.parse_args()
    start = time.monotonic()
    head, cuda = device_section()
    parts = [f"## Duet gpu-check ({'CUDA' if cuda else 'no CUDA: a rehearsal on the CPU'})", "", head, ""]
    if not a.skip_tests:
        parts += ["### Tests on this backend", "", tests_section(a.budget_s * 0.3), ""]
    table, measured = prefill_section(cuda, start + a.budget_s * 0.8)
    parts += ["### Prefill, Llama-3.1-8B shape", "", table, ""]
    parts += ["### The planner's profile", "", planner_section(measured, cuda), ""]
    parts += [f"({time.monotonic() - start:.0f} s)"]
    report = "\n".join(parts)
    print(report)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(report + "\n")
    (Path(a.out).with_suffix(".json")).write_text(json.dumps(measured))


if __name__ == "__main__":
    main()
