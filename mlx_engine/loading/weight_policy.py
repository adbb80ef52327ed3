"""Whether quantized weights stay quantized on a backend: the one place that decides.

``load_model(weights="auto")`` asks ``keep_quantized(backend_name())``. Kept quantized, a GGUF's blocks
become MLX's packed affine layers (``QuantizedLinear``/``QuantizedEmbedding``, mlx_engine/loading/
gguf_loader.py) and an MLX-quantized checkpoint stays as it is; otherwise both are expanded once, at
load time, to dense float32.

- Metal and CUDA: quantized. MLX's quantized kernels there are fast and read 4-8x fewer bytes.
- CPU: dense float32. MLX's CPU ``quantized_matmul`` runs at ~0.8 GB/s against 30-48 GB/s for an
  fp32 GEMV through OpenBLAS (issue 15, docs/BENCHMARKS.md), so expanding wins while the weights fit
  in memory. CPU quantized-matmul kernels that beat the dense path should turn this to True for "cpu".
"""

from __future__ import annotations


def keep_quantized(backend: str) -> bool:
    """True when quantized weights should stay quantized on ``backend`` ("metal", "cuda" or "cpu")."""
    return backend != "cpu"
