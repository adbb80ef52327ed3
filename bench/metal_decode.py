"""End-to-end decode speed: Duet with the paged attention kernel on and off, and mlx-lm, one model.

    .venv/bin/python bench/metal_decode.py [--model M] [--contexts 512,4096] [--batch 1,8]
        [--tokens 64] [--runs 3] [--kv-bits 8] [--json bench/out/metal_decode.json]

For each context length and batch size, ``batch`` greedy requests (EOS ignored) with distinct
random prompts of ``context`` tokens each generate ``--tokens`` tokens. Decode tok/s = tokens
generated after each request's first one / time from the batch's first token to its last, so
prefill is excluded. Duet runs twice on the same engine object: with the Metal decode kernel
(``AttentionRoute.metal_kernels()``, the engine's default on a Mac) and with the reference path (gather +
MLX SDPA). mlx-lm runs its own ``generate_step`` (batch 1 only; its own contiguous KV cache) on the
same loaded model. Medians over ``--runs``, in alternating order. Without Metal both Duet columns
run the reference path (the script says so); the numbers then say nothing about the kernel.
The default model is the bundled SmolLM2-135M GGUF; pass a larger one (an HF id in the local
cache, or a path) for numbers that matter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from metal_kernels.spec import metal_available  # noqa: E402
from mlx_engine.config import EngineConfig  # noqa: E402
from mlx_engine.engine import Engine  # noqa: E402
from mlx_engine.kv_cache import paged_attention  # noqa: E402
from mlx_engine.loading.loader import load_model  # noqa: E402
from mlx_engine.request import GenerationRequest, SamplingParams  # noqa: E402


def duet_decode(engine: Engine, prompts: list[list[int]], n: int) -> float:
    """Decode tok/s of the whole batch, first token (prefill) excluded."""
    first: list[float] = []
    last: list[float] = []

    async def one(p):
        k = 0
        req = GenerationRequest(
            prompt=p, max_tokens=n, sampling=SamplingParams(temperature=0), ignore_eos=True
        )
        async for ev in engine.generate(req):
            if k == 0:
                first.append(time.perf_counter())
            k += len(ev.token_ids)
        last.append(time.perf_counter())
        return k

    async def go():
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return (sum(counts) - len(prompts)) / (max(last) - max(first))

    return asyncio.run(go())


def mlx_lm_decode(model, prompt: list[int], n: int) -> float:
    from mlx_lm.generate import generate_step

    t_first = None
    k = 0
    for _tok, _ in generate_step(
        mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)
    ):
        k += 1
        if t_first is None:
            t_first = time.perf_counter()
    assert t_first is not None
    return (k - 1) / (time.perf_counter() - t_first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model spec as `duet --model` takes it (default: bundled)")
    ap.add_argument("--contexts", default="512,4096", help="prompt lengths, comma-separated")
    ap.add_argument("--batch", default="1,8", help="concurrent requests, comma-separated")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kv-bits", type=int, default=None, choices=(4, 8))
    ap.add_argument("--cache-gb", type=float, default=None, help="KV pool budget (default: the engine's)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    loaded = load_model(args.model)
    metal = metal_available()
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    engine = Engine(loaded, EngineConfig(kv_bits=args.kv_bits, cache_gb=args.cache_gb))
    rng = random.Random(0)
    vocab = loaded.tokenizer.vocab_size
    rows = []
    print(f"model {args.model or 'bundled'}; KV {f'{args.kv_bits}-bit' if args.kv_bits else 'unquantized'}; Metal: {metal}"
          + ("" if metal else " (no Metal: 'kernel' runs the reference path too)"))  # fmt: skip
    print(
        "\n| context | batch | Duet kernel tok/s | Duet reference tok/s | kernel/ref | mlx-lm tok/s | kernel/mlx-lm |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    try:
        for ctx in contexts:
            for b in batches:
                prompts = [[rng.randrange(3, vocab) for _ in range(ctx)] for _ in range(b)]
                samples: dict[str, list[float]] = {"kernel": [], "reference": [], "mlx_lm": []}
                for run in range(args.runs):
                    order = ["kernel", "reference"] if run % 2 == 0 else ["reference", "kernel"]
                    for name in order:
                        route = paged_attention.AttentionRoute
                        engine.runner.attention = (
                            route.metal_kernels() if name == "kernel" and metal else route.reference()
                        )
                        samples[name].append(duet_decode(engine, prompts, args.tokens))
                    if b == 1:
                        samples["mlx_lm"].append(mlx_lm_decode(loaded.model, prompts[0], args.tokens))
                med = {k: statistics.median(v) for k, v in samples.items() if v}
                row = dict(context=ctx, batch=b, **med)
                rows.append(row)
                ml = med.get("mlx_lm")
                kern, ref = med["kernel"], med["reference"]
                vs_ml = f"{ml:.1f} | {kern / ml:.2f}" if ml else "- | -"
                print(f"| {ctx} | {b} | {kern:.1f} | {ref:.1f} | {kern / ref:.2f} | {vs_ml} |", flush=True)
    finally:
        engine.shutdown()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, "metal": metal, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
