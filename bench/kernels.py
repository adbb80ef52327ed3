"""Kernel benchmark: quantized mat-vec and paged decode attention at 1B-8B decode shapes.

    .venv/bin/python bench/kernels.py [--quick] [--peak-gbps 400] [--json bench/out/kernels.json]

On Apple Silicon (Metal): GB/s and % of peak memory bandwidth for
  * qmv: our kernel vs MLX's ``mx.quantized_matmul`` (weights 4-bit, group 64; 1, 4 and 8 vectors);
  * paged decode attention: our kernel vs MLX's gather + ``scaled_dot_product_attention`` (the
    reference path) and vs MLX's SDPA on already contiguous K/V (the target: within 10%).
Bytes are the compulsory traffic: weights (+ scales/biases) or the K/V actually attended.

Elsewhere there is no Metal: it times the MLX reference path on the CPU and the CPU emulator on
small shapes (the emulator checks correctness, its speed says nothing about a GPU) and says so.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from metal_kernels import paged_attention as pa  # noqa: E402
from metal_kernels.qmv import qmv  # noqa: E402
from metal_kernels.spec import metal_available  # noqa: E402


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    intermediate: int
    n_q: int
    n_kv: int
    head_dim: int


MODELS = (
    Model("Llama-3.2-1B", 2048, 8192, 32, 8, 64),
    Model("Llama-3.2-3B", 3072, 8192, 24, 8, 128),
    Model("Llama-3.1-8B", 4096, 14336, 32, 8, 128),
)

# Unified-memory bandwidth (GB/s) by chip, from Apple's published specifications.
PEAK_GBPS = {
    "Apple M1": 68.25, "Apple M1 Pro": 200, "Apple M1 Max": 400, "Apple M1 Ultra": 800,
    "Apple M2": 100, "Apple M2 Pro": 200, "Apple M2 Max": 400, "Apple M2 Ultra": 800,
    "Apple M3": 100, "Apple M3 Pro": 150, "Apple M3 Max": 400, "Apple M3 Ultra": 819,
    "Apple M4": 120, "Apple M4 Pro": 273, "Apple M4 Max": 546,
}  # fmt: skip


def chip_name() -> str:
    if platform.system() == "Darwin":
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True)
        return out.stdout.strip()
    return platform.processor() or platform.machine()


def timeit(fn, repeat: int, inner: int) -> float:
    """Median seconds per call; ``inner`` independent calls share one evaluation."""
    mx.eval(fn())
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(inner)])
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def qmv_cases(quick: bool):
    for m in MODELS[:1] if quick else MODELS:
        yield m.name, "q_proj", m.hidden, m.hidden
        yield m.name, "gate_proj", m.intermediate, m.hidden
        yield m.name, "down_proj", m.hidden, m.intermediate


def qmv_bytes(n: int, k: int, m: int, bits: int, gs: int, act: int = 2) -> int:
    return n * k * bits // 8 + 2 * n * (k // gs) * act + m * (k + n) * act


def attention_problem(model: Model, batch: int, context: int, block_size: int = 16, dtype=mx.float16):
    blocks_per_seq = -(-context // block_size)
    num_blocks = 1 + batch * blocks_per_seq
    k = mx.random.normal((num_blocks, block_size, model.n_kv, model.head_dim)).astype(dtype)
    v = mx.random.normal((num_blocks, block_size, model.n_kv, model.head_dim)).astype(dtype)
    tables = mx.arange(1, num_blocks, dtype=mx.int32).reshape(batch, blocks_per_seq)
    lens = mx.full((batch,), context, dtype=mx.int32)
    q = mx.random.normal((batch, model.n_q, model.head_dim)).astype(dtype)
    mx.eval(k, v, tables, lens, q)
    return q, k, v, tables, lens


def run_metal(args, rows):
    peak = args.peak_gbps or PEAK_GBPS.get(chip_name())
    bits, gs = 4, 64
    for model_name, proj, n, k in qmv_cases(args.quick):
        w = mx.random.normal((n, k)).astype(mx.float16)
        wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
        for m in (1, 4, 8):
            x = mx.random.normal((m, k)).astype(mx.float16)
            mx.eval(wq, s, b, x)
            nbytes = qmv_bytes(n, k, m, bits, gs)
            t_ours = timeit(lambda: qmv(x, wq, s, b, gs, bits, backend="metal"), args.repeat, 10)  # noqa: B023
            t_mlx = timeit(lambda: mx.quantized_matmul(x, wq, s, b, True, gs, bits), args.repeat, 10)  # noqa: B023
            rows.append(dict(kernel="qmv", model=model_name, shape=f"{proj} {n}x{k} M={m}", bytes=nbytes,
                             ours_s=t_ours, mlx_s=t_mlx))  # fmt: skip
    for model in MODELS[:1] if args.quick else MODELS:
        for batch in (1, 8):
            for context in (512, 2048, 8192):
                q, kp, vp, tables, lens = attention_problem(model, batch, context)
                nbytes = 2 * batch * context * model.n_kv * model.head_dim * 2
                scale = model.head_dim**-0.5
                kc = kp[tables].reshape(batch, -1, model.n_kv, model.head_dim).transpose(0, 2, 1, 3)
                vc = vp[tables].reshape(batch, -1, model.n_kv, model.head_dim).transpose(0, 2, 1, 3)
                kc, vc = mx.contiguous(kc), mx.contiguous(vc)
                mx.eval(kc, vc)

                def ours(q=q, kp=kp, vp=vp, tables=tables, lens=lens, scale=scale):
                    return pa.paged_decode_attention(q, kp, vp, tables, lens, scale=scale, backend="metal")

                def gathered(q=q, kp=kp, vp=vp, tables=tables, lens=lens, scale=scale):
                    return pa.paged_decode_attention(
                        q, kp, vp, tables, lens, scale=scale, backend="reference"
                    )

                def contiguous(q=q, kc=kc, vc=vc, scale=scale):
                    return mx.fast.scaled_dot_product_attention(q[:, :, None], kc, vc, scale=scale)

                t = {
                    n: timeit(f, args.repeat, 10)
                    for n, f in (("ours", ours), ("gather", gathered), ("sdpa", contiguous))
                }
                rows.append(dict(kernel="paged_attention", model=model.name, shape=f"B={batch} ctx={context}",
                                 bytes=nbytes, ours_s=t["ours"], mlx_s=t["gather"], sdpa_s=t["sdpa"]))  # fmt: skip
    print(f"Metal on {chip_name()}; peak bandwidth {peak or 'unknown (pass --peak-gbps)'} GB/s\n")
    print(
        f"{'kernel':16} {'model':14} {'shape':30} {'ours GB/s':>10} {'%peak':>6} {'MLX GB/s':>9} {'ours/MLX':>8}"
    )
    for r in rows:
        gb = r["bytes"] / 1e9
        ours, base = gb / r["ours_s"], gb / r["mlx_s"]
        pct = f"{100 * ours / peak:.0f}" if peak else "-"
        extra = f"  vs contiguous SDPA {r['sdpa_s'] / r['ours_s']:.2f}x" if "sdpa_s" in r else ""
        print(f"{r['kernel']:16} {r['model']:14} {r['shape']:30} {ours:10.1f} {pct:>6} {base:9.1f} "
              f"{base and r['mlx_s'] / r['ours_s']:8.2f}{extra}")  # fmt: skip
    return {"device": chip_name(), "peak_gbps": peak}


def run_cpu(args, rows):
    """No Metal: MLX reference path timings at real shapes, emulator timings at the same shapes.

    float32 activations: the dtype a Linux engine uses (MLX's CPU quantized matmul is about 40x slower
    in float16 than in float32).
    """
    bits, gs, dtype = 4, 64, mx.float32
    for model_name, proj, n, k in qmv_cases(True):
        for m in (1, 4):
            w = mx.random.normal((n, k)).astype(dtype)
            wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
            x = mx.random.normal((m, k)).astype(dtype)
            mx.eval(wq, s, b, x)
            call = partial(qmv, x, wq, s, b, gs, bits)
            rows.append(dict(kernel="qmv", model=model_name, shape=f"{proj} {n}x{k} M={m}",
                             reference_s=timeit(partial(call, backend="reference"), args.repeat, 1),
                             emulator_s=timeit(partial(call, backend="emulator"), 1, 1)))  # fmt: skip
    model = MODELS[0]
    for batch, context in ((1, 512), (4, 2048)):
        call = partial(pa.paged_decode_attention, *attention_problem(model, batch, context, dtype=dtype))
        rows.append(dict(kernel="paged_attention", model=model.name, shape=f"B={batch} ctx={context}",
                         reference_s=timeit(partial(call, backend="reference"), args.repeat, 1),
                         emulator_s=timeit(partial(call, backend="emulator"), 1, 1)))  # fmt: skip
    print(f"No Metal on this machine ({chip_name()}): GB/s and % of peak need a Mac with Apple Silicon.")
    print("Below, float32: the MLX reference path on the CPU, and the CPU emulator running the Metal")
    print("kernels (a correctness tool; fibers on a CPU say nothing about GPU speed).\n")
    print(f"{'kernel':16} {'model':14} {'shape':30} {'reference ms':>13} {'emulator ms':>12}")
    for r in rows:
        print(
            f"{r['kernel']:16} {r['model']:14} {r['shape']:30} {1e3 * r['reference_s']:13.2f} {1e3 * r['emulator_s']:12.1f}"
        )
    return {"device": chip_name(), "peak_gbps": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only the 1B shapes")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--peak-gbps", type=float, default=None, help="override the chip's peak bandwidth")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = ap.parse_args()
    rows: list[dict] = []
    meta = run_metal(args, rows) if metal_available() else run_cpu(args, rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
