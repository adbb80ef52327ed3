"""CPU emulator for Metal compute kernels written for ``mx.fast.metal_kernel``.

``metal_kernel(...)`` has the same signature as ``mx.fast.metal_kernel`` and runs the exact kernel
source on the CPU: the Metal text is generated as MLX generates it, translated to C++ against a shim
header, compiled with the host C++ compiler into a cached shared library and executed with every
Metal thread as a fiber, one threadgroup at a time. See ``docs/kernels.md`` for what it checks and
what it cannot see.
"""

from metal_kernels.emulator.build import EmulatorCompileError
from metal_kernels.emulator.kernel import (
    ORDERS,
    EmulatedKernel,
    EmulatorError,
    EmulatorOptions,
    current_options,
    metal_kernel,
    options,
)

__all__ = [
    "ORDERS",
    "EmulatedKernel",
    "EmulatorCompileError",
    "EmulatorError",
    "EmulatorOptions",
    "current_options",
    "metal_kernel",
    "options",
]
