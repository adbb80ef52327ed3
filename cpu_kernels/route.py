"""A mixture-of-experts layer's routing in one op on the CPU.

Qwen3-MoE's block routes each token through ``softmax(gate(x))``, ``argpartition`` for the top k,
``take_along_axis`` and (``norm_topk_prob``) a renormalisation: ~8 MLX ops per layer and decode step,
each paying MLX's per-op cost on the CPU (2-4 µs, a BLAS call more), about 1 ms of a 16-layer,
16-expert model's ~25 ms step. ``moe_route`` is that routing as one primitive (``src/moe_route.cpp``):
the router's logits in float32, the softmax against the largest, the k most probable experts (ties:
the lower index first) and their probabilities, renormalised if asked.
"""

from __future__ import annotations

import mlx.core as mx

from cpu_kernels.spec import FLOATS, choose_backend, extension

ROUTE_ROWS = 16  # tokens up to which the block routes through the op; a prefill keeps BLAS's GEMM


def moe_route(
    x: mx.array, w: mx.array, k: int, normalize: bool, *, backend: str | None = None
) -> tuple[mx.array, mx.array]:
    """(indices (..., k) uint32, scores (..., k)): the k largest of ``softmax(x @ w.T)`` and their
    experts, the scores renormalised to sum to 1 with ``normalize``."""
    fits = x.dtype in FLOATS and w.dtype in FLOATS and w.ndim == 2 and 1 <= k <= w.shape[0]
    requirement = (
        "moe_route's kernel takes float x (..., D), a float router (experts, D) and 1 <= k <= experts"
    )
    ext = extension()
    if choose_backend(backend, fits, requirement) == "native" and ext is not None:
        inds, scores = ext.moe_route(x, w, k, normalize)
        return inds, scores
    return reference(x, w, k, normalize)


def reference(x: mx.array, w: mx.array, k: int, normalize: bool) -> tuple[mx.array, mx.array]:
    """mlx-lm's Qwen3-MoE routing with MLX ops (its experts in argpartition's order)."""
    gates = mx.softmax(x @ w.T, axis=-1, precise=True)
    inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if normalize:
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    return inds.astype(mx.uint32), scores
