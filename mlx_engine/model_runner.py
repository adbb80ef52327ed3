"""Runs one scheduler step through the model: rows of tokens in, last-position logits out.

Rows that process the same number of tokens (all decodes, equal-size prefill chunks) run
as one batched forward pass; each pass gets a ``BatchLayout`` telling the paged caches
where to read and write. Only the last position of each row goes through the LM head:
computing vocabulary logits for every prompt position would cost more than the rest of a
small model's prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from cpu_kernels.spec import available as cpu_kernels_available
from mlx_engine.backend import backend_name
from mlx_engine.kv_cache import paged_attention
from mlx_engine.kv_cache.kv_pool import KVPool
from mlx_engine.kv_cache.paged_attention import AttentionRoute, BatchLayout, LayerExport, PagedLayerCache


@dataclass
class Row:
    tokens: list[int]  # tokens to process this step
    start: int  # tokens of this sequence already in the pool
    blocks: list[int]  # the sequence's block table
    export: LayerExport | None = None  # KV of these tokens to hand out per layer (a prefill peer)
    all_logits: bool = False  # logits at every position, not only the last (verifying proposals)


def lm_head(model: nn.Module, h: mx.array) -> mx.array:
    """The model's output projection (tied or not, with Gemma-style final soft-capping)."""
    out = model.lm_head(h) if "lm_head" in model else model.model.embed_tokens.as_linear(h)
    cap = getattr(model.args, "final_logit_softcapping", None)
    if cap:
        out = mx.tanh(out / cap) * cap
    scale = getattr(model.args, "logits_scaling", None)  # Granite divides its logits
    if scale:
        out = out / scale
    return out


# mlx-lm models that apply an array mask to 5-D grouped-query scores themselves
_FIVE_D_MASKS = {"gemma2"}


class ModelRunner:
    def __init__(self, model: nn.Module, pool: KVPool):
        paged_attention.install()
        # how attention runs over the pool (a kernel for this backend, else the reference path);
        # set another route between steps to compare paths (tests, bench/metal_decode.py)
        self.attention = AttentionRoute.for_backend(backend_name(), cpu_kernels_available())
        self.model = model
        self.pool = pool
        self.position_logits: dict[int, mx.array] = {}  # row index -> (tokens, vocab), last forward

    def lazy_logits(self, rows: list[Row], all_positions: bool = False) -> mx.array:
        """One pass over rows of equal length, as a lazy graph: its logits (the last position, or every
        one); the KV writes are pending in the pool's arrays. Nothing is evaluated."""
        layout = BatchLayout(
            starts=[r.start for r in rows],
            num_new=len(rows[0].tokens),
            block_tables=[r.blocks for r in rows],
            block_size=self.pool.block_size,
            exports=[r.export for r in rows if r.export is not None],
            route=self.attention,
            array_mask_rank=5 if getattr(self.model, "model_type", None) in _FIVE_D_MASKS else 4,
        )
        caches = [PagedLayerCache(self.pool, i, layout) for i in range(self.pool.num_layers)]
        h = self.model.model(mx.array([r.tokens for r in rows], dtype=mx.int32), caches)
        return lm_head(self.model, h if all_positions else h[:, -1:, :])

    def forward(self, rows: list[Row]) -> mx.array:
        """Logits (len(rows), vocab) of each row's last token, in row order; KV written to the pool."""
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault(len(r.tokens), []).append(i)
        parts, order = [], []
        self.position_logits = {}
        for idx in groups.values():
            every = any(rows[i].all_logits for i in idx)
            out = self.lazy_logits([rows[i] for i in idx], all_positions=every)
            for j, i in enumerate(idx):
                if rows[i].all_logits:
                    self.position_logits[i] = out[j]
            parts.append(out[:, -1, :])
            order.extend(idx)
            if len(groups) > 1:
                # Evaluate each pass before building the next: the pool arrays are updated in
                # place only while nothing else holds the old buffer. Two passes in one graph
                # let MLX schedule pass 2's writes before pass 1's reads, and each layer's
                # whole pool array is then copied (seconds per step with a GiB-sized pool).
                mx.eval(parts[-1], *self.pool.arrays())
        logits = mx.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
        if order != sorted(order):
            inv = [0] * len(order)
            for pos, i in enumerate(order):
                inv[i] = pos
            logits = logits[mx.array(inv)]
        mx.eval(logits, *self.position_logits.values(), *self.pool.arrays())
        return logits

    def forward_all(self, row: Row) -> mx.array:
        """Logits at every position of one row (teacher forcing in tests and evals)."""
        logits = self.lazy_logits([row], all_positions=True)[0]
        mx.eval(logits, *self.pool.arrays())
        return logits
