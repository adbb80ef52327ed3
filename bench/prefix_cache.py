"""Multi-turn chat: time to first token per turn, with and without the prefix cache.

    LD_PRELOAD=$(.venv/bin/python -m mlx_engine.blas --preload) \
        .venv/bin/python bench/prefix_cache.py [--model M] [--turns 10] [--runs 3]

A 10-turn conversation grows its history each turn (a ~150-token user message, the model's
~48-token reply). Each turn re-sends the whole history through the chat template, as every
chat client does. With the prefix cache only the new turn is prefilled.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_engine.blas import active_blas  # noqa: E402
from mlx_engine.engine import Engine, EngineConfig  # noqa: E402
from mlx_engine.loader import load_model  # noqa: E402
from mlx_engine.request import GenerationRequest, SamplingParams  # noqa: E402

WORDS = ("river stone light garden north window paper music seven quiet engine orange market "
         "forest silver winter letter morning bridge number story yellow doctor island").split()


def conversation(engine: Engine, turns: int, seed: int) -> list[tuple[int, int, float]]:
    rng = random.Random(seed)
    history: list[dict] = [{"role": "system", "content": "You are a helpful assistant."}]
    out = []

    async def turn(req):
        text, usage = [], None
        async for ev in engine.generate(req):
            text.append(ev.text)
            usage = ev.usage or usage
        return "".join(text), usage

    for _ in range(turns):
        history.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(120))})
        req = GenerationRequest(messages=list(history), max_tokens=48, ignore_eos=True,
                                sampling=SamplingParams(temperature=0))
        reply, usage = asyncio.run(turn(req))
        history.append({"role": "assistant", "content": reply})
        out.append((usage.prompt_tokens, usage.cached_tokens, usage.ttft_s))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    loaded = load_model(args.model)
    results = {}
    for cached in (True, False):
        engine = Engine(loaded, EngineConfig(prefix_cache=cached))
        runs = [conversation(engine, args.turns, seed) for seed in range(args.runs)]
        engine.shutdown()
        results[cached] = [
            (runs[0][t][0], statistics.median(r[t][1] for r in runs), statistics.median(r[t][2] for r in runs))
            for t in range(args.turns)
        ]
    print(f"model {loaded.name}, weights {loaded.weight_format}, BLAS {active_blas()}, median of {args.runs} "
          f"conversations\n")
    print("| turn | prompt tokens | cached tokens | TTFT with prefix cache (ms) | TTFT without (ms) | speed-up |")
    print("|---:|---:|---:|---:|---:|---:|")
    for t in range(args.turns):
        p, c, on = results[True][t]
        off = results[False][t][2]
        print(f"| {t + 1} | {p} | {c:.0f} | {on * 1000:.0f} | {off * 1000:.0f} | {off / on:.1f}x |")


if __name__ == "__main__":
    main()
