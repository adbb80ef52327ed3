"""How far the CPU kernels' int8 and int16 math move a model's next-token predictions from exact math.

    PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python bench/cpu_accuracy.py [--model PATH] [--tokens 801]
                                                                        [--prompts 64,256,512] [--maths int8,int16]

Exact math (the default: float32-accurate products) is the reference. The text (docs/architecture.md
then README.md, tokenized, its first ``--tokens`` tokens) is teacher-forced through mlx-lm's model as
Duet loads it, with a KV cache:

* **int8** (and each of ``--maths``): every product with that math, 8 tokens a pass (every product
  through the fused kernels, as a short prefill chunk or a speculative verification is); every
  position is compared;
* **int8 prefill, exact decode** (one row per ``--prompts`` length P and math): the first P tokens
  prefilled in one pass with that math, the rest decoded one token a pass with exact math, so the KV
  cache of the prompt is that math's; the decoded positions (the first one the prompt's last) are
  compared;
* **exact prefill, exact decode** (the control): the same passes with exact math throughout, so what
  the split of passes alone changes shows.

For each: top-1 agreement with the reference (the issue's bar for a default: 99%), the largest
absolute difference of a logit, and the perplexity of the text under each. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cpu_kernels.spec import set_cpu_math  # noqa: E402
from mlx_engine.loading.loader import load_model  # noqa: E402
from mlx_engine.loading.resolve import bundled_model_path  # noqa: E402

TEXT = ("docs/architecture.md", 6000), ("README.md", 3000)  # (file, characters) of plain text


def text_tokens(tokenizer, n: int) -> list[int]:
    text = "".join((ROOT / name).read_text()[:chars] for name, chars in TEXT)
    ids = list(tokenizer.encode(text))
    if len(ids) < n:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --tokens {n}")
    return ids[:n]


def passes(model, ids: list[int], plan: list[tuple[int, int, str]]) -> list[mx.array]:
    """Float32 logits for positions 0 .. len(ids) - 2, computed pass by pass: (start, end, math)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out: list[mx.array] = []
    for start, end, math_ in plan:
        set_cpu_math(math_)  # the products built from now on
        logits = model(mx.array([ids[start:end]]), cache=cache)[0].astype(mx.float32)
        mx.eval(logits)
        out.extend(logits[j] for j in range(logits.shape[0]))
    set_cpu_math()
    return out


def chunked(n: int, size: int, math_: str) -> list[tuple[int, int, str]]:
    return [(s, min(s + size, n), math_) for s in range(0, n, size)]


def prefill_then_decode(n: int, prompt: int, math_: str) -> list[tuple[int, int, str]]:
    return [(0, prompt, math_)] + [(i, i + 1, "exact") for i in range(prompt, n)]


def compare(ref: list[mx.array], got: list[mx.array], ids: list[int], first: int) -> dict[str, float]:
    agree, worst, nll_ref, nll_got = 0, 0.0, 0.0, 0.0
    positions = range(first, len(ref))
    for i in positions:
        a, b = ref[i], got[i]
        agree += int(mx.argmax(a).item() == mx.argmax(b).item())
        worst = max(worst, mx.max(mx.abs(a - b)).item())
        target = ids[i + 1]
        nll_ref -= (a[target] - mx.logsumexp(a)).item()
        nll_got -= (b[target] - mx.logsumexp(b)).item()
    count = len(positions)
    return {
        "positions": count,
        "top1": agree / count,
        "max_dlogit": worst,
        "ppl_ref": math.exp(nll_ref / count),
        "ppl": math.exp(nll_got / count),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF or MLX model (default: the bundled one)")
    ap.add_argument("--tokens", type=int, default=801, help="tokens of text (positions compared: one fewer)")
    ap.add_argument("--prompts", default="64,256,512", help="prompt lengths for int8 prefill + exact decode")
    ap.add_argument("--maths", default="int8,int16", help="the maths compared with exact math")
    args = ap.parse_args()
    loaded = load_model(args.model or str(bundled_model_path()))
    ids = text_tokens(loaded.tokenizer, args.tokens)
    n = len(ids) - 1  # positions with a next token
    model = loaded.model
    ref = passes(model, ids, chunked(n, 8, "exact"))
    maths = [m for m in args.maths.split(",") if m]
    rows = [
        (f"{m}, 8 tokens a pass", compare(ref, passes(model, ids, chunked(n, 8, m)), ids, 0)) for m in maths
    ]
    for p in (int(v) for v in args.prompts.split(",") if v):
        for label, math_ in [(m, m) for m in maths] + [("exact (control)", "exact")]:
            got = passes(model, ids, prefill_then_decode(n, p, math_))
            rows.append((f"{label} prefill of {p}, exact decode", compare(ref, got, ids, p - 1)))
    print(f"{loaded.weight_format}; reference: exact math, 8 tokens a pass; {n} positions of text\n")
    print("| path | positions | top-1 agreement | max abs logit diff | perplexity (exact's) |")
    print("|---|---:|---:|---:|---|")
    for label, r in rows:
        print(
            f"| {label} | {r['positions']} | {100 * r['top1']:.1f}% | {r['max_dlogit']:.3f} |"
            f" {r['ppl']:.2f} ({r['ppl_ref']:.2f}) |"
        )


if __name__ == "__main__":
    main()
