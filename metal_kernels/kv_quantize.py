"""Quantize newly produced K/V rows into MLX's affine 8/4-bit format, and store them in a pool.

``quantize_kv(x, group_size, bits)`` returns exactly what ``mx.quantize`` returns on the last axis:
uint32 words ``(..., D * bits / 32)`` (element 0 in the low bits), scales and biases
``(..., D / group_size)`` in x's dtype. The formula is MLX's (scale from the group's min and max,
the larger-magnitude edge mapped exactly onto a quantization level) in float32, bit for bit equal to
``mx.quantize`` on the CPU: true group min and max, and ``rint`` (ties to even) for the levels. MLX's
own Metal kernel differs in two corners: it starts the max at 0 (all-negative groups) and uses
``round`` (ties away from zero), so an exact tie can land one level apart.

Kernel design: one thread per quantization group; a decode step quantizes only the new tokens
(batch x kv_heads x D / group_size groups), so the kernel is tiny and launch-bound.

``metal_kernel`` outputs are fresh buffers, so the pool itself is updated with MLX indexed
assignment (``write_quantized``): MLX scatters into the existing buffer when the pool array is
the only reference to it, so a step costs O(new tokens), not a copy of the pool.
"""

from __future__ import annotations

import mlx.core as mx

from metal_kernels.spec import KernelSpec, Launch, resolve_backend, run

_SOURCE = """
  constexpr int PER_WORD = 32 / BITS;
  constexpr float N_BINS = float((1 << BITS) - 1);
  const uint group = thread_position_in_grid.x;
  const uint n_groups = uint(n_groups_arr[0]);
  if (group >= n_groups) {
    return;
  }
  const size_t base = size_t(group) * GS;
  float vals[GS];
  float w_min = float(x[base]);
  float w_max = w_min;
  for (int i = 0; i < GS; ++i) {
    vals[i] = float(x[base + i]);
    w_min = min(w_min, vals[i]);
    w_max = max(w_max, vals[i]);
  }
  float scale = max((w_max - w_min) / N_BINS, 1e-7f);
  const bool side = abs(w_min) > abs(w_max);
  scale = side ? scale : -scale;
  const float edge = side ? w_min : w_max;
  const float q0 = rint(edge / scale);
  const bool at_zero = q0 == 0.0f;
  scale = at_zero ? scale : edge / q0;
  const float bias = at_zero ? 0.0f : edge;
  scales[group] = static_cast<T>(scale);
  biases[group] = static_cast<T>(bias);
  for (int wi = 0; wi < GS / PER_WORD; ++wi) {
    uint word = 0;
    for (int i = 0; i < PER_WORD; ++i) {
      const float qv = clamp(rint((vals[wi * PER_WORD + i] - bias) / scale), 0.0f, N_BINS);
      word |= uint(qv) << (i * BITS);
    }
    q[size_t(group) * (GS / PER_WORD) + wi] = word;
  }
"""

SPEC = KernelSpec("duet_kv_quantize", ("x", "n_groups_arr"), ("q", "scales", "biases"), _SOURCE)
THREADS = 64


def quantize_kv(
    x: mx.array, group_size: int = 32, bits: int = 8, *, backend: str | None = None
) -> tuple[mx.array, mx.array, mx.array]:
    """Affine-quantize ``x`` along its last axis; returns ``(words, scales, biases)``."""
    if bits not in (4, 8):
        raise ValueError("bits must be 4 or 8")
    if group_size not in (32, 64, 128):
        raise ValueError("group_size must be 32, 64 or 128")
    dim = x.shape[-1]
    if dim % group_size:
        raise ValueError(f"last axis {dim} is not a multiple of group_size {group_size}")
    backend = resolve_backend(backend)
    if backend == "reference":
        return mx.quantize(x, group_size=group_size, bits=bits)
    lead = x.shape[:-1]
    n_groups = x.size // group_size
    launch = Launch(
        [x.reshape(-1), mx.array([n_groups], dtype=mx.int32)],
        [(n_groups * group_size * bits // 32,), (n_groups,), (n_groups,)],
        [mx.uint32, x.dtype, x.dtype],
        (max(1, n_groups), 1, 1),
        (THREADS, 1, 1),
        [("T", x.dtype), ("GS", group_size), ("BITS", bits)],
    )
    q, s, b = run(SPEC, launch, backend)
    groups = dim // group_size
    return q.reshape(*lead, dim * bits // 32), s.reshape(*lead, groups), b.reshape(*lead, groups)


def write_quantized(
    pool: tuple[mx.array, mx.array, mx.array],
    slots: mx.array,
    x: mx.array,
    group_size: int = 32,
    bits: int = 8,
    *,
    backend: str | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """Quantize ``x`` (T, n_kv_heads, D) and store it at flat ``slots`` (T,) of a quantized pool.

    ``pool`` is (words, scales, biases) with leading axis ``num_blocks * block_size``. The arrays are
    updated by indexed assignment and returned. MLX writes in place only while each pool array is the
    sole reference to its buffer: do not keep other arrays (views, reshapes) of the old pool alive
    across the step, or MLX copies the whole pool.
    """
    q, s, b = quantize_kv(x, group_size, bits, backend=backend)
    words, scales, biases = pool
    words[slots] = q
    scales[slots] = s.astype(scales.dtype)
    biases[slots] = b.astype(biases.dtype)
    return words, scales, biases
