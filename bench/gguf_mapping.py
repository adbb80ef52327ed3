"""How exactly GGUF blocks map to MLX's affine layout, measured against the ``gguf`` package's dequantizer.

For each block type: random blocks (every byte random but the fp16 scales) are decoded by
``mlx_engine/loading/ggml_blocks.py`` and, for the 32-weight types, put through MLX's packed form and
``mx.dequantize``; the script reports the largest difference from ``gguf.quants.dequantize`` (0 means
bit for bit). For Q6_K, re-coded at 8 bits in groups of 32, it reports the largest error in units of the
group's larger Q6_K step, the RMS error relative to the weights' RMS, the share of groups held exactly,
and the same with ``mx.quantize`` (plain 8-bit round-to-nearest) for comparison. With ``--smollm2`` it
also builds the bundled SmolLM2 as llama.cpp's Q4_K_M mix (tests/gguf_quantize.py) and its float32 twin,
and compares the quantized model's teacher-forced logits with the twin's over the reference prompts
(tests/data/smollm2_reference.json): all types, and with the Q6_K layers swapped for exact dense ones.

    .venv/bin/python bench/gguf_mapping.py [--smollm2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

import mlx_engine  # noqa: E402, F401  (before mlx: OpenBLAS)
from mlx_engine.loading.ggml_blocks import decode, to_8bit_groups_of_32  # noqa: E402
from tests.gguf_quantize import Q, dequantize, q4_k_m_type, quantize, random_blocks, requantize  # noqa: E402

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def exact_types(rng: np.random.Generator) -> None:
    print("| type | MLX bits, group | max abs diff, decoded vs gguf | max abs diff, MLX packed vs gguf |")
    print("|---|---|---:|---:|")
    for qtype in TYPES:
        raw = random_blocks(qtype, 64, 8, rng)
        want = dequantize(raw, qtype)
        codes = decode(raw, qtype.name, *want.shape)
        float_diff = float(np.abs(codes.to_float() - want).max())
        if codes.group != 32:
            codes = to_8bit_groups_of_32(codes)
        packed = mx.dequantize(
            mx.array(codes.pack()),
            mx.array(codes.scales),
            mx.array(codes.biases),
            group_size=32,
            bits=codes.bits,
        )
        mlx_diff = float(np.abs(np.array(packed) - want).max())
        print(f"| {qtype.name} | {codes.bits}, 32 | {float_diff:g} | {mlx_diff:g} |")


def q6_k(w: np.ndarray, label: str) -> None:
    raw = quantize(w, Q.Q6_K)
    codes = decode(raw, "Q6_K", *w.shape)
    exact = codes.to_float()
    rows = exact.shape[0]
    step = np.abs(codes.scales.reshape(rows, -1, 2)).max(-1)
    ours = to_8bit_groups_of_32(codes)
    mine = mx.dequantize(
        mx.array(ours.pack()), mx.array(ours.scales), mx.array(ours.biases), group_size=32, bits=8
    )
    plain = mx.dequantize(*mx.quantize(mx.array(exact), group_size=32, bits=8), group_size=32, bits=8)
    own = np.sqrt(np.mean((exact - w) ** 2) / np.mean(w**2))
    print(
        f"\nQ6_K -> 8-bit groups of 32, {label} ({w.shape[0]}x{w.shape[1]}; Q6_K's own RMS error {own:.4f}):"
    )
    for name, got in (("ggml_blocks.to_8bit_groups_of_32", mine), ("mx.quantize (round to nearest)", plain)):
        err = np.abs(np.array(got) - exact).reshape(rows, -1, 32)
        worst = float((err.max(-1) / np.maximum(step, 1e-30)).max())
        rms = float(np.sqrt(np.mean(err**2) / np.mean(exact**2)))
        tiny = 4 * np.finfo(np.float32).eps * np.abs(exact.reshape(rows, -1, 32)).max(-1)
        held = float((err.max(-1) <= tiny).mean())
        print(f"  {name}: max error {worst:.3f} Q6_K steps, RMS {rms:.5f}, exact groups {held:.1%}")


def smollm2() -> None:
    from mlx_engine.loading.gguf_loader import load_gguf
    from mlx_engine.loading.resolve import bundled_model_path

    prompts = json.loads((ROOT / "tests/data/smollm2_reference.json").read_text())["prompts"]
    with tempfile.TemporaryDirectory() as tmp:
        path, twin = Path(tmp) / "q4km.gguf", Path(tmp) / "twin.gguf"
        requantize(bundled_model_path(), path, lambda n, c: q4_k_m_type(n, c, 30, tied=True), twin=twin)
        reference, _, _ = load_gguf(twin, dense=True)
        quantized, _, info = load_gguf(path, dense=False)
        print(f"\nSmolLM2-135M as Q4_K_M: {info['weight_format']}")

        def compare(model: nn.Module, label: str) -> None:
            worst, diffs, agree, total = 0.0, [], 0, 0
            for p in prompts:
                x = mx.array([p["ids"]])
                a, b = reference(x)[0], model(x)[0]
                d = mx.abs(a - b)
                worst = max(worst, d.max().item())
                diffs.append(d.mean().item())
                agree += int((mx.argmax(a, -1) == mx.argmax(b, -1)).sum().item())
                total += len(p["ids"])
            print(
                f"  {label}: max |logit diff| {worst:.4f}, mean {np.mean(diffs):.4f}, "
                f"top-1 agrees on {agree}/{total} positions"
            )

        compare(quantized, "quantized (all types)")
        for i, layer in enumerate(quantized.model.layers):
            if layer.mlp.down_proj.bits == 8:  # the Q6_K ones
                layer.mlp.down_proj = reference.model.layers[i].mlp.down_proj
        compare(quantized, "quantized, Q6_K layers dense")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--smollm2", action="store_true", help="also the bundled model as Q4_K_M (about a minute)"
    )
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    exact_types(rng)
    q6_k((rng.standard_normal((1024, 1536)) * 0.05).astype(np.float32), "Gaussian weights")
    heavy = rng.standard_t(3, (1024, 1536)).astype(np.float32) * 0.02
    q6_k(heavy, "heavy-tailed weights (Student t, 3 dof)")
    if args.smollm2:
        smollm2()


if __name__ == "__main__":
    main()
