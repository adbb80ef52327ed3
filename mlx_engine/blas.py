"""Which BLAS MLX's CPU backend uses, and how Duet gets a fast one on Linux.

The `mlx[cpu]` wheel links a reference (netlib) BLAS: ~4 GFLOP/s sgemm, so prefill on
dense weights crawls. Preloading Debian's multithreaded OpenBLAS makes MLX's `sgemm_`
calls resolve there instead (~15x faster prefill, see docs/BENCHMARKS.md). `duet`
re-executes itself once with LD_PRELOAD set; `make test` sets it for pytest.

`python -m mlx_engine.blas --preload` prints the library to preload (or nothing).
"""

from __future__ import annotations

import glob
import os
import sys

ENV_DISABLE = "DUET_NO_OPENBLAS"
_CANDIDATES = (
    "/usr/lib/*/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*/libopenblas.so.0",
    "/usr/lib64/libopenblas*.so.0",
)


def openblas_path() -> str | None:
    if sys.platform != "linux" or os.environ.get(ENV_DISABLE):
        return None
    for pattern in _CANDIDATES:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


def active_blas() -> str:
    """Name of the BLAS loaded in this process ('Accelerate' on macOS)."""
    if sys.platform == "darwin":
        return "Accelerate"
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "unknown"
    if "openblas" in maps:
        return "OpenBLAS"
    if "libblas" in maps or "libcblas" in maps:
        return "reference BLAS (slow; install libopenblas0-pthread)"
    return "bundled BLAS (slow; install libopenblas0-pthread)"


def reexec_with_openblas() -> None:
    """Re-execute the current command with OpenBLAS preloaded, once. Returns if not applicable."""
    lib = openblas_path()
    if lib is None or lib in os.environ.get("LD_PRELOAD", "") or os.environ.get("_DUET_REEXEC"):
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env["_DUET_REEXEC"] = "1"
    argv = [sys.executable, *sys.orig_argv[1:]] if hasattr(sys, "orig_argv") else [sys.executable, *sys.argv]
    try:
        os.execve(sys.executable, argv, env)
    except OSError:
        return


if __name__ == "__main__":
    if "--preload" in sys.argv:
        print(openblas_path() or "")
    else:
        print(active_blas())
