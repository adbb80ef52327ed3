"""Verifying proposed tokens: sample every position of a drafted row as plain decoding would and
keep the proposals up to the first that differs from the sampled token.

A proposal that is a fixed token (n-gram lookup, a greedy draft model) kept while it equals the
sample *is* exact rejection sampling, so greedy output is token-identical to plain decoding and
sampled output has the target's distribution (and, for a seed, the same tokens).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_engine.request import SamplingParams
from mlx_engine.sampling.sampler import SampleResult, SamplerRow, SeedState, has_penalty, sample
from mlx_engine.scheduler import Sequence


def sampler_row(
    params: SamplingParams, rng: SeedState, seq: Sequence, upto: int, allowed: np.ndarray | None = None
) -> SamplerRow:
    """The sampler row of the token after ``seq.tokens[:upto]``: penalties see the prompt and the
    output up to there (what the output is if the proposals before ``upto`` are kept)."""
    penalised = has_penalty(params)
    return SamplerRow(
        params=params,
        rng=rng,
        prompt_ids=seq.tokens[: seq.num_prompt] if penalised else (),
        output_ids=seq.tokens[seq.num_prompt : upto] if penalised else (),
        allowed=allowed,
    )


def kept(results: list[SampleResult], proposals: list[int]) -> list[SampleResult]:
    """The sampled results to emit: up to and including the first that differs from its proposal
    (all of them when every proposal matched)."""
    n = 1
    while n <= len(proposals) and n < len(results) and results[n - 1].token_id == proposals[n - 1]:
        n += 1
    return results[:n]


def verify(rows: list[tuple[Sequence, SamplingParams, SeedState, mx.array]]) -> list[list[SampleResult]]:
    """Per drafted row ``(seq, params, rng, logits)`` (``logits``: one row per position, the
    last sampled token's and each proposal's), the results to emit (``kept``). Rows that draw no
    random numbers (greedy) have every position sampled in one batched call; a row that draws
    samples position by position, so that its random stream advances once per emitted token."""
    out: list[list[SampleResult]] = [[] for _ in rows]
    greedy = [i for i, (_, p, _, _) in enumerate(rows) if p.greedy]
    if greedy:
        srows = [
            sampler_row(p, rng, seq, seq.num_verified + j)
            for seq, p, rng, lg in (rows[i] for i in greedy)
            for j in range(lg.shape[0])
        ]
        logits = [rows[i][3] for i in greedy]
        results, at = sample(mx.concatenate(logits, axis=0) if len(logits) > 1 else logits[0], srows), 0
        for i in greedy:
            n = rows[i][3].shape[0]
            out[i] = results[at : at + n]
            at += n
    for i, (seq, p, rng, lg) in enumerate(rows):
        if p.greedy:
            continue
        for j in range(lg.shape[0]):
            out[i].append(sample(lg[j : j + 1], [sampler_row(p, rng, seq, seq.num_verified + j)])[0])
            if j == lg.shape[0] - 1 or out[i][-1].token_id != seq.tokens[seq.num_verified + j]:
                break
    return [
        kept(results, seq.tokens[seq.num_verified :])
        for results, (seq, _, _, _) in zip(out, rows, strict=True)
    ]
