"""Aggregate decode throughput vs concurrency: Duet's Engine vs mlx-lm's BatchGenerator.

    LD_PRELOAD=$(.venv/bin/python -m mlx_engine.blas --preload) \
        .venv/bin/python bench/batch_decode.py [--model M] [--levels 1,2,4,8,16,32] [--runs 3]
            [--prompt-tokens 64 | --prompt-tokens 16-512]

At each concurrency level c, c requests with distinct prompts each generate ``--tokens``
tokens (greedy, EOS ignored), all submitted at once. Prompts have ``--prompt-tokens`` tokens:
one length for all (the default, 64), or a range ``lo-hi`` from which each stream draws its
length uniformly (seeded, the same prompts for both sides), as a server sees. Aggregate tok/s = generated
tokens / wall time until the last finishes. Both sides drive the same loaded model object in
the same process, alternating order per run; medians and the Duet / mlx-lm ratio are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_engine.blas import active_blas  # noqa: E402
from mlx_engine.engine import Engine, EngineConfig  # noqa: E402
from mlx_engine.loading.loader import load_model  # noqa: E402
from mlx_engine.request import GenerationRequest, SamplingParams  # noqa: E402


def duet(engine: Engine, prompts: list[list[int]], n: int) -> float:
    async def one(p):
        k = 0
        req = GenerationRequest(
            prompt=p, max_tokens=n, sampling=SamplingParams(temperature=0), ignore_eos=True
        )
        async for ev in engine.generate(req):
            k += len(ev.token_ids)
        return k

    async def go():
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return sum(counts) / (time.perf_counter() - t0)

    return asyncio.run(go())


def mlx_lm(model, prompts: list[list[int]], n: int) -> float:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(
        model,
        max_tokens=n,
        completion_batch_size=max(len(prompts), 1),
        prefill_batch_size=min(len(prompts), 8),
    )
    t0 = time.perf_counter()
    gen.insert(prompts, max_tokens=[n] * len(prompts))
    done, k = 0, 0
    while done < len(prompts):
        for r in gen.next_generated():
            k += 1
            done += r.finish_reason is not None
    rate = k / (time.perf_counter() - t0)
    gen.close()
    return rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--levels", default="1,2,4,8,16,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt-tokens", default="64", help="N, or lo-hi for lengths drawn per stream")
    args = ap.parse_args()
    lo, _, hi = args.prompt_tokens.partition("-")
    lo, hi = int(lo), int(hi or lo)
    loaded = load_model(args.model)
    engine = Engine(loaded, EngineConfig(prefix_cache=False))
    vocab = loaded.tokenizer.vocab_size
    rng = random.Random(0)

    def make(c):
        return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(c)]

    duet(engine, make(2), 4)
    mlx_lm(loaded.model, make(2), 4)
    rows = []
    for c in (int(x) for x in args.levels.split(",")):
        d, m = [], []
        for i in range(args.runs):
            ps = make(c)
            if i % 2 == 0:
                d.append(duet(engine, ps, args.tokens))
                m.append(mlx_lm(loaded.model, ps, args.tokens))
            else:
                m.append(mlx_lm(loaded.model, ps, args.tokens))
                d.append(duet(engine, ps, args.tokens))
        rows.append((c, statistics.median(d), statistics.median(m)))
        print(
            f"c={c}: duet {rows[-1][1]:.1f} tok/s, mlx-lm {rows[-1][2]:.1f} tok/s",
            file=sys.stderr,
            flush=True,
        )
    engine.shutdown()
    print(
        f"model {loaded.name}, weights {loaded.weight_format}, BLAS {active_blas()}, "
        f"{args.tokens} tokens per stream, {args.prompt_tokens}-token prompts, median of {args.runs}\n"
    )
    print("| streams | Duet (tok/s) | mlx-lm BatchGenerator (tok/s) | Duet / mlx-lm |")
    print("|---:|---:|---:|---:|")
    for c, d, m in rows:
        print(f"| {c} | {d:.1f} | {m:.1f} | {d / m:.2f}x |")


if __name__ == "__main__":
    main()
