"""IQ and MXFP4 GGUFs: every block type decodes to the values the ``gguf`` package's dequantizer gives,
bit for bit, and maps to an MLX quantized layout that holds exactly those values: IQ4_NL, IQ4_XS and
IQ2_XXS as 8-bit affine codes, IQ3_XXS as 6-bit, IQ3_S as 4-bit, IQ1_S as 2-bit (groups of 32), and
MXFP4 in MLX's own ``mxfp4`` mode (uint8 E8M0 scales, no biases), for 2-D and 3-D (stacked experts)
tensors. Tiny Llamas in each type load and give the logits (and, through the engine, the greedy
tokens) of the mlx-lm model on ``gguf``'s decoded values.

The files are written by tests/gguf_quantize.py: IQ4_NL and IQ4_XS by its NumPy quantizers, MXFP4
by ``gguf``'s, the grid types (no quantizer) as random valid blocks on each row's scale.

Tolerances: every type here is held exactly, so ``mx.dequantize`` equals ``gguf``'s values bit for
bit and quantized logits differ from the float path's only by float32 summation order (bound 5e-5
of the largest logit, as test_gguf_kquants.py's exact types).
"""

from __future__ import annotations

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from cpu_kernels.modules import CPUQuantizedLinear
from cpu_kernels.spec import available as cpu_kernels_available
from mlx_engine.errors import GGUFError
from mlx_engine.loading.ggml_blocks import BLOCK_TYPES, Fp4Codes, decode
from mlx_engine.loading.gguf_file import SUPPORTED_TYPES, TensorInfo
from mlx_engine.loading.gguf_loader import load_gguf
from mlx_engine.loading.gguf_tensors import _tensor_arrays, quantization_of
from mlx_engine.loading.loader import load_model
from mlx_engine.loading.preflight import check_model
from tests.gguf_quantize import TINY_IDS, Q, dequantize, random_blocks, write_tiny_gguf
from tests.test_engine_tiny import reference_greedy
from tests.test_gguf_kquants import ENGINE_PROMPTS, K_CONFIG, _engine_greedy


@pytest.fixture(autouse=True)
def _no_weight_cache(monkeypatch):
    monkeypatch.setenv("DUET_WEIGHT_CACHE", "0")


IQ_TYPES = [Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4, Q.IQ2_XXS, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S]
MLX_BITS = {Q.IQ4_NL: 8, Q.IQ4_XS: 8, Q.MXFP4: 4, Q.IQ2_XXS: 8, Q.IQ3_XXS: 6, Q.IQ3_S: 4, Q.IQ1_S: 2}
TYPE_IDS = {  # ggml's type ids, as gguf_file lists them
    Q.IQ2_XXS: 16, Q.IQ3_XXS: 18, Q.IQ1_S: 19, Q.IQ4_NL: 20, Q.IQ3_S: 21, Q.IQ4_XS: 23, Q.MXFP4: 39,
}  # fmt: skip


def _ids(t: Q) -> str:
    return t.name


def test_type_ids_and_block_sizes_are_ggmls():
    for qtype, type_id in TYPE_IDS.items():
        assert int(qtype) == type_id
        name, weights, nbytes = SUPPORTED_TYPES[type_id]
        assert name == qtype.name and (weights, nbytes) == gguf.GGML_QUANT_SIZES[qtype]
        assert (BLOCK_TYPES[name].weights, BLOCK_TYPES[name].nbytes) == (weights, nbytes)


def _mlx_dense(arrays: dict[str, mx.array], base: str, quant: dict) -> mx.array:
    return mx.dequantize(
        arrays[f"{base}.weight"],
        arrays[f"{base}.scales"],
        arrays.get(f"{base}.biases"),
        dtype=mx.float32,
        **quant,
    )


def _as_tensor(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> TensorInfo:
    """A TensorInfo for ``raw`` (the whole tensor's bytes), ``shape`` as MLX lists it (outermost first)."""
    return TensorInfo("blk.0.ffn_down.weight", qtype.name, tuple(reversed(shape)), 0, raw.size)


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=_ids)
@pytest.mark.parametrize(("rows", "superblocks"), [(1, 1), (5, 2), (17, 3)])
def test_decoder_matches_gguf(qtype, rows, superblocks):
    rng = np.random.default_rng(superblocks * 100 + rows + int(qtype))
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    blocks = superblocks * 256 // block  # rows of 1-3 super-blocks of 256 weights for every type
    raw = random_blocks(qtype, rows, blocks, rng)
    want = dequantize(raw, qtype)
    cols = blocks * block
    assert want.shape == (rows, cols) and np.isfinite(want).all()
    codes = decode(raw, qtype.name, rows, cols)
    assert (codes.bits, codes.group) == (MLX_BITS[qtype], 32)
    assert int(codes.q.max()) < 2**codes.bits
    assert isinstance(codes, Fp4Codes) == (qtype == Q.MXFP4)
    np.testing.assert_array_equal(codes.to_float(), want)  # bit for bit
    # what gguf_tensors emits for the quantized path holds the same values...
    arrays = _tensor_arrays(_as_tensor(raw, qtype, (rows, cols)), raw.reshape(-1), dense=False)
    quant = quantization_of(arrays, "blk.0.ffn_down")
    packed, scales = arrays["blk.0.ffn_down.weight"], arrays["blk.0.ffn_down.scales"]
    assert packed.dtype == mx.uint32 and packed.shape == (rows, cols * codes.bits // 32)
    assert scales.shape == (rows, cols // 32)
    if qtype == Q.MXFP4:
        assert quant == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
        assert scales.dtype == mx.uint8 and "blk.0.ffn_down.biases" not in arrays
    else:
        assert quant == {"group_size": 32, "bits": codes.bits}
        assert scales.dtype == mx.float32 and arrays["blk.0.ffn_down.biases"].shape == scales.shape
    np.testing.assert_array_equal(np.array(_mlx_dense(arrays, "blk.0.ffn_down", quant)), want)
    # ...MLX's quantized matmul computes with them, and dense=True gives the same values
    x = mx.array(rng.standard_normal((2, cols)).astype(np.float32))
    got = mx.quantized_matmul(x, packed, scales, arrays.get("blk.0.ffn_down.biases"), transpose=True, **quant)
    ref = np.array(x, dtype=np.float64) @ want.astype(np.float64).T
    np.testing.assert_allclose(np.array(got), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    dense = _tensor_arrays(_as_tensor(raw, qtype, (rows, cols)), raw.reshape(-1), dense=True)
    np.testing.assert_array_equal(np.array(dense["blk.0.ffn_down.weight"]), want)


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=_ids)
def test_stacked_experts_stay_quantized(qtype):
    """A 3-D tensor (experts, rows, cols), as a mixture of experts stores its expert matrices (gpt-oss:
    MXFP4), is quantized per expert; gather_qmm picks experts from it."""
    experts, rows, cols = 3, 4, 512
    rng = np.random.default_rng(int(qtype))
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, experts * rows, cols // block, rng)
    want = dequantize(raw, qtype).reshape(experts, rows, cols)
    t = TensorInfo("blk.0.ffn_down_exps.weight", qtype.name, (cols, rows, experts), 0, raw.size)
    arrays = _tensor_arrays(t, raw.reshape(-1), dense=False)
    quant = quantization_of(arrays, "blk.0.ffn_down_exps")
    packed, scales = arrays[t.name], arrays["blk.0.ffn_down_exps.scales"]
    assert packed.shape == (experts, rows, cols * MLX_BITS[qtype] // 32)
    assert scales.shape == (experts, rows, cols // 32)
    assert ("blk.0.ffn_down_exps.biases" in arrays) == (qtype != Q.MXFP4)
    np.testing.assert_array_equal(np.array(_mlx_dense(arrays, "blk.0.ffn_down_exps", quant)), want)
    x = mx.array(rng.standard_normal((2, 1, cols)).astype(np.float32))
    pick = mx.array([2, 0])
    got = mx.gather_qmm(
        x,
        packed,
        scales,
        arrays.get("blk.0.ffn_down_exps.biases"),
        rhs_indices=pick,
        transpose=True,
        **quant,
    )
    ref = np.einsum("bk,bnk->bn", np.array(x[:, 0], np.float64), want[[2, 0]].astype(np.float64))
    np.testing.assert_allclose(np.array(got)[:, 0], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_mxfp4_exponent_edges():
    """E8M0 exponents 0 and 1 (subnormal float32 scales) and 252 decode as ggml's; 255, which ggml
    reads as 2**127 and MLX's mxfp4 as NaN, loads dense and is refused kept quantized."""
    rng = np.random.default_rng(3)
    raw = random_blocks(Q.MXFP4, 4, 8, rng).reshape(4, 8, 17)
    raw[..., 0] = np.array([0, 1, 2, 252])[:, None]

    raw = raw.reshape(4, -1)
    want = dequantize(raw, Q.MXFP4)
    assert np.isfinite(want).all() and 0 < np.abs(want[0][want[0] != 0]).min() < 1e-38
    arrays = _tensor_arrays(_as_tensor(raw, Q.MXFP4, (4, 256)), raw.reshape(-1), dense=False)
    np.testing.assert_array_equal(
        np.array(_mlx_dense(arrays, "blk.0.ffn_down", quantization_of(arrays, "blk.0.ffn_down"))), want
    )

    raw[1, 17] = 255  # row 1's second block: ggml's value 2**127 * kvalue, finite for codes 0 and 1
    raw[1, 18:34] = 0x10
    t = _as_tensor(raw, Q.MXFP4, (4, 256))
    dense = _tensor_arrays(t, raw.reshape(-1), dense=True)["blk.0.ffn_down.weight"]
    np.testing.assert_array_equal(np.array(dense), dequantize(raw, Q.MXFP4))
    with pytest.raises(GGUFError, match="'blk.0.ffn_down.weight' has an MXFP4 block with exponent byte 255"):
        _tensor_arrays(t, raw.reshape(-1), dense=False)


def test_mxfp4_layers_load_without_biases():
    """nn.quantize with quantization_of's mxfp4 parameters builds QuantizedLinear/QuantizedEmbedding
    layers with no biases parameter, which load gguf_tensors' arrays strictly."""
    rng = np.random.default_rng(5)
    model = nn.Sequential(nn.Linear(256, 8, bias=False), nn.Embedding(6, 256))
    weights: dict[str, mx.array] = {}
    for i, rows in ((0, 8), (1, 6)):
        raw = random_blocks(Q.MXFP4, rows, 8, rng)
        arrays = _tensor_arrays(_as_tensor(raw, Q.MXFP4, (rows, 256)), raw.reshape(-1), dense=False)
        weights |= {f"layers.{i}.{k.rsplit('.', 1)[1]}": v for k, v in arrays.items()}
    quant = {f"layers.{i}": quantization_of(weights, f"layers.{i}") for i in (0, 1)}
    nn.quantize(model, class_predicate=lambda p, _m: quant.get(p, False))
    model.load_weights(list(weights.items()), strict=True)
    linear, embedding = model.layers
    assert (linear.mode, linear.bits, linear.group_size) == ("mxfp4", 4, 32) and "biases" not in linear
    assert embedding.mode == "mxfp4" and "biases" not in embedding
    x = mx.array(rng.standard_normal((1, 256)).astype(np.float32))
    dense = mx.dequantize(linear.weight, linear.scales, mode="mxfp4", dtype=mx.float32)
    np.testing.assert_allclose(np.array(linear(x)), np.array(x @ dense.T), rtol=1e-5, atol=1e-5)


# --- tiny Llamas, every matrix in one type ------------------------------------------------------------


@pytest.fixture(scope="module", params=IQ_TYPES, ids=_ids)
def tiny_iquant(request, tmp_path_factory):
    """(file, its type, the mlx-lm model on the values gguf decodes the file's blocks to)."""
    qtype = request.param
    path = tmp_path_factory.mktemp(f"tiny-{qtype.name}") / "model.gguf"

    def type_of(name: str) -> Q:
        return qtype if name.endswith(".weight") and "norm" not in name else Q.F32

    expected = write_tiny_gguf(path, "llama", qtypes=type_of, config=K_CONFIG)
    return path, qtype, expected


def test_tiny_iquant_loads_exactly(tiny_iquant):
    path, qtype, expected = tiny_iquant
    assert check_model(str(path)).path == path
    dense, _, _ = load_gguf(path, dense=True)
    reference = expected(TINY_IDS)
    scale = mx.abs(reference).max().item()
    assert mx.abs(dense(TINY_IDS) - reference).max().item() < 5e-5 * scale
    model, _, _ = load_gguf(path, dense=False)
    expected_modules = dict(expected.named_modules())
    n = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding):
            continue
        assert (module.bits, module.group_size) == (MLX_BITS[qtype], 32), name
        assert module.mode == ("mxfp4" if qtype == Q.MXFP4 else "affine")
        assert ("biases" in module) == (qtype != Q.MXFP4)
        weight = mx.dequantize(
            module.weight, module.scales, module.get("biases"), group_size=32, bits=module.bits,
            mode=module.mode, dtype=mx.float32,
        )  # fmt: skip
        assert mx.array_equal(weight, expected_modules[name].weight).item(), name
        n += 1
    assert n == 2 + 7 * K_CONFIG["num_hidden_layers"]  # the embedding, the LM head, 7 per layer
    got = model(TINY_IDS).astype(mx.float32)
    diff = mx.abs(got - reference).max().item()
    print(f"{qtype.name}: quantized vs gguf's values: max |logit diff| {diff:.2e} (logits up to {scale:.1f})")
    assert diff < 5e-5 * scale


def test_tiny_iquant_through_the_engine(tiny_iquant):
    """With this backend's default weight format (CPU: quantized through cpu_kernels where they
    support the layer's format, MLX's own quantized_matmul for mxfp4 and 2-bit layers), the engine's
    paged, batched path gives mlx-lm's own greedy tokens on the same model."""
    path, qtype, _ = tiny_iquant
    loaded = load_model(str(path))
    want = [reference_greedy(loaded.model, p, 12, vocab=None) for p in ENGINE_PROMPTS]
    assert _engine_greedy(loaded) == want
    assert loaded.dtype == mx.float32  # the activations' dtype, even with an mxfp4 (uint8-scaled) embedding
    q_proj = loaded.model.model.layers[0].self_attn.q_proj
    if isinstance(q_proj, nn.QuantizedLinear):
        kernel_format = qtype not in (Q.MXFP4, Q.IQ1_S)  # cpu_kernels: affine, bits 4/5/6/8
        assert (type(q_proj) is CPUQuantizedLinear) == (kernel_format and cpu_kernels_available())
