"""Long-prompt interference: inter-token latency of running streams while a long prompt arrives.

    LD_PRELOAD=$(.venv/bin/python -m mlx_engine.blas --preload) \
        .venv/bin/python bench/interference.py [--model M] [--long 8192] [--streams 4]

4 streams decode; once they are going, an 8K-token prompt is submitted. We record every
inter-token gap of the 4 streams from that moment until the long request's first token and
report p50/p99/max, with chunked prefill (chunk 256) and without (the whole prompt in one step).
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


def run(engine: Engine, vocab: int, long_len: int, streams: int) -> tuple[list[float], float]:
    rng = random.Random(0)
    gaps: list[float] = []
    window = {"start": None, "end": None}

    async def stream(i):
        req = GenerationRequest(
            prompt=[rng.randrange(100, vocab) for _ in range(32)],
            max_tokens=100_000,
            ignore_eos=True,
            sampling=SamplingParams(temperature=0),
            request_id=f"s{i}",
        )
        last = None
        async for ev in engine.generate(req):
            if not ev.token_ids:
                continue
            now = time.perf_counter()
            if (
                last is not None
                and window["start"] is not None
                and window["end"] is None
                and now > window["start"]
            ):
                gaps.append(now - last)
            last = now
            if window["end"] is not None:
                break

    async def long_prompt():
        await asyncio.sleep(1.0)
        req = GenerationRequest(
            prompt=[rng.randrange(100, vocab) for _ in range(long_len)],
            max_tokens=1,
            sampling=SamplingParams(temperature=0),
            request_id="long",
        )
        window["start"] = time.perf_counter()
        async for ev in engine.generate(req):
            if ev.token_ids and window["end"] is None:
                window["end"] = time.perf_counter()

    async def go():
        await asyncio.gather(long_prompt(), *(stream(i) for i in range(streams)))

    asyncio.run(go())
    return gaps, window["end"] - window["start"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--long", type=int, default=8192)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=256)
    args = ap.parse_args()
    loaded = load_model(args.model)
    ctx = min(loaded.context_length - 1, args.long)
    print(
        f"model {loaded.name}, weights {loaded.weight_format}, BLAS {active_blas()}, {args.streams} streams, "
        f"{ctx}-token prompt arriving\n"
    )
    print("| prefill | ITL p50 (ms) | ITL p99 (ms) | ITL max (ms) | long prompt TTFT (s) |")
    print("|---|---:|---:|---:|---:|")
    for label, chunk in ((f"chunked ({args.chunk})", args.chunk), ("unchunked", ctx)):
        engine = Engine(
            loaded,
            EngineConfig(prefix_cache=False, prefill_chunk=chunk, max_batch_tokens=chunk + args.streams),
        )
        gaps, ttft = run(engine, loaded.tokenizer.vocab_size, ctx, args.streams)
        engine.shutdown()
        q = statistics.quantiles(gaps, n=100) if len(gaps) > 2 else [max(gaps)] * 99
        print(
            f"| {label} | {statistics.median(gaps) * 1000:.0f} | {q[98] * 1000:.0f} | {max(gaps) * 1000:.0f} "
            f"| {ttft:.1f} |"
        )


if __name__ == "__main__":
    main()
