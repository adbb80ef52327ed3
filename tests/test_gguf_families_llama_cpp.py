"""Each GGUF family against llama.cpp itself on the same file (only where llama-cpp-python is
installed: ``make bench-deps``; CI without it skips these).

Tiny random files of each family (tests/gguf_families.py), in F32 and quantized by llama.cpp's own
quantizer (``llama_model_quantize``): Duet's logits at every position against llama.cpp's
(``logits_all``, float32 KV cache). Tolerances:

- F32: the same float arithmetic up to summation order, so max |Δlogit| <= 1e-4 of the logits'
  scale, except Gemma 2/3 (5e-3 measured): ggml computes GELU from an fp16 lookup table;
- quantized: Duet's logits equal the file's exact float32 twin (every block decoded by gguf-py's
  dequantizer) to 1e-4, while llama.cpp rounds the activations to 8 bits for its integer dot
  products, which moves its logits by a relative RMS of 1.7-5.9% (measured on Q8_0 files; MoE
  families at the top, where the noise flips a router's choice now and then). So: relative RMS
  <= 10% and the same top-1 at >= 85% of positions (a wrong tensor mapping gives ~100% and chance);
  Q4_K_M (LLAMA_CPP_BOUNDS) 15% and 75%.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_engine.loading.gguf_loader import load_gguf
from tests.gguf_families import FAMILIES, write_family_gguf
from tests.gguf_quantize import TOKENS, float32_twin, llama_cpp_logits, llama_cpp_quantize

pytestmark = pytest.mark.slow
pytest.importorskip("llama_cpp")

ARCHS = sorted(FAMILIES)
# 64 positions, so the top-1 agreement is a fraction of many (the tiny models' margins are small)
IDS = [1, *np.random.default_rng(5).integers(3, len(TOKENS), 63).tolist()]
# rows of 256 weights, so llama.cpp's K-quant mix applies (hidden, FFN and experts)
WIDE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64, "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 256}  # fmt: skip


def _logits(model) -> np.ndarray:
    return np.array(model(mx.array([IDS]))[0])


def _relative_rms(a: np.ndarray, b: np.ndarray) -> float:
    spread = b - b.mean(axis=-1, keepdims=True)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(spread**2)))


@pytest.mark.parametrize("arch", ARCHS)
def test_float_file_matches_llama_cpp(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    write_family_gguf(path, arch, quantized=False)
    theirs = llama_cpp_logits(path, IDS)
    ours = _logits(load_gguf(path, dense=True)[0])
    scale = np.abs(theirs).max()
    tolerance = 1e-3 if arch.startswith("gemma") else 1e-5  # x scale (module docstring)
    assert np.abs(ours - theirs).max() <= tolerance * scale, np.abs(ours - theirs).max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


# (relative RMS to llama.cpp, top-1 agreement over 64 positions) per file type. Measured (every
# family): Q8_0 1.4-6.0% and >= 89%; 4-bit types on the narrow models 1.4-14% and >= 86%; on the
# 256-wide ones (K-quant and IQ4_XS mixes, MXFP4 experts) 2.2-27% and >= 77%, more layers of 8-bit
# activation rounding adding up (the 27%: Granite MoE, whose logits spread least; there llama.cpp
# is 29% from the file's exact values and Duet 14%). A mis-mapped tensor gives ~100% and chance.
LLAMA_CPP_BOUNDS = {
    "Q8_0": (0.10, 0.85), "Q4_0": (0.20, 0.80), "IQ4_NL": (0.20, 0.80),
    "Q4_K_M": (0.30, 0.75), "IQ4_XS": (0.30, 0.75), "MXFP4_MOE": (0.30, 0.75),
}  # fmt: skip
# llama.cpp's quantizer needs rows of 256 weights for these to apply as named
NEEDS_WIDE = {"Q4_K_M", "IQ4_XS", "MXFP4_MOE"}


@pytest.mark.parametrize("arch", ["qwen3moe", "olmo2", "gpt-oss"])
def test_yarn_rope_scaling_matches_llama_cpp(tmp_path, arch):
    """YaRN (Qwen3's and Qwen2.5's 128K files, gpt-oss): a file trained for 16 positions, scaled 4x,
    read at 64 positions, so three quarters of them are past the original context."""
    path = tmp_path / f"{arch}-yarn.gguf"
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    write_family_gguf(path, arch, quantized=False, rope_scaling=yarn)
    plain = tmp_path / f"{arch}.gguf"
    write_family_gguf(plain, arch, quantized=False)
    theirs = llama_cpp_logits(path, IDS)
    ours = _logits(load_gguf(path, dense=True)[0])
    assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(theirs).max(), np.abs(ours - theirs).max()
    # and the scaling is really applied: without it the logits differ
    assert np.abs(_logits(load_gguf(plain, dense=True)[0]) - ours).max() > 1e-2


def test_phi3_longrope_matches_llama_cpp(tmp_path):
    """Phi-3.5-mini's LongRoPE (rope_factors_long/short): llama.cpp takes the long factors when its
    context is past the original one (here 64 > 16), as mlx-lm's SuScaledRoPE always does."""
    path = tmp_path / "phi3-longrope.gguf"
    rng = np.random.default_rng(3)
    longrope = {
        "type": "longrope",
        "long_factor": (1 + 3 * rng.random(8)).tolist(),
        "short_factor": (1 + 0.1 * rng.random(8)).tolist(),
    }
    config = {"rope_scaling": longrope, "original_max_position_embeddings": 16}
    expected = write_family_gguf(path, "phi3", quantized=False, **config)
    theirs = llama_cpp_logits(path, IDS)
    ours = _logits(load_gguf(path, dense=True)[0])
    assert np.abs(ours - _logits(expected)).max() <= 1e-4
    assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(theirs).max(), np.abs(ours - theirs).max()


# MXFP4 is the experts' format (gpt-oss's), so only MoE families get that file type
QUANTIZED_CASES = [
    (arch, ftype)
    for ftype in sorted(LLAMA_CPP_BOUNDS)
    for arch in ARCHS
    if ftype != "MXFP4_MOE" or arch in ("gpt-oss", "qwen3moe")
]


@pytest.mark.parametrize(("arch", "ftype"), QUANTIZED_CASES)
def test_llama_cpp_quantized_file_matches_llama_cpp(tmp_path: Path, arch, ftype):
    src, path, twin = (tmp_path / f"{arch}-{x}.gguf" for x in ("f32", ftype, "twin"))
    write_family_gguf(src, arch, quantized=False, **(WIDE if ftype in NEEDS_WIDE else {}))
    llama_cpp_quantize(src, path, ftype)
    float32_twin(path, twin)
    ours = _logits(load_gguf(path, dense=False)[0])
    exact = _logits(load_gguf(twin, dense=True)[0])
    theirs = llama_cpp_logits(path, IDS)
    if ftype in ("Q4_K_M", "IQ4_XS"):  # their Q6_K tensors are re-coded at 8 bits, within 1/8 of a step
        # still, we compute the file's values more exactly than llama.cpp does
        assert _relative_rms(ours, exact) <= _relative_rms(theirs, exact)
    else:
        assert np.abs(ours - exact).max() <= 1e-4 * max(1.0, np.abs(exact).max())
    rms, top1 = LLAMA_CPP_BOUNDS[ftype]
    assert _relative_rms(ours, theirs) <= rms, _relative_rms(ours, theirs)
    agree = (ours.argmax(-1) == theirs.argmax(-1)).mean()
    print(f"{arch} {ftype}: relative RMS {_relative_rms(ours, theirs):.3f}, top-1 {agree:.2f}")
    assert agree >= top1
