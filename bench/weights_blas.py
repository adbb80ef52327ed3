"""Which weight format and BLAS to use on this backend: the benchmark behind the loader's default.

    .venv/bin/python bench/weights_blas.py [--model M] [--runs 3]

Runs Duet's engine in a fresh subprocess for each combination of weight format (kept quantized
vs dense float32) and BLAS (the one bundled with the mlx wheel vs OpenBLAS preloaded), and prints
prefill tok/s (512-token prompt) and decode tok/s (batch 1, and aggregate at 16 streams).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def child(model: str | None, weights: str, runs: int) -> dict:
    from mlx_engine.blas import active_blas
    from mlx_engine.engine import Engine, EngineConfig
    from mlx_engine.loading.loader import load_model
    from mlx_engine.request import GenerationRequest, SamplingParams

    loaded = load_model(model, weights=weights)
    engine = Engine(loaded, EngineConfig(prefix_cache=False, prefill_chunk=512, max_batch_tokens=512))
    vocab = loaded.tokenizer.vocab_size
    rng = random.Random(0)

    async def one(prompt, n, marks):
        req = GenerationRequest(
            prompt=prompt, max_tokens=n, ignore_eos=True, sampling=SamplingParams(temperature=0)
        )
        t0 = time.perf_counter()
        async for ev in engine.generate(req):
            if ev.token_ids:
                marks.append(time.perf_counter() - t0)

    def single():
        marks: list[float] = []
        asyncio.run(one([rng.randrange(100, vocab) for _ in range(512)], 32, marks))
        return 512 / marks[0], (len(marks) - 1) / (marks[-1] - marks[0])

    def streams(c=16, n=32):
        async def go():
            marks = [[] for _ in range(c)]
            t0 = time.perf_counter()
            await asyncio.gather(*(one([rng.randrange(100, vocab) for _ in range(32)], n, m) for m in marks))
            return c * n / (time.perf_counter() - t0)

        return asyncio.run(go())

    single()
    res = [single() for _ in range(runs)]
    agg = [streams() for _ in range(runs)]
    engine.shutdown()
    return {
        "blas": active_blas(),
        "weights": loaded.weight_format,
        "prefill": statistics.median(r[0] for r in res),
        "decode": statistics.median(r[1] for r in res),
        "agg16": statistics.median(agg),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--child", nargs=2, metavar=("WEIGHTS", "RUNS"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.child[0], int(args.child[1]))))
        return
    from mlx_engine.blas import openblas_path

    lib = openblas_path()
    rows = []
    for weights in ("quantized", "dense"):
        for preload in [None, lib] if lib else [None]:
            env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
            if preload:
                env["LD_PRELOAD"] = preload
            else:  # `import mlx_engine` would load OpenBLAS itself
                env["DUET_NO_OPENBLAS"] = "1"
            cmd = [sys.executable, __file__, "--child", weights, str(args.runs)]
            if args.model:
                cmd += ["--model", args.model]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(rows[-1], file=sys.stderr, flush=True)
    print("| weights | BLAS | prefill 512 (tok/s) | decode, 1 stream (tok/s) | decode, 16 streams (tok/s) |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['weights']} | {r['blas'].split(' (')[0]} | {r['prefill']:.0f} | {r['decode']:.1f} | {r['agg16']:.0f} |"
        )


if __name__ == "__main__":
    main()
