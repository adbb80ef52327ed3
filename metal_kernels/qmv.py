"""Quantized matrix times a few vectors (decode): y = x @ dequantize(w).T.

MLX affine format: ``w`` uint32 (N, K * bits / 32) with element 0 in the low bits, ``scales`` and
``biases`` (N, K / group_size) in the activation dtype, exactly as ``mx.quantize`` returns them.

Kernel design: a threadgroup is 2 SIMD-groups; each SIMD-group owns 4 output rows and all M (1-8)
vectors, so each weight word is read once per step for every vector (MLX's qmv re-reads the
weights per vector). Lane l takes a contiguous run of ``values_per_thread`` inputs per step,
which lies inside one quantization group; the per-group affine term is folded as
``scale * dot(x, q) + bias * sum(x)``. Partial sums are float32 and reduced with ``simd_sum``. The
grid has one SIMD-group per 4 rows, so the last threadgroup may hold a single SIMD-group and its
last rows may pass N (skipped); a K tail shorter than a full step leaves the upper lanes idle.
"""

from __future__ import annotations

import mlx.core as mx

from metal_kernels.spec import KernelSpec, Launch, resolve_backend, run

MAX_VECTORS = 8
ROWS_PER_SIMDGROUP = 4
# With backend=None on Metal, a single vector goes to MLX's own qmv (tuned on hardware); our kernel
# pays off from 2 vectors, reading each weight once for all of them. bench/kernels.py measures both.
KERNEL_MIN_VECTORS = 2

_SOURCE = """
  constexpr int R = 4;
  constexpr int PER_WORD = 32 / BITS;
  constexpr int WORDS = M <= 2 ? 2 : 1;
  constexpr int VPT = WORDS * PER_WORD;
  constexpr int STEP = 32 * VPT;
  constexpr uint MASK = (1u << BITS) - 1u;
  const int K = dims[0];
  const int N = dims[1];
  const int words_per_row = K / PER_WORD;
  const int groups_per_row = K / GS;
  const uint lane = thread_index_in_simdgroup;
  const int r0 = int(thread_position_in_grid.y) * R;

  float acc[R][M];
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < M; ++m) {
      acc[r][m] = 0.0f;
    }
  }

  for (int k0 = 0; k0 < K; k0 += STEP) {
    const int kk = k0 + int(lane) * VPT;
    if (kk < K) {
      float xs[M][VPT];
      float xsum[M];
      for (int m = 0; m < M; ++m) {
        xsum[m] = 0.0f;
        for (int i = 0; i < VPT; ++i) {
          xs[m][i] = float(x[size_t(m) * K + kk + i]);
          xsum[m] += xs[m][i];
        }
      }
      for (int r = 0; r < R; ++r) {
        const int row = r0 + r;
        if (row < N) {
          const float s = float(scales[size_t(row) * groups_per_row + kk / GS]);
          const float b = float(biases[size_t(row) * groups_per_row + kk / GS]);
          float part[M];
          for (int m = 0; m < M; ++m) {
            part[m] = 0.0f;
          }
          for (int wi = 0; wi < WORDS; ++wi) {
            const uint word = w[size_t(row) * words_per_row + kk / PER_WORD + wi];
            for (int i = 0; i < PER_WORD; ++i) {
              const float qv = float((word >> (i * BITS)) & MASK);
              for (int m = 0; m < M; ++m) {
                part[m] += xs[m][wi * PER_WORD + i] * qv;
              }
            }
          }
          for (int m = 0; m < M; ++m) {
            acc[r][m] += s * part[m] + b * xsum[m];
          }
        }
      }
    }
  }

  for (int r = 0; r < R; ++r) {
    const int row = r0 + r;
    for (int m = 0; m < M; ++m) {
      const float total = simd_sum(acc[r][m]);
      if (lane == 0 && row < N) {
        y[size_t(m) * N + row] = static_cast<T>(total);
      }
    }
  }
"""

SPEC = KernelSpec("duet_qmv", ("x", "w", "scales", "biases", "dims"), ("y",), _SOURCE)


def _check(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError("bits must be 4 or 8")
    if group_size not in (32, 64, 128):
        raise ValueError("group_size must be 32, 64 or 128")
    if w.ndim != 2 or w.dtype != mx.uint32:
        raise ValueError("w must be uint32 (N, K * bits / 32)")
    k = x.shape[-1]
    n = w.shape[0]
    if k % group_size or w.shape[1] * 32 // bits != k:
        raise ValueError(f"x has K={k}, w packs {w.shape[1] * 32 // bits} values per row")
    if scales.shape != (n, k // group_size) or biases.shape != scales.shape:
        raise ValueError("scales/biases must be (N, K / group_size)")
    return k


def qmv(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int = 64,
    bits: int = 4,
    *,
    backend: str | None = None,
) -> mx.array:
    """``x @ dequantize(w, scales, biases).T`` for x of shape (..., K); returns (..., N) in x.dtype."""
    k = _check(x, w, scales, biases, group_size, bits)
    if backend is None and x.size // k < KERNEL_MIN_VECTORS:
        backend = "reference"
    backend = resolve_backend(backend)
    if backend == "reference":
        return reference(x, w, scales, biases, group_size, bits)
    n = w.shape[0]
    lead = x.shape[:-1]
    rows = x.reshape(-1, k)
    outs = []
    for start in range(0, rows.shape[0], MAX_VECTORS):
        chunk = rows[start : start + MAX_VECTORS]
        m = chunk.shape[0]
        simdgroups = -(-n // ROWS_PER_SIMDGROUP)
        launch = Launch(
            [chunk, w, scales.astype(x.dtype), biases.astype(x.dtype), mx.array([k, n], dtype=mx.int32)],
            [(m, n)],
            [x.dtype],
            (32, simdgroups, 1),
            (32, 2, 1),
            [("T", x.dtype), ("M", m), ("BITS", bits), ("GS", group_size)],
        )
        outs.append(run(SPEC, launch, backend)[0])
    y = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    return y.reshape(*lead, n)


def reference(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> mx.array:
    """MLX's built-in quantized matmul: the path used without Metal."""
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
