"""Ops in one decode step of a model on the CPU backend, by primitive (the lazy graph MLX evaluates).

    python bench/decode_ops.py [--model SPEC] [--weights auto|dense|quantized] [--ctx 64]
    python bench/decode_ops.py --fused [--runs 7] [--threads 1]

Counts the primitives in the graph of one batch-1 decode step (mlx-lm's forward with ``ctx`` tokens
cached, then argmax) as ``mx.export_to_dot`` writes it; inputs (``Load``) are left out of the total.
With ``DUET_CPU_KERNELS=0`` the model runs without the CPU kernel extension, for a before/after.

``--fused`` measures the fused RMSNorm and RoPE kernels (cpu_kernels/norm.py, rope.py): the same model
loaded twice, its norms and RoPE through the kernels and through ``mx.fast.rms_norm`` / ``mx.fast.rope``
(MLX's CPU fallbacks), both with the quantized matmul kernel; ops per step of each, then Duet's engine decoding (greedy, batch 1, 64-token prompt,
128 tokens) with runs interleaved: median decode tok/s by wall clock and by process CPU time, the
ratio, and whether the greedy tokens agree.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path


def count_ops(model, ctx: int) -> dict[str, int]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(100, 100 + ctx))]), cache=cache))
    token = mx.argmax(model(mx.array([[42]]), cache=cache)[:, -1, :], axis=-1)
    with tempfile.NamedTemporaryFile("w+", suffix=".dot") as f:
        mx.export_to_dot(f.name, token)
        dot = Path(f.name).read_text()
    counts: dict[str, int] = {}
    for m in re.finditer(r'label\s*=\s*"([A-Za-z]+)', dot):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def decode_fused(model: str | None, weights: str, runs: int, tokens: int = 128) -> None:
    import asyncio
    import random
    import statistics
    import time

    import mlx.nn as nn

    from cpu_kernels.modules import CPURMSNorm, CPURoPE
    from mlx_engine.engine import Engine, EngineConfig
    from mlx_engine.loading.loader import load_model
    from mlx_engine.request import GenerationRequest, SamplingParams

    engines = {}
    base = "mx.fast"
    for name in (base, "kernel"):
        loaded = load_model(model, weights=weights)
        if name != "kernel":
            for _, m in loaded.model.named_modules():
                if type(m) is CPURMSNorm:
                    m.__class__ = nn.RMSNorm
                elif type(m) is CPURoPE:
                    m.__class__ = nn.RoPE
        n_ops = sum(v for k, v in count_ops(loaded.model, 64).items() if k != "Load")
        engines[name] = (n_ops, Engine(loaded, EngineConfig(prefix_cache=False, cache_gb=0.25)))
    vocab = loaded.tokenizer.vocab_size
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

    res: dict[str, list[tuple[float, float, list[int]]]] = {name: [] for name in engines}
    for _, engine in engines.values():
        run(engine, [rng.randrange(100, vocab) for _ in range(16)])  # warm-up
    for i in range(runs):
        prompt = [rng.randrange(100, vocab) for _ in range(64)]
        for name in list(engines) if i % 2 == 0 else list(engines)[::-1]:
            res[name].append(run(engines[name][1], prompt))
    agree = sum(a[2] == b[2] for a, b in zip(res[base], res["kernel"], strict=True))
    med = {
        n: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)) for n, rs in res.items()
    }
    print("| RMSNorm, RoPE | ops per step | decode tok/s (wall) | decode tok/s (CPU time) |")
    print("|---|---:|---:|---:|")
    for name, (n_ops, engine) in engines.items():
        print(f"| {name} | {n_ops} | {med[name][0]:.1f} | {med[name][1]:.1f} |")
        engine.shutdown()
    print(
        f"\nkernels / mx.fast: wall {med['kernel'][0] / med[base][0]:.2f}x, "
        f"CPU time {med['kernel'][1] / med[base][1]:.2f}x (medians of {runs}, interleaved)"
    )
    print(f"greedy {tokens}-token replies identical in {agree}/{runs} runs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model spec (default: the bundled model)")
    ap.add_argument("--weights", default="auto", choices=("auto", "dense", "quantized"))
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--fused", action="store_true", help="decode tok/s, RMSNorm/RoPE kernels vs MLX's")
    ap.add_argument("--runs", type=int, default=7, help="--fused runs")
    ap.add_argument("--threads", type=int, default=1, help="--fused: kernel and BLAS threads")
    a = ap.parse_args()
    if a.fused:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", str(a.threads))

    import mlx.core as mx

    from mlx_engine.loading.loader import load_model

    mx.set_default_device(mx.cpu)
    if a.fused:
        from cpu_kernels import spec

        spec.set_threads(a.threads)
        decode_fused(a.model, a.weights, a.runs)
        return
    loaded = load_model(a.model, weights=a.weights)
    counts = count_ops(loaded.model, a.ctx)
    total = sum(v for k, v in counts.items() if k != "Load")
    layers = loaded.num_layers
    print(f"model {loaded.name} ({layers} layers, {loaded.weight_format}), ctx {a.ctx}")
    print(f"ops per decode step: {total} ({total / max(layers, 1):.1f} per layer)")
    for name, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        if name != "Load":
            print(f"  {name:28s} {n:6d}")


if __name__ == "__main__":
    main()
