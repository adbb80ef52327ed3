"""Kernel benchmark: quantized mat-vec and paged decode attention at 1B-8B decode shapes.

    .venv/bin/python bench/kernels.py [--quick] [--peak-gbps N] [--json bench/out/kernels.json]

On Apple Silicon (Metal): GB/s and % of the machine's own copy bandwidth (measured first: an
elementwise copy of 1 GB, read + write; Apple's published figure is printed beside it, but binned
chips differ, e.g. an M3 Max with 30 GPU cores has 300 GB/s, not 400) for
  * qmv: our kernel vs MLX's ``mx.quantized_matmul`` (weights 4-bit, group 64; 1, 4 and 8 vectors);
  * paged decode attention: our kernel vs MLX's gather + ``scaled_dot_product_attention`` (the
    reference path) and vs MLX's SDPA on already contiguous K/V (the target: within 10%), at
    batch 1 and 16, 4K and 32K context, fp16 and 8/4-bit KV, a 128-token sliding window, and a
    ragged batch (one 32K row among fifteen 1K rows; its contiguous baseline is padded + masked).
Bytes are the compulsory traffic: weights (+ scales/biases) or the K/V actually attended.

Timing: every measurement is a chain of calls, each one's output the next one's input (the
attention output is the next query), so MLX cannot overlap them; each call of a chain reads its own
copy of the data (32 distinct pools or weight sets, fewer only when 32 would pass 4 GB, and then
each is far larger than any cache), so nothing is served from cache. The graph is built before the
clock starts; the median over ``--repeat`` chains, divided by the chain length, is reported.

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
    """Median seconds per call; ``inner`` independent calls share one evaluation (CPU timings only)."""
    mx.eval(fn())
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(inner)])
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


CHAIN = 32  # distinct data sets per chain
CHAIN_BYTES = 4 * 2**30  # ... unless they would pass this; then fewer (each far larger than a cache)


def copies(nbytes: int) -> int:
    return max(2, min(CHAIN, CHAIN_BYTES // max(1, nbytes)))


def time_chain(step, x0: mx.array, datasets: list, repeat: int) -> float:
    """Median seconds per call of ``x = step(x, data)`` chained over ``datasets`` (graph built first)."""

    def build():
        x = x0
        for data in datasets:
            x = step(x, data)
        return x

    mx.eval(build())  # compile, warm up
    samples = []
    for _ in range(repeat):
        y = build()
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(y)
        samples.append((time.perf_counter() - t0) / len(datasets))
    return statistics.median(samples)


def copy_bandwidth(repeat: int) -> float:
    """The machine's own peak: GB/s of an elementwise copy of 1 GB (bytes read + written)."""
    n = 2**30 // 4
    srcs = [mx.random.uniform(shape=(n,)) for _ in range(2)]
    mx.eval(srcs)

    def step(x, src):
        return src + x[:1] * 0  # a full read and write of src, ordered after x

    t = time_chain(step, mx.zeros((1,)), srcs * 4, repeat)
    return 2 * n * 4 / t / 1e9


def qmv_cases(quick: bool):
    for m in MODELS[:1] if quick else MODELS:
        yield m.name, "q_proj", m.hidden, m.hidden
        yield m.name, "gate_proj", m.intermediate, m.hidden
        yield m.name, "down_proj", m.hidden, m.intermediate


def qmv_bytes(n: int, k: int, m: int, bits: int, gs: int, act: int = 2) -> int:
    return n * k * bits // 8 + 2 * n * (k // gs) * act + m * (k + n) * act


@dataclass(frozen=True)
class AttnCase:
    model: Model
    batch: int
    context: int
    bits: int | None = None
    window: int | None = None
    ragged: bool = False  # one row of ``context`` among rows of 1K

    @property
    def lens(self) -> list[int]:
        if self.ragged:
            return [self.context] + [1024] * (self.batch - 1)
        return [self.context] * self.batch

    @property
    def label(self) -> str:
        kv = f"{self.bits}-bit" if self.bits else "fp16"
        extra = f" win={self.window}" if self.window else (" ragged" if self.ragged else "")
        return f"B={self.batch} ctx={self.context // 1024}K {kv}{extra}"

    def attended_bytes(self) -> int:
        m = self.model
        per_token = (
            2
            * m.n_kv
            * (
                m.head_dim * 2
                if self.bits is None
                else m.head_dim * self.bits // 8 + 2 * 2 * (m.head_dim // 32)
            )
        )
        return sum(min(n, self.window or n) for n in self.lens) * per_token


def attention_cases(quick: bool) -> list[AttnCase]:
    small, big = MODELS[0], MODELS[2]
    models = (small,) if quick else (small, big)
    out = []
    for m in models:
        out += [AttnCase(m, 1, 4096), AttnCase(m, 1, 32768), AttnCase(m, 16, 4096)]
        if not quick:
            out.append(AttnCase(m, 16, 32768))
        out += [AttnCase(m, 1, 32768, bits=8), AttnCase(m, 1, 32768, bits=4), AttnCase(m, 16, 4096, bits=8)]
        out += [AttnCase(m, 1, 32768, window=128), AttnCase(m, 16, 32768, ragged=True)]
    return out


def attention_problem(case: AttnCase, block_size: int = 16, dtype=mx.float16):
    """One paged pool holding ``case``'s rows (shuffled blocks), its query, and contiguous K/V."""
    m, lens = case.model, case.lens
    need = [-(-n // block_size) for n in lens]
    num_blocks = 1 + sum(need)
    order = mx.random.permutation(num_blocks - 1) + 1
    tables, pos = [], 0
    for n in need:
        tables.append(order[pos : pos + n].tolist() + [0] * (max(need) - n))
        pos += n
    k = mx.random.normal((num_blocks, block_size, m.n_kv, m.head_dim)).astype(dtype)
    v = mx.random.normal((num_blocks, block_size, m.n_kv, m.head_dim)).astype(dtype)
    quant = {}
    if case.bits:
        (kq, ks, kb), (vq, vs, vb) = (mx.quantize(a, group_size=32, bits=case.bits) for a in (k, v))
        quant = dict(k_scales=ks, k_biases=kb, v_scales=vs, v_biases=vb, bits=case.bits, group_size=32)
        k, v = kq, vq
    return dict(
        k_pool=k,
        v_pool=v,
        block_tables=mx.array(tables, dtype=mx.int32),
        context_lens=mx.array(lens, dtype=mx.int32),
        **quant,
    )


def contiguous_kv(case: AttnCase, data: dict):
    """The same K/V as a contiguous (B, n_kv, S, D) cache (dequantized), as a non-paged engine holds it."""
    m, b = case.model, case.batch

    def gather(pool, scales, biases):
        g = pool[data["block_tables"]].reshape(b, -1, m.n_kv, pool.shape[-1])
        if case.bits:
            s = scales[data["block_tables"]].reshape(b, -1, m.n_kv, scales.shape[-1])
            bb = biases[data["block_tables"]].reshape(b, -1, m.n_kv, biases.shape[-1])
            g = mx.dequantize(g, s, bb, group_size=32, bits=case.bits)
        g = g.astype(mx.float16).transpose(0, 2, 1, 3)
        if case.window:
            g = g[:, :, -case.window :]
        return mx.contiguous(g)

    k = gather(data["k_pool"], data.get("k_scales"), data.get("k_biases"))
    v = gather(data["v_pool"], data.get("v_scales"), data.get("v_biases"))
    mask = None
    if case.ragged:
        pos = mx.arange(k.shape[2])[None]
        mask = (pos < data["context_lens"][:, None])[:, None, None, :]
    mx.eval(k, v)
    return k, v, mask


def run_metal(args, rows):
    measured = copy_bandwidth(args.repeat)
    spec = PEAK_GBPS.get(chip_name())
    peak = args.peak_gbps or measured
    print(f"Metal on {chip_name()}: measured copy bandwidth {measured:.0f} GB/s (Apple's figure: "
          f"{spec or 'unknown'}); % of peak below is of {peak:.0f} GB/s\n")  # fmt: skip
    print(TABLE_HEAD, flush=True)
    bits, gs = 4, 64
    for model_name, proj, n, k in qmv_cases(args.quick):
        nbytes_w = n * k * bits // 8
        weights = []
        for _ in range(copies(nbytes_w)):
            wq, s, b = mx.quantize(mx.random.normal((n, k)).astype(mx.float16), group_size=gs, bits=bits)
            mx.eval(wq, s, b)
            weights.append((wq, s, b))
        for m in (1, 4, 8):
            x0 = mx.random.normal((m, k)).astype(mx.float16)

            def ours(x, w):
                y = qmv(x, *w, gs, bits, backend="metal")
                return x + y[:, :1] * 0  # the next call waits for this one

            def theirs(x, w):
                y = mx.quantized_matmul(x, *w, True, gs, bits)
                return x + y[:, :1] * 0

            rows.append(dict(kernel="qmv", model=model_name, shape=f"{proj} {n}x{k} M={m}",
                             bytes=qmv_bytes(n, k, m, bits, gs), ours_s=time_chain(ours, x0, weights, args.repeat),
                             mlx_s=time_chain(theirs, x0, weights, args.repeat)))  # fmt: skip
            print(_row(rows[-1], peak), flush=True)
    for case in attention_cases(args.quick):
        m = case.model
        one = attention_problem(case)
        mx.eval(one)
        size = sum(a.nbytes for a in one.values() if isinstance(a, mx.array))
        datasets = [one] + [attention_problem(case) for _ in range(copies(size) - 1)]
        mx.eval(datasets)
        q0 = mx.random.normal((case.batch, m.n_q, m.head_dim)).astype(mx.float16)
        scale = m.head_dim**-0.5
        kw = dict(scale=scale, window=case.window, max_context=max(case.lens))

        def ours(q, d, kw=kw):
            return pa.paged_decode_attention(q, **d, **kw, backend="metal")

        def gathered(q, d, kw=kw):
            return pa.paged_decode_attention(q, **d, **kw, backend="reference")

        row = dict(kernel="paged_attention", model=m.name, shape=case.label, bytes=case.attended_bytes(),
                   pools=len(datasets), ours_s=time_chain(ours, q0, datasets, args.repeat),
                   mlx_s=time_chain(gathered, q0, datasets, args.repeat))  # fmt: skip
        contiguous = [contiguous_kv(case, d) for d in datasets[: copies(2 * size)]]

        def sdpa(q, kvm, scale=scale):
            k, v, mask = kvm
            return mx.fast.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, mask=mask)[:, :, 0]

        row["sdpa_s"] = time_chain(sdpa, q0, contiguous, args.repeat)
        del contiguous, datasets
        rows.append(row)
        print(_row(row, peak), flush=True)
    return {"device": chip_name(), "peak_gbps": peak, "copy_gbps": measured, "spec_gbps": spec}


def _row(r: dict, peak: float) -> str:
    gb = r["bytes"] / 1e9
    ours, base = gb / r["ours_s"], gb / r["mlx_s"]
    extra = f" {r['sdpa_s'] / r['ours_s']:9.2f}" if "sdpa_s" in r else f" {'':9}"
    return (f"| {r['kernel']:15} | {r['model']:12} | {r['shape']:26} | {1e6 * r['ours_s']:9.1f} | {ours:7.1f} | "
            f"{100 * ours / peak:5.0f} | {base:8.1f} | {r['mlx_s'] / r['ours_s']:7.2f} |{extra} |")  # fmt: skip


TABLE_HEAD = (
    "| kernel          | model        | shape                      |   ours us |  GB/s  | %peak | MLX GB/s | vs MLX  |"
    " vs SDPA   |\n|---|---|---|---:|---:|---:|---:|---:|---:|"
)


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
        data = attention_problem(AttnCase(model, batch, context), dtype=dtype)
        q = mx.random.normal((batch, model.n_q, model.head_dim)).astype(dtype)
        call = partial(pa.paged_decode_attention, q, **data)
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
