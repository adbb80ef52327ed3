"""Disk tier of the prefix cache (off by default).

Blocks evicted from memory, and everything still cached at shutdown, are written to
``<dir>/<model fingerprint>/<sha256 of the token prefix through the block>.safetensors``;
a later request (in this process or after a restart) whose prompt continues a prefix found
on disk loads those blocks back instead of recomputing them. The directory is kept under a
size cap by deleting the least recently used files.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import mlx.core as mx

from .prefix_index import prefix_hash


class PrefixDiskTier:
    def __init__(self, root: str | os.PathLike, fingerprint: dict, max_bytes: int):
        key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
        self.dir = Path(root) / key
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "model.json").write_text(json.dumps(fingerprint, indent=1, sort_keys=True))
        self.max_bytes = max_bytes
        self.saved = 0
        self.loaded = 0

    def _path(self, tokens: list[int]) -> Path:
        return self.dir / f"{prefix_hash(tokens)}.safetensors"

    def has(self, tokens: list[int]) -> bool:
        return self._path(tokens).exists()

    def save(self, tokens: list[int], arrays: list[mx.array]) -> None:
        path = self._path(tokens)
        if path.exists():
            os.utime(path)
            return
        mx.eval(arrays)
        tmp = path.with_name(path.stem + ".tmp.safetensors")
        mx.save_safetensors(str(tmp), {str(i): a for i, a in enumerate(arrays)})
        tmp.replace(path)  # atomic: a crash never leaves a half-written block behind
        self.saved += 1
        self._trim()

    def load(self, tokens: list[int]) -> list[mx.array] | None:
        path = self._path(tokens)
        try:
            data = mx.load(str(path))
            assert isinstance(data, dict)  # a .safetensors file always loads as {name: array}
            os.utime(path)
        except (OSError, ValueError, RuntimeError):
            path.unlink(missing_ok=True)  # unreadable or corrupt: drop it, recompute instead
            return None
        self.loaded += 1
        return [data[str(i)] for i in range(len(data))]

    def _trim(self) -> None:
        files = [(p.stat().st_mtime, p.stat().st_size, p) for p in self.dir.glob("*.safetensors")]
        total = sum(s for _, s, _ in files)
        for _, size, p in sorted(files):
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size
