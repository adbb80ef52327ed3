"""Batched token sampler: one call picks the next token for every running sequence,
each with its own sampling parameters and its own random state.

Per row, in this order (what OpenAI / llama.cpp / vLLM users expect):

1. ``logit_bias``: added to the raw logits (-100 effectively bans a token, +100 forces it).
2. Penalties, on the biased logits:
   - ``repetition_penalty`` (CTRL / HF / llama.cpp style) over every token in prompt + output:
     a positive logit is divided by the penalty, a negative one multiplied.
   - ``frequency_penalty`` and ``presence_penalty`` (OpenAI style) over output tokens only:
     ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.
3. Constraint mask: tokens outside ``allowed`` get -inf. Logit positions beyond the mask's
   length (a model whose vocabulary is padded past the tokenizer's) count as disallowed.
4. Log-probabilities, when asked for, are reported from this distribution at temperature 1:
   ``log_softmax`` of the biased, penalised, masked logits, before temperature and
   truncation. This is the model's distribution as the request shaped it, comparable across
   temperatures; a banned token reports -inf and is left out of the alternatives (so ``top``
   has ``min(top_logprobs, number of allowed tokens)`` entries).
5. ``temperature == 0``: greedy, the argmax (the lowest token id on an exact tie). Otherwise
   the logits are divided by the temperature, then
6. ``top_k`` keeps the k most likely tokens (0 = off),
7. ``top_p`` keeps the smallest set of most likely tokens whose probability, renormalised after
   top_k, reaches top_p (1 = off),
8. ``min_p`` keeps tokens whose probability is at least ``min_p`` times the most likely one's
   (0 = off), and
9. one token is drawn from what is left, by inverse-CDF with one uniform number from the
   row's own random state.

Seeds: each request owns a ``SeedState`` made once by ``make_rng(seed)`` and advanced by one
draw per sampled (non-greedy) token, so a seeded request gives the same tokens whatever else
is in the batch and wherever it sits in it. ``make_rng(None)`` draws fresh OS entropy.

Cost: when every row is plain greedy (no bias, penalties, mask or logprobs) the whole call is
one argmax. Otherwise the work is a handful of vectorised ops over (B, vocab); top_k / top_p
look at the 256 most likely tokens and sort the whole vocabulary only for rows whose nucleus
reaches past them. The array code is written once against ``xp``: MLX on Metal / CUDA, numpy
on MLX's CPU backend, whose exp, reductions and partition measured 2-10x slower than numpy's
on x86 and would make the sampler a large part of a CPU decode step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_engine.backend import backend_name
from mlx_engine.request import SamplingParams

SeedState = np.random.Generator

CANDIDATES = 256  # most likely tokens looked at first for top_k / top_p
BLOCK = 256  # inverse-CDF block width
NUCLEUS_MARGIN = 1e-4

Array = Any  # an mx.array or np.ndarray, whichever ``xp`` makes


def _xp() -> Any:
    return np if backend_name() == "cpu" else mx


def make_rng(seed: int | None) -> SeedState:
    """A request's random state: reproducible from ``seed`` (any integer, negative too, as OpenAI
    clients send), or fresh entropy for None."""
    return np.random.default_rng(None if seed is None else int(seed) % 2**64)


@dataclass
class SamplerRow:
    params: SamplingParams
    rng: SeedState
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    allowed: np.ndarray | None = None  # bool (vocab,) from a Constraint, or None


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None  # set when params.logprobs
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _is_plain_greedy(row: SamplerRow) -> bool:
    p = row.params
    return p.greedy and not p.logprobs and not p.logit_bias and not has_penalty(p) and row.allowed is None


def sample(logits: mx.array, rows: list[SamplerRow]) -> list[SampleResult]:
    """Pick one token per row. ``logits``: (B, V), any float dtype, row i for ``rows[i]``."""
    if logits.ndim != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits shape {logits.shape} does not match {len(rows)} rows")
    xp = _xp()
    x: Array = logits.astype(mx.float32)  # a new array (the steps below assign into it), float32 math
    if xp is np:
        x = np.array(x)
    if all(_is_plain_greedy(r) for r in rows):
        return [SampleResult(t) for t in xp.argmax(x if xp is np else logits, axis=-1).tolist()]

    x = _apply_bias(xp, x, rows)
    x = _apply_penalties(xp, x, rows)
    x = _apply_masks(xp, x, rows)

    want_lp = [i for i, r in enumerate(rows) if r.params.logprobs]
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    drawn = [i for i, r in enumerate(rows) if not r.params.greedy]

    if not drawn:
        tokens = xp.argmax(x, axis=-1).astype(xp.uint32)
    elif not greedy:
        tokens = _draw(xp, x, rows)
    else:
        tokens = xp.zeros((len(rows),), dtype=xp.uint32)
        gi, di = xp.array(greedy), xp.array(drawn)
        tokens[gi] = xp.argmax(x[gi], axis=-1).astype(xp.uint32)
        tokens[di] = _draw(xp, x[di], [rows[i] for i in drawn])

    if not want_lp:
        return [SampleResult(t) for t in tokens.tolist()]
    return _with_logprobs(xp, x, tokens, rows, want_lp)


def _apply_bias(xp: Any, x: Array, rows: list[SamplerRow]) -> Array:
    r_idx: list[int] = []
    t_idx: list[int] = []
    vals: list[float] = []
    for i, row in enumerate(rows):
        for tok, b in (row.params.logit_bias or {}).items():
            r_idx.append(i)
            t_idx.append(int(tok))
            vals.append(float(b))
    if not r_idx:
        return x
    r, t = xp.array(r_idx), xp.array(t_idx)  # one (row, token) pair at most once: dict keys
    x[r, t] = x[r, t] + xp.array(vals, dtype=xp.float32)
    return x


def _apply_penalties(xp: Any, x: Array, rows: list[SamplerRow]) -> Array:
    r_parts, t_parts, rep_parts, sub_parts = [], [], [], []
    for i, row in enumerate(rows):
        p = row.params
        if not has_penalty(p):
            continue
        out = np.asarray(row.output_ids, dtype=np.int64)
        out_toks, counts = np.unique(out, return_counts=True)
        if p.repetition_penalty != 1.0 and len(row.prompt_ids):
            toks = np.union1d(out_toks, np.asarray(row.prompt_ids, dtype=np.int64))
            out_counts = np.zeros(len(toks), dtype=np.float32)
            out_counts[np.searchsorted(toks, out_toks)] = counts
        else:
            toks, out_counts = out_toks, counts.astype(np.float32)
        if not len(toks):
            continue
        r_parts.append(np.full(len(toks), i, dtype=np.int64))
        t_parts.append(toks)
        rep_parts.append(np.full(len(toks), p.repetition_penalty, dtype=np.float32))
        sub_parts.append(p.frequency_penalty * out_counts + p.presence_penalty * (out_counts > 0))
    if not r_parts:
        return x
    r = xp.array(np.concatenate(r_parts))
    t = xp.array(np.concatenate(t_parts))
    rep = xp.array(np.concatenate(rep_parts))
    sub = xp.array(np.concatenate(sub_parts).astype(np.float32))
    g = x[r, t]
    x[r, t] = xp.where(g > 0, g / rep, g * rep) - sub
    return x


def _apply_masks(xp: Any, x: Array, rows: list[SamplerRow]) -> Array:
    if all(r.allowed is None for r in rows):
        return x
    vocab = x.shape[1]
    mask = np.ones((len(rows), vocab), dtype=bool)
    for i, row in enumerate(rows):
        if row.allowed is None:
            continue
        allowed = np.asarray(row.allowed, dtype=bool).reshape(-1)[:vocab]
        mask[i, : len(allowed)] = allowed
        mask[i, len(allowed) :] = False
        if not mask[i].any():
            raise ValueError(f"row {i}: the constraint allows no token")
    return xp.where(xp.array(mask), x, -xp.inf)


def _draw(xp: Any, x: Array, rows: list[SamplerRow]) -> Array:
    """Sample one token per row from logits ``x`` (n, V): temperature, top_k, top_p, min_p, draw.

    Each row takes a path that depends only on its own parameters and logits (never on the
    rest of the batch), so seeded rows stay reproducible whatever they are batched with:
    - no top_k / top_p: inverse CDF over the whole vocabulary, no sort;
    - top_k / top_p: the ``CANDIDATES`` most likely tokens are enough when top_k is within
      them or the top_p nucleus ends inside them (the usual case); otherwise a full sort.
    """
    params = [r.params for r in rows]
    temp = xp.array([p.temperature for p in params], dtype=xp.float32)[:, None]
    z = x / temp
    u = xp.array([r.rng.random() for r in rows], dtype=xp.float32)[:, None]
    plain = [j for j, p in enumerate(params) if p.top_k == 0 and p.top_p >= 1.0]
    trunc = [j for j, p in enumerate(params) if not (p.top_k == 0 and p.top_p >= 1.0)]
    if not trunc:
        return _draw_unsorted(xp, z, params, u)
    if not plain:
        return _draw_truncated(xp, z, params, u)
    pick = xp.zeros((len(rows),), dtype=xp.uint32)
    pi, ti = xp.array(plain), xp.array(trunc)
    pick[pi] = _draw_unsorted(xp, z[pi], [params[j] for j in plain], u[pi])
    pick[ti] = _draw_truncated(xp, z[ti], [params[j] for j in trunc], u[ti])
    return pick


def _log_min_p(xp: Any, params: list[SamplingParams]) -> Array:
    # min_p in logit space: p_i >= min_p * p_max  <=>  z_i >= z_max + log(min_p)
    return xp.array([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], dtype=xp.float32)[
        :, None
    ]


def _inverse_cdf(xp: Any, weights: Array, u: Array) -> Array:
    """Per row, the first position where the cumulative weight exceeds ``u`` times the total.

    Two levels, so the whole row is only summed, never scanned: pick a block of ``BLOCK``
    positions by the blocks' cumulative sums, then the position inside that block. A position
    with zero weight is never chosen (the cumulative sum does not rise there), whatever float
    rounding does.
    """
    n, width = weights.shape
    if width <= 4 * BLOCK:
        return _pick_in(xp, weights, u * weights.sum(axis=-1, keepdims=True))
    pad = -width % BLOCK
    if pad:
        weights = xp.concatenate([weights, xp.zeros((n, pad), dtype=weights.dtype)], axis=-1)
    block_cum = xp.cumsum(weights.reshape(n, -1, BLOCK).sum(axis=-1), axis=-1)
    target = u * block_cum[:, -1:]
    block = _pick_in(xp, block_cum, target, cumulative=True)[:, None]
    before = xp.where(block > 0, xp.take_along_axis(block_cum, xp.maximum(block - 1, 0), axis=-1), 0.0)
    inner = xp.take_along_axis(weights, block * BLOCK + xp.arange(BLOCK)[None, :], axis=-1)
    return block[:, 0] * BLOCK + _pick_in(xp, inner, xp.maximum(target - before, 0.0))


def _pick_in(xp: Any, w: Array, target: Array, cumulative: bool = False) -> Array:
    """First position whose cumulative weight exceeds ``target`` (n, 1), kept at or before the
    last position with weight: float rounding can put ``target`` at the total."""
    cum = w if cumulative else xp.cumsum(w, axis=-1)
    return xp.minimum((cum <= target).sum(axis=-1), (cum < cum[:, -1:]).sum(axis=-1))


def _draw_unsorted(xp: Any, z: Array, params: list[SamplingParams], u: Array) -> Array:
    z_max = z.max(axis=-1, keepdims=True)
    w = xp.exp(z - z_max)
    if any(p.min_p > 0 for p in params):
        w = xp.where(z >= z_max + _log_min_p(xp, params), w, 0.0)
    return _inverse_cdf(xp, w, u).astype(xp.uint32)


def _draw_truncated(xp: Any, z: Array, params: list[SamplingParams], u: Array) -> Array:
    vocab = z.shape[1]
    c = min(CANDIDATES, vocab)
    cand = xp.argpartition(z, kth=vocab - c, axis=-1)[:, vocab - c :]  # the c largest, unordered
    cz = xp.take_along_axis(z, cand, axis=-1)
    by_value = xp.argsort(-cz, axis=-1)
    cand = xp.take_along_axis(cand, by_value, axis=-1)
    cz = xp.take_along_axis(cz, by_value, axis=-1)  # descending
    # Rows whose top_k cuts inside the candidates renormalise over them; the others need the
    # whole row's mass (relative to its max, like the candidates' weights).
    row_mass = None
    if c < vocab and not all(0 < p.top_k <= c for p in params):
        row_mass = xp.exp(z - cz[:, :1]).sum(axis=-1, keepdims=True)
    w, fits = _truncate_sorted(xp, cz, params, row_mass)
    pick = xp.take_along_axis(cand, _inverse_cdf(xp, w, u)[:, None], axis=-1)[:, 0].astype(xp.uint32)
    redo = [j for j, ok in enumerate(fits.tolist()) if not ok] if fits is not None else []
    if redo:  # top_k or the nucleus reaches past the candidates: sort these rows' whole vocabulary
        ri = xp.array(redo)
        zr = z[ri]
        order = xp.argsort(-zr, axis=-1)
        w, _ = _truncate_sorted(xp, xp.take_along_axis(zr, order, axis=-1), [params[j] for j in redo], None)
        pick[ri] = xp.take_along_axis(order, _inverse_cdf(xp, w, u[ri])[:, None], axis=-1)[:, 0].astype(
            xp.uint32
        )
    return pick


def _truncate_sorted(
    xp: Any, zs: Array, params: list[SamplingParams], row_mass: Array | None
) -> tuple[Array, Array | None]:
    """Sampling weights over the leading logits ``zs`` (descending) after top_k, top_p, min_p.

    ``row_mass``: when ``zs`` holds only a row's most likely logits, that row's total
    ``sum(exp(z - z_max))``. Then also return ``fits``: per row, whether top_k or the top_p
    nucleus ends inside ``zs``, i.e. whether the weights are exact.
    """
    c = zs.shape[1]
    k_inside = xp.array([0 < p.top_k <= c for p in params])[:, None]
    k = xp.array([p.top_k if 0 < p.top_k <= c else c for p in params])[:, None]
    top_p = xp.array([p.top_p if p.top_p < 1.0 else math.inf for p in params], dtype=xp.float32)[:, None]
    w = xp.exp(zs - zs[:, :1])
    w = xp.where(xp.arange(c)[None, :] < k, w, 0.0)
    # top_p applies to the distribution renormalised after top_k
    mass = w.sum(axis=-1, keepdims=True)
    if row_mass is not None:
        mass = xp.where(k_inside, mass, row_mass)
    probs = w / mass
    cum = xp.cumsum(probs, axis=-1)
    keep = (cum - probs) < top_p  # the most likely token is always kept
    keep = keep & (zs >= zs[:, :1] + _log_min_p(xp, params))
    fits = None
    if row_mass is not None:
        # exact when top_k cuts inside, or with no top_k the nucleus ends inside (with a margin,
        # so float error never decides); a top_k beyond the candidates needs the full sort
        no_k = xp.array([p.top_k == 0 for p in params])
        fits = k_inside[:, 0] | (no_k & (cum[:, -1] >= top_p[:, 0] + NUCLEUS_MARGIN))
    return xp.where(keep, probs, 0.0), fits


def _with_logprobs(
    xp: Any, x: Array, tokens: Array, rows: list[SamplerRow], want: list[int]
) -> list[SampleResult]:
    wi = xp.array(want)
    xw = x[wi]
    x_max = xw.max(axis=-1, keepdims=True)
    lp = xw - (x_max + xp.log(xp.exp(xw - x_max).sum(axis=-1, keepdims=True)))
    chosen_lp = xp.take_along_axis(lp, tokens[wi][:, None].astype(xp.int32), axis=-1)[:, 0]
    n_top = min(max(rows[i].params.top_logprobs for i in want), lp.shape[1])
    top_ids = top_vals = None
    if n_top > 0:
        vocab = lp.shape[1]
        top_ids = xp.argpartition(lp, kth=vocab - n_top, axis=-1)[:, vocab - n_top :]
        top_vals = xp.take_along_axis(lp, top_ids, axis=-1)
    if xp is mx:
        mx.eval(tokens, chosen_lp, *([top_ids, top_vals] if n_top else []))

    token_list = tokens.tolist()
    results = [SampleResult(t) for t in token_list]
    chosen = chosen_lp.tolist()
    ids_np = np.array(top_ids) if n_top else None
    vals_np = np.array(top_vals) if n_top else None
    for j, i in enumerate(want):
        res = results[i]
        res.logprob = chosen[j]
        n = rows[i].params.top_logprobs
        if n and ids_np is not None and vals_np is not None:
            by_best = np.lexsort((ids_np[j], -vals_np[j]))  # best first; lower id first on a tie
            res.top = [
                (int(ids_np[j, m]), float(vals_np[j, m])) for m in by_best[:n] if np.isfinite(vals_np[j, m])
            ]
    return results
