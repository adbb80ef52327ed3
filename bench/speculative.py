"""Speculative decoding (n-gram prompt lookup, a draft model): decode tok/s with it off, at a fixed k,
and adaptive.

    LD_PRELOAD=$(.venv/bin/python -m mlx_engine.blas --preload) \\
        .venv/bin/python bench/speculative.py [--model M] [--draft-model D | --tiny-pair] \\
        [--streams 1,4,16] [--runs 3] [--tokens 128]

Two chat prompts on the bundled model (greedy): an *edit* prompt (rewrite a given paragraph with
one change: the reply copies most of the prompt, which prompt lookup can propose) and a free-form
*story*. For each, ``c`` identical requests run at once (``--streams``), each generating up to
``--tokens`` tokens: a reply ends where the model ends it (the edit prompt's reply is the rewritten
paragraph, ~80 tokens on the bundled model), or runs on to ``--tokens`` with ``--ignore-eos`` (which
measures the text a model writes after its answer, a chat it makes up). Decode tok/s = tokens after
each stream's first / the time from the first stream's first token to the last stream's last, so a
prompt's prefill is not counted (the wall-clock rate, prefill included, is printed beside it). Modes: ``off``; ``k=N``
(propose N tokens whenever the text has a match, whatever it costs); ``adaptive`` (the engine's
default: k from the measured acceptance and per-token pass cost, 0 when it does not pay).
Modes alternate within each run; medians over ``--runs`` and the ratio to ``off`` are printed,
and every mode's output is checked to be token-identical to ``off``.

``--draft-model D`` adds ``draft k=N`` and ``draft adaptive`` (speculative="draft" with D, which must
share the model's tokenizer). No real draft/target pair that shares a tokenizer is available
offline here, so ``--tiny-pair`` runs the modes on tiny random-weight models instead
(tests/tiny_models.py: the target, a draft with its own weights, which keeps nearly every proposal,
and one with other random weights, which keeps few): for correctness (same tokens as ``off``,
proposed and kept counts), not speed.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_engine.blas import active_blas  # noqa: E402
from mlx_engine.engine import Engine, EngineConfig  # noqa: E402
from mlx_engine.loading.loader import load_model  # noqa: E402
from mlx_engine.request import GenerationRequest, SamplingParams  # noqa: E402

PARAGRAPH = (
    "The river stone sat quietly in the garden, north of the old window. Every morning the light "
    "came through the paper blinds and fell across the table where the music books were stacked. "
    "Seven quiet engines hummed in the market across the street, and the orange trees in the "
    "forest beyond turned silver in winter. A letter arrived each morning from the bridge keeper, "
    "who counted the number of boats that passed and wrote a short story about each of them."
)
PROMPTS = {
    "edit": "Rewrite the following paragraph exactly, word for word, but replace 'garden' with "
    "'courtyard'. Output only the rewritten paragraph.\n\n" + PARAGRAPH,
    "story": "Write a short, original story about a lighthouse keeper who finds a map.",
}


@dataclass
class Result:
    decode: float  # tok/s after each stream's first token
    wall: float  # tok/s over the whole run, prefill included
    tokens: list[list[int]]
    proposed: int
    accepted: int


def run(engine: Engine, messages: list[dict], streams: int, n: int, ignore_eos: bool = False) -> Result:
    async def one():
        ids, last, first = [], None, None
        req = GenerationRequest(
            messages=messages, max_tokens=n, ignore_eos=ignore_eos, sampling=SamplingParams(temperature=0)
        )
        async for ev in engine.generate(req):
            if first is None and ev.token_ids:
                first = time.perf_counter()
            ids += ev.token_ids
            last = ev
        return ids, first, time.perf_counter(), last.usage.speculative or {"proposed": 0, "accepted": 0}

    async def go():
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one() for _ in range(streams)))
        return t0, outs

    t0, outs = asyncio.run(go())
    toks = [ids for ids, *_ in outs]
    first = min(f for _, f, _, _ in outs if f is not None)
    end = max(e for _, _, e, _ in outs)
    return Result(
        decode=sum(max(len(t) - 1, 0) for t in toks) / max(end - first, 1e-9),
        wall=sum(map(len, toks)) / (end - t0),
        tokens=toks,
        proposed=sum(s["proposed"] for *_, s in outs),
        accepted=sum(s["accepted"] for *_, s in outs),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128, help="the most tokens a reply may have")
    ap.add_argument(
        "--ignore-eos", action="store_true", help="generate --tokens tokens, past where the reply ends"
    )
    ap.add_argument("--k", type=int, default=5, help="the fixed-k mode's proposals per step")
    ap.add_argument("--draft-model", default=None, help="add draft-model modes with this draft")
    ap.add_argument(
        "--tiny-pair",
        action="store_true",
        help="tiny random-weight target and drafts (correctness only: no real pair offline)",
    )
    args = ap.parse_args()
    drafts: dict[str, object] = {}
    if args.tiny_pair:
        import tempfile

        from tests.tiny_models import make_tiny_model_dir

        root = Path(tempfile.mkdtemp(prefix="duet-bench-spec-"))
        target_dir = make_tiny_model_dir(root / "target", "llama")
        loaded = load_model(str(target_dir))
        drafts["draft(same)"] = load_model(str(target_dir))
        drafts["draft(other)"] = load_model(str(make_tiny_model_dir(root / "other", "llama", seed=7)))
    else:
        loaded = load_model(args.model)
        if args.draft_model:
            drafts["draft"] = load_model(args.draft_model)
    modes = {"off": "off", f"k={args.k}": "ngram", "adaptive": "ngram"}
    for d in drafts:
        modes |= {f"{d} k={args.k}": d, f"{d} adaptive": d}
    engines = {}
    for name, spec in modes.items():
        cfg = EngineConfig(speculative=spec, prefix_cache=False)
        if spec in drafts:
            cfg.speculative, cfg.draft_model = "draft", drafts[spec]
        e = engines[name] = Engine(loaded, cfg)
        if name.endswith(f"k={args.k}"):  # k proposals for every row in every step, whatever they cost
            e.speculation.measure, e.speculation.max_k = False, args.k
            e.speculation.choose = lambda proposed, accepted, rows, k=args.k: k
    print(
        f"model {loaded.name}, weights {loaded.weight_format}, BLAS {active_blas()}, greedy, "
        f"up to {args.tokens} tokens per stream{' (EOS ignored)' if args.ignore_eos else ''}, "
        f"median of {args.runs} runs, ratios on decode tok/s\n"
    )
    print(
        "| prompt | streams | tokens | mode | decode tok/s | vs off | wall tok/s | proposed | kept "
        "| same tokens as off |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---|")
    for pname, text in PROMPTS.items():
        messages = [{"role": "user", "content": text}]
        for c in (int(x) for x in args.streams.split(",")):
            results: dict[str, list[Result]] = {m: [] for m in modes}
            run(engines["adaptive"], messages, c, args.tokens, args.ignore_eos)  # warm-up: pass costs
            for r in range(args.runs):
                for m in list(modes)[r % len(modes) :] + list(modes)[: r % len(modes)]:
                    results[m].append(run(engines[m], messages, c, args.tokens, args.ignore_eos))
            base = statistics.median(x.decode for x in results["off"])
            for m, rs in results.items():
                med = statistics.median(x.decode for x in rs)
                wall = statistics.median(x.wall for x in rs)
                last = rs[-1]
                same = "yes" if all(x.tokens == results["off"][0].tokens for x in rs) else "NO"
                print(
                    f"| {pname} | {c} | {len(last.tokens[0])} | {m} | {med:.1f} | {med / base:.2f}x "
                    f"| {wall:.1f} | {last.proposed} | {last.accepted} | {same} |"
                )
    for e in engines.values():
        e.shutdown()


if __name__ == "__main__":
    main()
