"""Dense weight layout on the CPU: input-major (what the loader stores) vs row-major (as loaded).

    LD_PRELOAD=$(.venv/bin/python -m mlx_engine.blas --preload) \
        .venv/bin/python bench/linear_layout.py [--model M] [--runs 5]

``Linear`` computes ``x @ W.T``. The loader keeps each dense weight as the transpose of a
contiguous (in, out) array, so ``W.T`` is the contiguous operand of the BLAS call. This times one
forward pass of the model (no KV cache) at batch 1, 16 and 64 rows of one token, and a 256-token
prefill, with both layouts of the same weights, alternating, and prints medians and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from mlx_engine.blas import active_blas  # noqa: E402
from mlx_engine.loading.loader import load_model  # noqa: E402


def linears(model: nn.Module) -> list[nn.Linear]:
    return [m for _, m in model.named_modules() if type(m) is nn.Linear]


def set_layout(layers: list[nn.Linear], weights: list[mx.array]) -> None:
    for m, w in zip(layers, weights, strict=True):
        m.weight = w


def time_forward(model: nn.Module, x: mx.array, reps: int = 3) -> float:
    mx.eval(model.model(x))
    t0 = time.perf_counter()
    for _ in range(reps):
        mx.eval(model.model(x))
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    loaded = load_model(args.model, weights="dense")
    layers = linears(loaded.model)
    input_major = [m.weight for m in layers]
    row_major = [mx.contiguous(w) for w in input_major]
    mx.eval(row_major)
    shapes = {
        "1 row x 1 token": (1, 1),
        "16 rows x 1 token": (16, 1),
        "64 rows x 1 token": (64, 1),
        "1 row x 256 tokens": (1, 256),
    }
    print(
        f"model {loaded.name}, {len(layers)} dense Linear layers, BLAS {active_blas()}, median of {args.runs}\n"
    )
    print("| forward pass | row-major W (ms) | input-major W (ms) | speed-up |")
    print("|---|---:|---:|---:|")
    for name, (b, n) in shapes.items():
        x = mx.array([[100 + (i * 7 + j) % 1000 for j in range(n)] for i in range(b)])
        rm, im = [], []
        for r in range(args.runs):
            for layout, out in ((row_major, rm), (input_major, im))[:: 1 if r % 2 == 0 else -1]:
                set_layout(layers, layout)
                out.append(time_forward(loaded.model, x))
        a, b_ = statistics.median(rm), statistics.median(im)
        print(f"| {name} | {a * 1000:.1f} | {b_ * 1000:.1f} | {a / b_:.2f}x |", flush=True)
    set_layout(layers, input_major)


if __name__ == "__main__":
    main()
