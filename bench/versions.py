"""Two versions of Duet side by side: a git revision against the working tree, in fresh processes.

    LD_PRELOAD="$(.venv/bin/python -m mlx_engine.blas --preload)" \\
        .venv/bin/python bench/versions.py --base REV [--model M] [--runs 5] [--threads 1]

The revision is checked out once into ``bench/out/versions/<rev>`` (a git worktree sharing this
repository's ``.venv``), its CPU kernels built there, then each run starts ``duet generate`` from
each tree in turn (the base first, then this tree; ``PYTHONPATH`` picks the tree): greedy, a chat
prompt, 128 tokens, speculation off, so decode is one token per forward pass. It reports per version
the median decode tok/s (``usage.decode_tps`` of ``--json``), the median time from spawning the
process to its first reply byte for a 1-token reply (cold start, page cache warm), whether the
greedy tokens are the same, and the ratios. On a shared machine the absolute numbers drift from
minute to minute; alternating the two versions run by run is what makes the ratio meaningful.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a short story about a robot who learns to paint, in three paragraphs."


def worktree(rev: str) -> Path:
    sha = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    tree = ROOT / "bench" / "out" / "versions" / sha
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=ROOT, check=True)
        (tree / ".venv").symlink_to(ROOT / ".venv")
    subprocess.run([sys.executable, "-m", "cpu_kernels.build"], cwd=tree, check=True, env=env(tree, 0))
    return tree


def env(tree: Path, threads: int) -> dict[str, str]:
    e = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(tree))
    if threads:
        e.update(
            OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads), DUET_CPU_THREADS=str(threads)
        )
    return e


def generate(tree: Path, model: str | None, threads: int, max_tokens: int, as_json: bool) -> list[str]:
    cmd = [sys.executable, "-m", "app.cli", "generate", "--prompt", PROMPT, "--temperature", "0"]
    cmd += ["--max-tokens", str(max_tokens), "--speculative", "off"] + (["--model", model] if model else [])
    return cmd + (["--json"] if as_json else [])


def decode_run(tree: Path, model: str | None, threads: int) -> tuple[float, list[int]]:
    out = subprocess.run(
        generate(tree, model, threads, 128, True),
        cwd=tree,
        env=env(tree, threads),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    reply = json.loads(out)
    return reply["usage"]["decode_tps"], reply["token_ids"]


def cold_run(tree: Path, model: str | None, threads: int) -> float:
    t0 = time.monotonic()
    p = subprocess.Popen(
        generate(tree, model, threads, 1, False),
        cwd=tree,
        env=env(tree, threads),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert p.stdout is not None
    p.stdout.read(1)
    first = time.monotonic() - t0
    p.stdout.read()
    if p.wait():
        raise SystemExit(f"duet generate failed in {tree}")
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the git revision to compare the working tree with")
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.model and Path(args.model).exists():
        args.model = str(Path(args.model).resolve())  # each version runs in its own tree
    trees = {"base": worktree(args.base), "this tree": ROOT}
    tps: dict[str, list[float]] = {k: [] for k in trees}
    cold: dict[str, list[float]] = {k: [] for k in trees}
    tokens: dict[str, list[int]] = {}
    cold_run(trees["base"], args.model, args.threads)  # the page cache and converted-weights cache
    cold_run(ROOT, args.model, args.threads)
    for r in range(args.runs):
        for name, tree in trees.items():
            rate, ids = decode_run(tree, args.model, args.threads)
            tps[name].append(rate)
            tokens[name] = ids
            cold[name].append(cold_run(tree, args.model, args.threads))
        print(f"run {r + 1}/{args.runs} done", file=sys.stderr, flush=True)
    med = {k: (statistics.median(tps[k]), statistics.median(cold[k])) for k in trees}
    print(f"base {args.base}, {args.runs} runs, {args.threads} thread(s), model {args.model or 'bundled'}")
    print("| version | decode tok/s (median) | first reply byte, s (median) |")
    print("|---|---:|---:|")
    for k, (d, c) in med.items():
        print(f"| {k} | {d:.1f} | {c:.2f} |")
    print(
        f"decode {med['this tree'][0] / med['base'][0]:.2f}x, cold start {med['this tree'][1] / med['base'][1]:.2f}x; "
        f"greedy tokens {'the same' if tokens['base'] == tokens['this tree'] else 'DIFFERENT'}"
    )


if __name__ == "__main__":
    main()
