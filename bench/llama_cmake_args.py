"""The CMake arguments ``make bench-deps`` builds llama-cpp-python with, for this machine.

    python3 bench/llama_cmake_args.py          # prints them (the Makefile's LLAMA_CMAKE_ARGS)
    python3 bench/llama_cmake_args.py --tag    # "native" or "noamx": the wheel cache's folder

A native build (``-march=native``) is what llama.cpp's users build, except where the CPU lists AMX
(``amx_tile`` in /proc/cpuinfo): there llama-cpp-python 0.3.36's AMX kernels die with SIGILL on their
first ``tilezero`` as soon as a prompt is evaluated in a batch (measured on an Emerald Rapids guest,
with Linux's permission for the tiles granted to the process beforehand, where Duet's own AMX kernel
runs: cpu_kernels/src/kernels_panel_amx.cpp). There the build names the instruction sets the CPU has,
one by one, without AMX: the same code as a native build otherwise.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

COMMON = "-DGGML_OPENMP=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
# /proc/cpuinfo flag -> ggml's CMake option, for a build without -march=native
GGML_FLAGS = {
    "sse4_2": "GGML_SSE42",
    "avx": "GGML_AVX",
    "avx_vnni": "GGML_AVX_VNNI",
    "avx2": "GGML_AVX2",
    "bmi2": "GGML_BMI2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def amx_listed(flags: set[str]) -> bool:
    """The CPU lists AMX tiles (x86-64), where llama.cpp's AMX build dies (see above)."""
    return "amx_tile" in flags and platform.machine() in ("x86_64", "AMD64")


def cmake_args() -> tuple[str, str]:
    """(tag, arguments): a native build, or the CPU's instruction sets by name without AMX."""
    flags = cpu_flags()
    if not amx_listed(flags):
        return "native", f"-DGGML_NATIVE=ON {COMMON}"
    named = " ".join(f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in GGML_FLAGS.items())
    return (
        "noamx",
        f"-DGGML_NATIVE=OFF {named} -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF {COMMON}",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tag", action="store_true", help="print the build's tag instead of its arguments")
    tag, args = cmake_args()
    print(tag if ap.parse_args().tag else args)


if __name__ == "__main__":
    main()
