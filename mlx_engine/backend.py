"""Which MLX backend this process runs on: "metal", "cuda" or "cpu"."""

from __future__ import annotations

from functools import cache

import mlx.core as mx


@cache
def backend_name() -> str:
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


def total_memory_bytes() -> int:
    """Device memory on Metal/CUDA, system RAM on CPU."""
    try:
        info = mx.device_info()
        if "memory_size" in info:
            return int(info["memory_size"])
    except Exception:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
