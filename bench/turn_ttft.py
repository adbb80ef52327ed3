"""A chat turn's time to first token over a cached history, by the history's length, with the CPU's
switch from the fused quantized matmul to dequantize + GEMM at different row counts.

    LD_PRELOAD=$(.venv/bin/python -m mlx_engine.blas --preload) \\
        .venv/bin/python bench/turn_ttft.py [--model M] [--cached 1766,2040,2268] [--new 53]
            [--rows-per-thread 16,32] [--runs 6]

One engine (prefix cache on, the default kernel threads) first computes a random prompt of the
longest ``--cached`` length; each measurement then sends that prompt's first ``C`` tokens plus
``--new`` fresh ones, so ``C`` tokens come from the cache and the rest are prefilled (in two pieces
where they cross the 256-token prefill grid). ``cpu_kernels.qmm.DEQUANTIZE_ROWS_PER_THREAD`` takes
each value of ``--rows-per-thread`` in turn, alternating run by run in the same process; medians of
the engine's TTFT. A last row does the same for a prompt of ``--fresh`` tokens from nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cpu_kernels.qmm as qmm  # noqa: E402
from cpu_kernels.spec import kernel_threads  # noqa: E402
from mlx_engine.engine import Engine, EngineConfig  # noqa: E402
from mlx_engine.loading.loader import load_model  # noqa: E402
from mlx_engine.request import GenerationRequest, SamplingParams  # noqa: E402


def ttft(engine: Engine, prompt: list[int]) -> float:
    async def go():
        usage = None
        req = GenerationRequest(prompt=prompt, max_tokens=1, sampling=SamplingParams(temperature=0))
        async for ev in engine.generate(req):
            usage = ev.usage or usage
        return usage.ttft_s

    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--cached", default="1766,2040,2268")
    ap.add_argument("--new", type=int, default=53)
    ap.add_argument("--fresh", type=int, default=300)
    ap.add_argument("--rows-per-thread", default="16,32")
    ap.add_argument("--runs", type=int, default=6)
    args = ap.parse_args()
    settings = [int(x) for x in args.rows_per_thread.split(",")]
    cached = [int(x) for x in args.cached.split(",")]
    loaded = load_model(args.model)
    engine = Engine(loaded, EngineConfig())
    rng = random.Random(0)
    vocab = loaded.tokenizer.vocab_size

    def fresh(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    history = fresh(max(cached))
    ttft(engine, history)  # the history is cached from here on
    print(
        f"model {loaded.name}, {kernel_threads()} kernel thread(s), {args.new} new tokens, "
        f"medians of {args.runs}; TTFT (ms) by rows per kernel thread from which x takes dequantize + GEMM\n"
    )
    print("| cached tokens | " + " | ".join(f"{s} rows/thread" for s in settings) + " |")
    print("|---:|" + "---:|" * len(settings))
    cases = [(f"{c}", lambda c=c: history[:c] + fresh(args.new)) for c in cached]
    cases.append((f"0 ({args.fresh}-token prompt)", lambda: fresh(args.fresh)))
    for name, make in cases:
        times: dict[int, list[float]] = {s: [] for s in settings}
        for r in range(args.runs):
            for s in settings[r % len(settings) :] + settings[: r % len(settings)]:
                qmm.DEQUANTIZE_ROWS_PER_THREAD = s
                times[s].append(ttft(engine, make()))
        print(
            f"| {name} | " + " | ".join(f"{statistics.median(times[s]) * 1e3:.0f}" for s in settings) + " |"
        )
    engine.shutdown()


if __name__ == "__main__":
    main()
