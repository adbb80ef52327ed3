"""Load the system OpenBLAS into the process's global symbol scope before MLX loads.

`libmlx.so` leaves `cblas_sgemm` & co. undefined; the dynamic linker binds them to the first
definition in the global scope (the program, LD_PRELOAD, libraries loaded with RTLD_GLOBAL) before
falling back to libmlx's own dependencies (the `mlx[cpu]` wheel's reference BLAS). Loading Debian's
multithreaded OpenBLAS with RTLD_GLOBAL before MLX is imported therefore has the same effect as
LD_PRELOAD. `mlx_engine/__init__.py` calls `preload_openblas()`; this module imports no MLX.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import platform
import sys
from collections.abc import Mapping

log = logging.getLogger(__name__)

ENV_DISABLE = "DUET_NO_OPENBLAS"
ENV_CORETYPE = "OPENBLAS_CORETYPE"  # OpenBLAS's own: the kernels' target, read when the library loads
PROBE_SYMBOL = "cblas_sgemm"  # what MLX's CPU matmul calls
_CANDIDATES = (
    "/usr/lib/*/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*/libopenblas.so.0",
    "/usr/lib64/libopenblas*.so.0",
)

_preloaded: ctypes.CDLL | None = None  # kept referenced: the library stays loaded for the process


def openblas_path() -> str | None:
    """The system OpenBLAS to use (None off Linux, when not installed, or with DUET_NO_OPENBLAS set)."""
    if sys.platform != "linux" or os.environ.get(ENV_DISABLE):
        return None
    for pattern in _CANDIDATES:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def openblas_coretype(flags: set[str] | None = None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The ``OPENBLAS_CORETYPE`` to load OpenBLAS with, or None to leave it to its own detection.

    OpenBLAS picks its kernels at load time from the CPU's model number, and a release older than the
    CPU does not know it: Debian 12's 0.3.21 takes an Emerald Rapids Xeon (family 6, model 207) for a
    Prescott and runs SSE3 kernels, a 2048^2 float32 matmul at 29 GFLOP/s instead of 183 (the
    dequantize-then-GEMM prefill of the exact math 5x slower than on a known CPU). Naming the target by
    the instruction sets the CPU reports gives the kernels a correct detection would: SkylakeX's with
    AVX-512 (what OpenBLAS picks for every AVX-512 CPU since, Zen 4 included), Haswell's with AVX2.
    A value the user set is theirs (None: nothing to add); off x86-64 Linux, None.
    """
    if ENV_CORETYPE in environ or sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    flags = _cpu_flags() if flags is None else flags
    if {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def preload_env() -> dict[str, str]:
    """What a child process's environment needs for MLX to run on OpenBLAS's right kernels:
    ``LD_PRELOAD`` (the library, ahead of what is preloaded already) and ``OPENBLAS_CORETYPE`` where
    ``openblas_coretype()`` names one; empty without OpenBLAS."""
    lib = openblas_path()
    if lib is None:
        return {}
    preloaded = os.environ.get("LD_PRELOAD", "")
    env = {"LD_PRELOAD": preloaded if lib in preloaded else ":".join(p for p in (lib, preloaded) if p)}
    coretype = os.environ.get(ENV_CORETYPE) or openblas_coretype()  # this process's own, if set
    if coretype:
        env[ENV_CORETYPE] = coretype
    return env


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def library_defining(handle: ctypes.CDLL, symbol: str) -> str | None:
    """Real path of the library in which `dlsym(handle, symbol)` finds `symbol`, or None."""
    try:
        address = ctypes.cast(getattr(handle, symbol), ctypes.c_void_p).value
    except AttributeError:
        return None
    try:
        dladdr = ctypes.CDLL(None).dladdr
    except AttributeError:  # glibc < 2.34 keeps it in libdl
        dladdr = ctypes.CDLL("libdl.so.2").dladdr
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    dladdr.restype = ctypes.c_int
    info = _DlInfo()
    if not address or not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(os.fsdecode(info.dli_fname))


def global_provider(symbol: str = PROBE_SYMBOL) -> str | None:
    """The library defining `symbol` in the global scope: what libmlx binds it to first."""
    return library_defining(ctypes.CDLL(None), symbol)


def preload_openblas() -> str | None:
    """Load the system OpenBLAS with RTLD_GLOBAL so MLX binds to it; returns its path, or None.

    Does nothing off Linux, with DUET_NO_OPENBLAS set, when OpenBLAS is not installed, when a BLAS
    is already global (LD_PRELOAD, an earlier call) or when MLX is already imported (its symbols
    are bound by then: loading now would change nothing for it).
    """
    global _preloaded
    lib = openblas_path()
    if lib is None or "mlx.core" in sys.modules or global_provider() is not None:
        return None
    coretype = openblas_coretype()
    if coretype is not None:  # read by the library as it loads, and inherited by child processes
        os.environ[ENV_CORETYPE] = coretype
    try:
        _preloaded = ctypes.CDLL(lib, mode=os.RTLD_GLOBAL | os.RTLD_NOW)
    except OSError as e:
        log.debug("could not load %s: %s", lib, e)
        return None
    return lib
