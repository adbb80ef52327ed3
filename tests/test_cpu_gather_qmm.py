"""The gather over experts (cpu_kernels/gather_qmm.py, src/gather_qmm.cpp) against float64 NumPy, in
every form mlx-lm's SwitchGLU calls it, and a tiny mlx-lm Qwen3-MoE model through it.

The oracle is independent of the kernel and of MLX's quantized ops: the packed words of each expert
are unpacked as a little-endian bit stream with NumPy, dequantized and multiplied in float64, one
(token, slot) pair at a time.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from cpu_kernels import spec
from cpu_kernels.gather_qmm import gather_qmm
from cpu_kernels.modules import use_cpu_kernels

pytestmark = [
    pytest.mark.skipif(
        mx.metal.is_available(), reason="the CPU kernels are for CPU inference (Metal has its own)"
    ),
    pytest.mark.usefixtures("exact_math"),  # exact math is these tests' reference (conftest.py)
]

BITS = (4, 5, 6, 8)
GROUPS = (32, 64, 128)
# Relative to |x| @ |w|.T, as tests/test_cpu_kernels.py bounds the dense kernel (measured < 2e-6).
F32_TOL = 1e-5


@pytest.fixture(scope="module")
def ext():
    """The built extension (``make setup`` builds it; as in test_cpu_kernels.py, its absence fails)."""
    module = spec.extension()
    assert module is not None and hasattr(module, "gather_quantized_matmul"), (
        f"cpu_kernels._ext with gather_quantized_matmul is not built: {spec.unavailable_reason()}"
    )
    yield module
    module.set_isa("")
    spec.set_threads()


def variants(ext) -> list[str]:
    order = ["avx512", "avx2", "base"]
    return order[order.index(ext.isa()) :] if ext.isa() in order else ["base"]


def f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def dequantize_f64(
    wq: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> np.ndarray:
    """(E, N, K) float64 weights from MLX's packed affine experts, unpacked bit by bit."""
    experts, rows = wq.shape[0], wq.shape[1]
    raw = np.array(wq).astype("<u4").view(np.uint8).reshape(experts, rows, -1)
    stream = np.unpackbits(raw, axis=2, bitorder="little").reshape(experts, rows, -1, bits)
    codes = stream.astype(np.int64) @ (1 << np.arange(bits, dtype=np.int64))
    s = np.repeat(f64(scales), group_size, axis=2)
    b = np.repeat(f64(biases), group_size, axis=2)
    return codes * s + b


def experts(rng: np.random.Generator, e: int, n: int, k: int, group_size: int, bits: int, dtype=mx.float32):
    w = mx.array(rng.standard_normal((e, n, k)).astype(np.float32) * 0.1).astype(dtype)
    return mx.quantize(w, group_size=group_size, bits=bits)


def routing(rng: np.random.Generator, tokens: int, k: int, e: int) -> mx.array:
    """Each token's k experts: distinct per token when they fit, else with repeats."""
    rows = [rng.choice(e, size=k, replace=k > e) for _ in range(tokens)]
    return mx.array(np.array(rows, dtype=np.uint32).reshape(tokens, k))


def oracle(x: mx.array, idx: mx.array, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The product and |x| @ |w|.T, pair by pair: x (..., M, K) broadcast against idx's shape."""
    batch = np.broadcast_shapes(x.shape[:-2], idx.shape)
    xs = np.broadcast_to(f64(x), (*batch, *x.shape[-2:])).reshape(-1, *x.shape[-2:])
    es = np.broadcast_to(np.array(idx), batch).reshape(-1)
    ref = np.stack([xs[p] @ w[e].T for p, e in enumerate(es)])
    mag = np.stack([np.abs(xs[p]) @ np.abs(w[e]).T for p, e in enumerate(es)])
    return ref.reshape(*batch, x.shape[-2], w.shape[1]), mag.reshape(*batch, x.shape[-2], w.shape[1])


def check(y: mx.array, x: mx.array, idx: mx.array, w: np.ndarray, tol: float) -> None:
    ref, mag = oracle(x, idx, w)
    assert y.shape == ref.shape, (y.shape, ref.shape)
    err = np.abs(f64(y) - ref) / (mag + 1e-30)
    assert float(err.max()) <= tol, f"max relative error {err.max():.3g} > {tol}"


def forms(rng: np.random.Generator, tokens: int, k: int, e: int, dim: int):
    """SwitchGLU's three calls: gate/up (x (T, 1, 1, K), idx (T, k)), down (x (T, k, 1, K)) and the
    sorted form it uses from 64 pairs on (x (T * k, 1, K) in expert order, idx (T * k,))."""
    idx = routing(rng, tokens, k, e)
    x = mx.array(rng.standard_normal((tokens, 1, 1, dim)).astype(np.float32))
    down = mx.array(rng.standard_normal((tokens, k, 1, dim)).astype(np.float32))
    flat = idx.flatten()
    order = mx.argsort(flat)
    sorted_x = x.flatten(0, -3)[order // k]
    return [("gate", x, idx), ("down", down, idx), ("sorted", sorted_x, flat[order])]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", GROUPS)
def test_matches_float64_in_every_switchglu_form_and_thread_count(ext, bits, group_size):
    rng = np.random.default_rng(bits * 1000 + group_size)
    # (tokens, k, experts, N, groups of K): one token; k of 1..8; 3 experts under 16 tokens (every
    # expert chosen by many, several slots of a token on one: more rows per expert than a tile);
    # 64 tokens over 16 experts; N odd (a task ends mid 8-row block); one token over K = 512 (an
    # expert's one row in the one-row kernels' 512-bit loops, x's steps paired).
    shapes = [
        (1, 1, 4, 24, 1),
        (1, 8, 16, 37, 2),
        (3, 5, 7, 45, 3),
        (16, 4, 3, 19, 2),
        (64, 8, 16, 29, 1),
        (1, 2, 6, 21, 512 // group_size),
    ]
    threads = max(2, spec.physical_cores())
    for tokens, k, e, n, groups in shapes:
        dim = groups * group_size
        wq, scales, biases = experts(rng, e, n, dim, group_size, bits)
        w = dequantize_f64(wq, scales, biases, group_size, bits)
        for name, x, idx in forms(rng, tokens, k, e, dim):
            outs = []
            for t in (1, threads):
                spec.set_threads(t)
                y = gather_qmm(
                    x, wq, scales, biases, rhs_indices=idx, group_size=group_size, bits=bits, backend="native"
                )
                check(y, x, idx, w, F32_TOL)
                outs.append(np.array(y))
            # each output row is computed by one thread whatever the split: bit-for-bit the same
            assert np.array_equal(outs[0], outs[1]), (name, tokens, k, e)
    spec.set_threads()


@pytest.mark.parametrize("bits", BITS)
def test_every_instruction_set(ext, bits):
    rng = np.random.default_rng(50 + bits)
    wq, scales, biases = experts(rng, 6, 40, 128, 32, bits)
    w = dequantize_f64(wq, scales, biases, 32, bits)
    for isa in variants(ext):
        ext.set_isa(isa)
        for tokens, k in ((1, 2), (9, 3)):  # one row per expert (the integer kernel) and several
            for _name, x, idx in forms(rng, tokens, k, 6, 128):
                y = gather_qmm(
                    x, wq, scales, biases, rhs_indices=idx, group_size=32, bits=bits, backend="native"
                )
                check(y, x, idx, w, F32_TOL)
    ext.set_isa("")


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_inputs_and_scales(ext, dtype):
    rng = np.random.default_rng(7)
    for bits in BITS:
        wq, scales, biases = experts(rng, 5, 33, 256, 64, bits, dtype)
        assert scales.dtype == dtype
        w = dequantize_f64(wq, scales, biases, 64, bits)
        for _name, x, idx in forms(rng, 6, 3, 5, 256):
            xh = x.astype(dtype)
            y = gather_qmm(
                xh, wq, scales, biases, rhs_indices=idx, group_size=64, bits=bits, backend="native"
            )
            assert y.dtype == dtype
            # float32 inside; the only extra error is the output's rounding to dtype
            check(y, xh, idx, w, 2.0**-7 if dtype == mx.bfloat16 else 2.0**-10)
        # float16 x against float32 scales: the promoted type, float32
        w32, s32, b32 = experts(rng, 5, 16, 64, 32, bits)
        x = mx.array(rng.standard_normal((2, 1, 1, 64)).astype(np.float32)).astype(dtype)
        idx = routing(rng, 2, 2, 5)
        y = gather_qmm(x, w32, s32, b32, rhs_indices=idx, group_size=32, bits=bits, backend="native")
        assert y.dtype == mx.float32
        check(y, x, idx, dequantize_f64(w32, s32, b32, 32, bits), F32_TOL)


def test_matches_mlx_gather_qmm_broadcasts_views_and_edges(ext):
    rng = np.random.default_rng(3)
    wq, scales, biases = experts(rng, 8, 40, 96, 32, 4)
    w = dequantize_f64(wq, scales, biases, 32, 4)
    cases = []
    # several rows of x per pair (M = 3), x broadcast against (2, 4) indices, int32 indices
    cases.append((mx.array(rng.standard_normal((2, 1, 3, 96)).astype(np.float32)), routing(rng, 2, 4, 8)))
    cases.append(
        (mx.array(rng.standard_normal((5, 96)).astype(np.float32)), routing(rng, 4, 1, 8).astype(mx.int32))
    )
    wide = mx.array(rng.standard_normal((96, 12)).astype(np.float32))
    cases.append((wide.T[::2].reshape(3, 2, 96)[:, None], routing(rng, 3, 2, 8)))  # strided x
    for x, idx in cases:
        y = gather_qmm(x, wq, scales, biases, rhs_indices=idx, group_size=32, bits=4, backend="native")
        check(y, x, idx, w, F32_TOL)
        ref = mx.gather_qmm(x, wq, scales, biases, rhs_indices=idx, transpose=True, group_size=32, bits=4)
        assert y.shape == ref.shape and np.allclose(np.array(y), np.array(ref), atol=1e-4)
    empty = gather_qmm(
        cases[0][0][:0],
        wq,
        scales,
        biases,
        rhs_indices=cases[0][1][:0],
        group_size=32,
        bits=4,
        backend="native",
    )
    assert empty.shape == (0, 4, 3, 40)
    # an index past the last expert gives zeros, never another expert's rows or a crash
    x = mx.array(rng.standard_normal((2, 1, 1, 96)).astype(np.float32))
    idx = mx.array([[1, 8], [9, 2]], dtype=mx.uint32)
    y = np.array(gather_qmm(x, wq, scales, biases, rhs_indices=idx, group_size=32, bits=4, backend="native"))
    assert (y[0, 1] == 0).all() and (y[1, 0] == 0).all()
    check(mx.array(y[0, :1]), x[0], idx[0, :1], w, F32_TOL)


def test_composes_lazily_and_under_compile(ext):
    rng = np.random.default_rng(11)
    wq, scales, biases = experts(rng, 4, 64, 128, 32, 4)

    def f(a, idx):
        h = gather_qmm(mx.maximum(a, 0) * 2, wq, scales, biases, rhs_indices=idx, group_size=32, bits=4)
        return mx.tanh(h).sum(axis=-1)

    x = mx.array(rng.standard_normal((5, 1, 1, 128)).astype(np.float32))
    idx = routing(rng, 5, 2, 4)
    eager = f(x, idx)
    assert np.array_equal(np.array(mx.compile(f)(x, idx)), np.array(eager))
    shapeless = mx.compile(f, shapeless=True)
    for m in (1, 3, 5):
        assert np.array_equal(np.array(shapeless(x[:m], idx[:m])), np.array(f(x[:m], idx[:m])))


def test_bad_arguments_are_one_line_errors_and_other_cases_take_mlx(ext):
    rng = np.random.default_rng(5)
    wq, scales, biases = experts(rng, 3, 16, 64, 32, 4)
    x = mx.array(rng.standard_normal((2, 1, 1, 64)).astype(np.float32))
    idx = routing(rng, 2, 2, 3)
    with pytest.raises(ValueError, match="K=32 but w packs 64"):
        ext.gather_quantized_matmul(x[..., :32], wq, scales, biases, idx, 32, 4)
    with pytest.raises(ValueError, match="bits must be"):
        ext.gather_quantized_matmul(x, wq, scales, biases, idx, 32, 3)
    with pytest.raises(ValueError, match="3-D uint32"):
        ext.gather_quantized_matmul(x, wq[0], scales, biases, idx, 32, 4)
    with pytest.raises(ValueError, match="scales and biases"):
        ext.gather_quantized_matmul(x, wq, scales[:, :, :1], biases, idx, 32, 4)
    with pytest.raises(ValueError, match="integers"):
        ext.gather_quantized_matmul(x, wq, scales, biases, idx.astype(mx.float32), 32, 4)
    with pytest.raises(ValueError):
        ext.gather_quantized_matmul(x, wq, scales, biases, routing(rng, 3, 2, 3), 32, 4)  # batch 2 vs 3
    with pytest.raises(ValueError, match="no lhs_indices"):
        gather_qmm(
            x, wq, scales, biases, lhs_indices=idx, rhs_indices=idx, group_size=32, bits=4, backend="native"
        )
    # 3-bit (not a kernel format) and lhs_indices: MLX's own gather_qmm
    w3, s3, b3 = experts(rng, 3, 16, 64, 32, 3)
    y = gather_qmm(x, w3, s3, b3, rhs_indices=idx, group_size=32, bits=3)
    ref = mx.gather_qmm(x, w3, s3, b3, rhs_indices=idx, transpose=True, group_size=32, bits=3)
    assert np.array_equal(np.array(y), np.array(ref))
    lhs = mx.array([[0, 1]], dtype=mx.uint32)
    xs = x.reshape(2, 1, 64)
    y = gather_qmm(xs, wq, scales, biases, lhs_indices=lhs, rhs_indices=idx[:1], group_size=32, bits=4)
    ref = mx.gather_qmm(
        xs, wq, scales, biases, lhs_indices=lhs, rhs_indices=idx[:1], transpose=True, group_size=32, bits=4
    )
    assert np.array_equal(np.array(y), np.array(ref))


# --- the layers of an mlx-lm mixture-of-experts model ---------------------------------------------

MOE_CONFIG = {
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 3,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_intermediate_size": 96,
    "rms_norm_eps": 1e-6,
    "vocab_size": 256,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 512,
    "norm_topk_prob": True,
}


def tiny_moe(seed: int = 0) -> nn.Module:
    from mlx_lm.models import qwen3_moe

    mx.random.seed(seed)
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(MOE_CONFIG))
    # random weights of a trained model's scale (mlx-lm's init leaves the experts at ~1/sqrt(K))
    model.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape) * 0.05, model.parameters()))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def logits_and_step(model: nn.Module, tokens: mx.array) -> tuple[np.ndarray, np.ndarray]:
    """A 40-token prefill's logits and one decode step's after it, through a KV cache."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    prefill = model(tokens, cache=cache)
    step = model(tokens[:, -1:], cache=cache)
    return f64(prefill), f64(step)


def test_moe_model_switches_and_logits_match(ext):
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwiGLU

    model = tiny_moe()
    rng = np.random.default_rng(0)
    for batch in (1, 4):
        tokens = mx.array(rng.integers(0, 256, (batch, 40)).astype(np.int32))
        before = logits_and_step(model, tokens)
        if batch == 1:
            assert use_cpu_kernels(model) > 0
            kinds = [type(m) for _, m in model.named_modules()]
            switched = [c for c in kinds if c.__name__ == "CPUQuantizedSwitchLinear"]
            assert len(switched) == 3 * MOE_CONFIG["num_hidden_layers"]  # gate, up, down per layer
            assert QuantizedSwitchLinear not in kinds
            assert all(issubclass(c, QuantizedSwitchLinear) for c in switched)
            # each SwitchGLU's activation is the swiglu kernel (not mlx-lm's compiled scalar exp)
            activations = [c for c in kinds if c.__name__ == "CPUSwitchSwiGLU"]
            assert len(activations) == MOE_CONFIG["num_hidden_layers"]
            assert SwiGLU not in kinds
        after = logits_and_step(model, tokens)
        # (1, 40): 120 (token, slot) pairs, mlx-lm's sorted path; the decode step: unsorted, one token
        for a, b in zip(after, before, strict=True):
            assert a.shape == b.shape
            scale = np.abs(b).max()
            assert np.abs(a - b).max() <= 1e-4 * scale, np.abs(a - b).max() / scale
            assert (a.argmax(-1) == b.argmax(-1)).all()
    # the switched layers' product is the kernel's, bit for bit (not MLX's gather_qmm kept by mistake)
    layer = model.model.layers[0].mlp.switch_mlp.gate_proj
    x = mx.random.normal((2, 1, 1, 64))
    idx = mx.array([[0, 5, 7], [2, 2, 3]], dtype=mx.uint32)
    assert np.array_equal(
        np.array(layer(x, idx)),
        np.array(
            ext.gather_quantized_matmul(x, layer["weight"], layer["scales"], layer["biases"], idx, 32, 4)
        ),
    )


def test_expert_bias_is_added_as_mlx_lm_adds_it(ext):
    from mlx_lm.models.switch_layers import SwitchLinear

    mx.random.seed(4)
    dense = SwitchLinear(64, 40, 6, bias=True)
    dense.bias = mx.random.normal((6, 40))
    holder = nn.Module()
    holder.proj = dense
    nn.quantize(holder, group_size=32, bits=8)
    x = mx.random.normal((3, 2, 1, 64))  # the down projection's form
    idx = mx.array([[1, 4], [4, 4], [0, 5]], dtype=mx.uint32)
    before = holder.proj(x, idx)
    assert use_cpu_kernels(holder) == 1
    assert type(holder.proj).__name__ == "CPUQuantizedSwitchLinear"
    after = holder.proj(x, idx)
    assert np.allclose(np.array(after), np.array(before), atol=1e-4)


def test_switch_layers_of_formats_the_kernel_lacks_keep_mlx(ext):
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    for mode, group_size, bits in (("mxfp4", 32, 4), ("affine", 32, 3)):  # gpt-oss's format; 3-bit
        mx.random.seed(1)
        holder = nn.Module()
        holder.proj = SwitchLinear(64, 32, 4, bias=False)
        nn.quantize(holder, group_size=group_size, bits=bits, mode=mode)
        x = mx.random.normal((2, 1, 1, 64))
        idx = mx.array([[0, 3], [1, 1]], dtype=mx.uint32)
        before = np.array(holder.proj(x, idx))
        use_cpu_kernels(holder)
        assert type(holder.proj) is QuantizedSwitchLinear, mode
        assert np.array_equal(np.array(holder.proj(x, idx)), before)
