"""CPU quantized matmul: Duet's kernel vs ``mx.quantized_matmul`` vs a dense fp32 GEMV/GEMM (BLAS).

    LD_PRELOAD="$(.venv/bin/python -m mlx_engine.blas --preload)" \
        .venv/bin/python bench/qmatmul.py [--threads 1] [--rows 1,4,16] [--bits 4,8] [--repeats 7]
    ... bench/qmatmul.py --model-decode [--runs 5] [--threads 1]
    ... bench/qmatmul.py --gbps [--threads-list 1,2] [--math exact,int8] [--rows 1] [--bits 4]

``--paths`` also times the two native paths ``quantized_matmul`` chooses between by the number of rows
of x (the fused kernel, and the dequantize kernel + MLX's GEMM): the measurement behind
``cpu_kernels.qmm.dequantize_rows()`` (rows per kernel thread).

``--model-decode`` instead measures the whole model: Duet's engine decoding the bundled GGUF (greedy,
batch 1, 64-token prompt, 128 tokens) with its weights dense float32 through BLAS (the path without
the kernels) and kept quantized through the kernels, runs interleaved; median tok/s by wall clock and
by process CPU time, the resident weight bytes, and whether the greedy tokens agree.

``--gbps`` measures the weight bytes read per second from DRAM at Llama-3.2-1B's shapes (q/o_proj 2048 x
2048, gate/up 8192 x 2048, down 2048 x 8192; 4-bit in groups of 32 with float16 scales and biases, as
Duet's GGUF loader makes them) for each ``cpu_math`` and thread count: every call reads another copy
of the matrix (copies enough to pass ~128 MB, 4x the L3 here), and 32 calls go into one ``mx.eval``
(a lone ``mx.eval`` costs ~0.1 ms here, as much as a 2048 x 2048 product); wall time, median of
``--repeats`` batches.

Shapes are the bundled model's (SmolLM2-135M: hidden 576, MLP 1536, KV 192, vocab 49152) and one
Llama-3.2-1B MLP matrix. For each shape, bit width and number of rows of x it prints the median time
per call and the weight bytes read per second (packed weights + scales + biases for the quantized
paths, the fp32 matrix for the dense one), and the kernel's speed-up over each.

Time is process CPU time per call with one thread everywhere by default (``--threads 1`` sets the
kernel's pool, ``OPENBLAS_NUM_THREADS`` and ``MLX`` run single-threaded on the CPU anyway): on a shared,
loaded machine wall time measures the neighbours, CPU time measures the work. ``--wall`` uses wall time
(for a quiet machine and several threads). Each figure is the median of ``--repeats`` batches.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = (  # (name, N out, K in)
    ("smollm2 q/o_proj", 576, 576),
    ("smollm2 k/v_proj", 192, 576),
    ("smollm2 gate/up", 1536, 576),
    ("smollm2 down", 576, 1536),
    ("smollm2 lm_head", 49152, 576),
    ("llama-1b gate/up", 8192, 2048),
)


def _time(
    fn: Callable[[], object], clock: Callable[[], float], repeats: int, budget_s: float = 0.05
) -> float:
    """Median seconds per call over ``repeats`` batches, each batch long enough to time."""
    fn()
    t0 = clock()
    fn()
    one = max(clock() - t0, 1e-6)
    calls = max(1, int(budget_s / one))
    samples = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(calls):
            fn()
        samples.append((clock() - t0) / calls)
    return statistics.median(samples)


def model_decode(runs: int, tokens: int = 128) -> None:
    import asyncio
    import random

    from mlx_engine.engine import Engine, EngineConfig
    from mlx_engine.loading.loader import load_model
    from mlx_engine.request import GenerationRequest, SamplingParams

    engines = {}
    for weights in ("dense", "quantized"):
        loaded = load_model(None, weights=weights)
        engines[weights] = (loaded, Engine(loaded, EngineConfig(prefix_cache=False, cache_gb=0.25)))
    vocab = engines["dense"][0].tokenizer.vocab_size
    rng = random.Random(0)

    def run(engine: Engine, prompt: list[int]) -> tuple[float, float, list[int]]:
        req = GenerationRequest(
            prompt=prompt, max_tokens=tokens, sampling=SamplingParams(temperature=0), ignore_eos=True
        )

        async def go() -> tuple[float, float, list[int]]:
            ids: list[int] = []
            t_first = c_first = 0.0
            async for ev in engine.generate(req):
                if ev.token_ids and not ids:
                    t_first, c_first = time.perf_counter(), time.process_time()
                ids.extend(ev.token_ids)
            n = len(ids) - 1
            return n / (time.perf_counter() - t_first), n / (time.process_time() - c_first), ids

        return asyncio.run(go())

    res: dict[str, list[tuple[float, float, list[int]]]] = {"dense": [], "quantized": []}
    for _, engine in engines.values():
        run(engine, [rng.randrange(100, vocab) for _ in range(16)])  # warm-up
    for i in range(runs):
        prompt = [rng.randrange(100, vocab) for _ in range(64)]
        order = list(engines) if i % 2 == 0 else list(engines)[::-1]
        for name in order:
            res[name].append(run(engines[name][1], prompt))
    agree = sum(a[2] == b[2] for a, b in zip(res["dense"], res["quantized"], strict=True))
    print("| weights | resident MB | decode tok/s (wall) | decode tok/s (CPU time) |")
    print("|---|---:|---:|---:|")
    for name, (loaded, engine) in engines.items():
        wall = statistics.median(r[0] for r in res[name])
        cpu = statistics.median(r[1] for r in res[name])
        print(f"| {loaded.weight_format} | {loaded.weight_bytes / 1e6:.0f} | {wall:.1f} | {cpu:.1f} |")
        engine.shutdown()
    print(f"\ngreedy {tokens}-token replies identical in {agree}/{runs} runs")


GBPS_SHAPES = (("q/o_proj", 2048, 2048), ("gate/up", 8192, 2048), ("down", 2048, 8192))
# --gbps --k-scan: the same bytes at growing K (how the length of a row of x moves the kernels' speed)
K_SCAN = (("K 2048", 8192, 2048), ("K 4096", 4096, 4096), ("K 8192", 2048, 8192), ("K 16384", 1024, 16384))


def gbps(
    threads: list[int],
    maths: list[str],
    rows: list[int],
    bits_list: list[int],
    repeats: int,
    scales: str,
    shapes: tuple[tuple[str, int, int], ...] = GBPS_SHAPES,
) -> None:
    """Weight bytes per second at Llama-3.2-1B's shapes, every call on a cold copy (module doc)."""
    import mlx.core as mx

    from cpu_kernels import spec

    ext = spec.extension()
    assert ext is not None
    print(
        "| matrix | N x K | bits | rows | threads | " + " | ".join(f"{m} us | {m} GB/s" for m in maths) + " |"
    )
    print("|---|---|---|---|---|" + "---|---|" * len(maths))
    for name, n, k in shapes:
        for bits in bits_list:
            copies = []
            while sum(a.nbytes for c in copies for a in c) < 128e6:
                w = mx.random.normal((n, k)) * 0.05
                wq, sc, bi = mx.quantize(w, group_size=32, bits=bits)
                dt = getattr(mx, scales)  # as the loader holds them (cpu_kernels/scales.py: float16)
                copies.append((wq, sc.astype(dt), bi.astype(dt)))
                mx.eval(*copies[-1])
            nbytes = sum(a.nbytes for a in copies[0])
            for m in rows:
                x = mx.random.normal((m, k))
                mx.eval(x)
                for t in threads:
                    spec.set_threads(t)
                    cells = []
                    for math in maths:
                        int8 = math == "int8"
                        samples = []
                        for r in range(repeats + 1):  # one warm-up batch
                            outs = [
                                ext.quantized_matmul(
                                    x, *copies[(r * 32 + i) % len(copies)], 32, bits, int8=int8
                                )
                                for i in range(32)
                            ]
                            t0 = time.perf_counter()
                            mx.eval(outs)
                            if r:
                                samples.append((time.perf_counter() - t0) / 32)
                        sec = statistics.median(samples)
                        cells.append(f"{sec * 1e6:.0f} | {nbytes / sec / 1e9:.1f}")
                    print(
                        f"| {name} | {n} x {k} | {bits} | {m} | {t} | " + " | ".join(cells) + " |", flush=True
                    )
    spec.set_threads()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,4,16", help="rows of x (decode batch), comma-separated")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--wall", action="store_true", help="wall time instead of process CPU time")
    ap.add_argument("--skip-mlx", action="store_true", help="skip mx.quantized_matmul (slow)")
    ap.add_argument("--isa", default="", help="force a kernel variant: avx512, avx2 or base")
    ap.add_argument("--shapes", default="", help="only shapes whose name contains this")
    ap.add_argument("--paths", action="store_true", help="also time the fused kernel and dequantize+GEMM")
    ap.add_argument("--model-decode", action="store_true", help="whole-model decode, dense vs kernels")
    ap.add_argument("--runs", type=int, default=5, help="--model-decode runs")
    ap.add_argument(
        "--gbps", action="store_true", help="DRAM GB/s at Llama-1B shapes per cpu_math and threads"
    )
    ap.add_argument("--threads-list", default="1,2", help="--gbps: kernel thread counts")
    ap.add_argument("--math", default="exact,int8", help="--gbps: cpu_math values")
    ap.add_argument("--k-scan", action="store_true", help="--gbps: the same bytes at growing K")
    ap.add_argument(
        "--scales", default="float16", choices=("float16", "float32"), help="--gbps: scales' dtype"
    )
    args = ap.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))

    import mlx.core as mx

    from cpu_kernels import spec
    from cpu_kernels.qmm import quantized_matmul

    mx.set_default_device(mx.cpu)
    ext = spec.extension()
    if ext is None:
        sys.exit(f"the CPU kernels are not built: {spec.unavailable_reason()}")
    spec.set_threads(args.threads)
    ext.set_isa(args.isa)
    if args.gbps:
        print(
            f"# kernel isa={ext.isa()} group=32 {args.scales} scales, cold weights, wall clock, mlx={mx.__version__}"
        )
        gbps(
            [int(t) for t in args.threads_list.split(",")],
            args.math.split(","),
            [int(r) for r in args.rows.split(",")],
            [int(b) for b in args.bits.split(",")],
            args.repeats,
            args.scales,
            K_SCAN if args.k_scan else GBPS_SHAPES,
        )
        return
    if args.model_decode:
        print(
            f"# bundled model, kernel isa={ext.isa()} threads={args.threads}, {args.runs} runs, mlx={mx.__version__}"
        )
        model_decode(args.runs)
        return
    clock = time.perf_counter if args.wall else time.process_time
    print(
        f"# kernel isa={ext.isa()} threads={args.threads} group={args.group_size} "
        f"clock={'wall' if args.wall else 'process CPU'} mlx={mx.__version__}"
    )
    print(f"{'shape':18} {'bits':>4} {'M':>3} | {'duet us':>9} {'GB/s':>6} | {'mlx us':>9} {'GB/s':>6} | "
          f"{'fp32 us':>9} {'GB/s':>6} | {'vs mlx':>6} {'vs fp32':>7}")  # fmt: skip
    gs = args.group_size
    for name, n, k in (s for s in SHAPES if args.shapes in s[0]):
        w = mx.random.normal((n, k)) * 0.05
        dense_t = mx.contiguous(w.T)  # the loader stores dense weights input-major (bench/linear_layout.py)
        mx.eval(w, dense_t)
        for bits in (int(b) for b in args.bits.split(",")):
            wq, scales, biases = mx.quantize(w, group_size=gs, bits=bits)
            mx.eval(wq, scales, biases)
            qbytes = wq.nbytes + scales.nbytes + biases.nbytes
            for m in (int(r) for r in args.rows.split(",")):
                x = mx.random.normal((m, k))
                mx.eval(x)
                ours = _time(
                    lambda x=x, wq=wq, s=scales, b=biases, bits=bits: mx.eval(
                        quantized_matmul(x, wq, s, b, group_size=gs, bits=bits, backend="native")
                    ),
                    clock,
                    args.repeats,
                )
                if args.paths:  # the two native paths quantized_matmul chooses between
                    fused = _time(
                        lambda x=x, wq=wq, s=scales, b=biases, bits=bits: mx.eval(
                            ext.quantized_matmul(x, wq, s, b, gs, bits)
                        ),
                        clock,
                        args.repeats,
                    )
                    via_gemm = _time(
                        lambda x=x, wq=wq, s=scales, b=biases, bits=bits: mx.eval(
                            x @ ext.dequantize(wq, s, b, gs, bits).T
                        ),
                        clock,
                        args.repeats,
                    )
                    print(
                        f"{name:18} {bits:>4} {m:>3} | fused kernel {fused * 1e6:9.1f} us | "
                        f"dequantize+GEMM {via_gemm * 1e6:9.1f} us",
                        flush=True,
                    )
                if args.skip_mlx:
                    theirs = float("nan")
                else:
                    theirs = _time(
                        lambda x=x, wq=wq, s=scales, b=biases, bits=bits: mx.eval(
                            mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=gs, bits=bits)
                        ),
                        clock,
                        args.repeats,
                    )
                dense = _time(lambda x=x, d=dense_t: mx.eval(x @ d), clock, args.repeats)
                print(
                    f"{name:18} {bits:>4} {m:>3} | {ours * 1e6:9.1f} {qbytes / ours / 1e9:6.2f} | "
                    f"{theirs * 1e6:9.1f} {qbytes / theirs / 1e9:6.2f} | {dense * 1e6:9.1f} "
                    f"{w.nbytes / dense / 1e9:6.2f} | {theirs / ours:6.1f} {dense / ours:7.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
