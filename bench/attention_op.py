"""The CPU's paged attention op alone, one decode step's worth: every layer of a model's shape at a
context length, float16 pool (the CPU's default), one sequence.

    DUET_CPU_THREADS=1 .venv/bin/python bench/attention_op.py [--shapes llama-1b,moe-16x4] [--ctx 1024]
        [--runs 15]

Prints the median time of one step's calls (one per layer, evaluated together) and the KV bytes it
read per second, and checks the first layer's result against the MLX reference path. The shapes are
those of ``bench/synthetic_gguf.py`` (query heads, KV heads, head dim, layers). To compare two builds
of the extension, run it under each (``python -m cpu_kernels.build --force`` between them).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from cpu_kernels import spec  # noqa: E402
from cpu_kernels.paged_attention import paged_attention, reference  # noqa: E402

BLOCK = 16
# name: (query heads, KV heads, head dim, layers)
SHAPES = {
    "llama-1b": (32, 8, 64, 16),
    "llama-3b": (24, 8, 128, 28),
    "moe-16x4": (32, 4, 128, 16),
}


def step_ms(shape: tuple[int, int, int, int], ctx: int, runs: int) -> tuple[float, float, float]:
    """(median ms for one step's layers, GB/s of K and V read, max |error| against the reference)."""
    hq, hkv, d, layers = shape
    blocks = ctx // BLOCK + 1
    slots = (blocks + 1) * BLOCK
    ks = [mx.random.normal((slots, hkv, d)).astype(mx.float16) for _ in range(layers)]
    vs = [mx.random.normal((slots, hkv, d)).astype(mx.float16) for _ in range(layers)]
    q = mx.random.normal((1, hq, 1, d))
    table = mx.array([list(range(1, blocks + 1))], dtype=mx.int32)
    lens = mx.array([ctx], dtype=mx.int32)
    mx.eval(ks, vs, q)
    scale = d**-0.5
    got = paged_attention(q, ks[0], vs[0], table, lens, scale=scale, block_size=BLOCK)
    want = reference(
        q, ks[0].astype(mx.float32), vs[0].astype(mx.float32), table, lens, scale=scale, block_size=BLOCK
    )
    err: float = mx.abs(got - want).max().item()  # type: ignore[assignment]
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        mx.eval(
            [
                paged_attention(q, ks[i], vs[i], table, lens, scale=scale, block_size=BLOCK)
                for i in range(layers)
            ]
        )
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    return med * 1e3, layers * ctx * hkv * d * 2 * 2 / med / 1e9, err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama-1b,moe-16x4", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    threads = spec.set_threads()
    for name in args.shapes.split(","):
        hq, hkv, d, layers = SHAPES[name]
        ms, gbs, err = step_ms(SHAPES[name], args.ctx, args.runs)
        print(
            f"{name} ({hq} query heads over {hkv} KV heads of {d}, {layers} layers), ctx {args.ctx}, "
            f"{threads} thread(s): {ms:.2f} ms a step, {gbs:.1f} GB/s of K and V, max |err| {err:.1e}"
        )


if __name__ == "__main__":
    main()
