"""A mixture-of-experts layer's experts on the CPU: Duet's gather kernel vs MLX's ``gather_qmm``.

    LD_PRELOAD="$(.venv/bin/python -m mlx_engine.blas --preload)" \
        .venv/bin/python bench/gather_qmm.py [--tokens 1,8] [--threads 1,2] [--runs 15] [--math exact,int8]

One layer's gate + up + down, called as the model calls them: mlx-lm's ``SwitchGLU`` (4-bit affine
weights in groups of 32; scales, biases and activations bfloat16, as an MLX checkpoint has them, and
float32), once
as mlx-lm builds it (``QuantizedSwitchLinear``: ``mx.gather_qmm``) and once after ``use_cpu_kernels``
(``CPUQuantizedSwitchLinear``: the kernel). Shapes: Qwen3-30B-A3B (hidden 2048, moe_intermediate 768,
128 experts, 8 per token) and a 16-expert, 4-active model of ~1.8B parameters in all (hidden 1536,
moe_intermediate 1024, 24 such layers). Each token draws its experts at random without repeats, fresh
for every run, the same for both paths within a run; 8 tokens (64 pairs) take mlx-lm's sorted path.

For every shape, token count and kernel thread count it prints the median wall time per call (the
two paths alternate, run after run) and the expert weight bytes actually read per second: the
packed words, scales and biases of every distinct expert the tokens chose, for the three matrices.
MLX's CPU ops run on one thread whatever ``--threads`` sets; the kernel's pool takes that many.
``--math exact,int8`` times the kernel under each ``cpu_math`` (``spec.set_cpu_math``), a row each;
``--skip-mlx`` leaves out ``mx.gather_qmm`` (slow).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

from cpu_kernels import spec  # noqa: E402
from cpu_kernels.modules import use_cpu_kernels  # noqa: E402

SHAPES = (  # (name, hidden, moe_intermediate, experts, active)
    ("qwen3-30b-a3b", 2048, 768, 128, 8),
    ("16x4 1.8B", 1536, 1024, 16, 4),
)


def build(hidden: int, inter: int, experts: int, dtype: mx.Dtype) -> tuple[nn.Module, nn.Module]:
    """The same quantized SwitchGLU twice, sharing its arrays: mlx-lm's, and one switched to the kernel."""
    from mlx_lm.models.switch_layers import SwitchGLU

    mx.random.seed(0)
    glu = SwitchGLU(hidden, inter, experts)  # mlx-lm's init: uniform, +-1/sqrt(fan in)
    glu.set_dtype(dtype)
    nn.quantize(glu, group_size=32, bits=4)
    mx.eval(glu.parameters())
    ours = copy.copy(glu)
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(ours, name, copy.copy(glu[name]))
    if use_cpu_kernels(ours) != 3 or type(glu.gate_proj).__name__ != "QuantizedSwitchLinear":
        raise SystemExit("use_cpu_kernels switched no expert layer: is cpu_kernels._ext built?")
    return glu, ours


def expert_bytes(glu: nn.Module) -> int:
    """Bytes of one expert's gate, up and down matrices (packed words, scales, biases)."""
    total = 0
    for proj in (glu.gate_proj, glu.up_proj, glu.down_proj):
        for name in ("weight", "scales", "biases"):
            total += proj[name].nbytes // proj[name].shape[0]
    return total


def routing(rng: np.random.Generator, tokens: int, experts: int, active: int) -> mx.array:
    rows = [rng.choice(experts, size=active, replace=False) for _ in range(tokens)]
    return mx.array(np.array(rows, dtype=np.uint32))


def measure(
    glu: nn.Module,
    ours: nn.Module,
    shape: tuple[str, int, int, int, int],
    tokens: int,
    threads: int,
    runs: int,
    dtype: mx.Dtype,
    maths: list[str],
    skip_mlx: bool,
) -> dict[str, float]:
    """Median seconds per call of mx.gather_qmm ("mlx") and of the kernel under each cpu_math, the
    paths in turn (rotated run after run), and the median bytes read ("bytes")."""
    _, hidden, _, experts, active = shape
    per_expert = expert_bytes(glu)
    rng = np.random.default_rng(tokens * 100 + threads)
    spec.set_threads(threads)
    x = (mx.random.normal((tokens, hidden)) * 0.5).astype(dtype)
    paths = ([] if skip_mlx else [("mlx", glu, None)]) + [(m, ours, m) for m in maths]
    times: dict[str, list[float]] = {label: [] for label, _, _ in paths}
    read: list[int] = []
    for run in range(runs + 2):  # two warm-up runs
        idx = routing(rng, tokens, experts, active)
        mx.eval(idx)
        for label, module, math in paths[run % len(paths) :] + paths[: run % len(paths)]:
            if math is not None:
                spec.set_cpu_math(math)
            t0 = time.perf_counter()
            mx.eval(module(x, idx))
            if run >= 2:
                times[label].append(time.perf_counter() - t0)
        if run >= 2:
            read.append(len(set(np.array(idx).ravel().tolist())) * per_expert)
    spec.set_cpu_math()
    out = {label: statistics.median(t) for label, t in times.items()}
    out["bytes"] = statistics.median(read)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--dtypes", default="bfloat16,float32", help="weights' (scales, biases) and x's dtype")
    ap.add_argument("--math", default="exact", help="the kernel's cpu_math values to time: exact,int8")
    ap.add_argument("--skip-mlx", action="store_true", help="leave out mx.gather_qmm (slow)")
    args = ap.parse_args()
    maths = args.math.split(",")
    if spec.extension() is None:
        print(f"cpu_kernels unavailable: {spec.unavailable_reason()}", file=sys.stderr)
        return 1
    print(f"kernel isa: {spec.extension().isa()}, mlx {mx.__version__}, {args.runs} runs, medians")
    print(
        "| shape | dtype | tokens | threads | cpu_math | MB read | mx.gather_qmm ms | GB/s | kernel ms | GB/s "
        "| speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(mx, dtype_name)
            glu, ours = build(*shape[1:4], dtype)
            for tokens in (int(t) for t in args.tokens.split(",")):
                for threads in (int(t) for t in args.threads.split(",")):
                    r = measure(glu, ours, shape, tokens, threads, args.runs, dtype, maths, args.skip_mlx)
                    mlx_s = r.get("mlx", float("nan"))
                    for math in maths:
                        print(
                            f"| {shape[0]} | {dtype_name} | {tokens} | {threads} | {math} | {r['bytes'] / 1e6:.1f} "
                            f"| {mlx_s * 1e3:.2f} | {r['bytes'] / mlx_s / 1e9:.2f} | {r[math] * 1e3:.2f} "
                            f"| {r['bytes'] / r[math] / 1e9:.1f} | {mlx_s / r[math]:.1f}x |",
                            flush=True,
                        )
            del glu, ours
    spec.set_threads()
    return 0


if __name__ == "__main__":
    sys.exit(main())
