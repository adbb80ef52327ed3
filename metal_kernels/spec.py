"""Kernel specs and the backend switch shared by the kernels.

A :class:`KernelSpec` holds what ``mx.fast.metal_kernel`` needs to build a kernel; a :class:`Launch`
holds one call's arguments. ``run`` builds the spec with a kernel factory (``mx.fast.metal_kernel``
on a Mac, the emulator's ``metal_kernel`` in tests) and launches it. Each public kernel function
takes ``backend``: ``"metal"`` (real GPU), ``"emulator"`` (exact source on the CPU) or
``"reference"`` (MLX ops, identical semantics); ``None`` picks Metal when available, else reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import mlx.core as mx

Backend = Literal["metal", "emulator", "reference"]
BACKENDS: tuple[str, ...] = ("metal", "emulator", "reference")


@dataclass(frozen=True)
class KernelSpec:
    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str = ""


@dataclass
class Launch:
    inputs: list[mx.array]
    output_shapes: list[tuple[int, ...]]
    output_dtypes: list[mx.Dtype]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    template: list[tuple[str, object]] = field(default_factory=list)


# MLX 0.29-0.31 pass inputs of fewer than 8 elements as ``constant`` and cache compiled kernels by
# name only, so block tables and context lengths crossing 8 elements recompile (and hit a
# use-after-free fixed in 0.32). pyproject pins a newer MLX; an older one keeps the reference path.
MIN_MLX = (0, 32)


def mlx_version_ok(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed MLX) is at least ``MIN_MLX``."""
    parts = (version or mx.__version__).split(".")[:2]
    try:
        return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts) >= MIN_MLX
    except ValueError:
        return False


def metal_available() -> bool:
    return bool(mx.metal.is_available()) and mlx_version_ok()


def resolve_backend(backend: str | None) -> str:
    if backend is None:
        return "metal" if metal_available() else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "metal" and not metal_available():
        raise RuntimeError(
            f"the Metal backend needs Apple Silicon with Metal and mlx >= {MIN_MLX[0]}.{MIN_MLX[1]}"
        )
    return backend


def _factory(backend: str) -> Callable[..., Callable[..., list[mx.array]]]:
    if backend == "metal":
        return mx.fast.metal_kernel
    if backend == "emulator":
        from metal_kernels.emulator import metal_kernel

        return metal_kernel
    raise ValueError(f"backend {backend!r} does not run kernels")


_built: dict[tuple[str, KernelSpec], Callable[..., list[mx.array]]] = {}


def build(spec: KernelSpec, backend: str) -> Callable[..., list[mx.array]]:
    key = (backend, spec)
    kernel = _built.get(key)
    if kernel is None:
        kernel = _factory(backend)(
            name=spec.name,
            input_names=list(spec.input_names),
            output_names=list(spec.output_names),
            source=spec.source,
            header=spec.header,
        )
        _built[key] = kernel
    return kernel


def run(spec: KernelSpec, launch: Launch, backend: str) -> Sequence[mx.array]:
    kernel = build(spec, backend)
    return kernel(
        inputs=launch.inputs,
        output_shapes=launch.output_shapes,
        output_dtypes=launch.output_dtypes,
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        template=launch.template,
    )
