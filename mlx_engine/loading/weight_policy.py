"""Whether quantized weights stay quantized on a backend: the one place that decides.

``load_model(weights="auto")`` asks ``keep_quantized(backend_name())``. Kept quantized, a GGUF's blocks
become MLX's packed affine layers (``QuantizedLinear``/``QuantizedEmbedding``, mlx_engine/loading/
gguf_loader.py) and an MLX-quantized checkpoint stays as it is; otherwise both are expanded once, at
load time, to dense float32.

- Metal and CUDA: quantized. MLX's quantized kernels there are fast and read 4-8x fewer bytes.
- CPU: quantized when Duet's CPU kernels (cpu_kernels/, a C++ extension built by ``make setup``) are
  available: they read the packed weights at 6-16 GB/s per core and decode the bundled model ~3x
  faster than dense float32 through OpenBLAS, in a fifth of the memory (docs/kernels.md,
  docs/BENCHMARKS.md). Without them, dense float32: MLX's own CPU ``quantized_matmul`` runs at
  ~0.8 GB/s, far below an fp32 GEMV through OpenBLAS (issue 15).
"""

from __future__ import annotations


def keep_quantized(backend: str) -> bool:
    """True when quantized weights should stay quantized on ``backend`` ("metal", "cuda" or "cpu")."""
    if backend != "cpu":
        return True
    from cpu_kernels.spec import available

    return available()
