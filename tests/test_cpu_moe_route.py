"""A mixture-of-experts layer's routing as one op (cpu_kernels/route.py, src/moe_route.cpp).

Qwen3-MoE's block on the CPU routes a decode step's tokens through ``moe_route``: the same experts
as mlx-lm's softmax + argpartition (as a set: argpartition's order is unspecified; ours is by
descending probability), the same scores to float32 rounding, renormalised or not, for any leading
shape and float dtype; and a model's logits unchanged, its prefill still mlx-lm's own path.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from cpu_kernels.modules import use_cpu_kernels
from cpu_kernels.route import ROUTE_ROWS, moe_route, reference
from tests.test_cpu_gather_qmm import MOE_CONFIG, logits_and_step, tiny_moe
from tests.test_cpu_kernels import ext  # noqa: F401

pytestmark = [
    pytest.mark.skipif(
        mx.metal.is_available(), reason="the CPU kernels are for CPU inference (Metal has its own)"
    ),
    pytest.mark.usefixtures("exact_math"),  # exact math is these tests' reference (conftest.py)
]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_the_chosen_experts_and_scores_are_mlx_lm_s(ext, dtype):  # noqa: F811
    rng = np.random.default_rng(0)
    for shape, experts, k in (
        ((1, 1, 64), 8, 3),
        ((4, 1, 2048), 128, 8),
        ((3, 5, 96), 16, 4),
        ((7, 32), 4, 4),
    ):
        x = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
        w = mx.array((rng.standard_normal((experts, shape[-1])) * 0.05).astype(np.float32)).astype(dtype)
        for normalize in (True, False):
            inds, scores = moe_route(x, w, k, normalize, backend="native")
            want_i, want_s = reference(x.astype(mx.float32), w.astype(mx.float32), k, normalize)
            assert inds.dtype == mx.uint32 and inds.shape == (*shape[:-1], k)
            assert scores.dtype == dtype and scores.shape == inds.shape
            got_i, got_s = np.array(inds), np.array(scores.astype(mx.float32))
            # by descending probability
            assert (np.diff(got_s, axis=-1) <= 0).all()
            assert (np.sort(got_i, -1) == np.sort(np.array(want_i), -1)).all()
            tol = 1e-6 if dtype == mx.float32 else 1e-2
            assert np.abs(np.sort(got_s, -1) - np.sort(np.array(want_s), -1)).max() <= tol
            if normalize:
                assert np.allclose(got_s.sum(-1), 1.0, atol=tol)


def test_a_router_in_any_layout_gives_the_same_bits(ext):  # noqa: F811
    # the loader keeps a dense float32 Linear's weight input-major (the transpose of a contiguous
    # (D, E) array); the op reads that layout in place, a strided one through a copy
    rng = np.random.default_rng(1)
    for shape, experts, k in (((1, 1, 2048), 16, 4), ((3, 1, 100), 128, 8), ((2, 37), 5, 2)):
        x = mx.array(rng.standard_normal(shape).astype(np.float32))
        w = (rng.standard_normal((experts, shape[-1])) * 0.05).astype(np.float32)
        row_major = mx.array(w)
        input_major = mx.array(np.ascontiguousarray(w.T)).T
        spread = np.zeros((experts, 2 * shape[-1]), np.float32)
        spread[:, ::2] = w
        strided = mx.array(spread)[:, ::2]
        want_i, want_s = (np.array(a) for a in ext.moe_route(x, row_major, k, True))
        for layout in (input_major, strided):
            got_i, got_s = (np.array(a) for a in ext.moe_route(x, layout, k, True))
            assert (got_i == want_i).all() and (got_s == want_s).all()


def test_ties_take_the_lower_expert_and_bad_arguments_raise(ext):  # noqa: F811
    x = mx.ones((1, 8))
    w = mx.zeros((6, 8))  # every expert equally likely
    inds, scores = moe_route(x, w, 3, False, backend="native")
    assert np.array(inds).tolist() == [[0, 1, 2]]
    assert np.allclose(np.array(scores), 1 / 6)
    with pytest.raises(ValueError):
        ext.moe_route(x, w, 7, True)
    with pytest.raises(ValueError):
        ext.moe_route(x, mx.zeros((6, 9)), 2, True)


def test_a_qwen3_moe_routes_a_decode_step_through_the_op_and_keeps_its_logits(ext, monkeypatch):  # noqa: F811
    """The switched block calls the op for a decode step (1 and 4 tokens) and mlx-lm's own routing
    for a 40-token prefill; logits within 1e-4 of the block's own, the greedy choice the same."""
    import cpu_kernels.spec

    model = tiny_moe()
    for layer in model.model.layers:  # a GGUF's router (ffn_gate_inp) is float32, not quantized
        q = layer.mlp.gate
        dense = nn.Linear(q.weight.shape[0], q.scales.shape[-1] * q.group_size, bias=False)
        dense.weight = mx.dequantize(q.weight, q.scales, q.biases, group_size=q.group_size, bits=q.bits)
        layer.mlp.gate = dense
    rng = np.random.default_rng(0)
    tokens = {b: mx.array(rng.integers(0, 256, (b, 40)).astype(np.int32)) for b in (1, 4)}
    before = {b: logits_and_step(model, t) for b, t in tokens.items()}
    use_cpu_kernels(model)
    blocks = [m for _, m in model.named_modules() if type(m).__name__ == "CPUQwen3MoeSparseMoeBlock"]
    assert len(blocks) == MOE_CONFIG["num_hidden_layers"]
    real = cpu_kernels.spec.extension()
    calls: list[tuple[int, ...]] = []

    class Counting:
        def __getattr__(self, name):
            if name == "moe_route":

                def route(x, *a, **kw):
                    calls.append(tuple(x.shape))
                    return real.moe_route(x, *a, **kw)

                return route
            return getattr(real, name)

    monkeypatch.setattr("cpu_kernels.modules.extension", lambda: Counting())
    for b, t in tokens.items():
        calls.clear()
        after = logits_and_step(model, t)
        # the decode step only (b tokens, within ROUTE_ROWS), once per layer
        assert calls == [(b, 1, MOE_CONFIG["hidden_size"])] * MOE_CONFIG["num_hidden_layers"]
        assert b <= ROUTE_ROWS < 40 * b
        for a, w in zip(after, before[b], strict=True):
            scale = np.abs(w).max()
            assert np.abs(a - w).max() <= 1e-4 * scale
            assert (a.argmax(-1) == w.argmax(-1)).all()
