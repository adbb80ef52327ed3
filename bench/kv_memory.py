"""KV cache memory per token, and how many 2K-token sequences fit in a 1 GiB budget.

    .venv/bin/python bench/kv_memory.py [--model M] [--budget-gb 1] [--seq-tokens 2048]

For each KV format (fp32, what the CPU runs; fp16, what Metal and CUDA run; 8- and 4-bit affine
with group 32 and fp16 scales), the script allocates the engine's real pool for the budget
(``KVPool.blocks_for_budget``, the sizing ``Engine`` uses) and reports bytes per token measured on
the allocated arrays. It then drives the real scheduler and block allocator (no model pass: this
is about admission, not speed) with more 2K-token sequences than can fit, and reports the most
that were ever running at once, the preemptions, and that no block leaked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from mlx_engine.kv_cache.block_allocator import BlockAllocator  # noqa: E402
from mlx_engine.kv_cache.kv_pool import KVPool  # noqa: E402
from mlx_engine.loading.loader import load_model  # noqa: E402
from mlx_engine.scheduler import Scheduler, SchedulerConfig, Sequence  # noqa: E402

FORMATS = [
    ("fp32", mx.float32, None),
    ("fp16", mx.float16, None),
    ("8-bit", mx.float16, 8),
    ("4-bit", mx.float16, 4),
]
BLOCK, GROUP = 16, 32


def max_resident(num_blocks: int, seq_tokens: int, n_seqs: int) -> tuple[int, int, int]:
    """Run ``n_seqs`` sequences of ``seq_tokens`` (all prompt but the last 16, which are decoded)
    through the scheduler; returns (most running at once, preemptions, blocks still used)."""
    alloc = BlockAllocator(num_blocks, BLOCK, enable_prefix_cache=False)
    sched = Scheduler(
        alloc,
        SchedulerConfig(
            max_batch_tokens=1 << 20, prefill_chunk=1 << 20, max_running=1 << 20, max_queue=1 << 20
        ),
    )
    prompt = seq_tokens - 16
    seqs = {}
    for i in range(n_seqs):
        s = Sequence(f"r{i}", [1 + (i + j) % 1000 for j in range(prompt)], prompt, seq_tokens)
        seqs[s.request_id] = s
        sched.add(s)
    peak = 0
    while sched.has_work():
        step = sched.schedule()
        peak = max(peak, len(sched.running))
        for rid, n in step.items():
            s = seqs[rid]
            s.num_computed += n
            if s.num_computed == len(s.tokens):
                s.tokens.append(7)  # the "sampled" token
                if len(s.tokens) >= s.max_total:
                    sched.finish(s)
    alloc.check_invariants()
    return peak, sched.preemptions, alloc.num_used


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--budget-gb", type=float, default=1.0)
    ap.add_argument("--seq-tokens", type=int, default=2048)
    args = ap.parse_args()
    m = load_model(args.model)
    budget = args.budget_gb * 2**30
    print(
        f"model {m.name}: {m.num_layers} layers, {m.n_kv_heads} KV heads x head_dim {m.head_dim}; "
        f"budget {args.budget_gb:g} GiB, {args.seq_tokens}-token sequences, blocks of {BLOCK} tokens\n"
    )
    print(
        "| KV format | bytes / token (all layers) | vs fp16 | blocks in budget | pool allocated (MiB) "
        f"| {args.seq_tokens}-token sequences that fit | scheduler run: peak running, preemptions, leaked blocks |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    fp16 = None
    for name, dtype, bits in FORMATS:
        nb = KVPool.blocks_for_budget(
            budget, m.num_layers, m.n_kv_heads, m.head_dim, dtype, bits, GROUP, BLOCK
        )
        pool = KVPool(m.num_layers, nb, BLOCK, m.n_kv_heads, m.head_dim, dtype, bits, GROUP)
        per_token = pool.nbytes / (nb * BLOCK)
        fp16 = per_token if name == "fp16" else fp16
        capacity = (nb - 1) // -(-args.seq_tokens // BLOCK)
        peak, preempt, leaked = max_resident(nb, args.seq_tokens, capacity + 8)
        ratio = f"{per_token / fp16:.2f}x" if fp16 else "2.00x"
        print(
            f"| {name} | {per_token:,.0f} | {ratio} | {nb - 1:,} | {pool.nbytes / 2**20:,.0f} | {capacity} "
            f"| {peak}, {preempt}, {leaked} |",
            flush=True,
        )
        del pool


if __name__ == "__main__":
    main()
