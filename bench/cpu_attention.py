"""One forward pass of a model through Duet's model runner on the CPU, attention through the paged
attention kernel (``cpu_kernels/paged_attention.py``) over a float32 pool and over a float16 one (the
CPU's default, ``kv_dtype`` "auto"), against the reference path (gather the rows' context out of the
float32 pool, then ``mx.fast.scaled_dot_product_attention``), in the same process.

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 DUET_CPU_THREADS=1 \\
    LD_PRELOAD="$(.venv/bin/python -m mlx_engine.blas --preload)" \\
        .venv/bin/python bench/cpu_attention.py [--model M] [--runs 7]
            [--cases 1@64,1@1024,65@0,65@2256,136@1616,512@0]

Threads come from the environment (BLAS reads its own at start-up, before Python runs): the line above
runs everything on one thread, as ``bench/cpu.py --threads 1`` does.

A case ``L@C`` is one pass of L new tokens for one row with C tokens already in the pool (random
tokens): ``1@1024`` a decode step at a 1K context, ``512@0`` a 512-token prefill from nothing,
``65@2256`` a later chat turn's prefill over its cached history. The two paths alternate run by run;
medians. For decode cases it also splits the kernel path's pass (float32 pool) into building the lazy
graph in Python and evaluating it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from cpu_kernels import spec  # noqa: E402
from mlx_engine.kv_cache import paged_attention  # noqa: E402
from mlx_engine.kv_cache.kv_pool import KVPool  # noqa: E402
from mlx_engine.loading.loader import load_model  # noqa: E402
from mlx_engine.model_runner import ModelRunner, Row  # noqa: E402

BLOCK = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--cases", default="1@64,1@1024,65@0,65@2256,136@1616,512@0")
    args = ap.parse_args()
    threads = spec.set_threads()  # DUET_CPU_THREADS, else the physical cores
    loaded = load_model(args.model)
    model, cfg = loaded.model, loaded.model.args
    cases = [tuple(int(v) for v in c.split("@")) for c in args.cases.split(",")]
    longest = max(n + c for n, c in cases)
    blocks = list(range(1, longest // BLOCK + 3))
    runners = {
        dt: ModelRunner(
            model,
            KVPool(
                cfg.num_hidden_layers,
                len(blocks) + 1,
                BLOCK,
                loaded.n_kv_heads,
                loaded.head_dim,
                dt,
                act_dtype=loaded.dtype,
            ),
        )
        for dt in (mx.float32, mx.float16)
    }
    runner, pool = runners[mx.float32], runners[mx.float32].pool
    kernel = runner.attention
    if kernel.kernel is None:
        sys.exit("the CPU kernels are not built (make setup)")
    reference = paged_attention.AttentionRoute.reference()

    def route(use_kernel: bool) -> None:
        for r in runners.values():
            r.attention = kernel if use_kernel else reference

    rng = random.Random(0)
    history = [rng.randrange(1000, 30000) for _ in range(longest)]
    for r in runners.values():
        for s in range(0, longest, 256):  # the pool holds a context for every case
            r.forward([Row(history[s : s + 256], s, blocks)])

    def once(n: int, cached: int, use_kernel: bool, dtype: mx.Dtype = mx.float32) -> float:
        route(use_kernel)
        t0 = time.perf_counter()
        runners[dtype].forward([Row(history[cached : cached + n], cached, blocks)])
        return time.perf_counter() - t0

    def build_and_eval(cached: int) -> tuple[float, float]:
        route(True)
        t0 = time.perf_counter()
        logits = runner.lazy_logits([Row(history[cached : cached + 1], cached, blocks)])
        t1 = time.perf_counter()
        mx.eval(logits, *pool.arrays())
        return t1 - t0, time.perf_counter() - t1

    print(
        f"{loaded.name}, weights {loaded.weight_format}, {threads} kernel thread(s), medians of {args.runs}\n"
    )
    print(
        "| new tokens | cached tokens | kernel, float32 KV (ms) | kernel, float16 KV (ms) | gather + SDPA (ms) "
        "| SDPA / kernel f32 | SDPA / kernel f16 |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    splits = []
    for n, cached in cases:
        once(n, cached, True), once(n, cached, True, mx.float16), once(n, cached, False)  # warm-up
        k, h, r = [], [], []
        for _ in range(args.runs):
            k.append(once(n, cached, True))
            h.append(once(n, cached, True, mx.float16))
            r.append(once(n, cached, False))
        km, hm, rm = (statistics.median(t) * 1e3 for t in (k, h, r))
        print(f"| {n} | {cached} | {km:.1f} | {hm:.1f} | {rm:.1f} | {rm / km:.2f}x | {rm / hm:.2f}x |")
        if n == 1:
            parts = [build_and_eval(cached) for _ in range(args.runs)]
            splits.append((cached, *(statistics.median(p) * 1e3 for p in zip(*parts, strict=True))))
    route(True)
    for cached, build, ev in splits:
        print(f"\ndecode at ctx {cached}: building the graph {build:.1f} ms, evaluating it {ev:.1f} ms")


if __name__ == "__main__":
    main()
