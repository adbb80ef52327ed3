"""Kernel specs, the extension loader and the one backend switch shared by the CPU kernels.

A :class:`KernelSpec` names a function of the C++ extension ``cpu_kernels._ext`` and what it
supports. Each public kernel function takes ``backend``: ``"native"`` (the extension), or
``"reference"`` (MLX's own ops, identical semantics); ``None`` picks the extension when it is built
and supports the call, else the reference. A missing or stale extension is reported once (one log
line) and every call then takes the reference path.

Threads: the extension's pool defaults to the machine's physical cores (``DUET_CPU_THREADS``
overrides); ``DUET_CPU_KERNELS=0`` turns the extension off.

Math: :func:`set_cpu_math` (or ``DUET_CPU_MATH``) picks how the quantized products (``quantized_matmul``
and ``gather_qmm``) treat x: ``"exact"`` keeps float32's accuracy (x in three int8 planes for the
integer kernels, 22 bits a run of 32), ``"int16"`` (the default) holds x to within 2^-15 of each run
of 32's largest value (its first two planes: two thirds of exact math's integer work, its products
within ~1e-4 relative of exact's; top-1 100% against exact on the bundled model), ``"int8"`` quantizes it to int8 per run of 32 values with one float
scale, as llama.cpp's Q8_0 does, for integer dot products with the weights' codes (about 2x the weight
bandwidth on AVX-512 VNNI; ~0.3% relative error in each product, docs/kernels.md). A product takes
the setting in force when it is built (the graph), not when it is evaluated.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx

log = logging.getLogger("duet.cpu_kernels")

BACKENDS: tuple[str, ...] = ("native", "reference")
# each math, and the int8 planes of x it gives the kernels (their ``x_planes``)
X_PLANES: dict[str, int] = {"exact": 3, "int16": 2, "int8": 1}
CPU_MATHS: tuple[str, ...] = tuple(X_PLANES)
FLOATS = (mx.float32, mx.float16, mx.bfloat16)  # the dtypes every kernel takes
STAMP = Path(__file__).resolve().parent / "_ext.stamp"


@dataclass(frozen=True)
class KernelSpec:
    name: str  # the function in cpu_kernels._ext
    bits: tuple[int, ...]
    group_sizes: tuple[int, ...]

    def supports(self, *, bits: int, group_size: int, dtype: mx.Dtype) -> bool:
        return bits in self.bits and group_size in self.group_sizes and dtype in FLOATS


_state: dict[str, Any] = {"loaded": False, "ext": None, "reason": None}


# int16: the issue-34 bar for a default (top-1 >= 99% against float32 on the bundled model: 100%),
# and on a Zen 4 1.3x exact math's prefill and 1.4x its batch-16 decode (docs/kernels.md, "Int16 math")
DEFAULT_CPU_MATH = "int16"


def _math_from_env() -> str:
    """What ``DUET_CPU_MATH`` asks for (anything not in CPU_MATHS is warned about once: the default)."""
    env = os.environ.get("DUET_CPU_MATH", DEFAULT_CPU_MATH).strip().lower() or DEFAULT_CPU_MATH
    if env not in CPU_MATHS:
        log.warning("DUET_CPU_MATH=%r is not one of %s; using %r", env, CPU_MATHS, DEFAULT_CPU_MATH)
        return DEFAULT_CPU_MATH
    return env


_math: dict[str, str] = {"name": _math_from_env()}


def set_cpu_math(math: str | None = None) -> str:
    """Set how the quantized products treat x: "exact" (float32), "int16" (to 2^-15 of each run of
    32) or "int8" (int8 per 32 values); None: what ``DUET_CPU_MATH`` says. Returns the setting.
    Products built afterwards use it."""
    if math is None:
        _math["name"] = _math_from_env()
    elif math in CPU_MATHS:
        _math["name"] = math
    else:
        raise ValueError(f"cpu_math must be one of {CPU_MATHS}, got {math!r}")
    return cpu_math()


def cpu_math() -> str:
    """The quantized products' math now: one of CPU_MATHS."""
    return _math["name"]


def int8_math() -> bool:
    """Whether the quantized products quantize x to int8 (cpu_math "int8"). Cheap: on the decode path."""
    return _math["name"] == "int8"


def x_planes() -> int:
    """The kernels' ``x_planes`` for the math now (3 exact, 2 int16, 1 int8). Cheap: on the decode path."""
    return X_PLANES[_math["name"]]


def panel_tiles() -> bool:
    """Whether the panel kernel's products of 16 or more rows of x run on AMX tiles (the extension's
    switch: where the CPU and OS allow it, unless ``DUET_CPU_AMX=0``)."""
    ext = extension()
    return bool(ext is not None and ext.panel_tiles())


def set_panel_tiles(on: bool) -> bool:
    """Turn the AMX tiles' path on (where allowed) or off, for A/B runs and tests; returns whether on."""
    ext = extension()
    return bool(ext is not None and ext.set_panel_tiles(on))


def _import_extension() -> ModuleType:
    return importlib.import_module("cpu_kernels._ext")


def _stamp_mismatch() -> str | None:
    """Why the built extension does not fit this mlx, or None when it does (or has no stamp)."""
    if not STAMP.exists():
        return None
    fields = STAMP.read_text().split()
    running = metadata.version("mlx")
    if fields and fields[0] != running:
        return f"built for mlx {fields[0]}, running mlx {running}"
    return None


def extension() -> ModuleType | None:
    """The loaded extension, or None (the reason logged once at WARNING and kept for
    :func:`unavailable_reason`)."""
    if not _state["loaded"]:
        _state["loaded"] = True
        reason = None
        ext = None
        if os.environ.get("DUET_CPU_KERNELS", "1") == "0":
            reason = "turned off by DUET_CPU_KERNELS=0"
        else:
            reason = _stamp_mismatch()
            if reason is None:
                try:
                    ext = _import_extension()
                except ImportError as e:
                    reason = f"cannot import cpu_kernels._ext ({e})"
        if ext is not None:
            _state["threads"] = default_threads()
            ext.set_num_threads(_state["threads"])
        else:
            log.warning(
                "CPU kernels unavailable: %s; quantized weights use the slower dequantized path (run `make setup`)",
                reason,
            )
        _state["ext"], _state["reason"] = ext, reason
    return _state["ext"]


def available() -> bool:
    return extension() is not None


def unavailable_reason() -> str | None:
    extension()
    return _state["reason"]


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads of one core count once)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS: no affinity API; its CPUs have no SMT siblings
        return max(1, os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            cores.add(siblings.read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


def default_threads() -> int:
    env = os.environ.get("DUET_CPU_THREADS")
    if env:
        try:
            return max(1, min(1024, int(env)))
        except ValueError:
            log.warning("DUET_CPU_THREADS=%r is not a number; using the physical core count", env)
    return min(1024, physical_cores())


def set_threads(threads: int | None = None) -> int:
    """Set the kernels' thread count (None: the default); returns it."""
    n = default_threads() if threads is None else threads
    ext = extension()
    if ext is not None:
        ext.set_num_threads(n)
        _state["threads"] = n
    return n


def kernel_threads() -> int:
    """The kernels' thread count now (1 before the extension is loaded, or without it). Cheap: on
    the decode step's path."""
    return _state.get("threads") or 1


def choose_backend(backend: str | None, fits: bool, requirement: str) -> str:
    """``backend`` checked, or chosen when None: "native" when the extension is built and the call
    ``fits`` the kernel, else "reference". Asking for "native" where it cannot run is an error
    (``requirement`` says what the kernel takes)."""
    if backend is None:
        return "native" if fits and available() else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "native":
        if not available():
            raise RuntimeError(f"the CPU kernels are not available: {unavailable_reason()}")
        if not fits:
            raise ValueError(requirement)
    return backend


def resolve_backend(
    backend: str | None, spec: KernelSpec, *, bits: int, group_size: int, dtype: mx.Dtype
) -> str:
    fits = spec.supports(bits=bits, group_size=group_size, dtype=dtype)
    requirement = f"{spec.name} supports bits {spec.bits}, group sizes {spec.group_sizes} and float dtypes"
    return choose_backend(backend, fits, requirement)


def run(spec: KernelSpec, *args: Any, **kwargs: Any) -> mx.array:
    ext = extension()
    if ext is None:
        raise RuntimeError(f"the CPU kernels are not available: {unavailable_reason()}")
    return getattr(ext, spec.name)(*args, **kwargs)
