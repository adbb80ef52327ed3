"""duet-llm's compiled part, the CPU kernels extension ``cpu_kernels._ext`` (cpu_kernels/src: CMake
and nanobind against the exact MLX in pyproject.toml), built into the wheel by MLX's own setuptools
helper (``mlx.extension.CMakeBuild``: libmlx is found at run time in the installed ``mlx`` package).
Everything else about the package is in pyproject.toml.

``DUET_CPU_KERNELS_BUILD`` decides what happens to the extension:

- ``1`` (the default): build it; if that fails (no C++20 compiler, no CMake), warn and make the
  wheel without it: Duet then uses its dequantized CPU path and says so once.
- ``require``: a failed build fails the wheel (release builds; cibuildwheel sets it).
- ``0``: leave it out (``make setup``'s editable install: ``python -m cpu_kernels.build`` builds it in
  place there).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

MODE = os.environ.get("DUET_CPU_KERNELS_BUILD", "1")
if MODE not in ("0", "1", "require"):
    sys.exit(f"DUET_CPU_KERNELS_BUILD must be 0, 1 or require, not {MODE!r}")
SOURCES = Path(__file__).resolve().parent / "cpu_kernels" / "src"


class CPUKernelsBuild(build_ext):
    """MLX's CMake build for the extension, which may be optional (see ``DUET_CPU_KERNELS_BUILD``)."""

    def build_extension(self, ext: Extension) -> None:
        try:
            from mlx.extension import CMakeBuild

            CMakeBuild.build_extension(self, ext)  # type: ignore[arg-type]
        except (ImportError, OSError, subprocess.CalledProcessError) as e:
            if MODE == "require":
                raise
            print(
                f"warning: cpu_kernels._ext was not built ({e}); this wheel has no CPU kernels and Duet "
                "will use its dequantized CPU path",
                file=sys.stderr,
            )


def extensions() -> list[Extension]:
    if MODE == "0" or not SOURCES.is_dir():
        return []
    ext = Extension("cpu_kernels._ext", sources=[])
    ext.sourcedir = str(SOURCES)  # type: ignore[attr-defined]  # what CMakeBuild reads
    return [ext]


setup(ext_modules=extensions(), cmdclass={"build_ext": CPUKernelsBuild})
