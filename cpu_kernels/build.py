"""Build the C++ extension ``cpu_kernels._ext`` from ``src/`` with CMake, in place.

    python -m cpu_kernels.build [--force] [--jobs N]

``make setup`` (hence ``make chat`` and ``make test``) runs this. It is a no-op when the stamp
``cpu_kernels/_ext.stamp`` matches: the installed mlx version (the extension links against
libmlx and must be rebuilt for every mlx release) and a digest of the sources. Needs a C++20
compiler, CMake >= 3.24 (the dev extra's ``cmake`` wheel, else the system's), ``nanobind`` (pinned
in the dev extra) and the Python headers. Build files go to ``build/cpu_kernels/``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
SOURCES = PACKAGE / "src"
STAMP = PACKAGE / "_ext.stamp"
BUILD_DIR = PACKAGE.parent / "build" / "cpu_kernels"


def stamp_text() -> str:
    digest = hashlib.sha256()
    for path in sorted(SOURCES.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for dist in ("nanobind",):
        try:
            digest.update(metadata.version(dist).encode())
        except metadata.PackageNotFoundError:
            pass
    return f"{metadata.version('mlx')} {digest.hexdigest()[:16]}\n"


def built_modules() -> list[Path]:
    return sorted(PACKAGE.glob("_ext.*.so")) + sorted(PACKAGE.glob("_ext.*.pyd"))


def up_to_date() -> bool:
    return bool(built_modules()) and STAMP.exists() and STAMP.read_text() == stamp_text()


def find_cmake() -> str | None:
    beside = Path(sys.executable).parent / "cmake"
    if beside.exists():
        return str(beside)
    return shutil.which("cmake")


def build(jobs: int) -> None:
    cmake = find_cmake()
    if cmake is None:
        raise RuntimeError("no cmake found (pip install cmake, or the system package)")
    for old in built_modules():
        old.unlink()
    STAMP.unlink(missing_ok=True)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    configure = [
        cmake,
        "-S",
        str(SOURCES),
        "-B",
        str(BUILD_DIR),
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DPython_EXECUTABLE={sys.executable}",
        f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={PACKAGE}",
    ]
    for cmd in (configure, [cmake, "--build", str(BUILD_DIR), "-j", str(jobs)]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
            raise RuntimeError(f"{' '.join(cmd[:2])} failed:\n{tail}")
    if not built_modules():
        raise RuntimeError(f"the build finished but left no _ext module in {PACKAGE}")
    STAMP.write_text(stamp_text())


def main() -> int:
    ap = argparse.ArgumentParser(description="Build Duet's CPU kernels (cpu_kernels._ext).")
    ap.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    if not args.force and up_to_date():
        print("cpu_kernels: up to date")
        return 0
    print("cpu_kernels: building the C++ extension (about a minute)...", flush=True)
    try:
        build(args.jobs)
    except (RuntimeError, OSError) as e:
        print(
            f"cpu_kernels: build failed, Duet will use the slower dequantized CPU path: {e}", file=sys.stderr
        )
        return 1
    print(f"cpu_kernels: built {built_modules()[0].name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
