"""Multi-turn chat: time to first token per turn, with and without the prefix cache.

    LD_PRELOAD=$(.venv/bin/python -m mlx_engine.blas --preload) \
        .venv/bin/python bench/prefix_cache.py [--model M] [--turns 10] [--runs 3]
            [--user-words 120] [--reply-tokens 48]

A 10-turn conversation grows its history each turn (a user message of ``--user-words`` random
words, the model's greedy reply of ``--reply-tokens`` tokens). Each turn re-sends the whole
history through the chat template, as every chat client does; with the prefix cache only what
is not cached yet is prefilled (the new user message, and the tail of the last reply). Replies
may not end early: control tokens are banned, so each reply is ``--reply-tokens`` of text. The
same prompts are then sent to an engine without the prefix cache, for their first token only.
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
from mlx_engine.loading.loader import load_model  # noqa: E402
from mlx_engine.request import GenerationRequest, SamplingParams  # noqa: E402

WORDS = (
    "river stone light garden north window paper music seven quiet engine orange market "
    "forest silver winter letter morning bridge number story yellow doctor island"
).split()


def ask(engine: Engine, history: list[dict], max_tokens: int) -> tuple[str, object]:
    async def go():
        # replies of a fixed length, as a client would see them: the model may not end its turn
        # (or write any other control token) before max_tokens
        no_end = {i: -100.0 for i in engine.tokenizer.special_ids | engine.tokenizer.eos_token_ids}
        req = GenerationRequest(
            messages=list(history),
            max_tokens=max_tokens,
            ignore_eos=True,
            sampling=SamplingParams(temperature=0, logit_bias=no_end),
        )
        text, usage = [], None
        async for ev in engine.generate(req):
            text.append(ev.text)
            usage = ev.usage or usage
        return "".join(text), usage

    return asyncio.run(go())


def conversation(engine: Engine, turns: int, seed: int, user_words: int, reply_tokens: int):
    """Chat with the prefix cache on; returns each turn's (history, prompt tokens, cached, TTFT)."""
    rng = random.Random(seed)
    history: list[dict] = [{"role": "system", "content": "You are a helpful assistant."}]
    out = []
    for _ in range(turns):
        history.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(user_words))})
        reply, usage = ask(engine, history, reply_tokens)
        out.append(
            (list(history), usage.prompt_tokens, usage.cached_tokens, usage.ttft_s, usage.completion_tokens)
        )
        history.append({"role": "assistant", "content": reply})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--user-words", type=int, default=120)
    ap.add_argument("--reply-tokens", type=int, default=48)
    args = ap.parse_args()
    loaded = load_model(args.model)
    cached = Engine(loaded, EngineConfig(prefix_cache=True))
    convs = [
        conversation(cached, args.turns, seed, args.user_words, args.reply_tokens)
        for seed in range(args.runs)
    ]
    cached.shutdown()
    # the same prompts again without the cache: only the first token is needed
    uncached = Engine(loaded, EngineConfig(prefix_cache=False))
    off = [[ask(uncached, hist, 1)[1].ttft_s for hist, *_ in conv] for conv in convs]
    uncached.shutdown()
    print(
        f"model {loaded.name}, weights {loaded.weight_format}, BLAS {active_blas()}, median of {args.runs} "
        f"conversations, ~{args.user_words}-word user messages, {args.reply_tokens}-token replies\n"
    )
    print(
        "| turn | prompt tokens | cached tokens | hit of last turn's prompt + reply "
        "| TTFT with prefix cache (ms) | TTFT without (ms) | speed-up |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for t in range(args.turns):
        p = convs[0][t][1]
        c = statistics.median(conv[t][2] for conv in convs)
        on = statistics.median(conv[t][3] for conv in convs)
        o = statistics.median(r[t] for r in off)
        prev = convs[0][t - 1][1] + convs[0][t - 1][4] if t else 0
        hit = f"{100 * c / prev:.0f}%" if prev else "–"
        print(f"| {t + 1} | {p} | {c:.0f} | {hit} | {on * 1000:.0f} | {o * 1000:.0f} | {o / on:.1f}x |")


if __name__ == "__main__":
    main()
