"""Compile translated kernels into shared libraries, cached on disk by content hash.

The cache lives in ``$DUET_METAL_EMU_CACHE`` when set (the test suite points it at its tmp dir),
else in the user cache directory (``~/.cache/duet/metal_emu`` on Linux).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from functools import cache
from pathlib import Path

import platformdirs

SHIM_DIR = Path(__file__).resolve().parent
SHIM_HEADERS = ("msl_shim.h", "msl_stdlib.h", "msl_types.h", "msl_runtime.h")
CXX_FLAGS = (
    "-std=c++17",
    "-O1",
    "-fPIC",
    "-fvisibility=hidden",
    "-fno-exceptions",
    "-fno-strict-aliasing",
    "-ffp-contract=off",
    "-U_FORTIFY_SOURCE",
    "-w",
)


class EmulatorCompileError(RuntimeError):
    """The C++ compiler rejected a translated kernel (message includes the compiler output)."""


def cache_dir() -> Path:
    env = os.environ.get("DUET_METAL_EMU_CACHE")
    path = Path(env) if env else Path(platformdirs.user_cache_dir("duet")) / "metal_emu"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:  # read-only home (some CI sandboxes)
        path = Path(tempfile.gettempdir()) / "duet_metal_emu"
        path.mkdir(parents=True, exist_ok=True)
    return path


@cache
def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise EmulatorCompileError("no C++ compiler found (set CXX or install g++)")
    return cxx


@cache
def _toolchain_key() -> str:
    out = subprocess.run([compiler(), "--version"], capture_output=True, text=True, check=False).stdout
    h = hashlib.sha256(out.encode())
    for name in SHIM_HEADERS:
        h.update((SHIM_DIR / name).read_bytes())
    h.update(" ".join(CXX_FLAGS).encode())
    return h.hexdigest()


@cache
def _pch_dir() -> Path | None:
    """Directory holding a precompiled ``msl_shim.h`` (saves most of the per-kernel parse time)."""
    directory = cache_dir() / f"pch_{_toolchain_key()[:24]}"
    gch = directory / "msl_shim.h.gch"
    if gch.exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".gch", dir=directory)
    os.close(fd)
    cmd = [compiler(), *CXX_FLAGS, "-x", "c++-header", str(SHIM_DIR / "msl_shim.h"), "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        Path(tmp).unlink(missing_ok=True)
        return None  # compilers without PCH support still work, just slower
    os.replace(tmp, gch)
    return directory


_libs: dict[str, ctypes.CDLL] = {}
_libs_lock = threading.Lock()
_build_locks: dict[str, threading.Lock] = {}


def load_library(cpp_source: str) -> tuple[ctypes.CDLL, Path]:
    """Compile (or reuse) the library for ``cpp_source``; returns it and its source path."""
    key = hashlib.sha256((_toolchain_key() + cpp_source).encode()).hexdigest()[:32]
    directory = cache_dir()
    so_path = directory / f"k_{key}.so"
    src_path = directory / f"k_{key}.cpp"
    with _libs_lock:
        lib = _libs.get(key)
        if lib is not None:
            return lib, src_path
        lock = _build_locks.setdefault(key, threading.Lock())
    with lock:
        with _libs_lock:
            if key in _libs:
                return _libs[key], src_path
        if not so_path.exists():
            _compile(cpp_source, src_path, so_path)
        lib = ctypes.CDLL(str(so_path))
        lib.emu_run.restype = ctypes.c_int
        lib.emu_run.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_void_p,
            ctypes.c_char_p,
            ctypes.c_int,
        ]
        with _libs_lock:
            _libs[key] = lib
    return lib, src_path


def _compile(cpp_source: str, src_path: Path, so_path: Path) -> None:
    directory = src_path.parent
    fd, tmp_src = tempfile.mkstemp(suffix=".cpp", dir=directory)
    with os.fdopen(fd, "w") as f:
        f.write(cpp_source)
    tmp_so = tmp_src[:-4] + ".so"
    pch = _pch_dir()
    includes = ([f"-I{pch}"] if pch else []) + [f"-I{SHIM_DIR}"]
    cmd = [compiler(), *CXX_FLAGS, "-shared", *includes, tmp_src, "-o", tmp_so]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        os.replace(tmp_src, src_path)
        raise EmulatorCompileError(
            f"compiling the translated kernel failed ({src_path}):\n{proc.stderr[-6000:]}"
        )
    os.replace(tmp_src, src_path)
    os.replace(tmp_so, so_path)
