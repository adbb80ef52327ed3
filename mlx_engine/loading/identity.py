"""One model identity and one numerics profile, for everything that must know whether two KV caches agree.

- ``model_fingerprint(path)``: ``xxh3-128:<hex>`` over the model's weight files (names, sizes, bytes). Two
  processes serve the same model exactly when it matches. Remembered per process and across processes
  (``fingerprints.json`` beside the converted weights, 0600) by each file's path, size, inode and its
  modification and change times, as git's index tells a changed file: hashing a 3B model's 1.9 GB took
  0.43 s of every start; a file rewritten in place, even with its old size and mtime put back, has a new
  change time (``st_ctime``, which no user can set) and is hashed again.
- ``numerics_profile(...)``: what decides whether KV computed in one place is bit-identical to KV computed
  in another for the same model: backend, mlx and mlx-lm versions, weight format, activation dtype, KV
  format and the prefill chunk grid.

The prefix cache's disk tier keys its files by both (a stale or foreign cache is never read), the server's
``system_fingerprint`` is derived from both, and a prefill peer must match the identity while the profile
decides whether its result is exact (``peer/identity.py`` builds the HELLO from these).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from importlib import metadata
from pathlib import Path
from typing import Any

import xxhash

from mlx_engine.private_files import private_dir, unsafe_dir_reason, write_private

READ_BYTES = 16 << 20
STORE_ENTRIES = 256  # fingerprints remembered across processes, the oldest forgotten first
_memo: dict[tuple[str, ...], str] = {}
_memo_lock = threading.Lock()


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The files that make a model's identity: a GGUF file itself; in a directory the
    safetensors shards and config.json (the architecture), in name order."""
    p = Path(path)
    if p.is_file():
        return [p]
    files = sorted(p.glob("*.safetensors")) + sorted(p.glob("*.gguf"))
    if (p / "config.json").is_file():
        files.append(p / "config.json")
    if not files:
        raise FileNotFoundError(f"no weight files in {p}")
    return files


def _store_path() -> Path:
    """Where fingerprints are remembered across processes: beside the converted weights' cache."""
    from mlx_engine.loading.weight_cache import cache_dir  # it imports this module

    return cache_dir().parent / "fingerprints.json"


def _read_store(store: Path) -> dict[str, str]:
    """The remembered fingerprints; none from a file that is missing, unreadable, not ours to trust
    (``unsafe_dir_reason``) or not what this module writes."""
    try:
        if unsafe_dir_reason(store.parent) is not None:
            return {}
        data = json.loads(store.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        k: v
        for k, v in data.items()
        if isinstance(k, str) and isinstance(v, str) and v.startswith("xxh3-128:")
    }


def _remember(store: Path, key: str, digest: str) -> None:
    """Add one fingerprint to the store (best effort: a read-only or full disk only means hashing
    again next time)."""
    with _memo_lock:  # one writer at a time in this process; another process's write may win, harmless
        known = _read_store(store)
        known.pop(key, None)
        known[key] = digest
        kept = dict(list(known.items())[-STORE_ENTRIES:])
        try:
            private_dir(store.parent)
            write_private(store, json.dumps(kept))
        except OSError:
            pass


def model_fingerprint(path: str | os.PathLike) -> str:
    """``xxh3-128:<hex>`` over the model's weight files (names, sizes and bytes). Remembered per
    process, and across processes in a 0600 file, by each file's resolved path, size, device and
    inode, and modification and change times (module docstring), so a second engine on the same
    files, or the next start, pays nothing."""
    files = weight_files(path)
    stats = [f.stat() for f in files]
    key = tuple(
        f"{f.resolve()}:{s.st_size}:{s.st_dev}:{s.st_ino}:{s.st_mtime_ns}:{s.st_ctime_ns}"
        for f, s in zip(files, stats, strict=True)
    )
    with _memo_lock:
        if key in _memo:
            return _memo[key]
    store = _store_path()
    stored = _read_store(store).get("|".join(key))
    if stored is not None:
        with _memo_lock:
            _memo[key] = stored
        return stored
    h = xxhash.xxh3_128()
    buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    for f, s in zip(files, stats, strict=True):
        h.update(f"{f.name}\0{s.st_size}\0".encode())
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                h.update(view[:n])
    digest = f"xxh3-128:{h.hexdigest()}"
    with _memo_lock:
        _memo[key] = digest
    _remember(store, "|".join(key), digest)
    return digest


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


def numerics_profile(
    *,
    backend: str,
    weight_format: str,
    dtype: str,
    kv_dtype: str,
    kv_bits: int | None,
    kv_group_size: int,
    prefill_chunk: int,
    cpu_math: str | None = None,
) -> dict[str, Any]:
    """What must be equal on two sides for their KV of the same model and tokens to be bit-identical."""
    return {
        "cpu_math": cpu_math,
        "backend": backend,
        "mlx": package_version("mlx"),
        "mlx_lm": package_version("mlx-lm"),
        "weights": weight_format,
        "dtype": dtype,
        "kv_dtype": kv_dtype,
        "kv_bits": kv_bits,
        "kv_group_size": kv_group_size if kv_bits else None,
        "prefill_chunk": prefill_chunk,
    }


def short_hash(*parts: Any) -> str:
    """A short, stable hex digest of JSON-able parts (for keys and ``system_fingerprint``)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
