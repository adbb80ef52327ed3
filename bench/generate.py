"""Single-stream speed: Duet's Engine vs mlx-lm's generation loop on the same loaded model.

    make bench            # or: LD_PRELOAD=$(.venv/bin/python -m mlx_engine.blas --preload) \
                          #     .venv/bin/python bench/generate.py [--model M] [--runs 5]

Prefill: a 512-token prompt, tokens / time-to-first-token. Decode: tokens after the first /
time between first and last token, at batch 1, greedy. Both sides drive the *same* model
object (`mlx_lm.generate.generate_step` is the loop under mlx-lm's `stream_generate`), one
after the other inside each run; medians over the runs and the Duet / mlx-lm ratio are printed
as a Markdown table for docs/BENCHMARKS.md.
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

import mlx.core as mx  # noqa: E402

from mlx_engine.blas import active_blas  # noqa: E402
from mlx_engine.engine import Engine, EngineConfig  # noqa: E402
from mlx_engine.loading.loader import load_model  # noqa: E402
from mlx_engine.request import GenerationRequest, SamplingParams  # noqa: E402


def mlx_lm_run(model, prompt: list[int], n: int) -> tuple[float, float]:
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    t_first = t_last = None
    count = 0
    for _tok, _ in generate_step(
        mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)
    ):
        t_last = time.perf_counter()
        if t_first is None:
            t_first = t_last
        count += 1
    return len(prompt) / (t_first - t0), (count - 1) / (t_last - t_first)


def duet_run(engine: Engine, prompt: list[int], n: int) -> tuple[float, float]:
    req = GenerationRequest(
        prompt=prompt, max_tokens=n, sampling=SamplingParams(temperature=0), ignore_eos=True
    )

    async def go():
        t0 = time.perf_counter()
        t_first = t_last = None
        count = 0
        async for ev in engine.generate(req):
            if ev.token_ids:
                t_last = time.perf_counter()
                t_first = t_first or t_last
                count += len(ev.token_ids)
        return len(prompt) / (t_first - t0), (count - 1) / (t_last - t_first)

    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--weights", default="auto")
    args = ap.parse_args()

    loaded = load_model(args.model, weights=args.weights)
    vocab = loaded.tokenizer.vocab_size
    # prefix cache off: every run prefills the whole prompt, like mlx-lm
    engine = Engine(
        loaded,
        EngineConfig(
            prefix_cache=False, prefill_chunk=args.prompt_tokens, max_batch_tokens=args.prompt_tokens
        ),
    )
    rng = random.Random(0)
    res = {"duet": [], "mlx_lm": []}
    duet_run(engine, [rng.randrange(vocab) for _ in range(32)], 8)  # warm-up both paths
    mlx_lm_run(loaded.model, [rng.randrange(vocab) for _ in range(32)], 8)
    for i in range(args.runs):
        prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]
        order = [
            ("duet", lambda p=prompt: duet_run(engine, p, args.decode_tokens)),
            ("mlx_lm", lambda p=prompt: mlx_lm_run(loaded.model, p, args.decode_tokens)),
        ]
        for name, fn in order if i % 2 == 0 else order[::-1]:
            res[name].append(fn())
    engine.shutdown()

    def med(name, k):
        return statistics.median(r[k] for r in res[name])

    print(
        f"model {loaded.name}, weights {loaded.weight_format}, BLAS {active_blas()}, "
        f"{args.runs} runs, prompt {args.prompt_tokens} tokens, decode {args.decode_tokens} tokens\n"
    )
    print("| metric | Duet (tok/s) | mlx-lm (tok/s) | Duet / mlx-lm |")
    print("|---|---:|---:|---:|")
    for k, label in ((0, f"prefill ({args.prompt_tokens}-token prompt)"), (1, "decode, batch 1")):
        d, m = med("duet", k), med("mlx_lm", k)
        print(f"| {label} | {d:.1f} | {m:.1f} | {d / m:.2f}x |")


if __name__ == "__main__":
    main()
