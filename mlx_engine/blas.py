"""Which BLAS MLX's CPU backend calls, and how Duet gives it a fast one on Linux.

The `mlx[cpu]` wheel links a reference (netlib) BLAS (`mlx_cpu.libs/libblas-*.so`): ~4 GFLOP/s
sgemm, so prefill on dense weights crawls (~10x slower than OpenBLAS, see docs/BENCHMARKS.md).
A BLAS in the process's global scope before MLX loads wins (see `blas_preload.py`):

- `import mlx_engine` loads Debian's multithreaded OpenBLAS (`libopenblas0-pthread`) with
  RTLD_GLOBAL before anything imports MLX; `DUET_NO_OPENBLAS=1` keeps the reference BLAS. If MLX
  was imported first that is too late, and building an `Engine` warns once with the fix.
- `LD_PRELOAD` does the same from outside: `python -m mlx_engine.blas --preload` prints the
  library to preload (or nothing), `--env` the `NAME=VALUE` words for `env` (with the
  `OPENBLAS_CORETYPE` a CPU newer than the OpenBLAS needs, `openblas_coretype()`); `duet`
  re-executes itself with them when the in-process load did not happen (`reexec_with_openblas()`).

`mlx_blas()` reports what MLX really calls: the library defining the `cblas_sgemm` that libmlx
binds to, looked up the way the dynamic linker does (global scope first, then libmlx's own
dependencies) and named by `dladdr`. `python -m mlx_engine.blas` prints it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import sys
from dataclasses import dataclass

from mlx_engine.blas_preload import (
    ENV_DISABLE,
    PROBE_SYMBOL,
    global_provider,
    library_defining,
    openblas_path,
    preload_env,
    preload_openblas,
)

__all__ = [
    "ENV_DISABLE",
    "BlasInfo",
    "active_blas",
    "fix_hint",
    "mlx_blas",
    "openblas_path",
    "preload_env",
    "preload_openblas",
    "reexec_with_openblas",
    "warn_if_slow",
]

log = logging.getLogger(__name__)

REFERENCE = "reference BLAS"
_NAMES = (("openblas", "OpenBLAS"), ("mkl", "MKL"), ("blis", "BLIS"), ("accelerate", "Accelerate"))
_LIBMLX = re.compile(r"/libmlx\.so(\.\d+)*$")
_warned = False


@dataclass(frozen=True)
class BlasInfo:
    """The BLAS library MLX calls in this process."""

    name: str  # "OpenBLAS", "reference BLAS", "Accelerate", "MKL", ... or "unknown"
    path: str | None  # the shared library defining cblas_sgemm, when found

    @property
    def slow(self) -> bool:
        return self.name == REFERENCE

    def describe(self) -> str:
        return f"{REFERENCE} (slow; {fix_hint()})" if self.slow else self.name


def fix_hint() -> str:
    """How to get MLX onto OpenBLAS from here, in one clause."""
    if os.environ.get(ENV_DISABLE):
        return f"unset {ENV_DISABLE} to use OpenBLAS"
    lib = openblas_path()
    if lib is None:
        return "install libopenblas0-pthread (packaging/install_system_deps.sh)"
    return f"import mlx_engine before mlx, run through `duet`, or set LD_PRELOAD={lib}"


def _libmlx_path() -> str | None:
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if _LIBMLX.search(path):
                    return path
    except OSError:
        pass
    return None


def _name(path: str | None) -> str:
    if path is None:
        return "unknown"
    base = os.path.basename(path).lower()
    for key, name in _NAMES:
        if key in base:
            return name
    if base.startswith(("libblas", "libcblas")):
        return REFERENCE
    return os.path.basename(path)


def mlx_blas() -> BlasInfo:
    """The BLAS library MLX's `cblas_sgemm` is bound to in this process (imports MLX)."""
    if sys.platform == "darwin":
        return BlasInfo("Accelerate", None)
    import mlx.core  # noqa: F401  (libmlx must be loaded to be inspected)

    path = global_provider()
    if path is None:  # nothing global: libmlx's own dependencies provide it
        libmlx = _libmlx_path()
        if libmlx is not None:
            try:  # RTLD_NOLOAD: a handle to the already loaded libmlx, never a second copy
                path = library_defining(ctypes.CDLL(libmlx, mode=os.RTLD_NOLOAD | os.RTLD_NOW), PROBE_SYMBOL)
            except OSError:
                path = None
    return BlasInfo(_name(path), path)


def active_blas() -> str:
    """What MLX's BLAS is, for display: 'OpenBLAS', 'Accelerate', 'reference BLAS (slow; ...)'."""
    return mlx_blas().describe()


def warn_if_slow(backend: str) -> None:
    """Log one warning per process when MLX's CPU backend runs on the reference BLAS."""
    global _warned
    if _warned or backend != "cpu" or sys.platform != "linux":
        return
    info = mlx_blas()
    if not info.slow:
        return
    _warned = True
    log.warning("MLX runs on the %s (%s): prefill is ~10x slower; %s", REFERENCE, info.path, fix_hint())


def reexec_with_openblas() -> None:
    """Re-execute the current command with OpenBLAS preloaded, once. Returns if not applicable:
    no OpenBLAS, already preloaded, or a fast BLAS already global in this process (`import
    mlx_engine` loaded it), so MLX binds to it without a re-exec."""
    lib = openblas_path()
    if lib is None or lib in os.environ.get("LD_PRELOAD", "") or os.environ.get("_DUET_REEXEC"):
        return
    provider = global_provider()
    if provider is not None and _name(provider) != REFERENCE:
        return
    env = dict(os.environ, **preload_env())
    env["_DUET_REEXEC"] = "1"
    argv = [sys.executable, *sys.orig_argv[1:]] if hasattr(sys, "orig_argv") else [sys.executable, *sys.argv]
    try:
        os.execve(sys.executable, argv, env)
    except OSError:
        return


if __name__ == "__main__":
    if "--preload" in sys.argv:
        print(openblas_path() or "")
    elif "--env" in sys.argv:  # NAME=VALUE words for `env`: LD_PRELOAD and, where needed, OPENBLAS_CORETYPE
        print(" ".join(f"{k}={v}" for k, v in preload_env().items()))
    else:
        info = mlx_blas()
        print(f"{info.describe()}: {info.path or 'library not found'}")
