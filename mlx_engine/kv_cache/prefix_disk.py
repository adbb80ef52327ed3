"""Disk tier of the prefix cache (off by default).

Blocks evicted from memory, and everything still cached at shutdown, are written to
``<dir>/<model fingerprint>/<sha256 of the token prefix through the block>.safetensors``;
a later request (in this process or after a restart) whose prompt continues a prefix found
on disk loads those blocks back instead of recomputing them. The directory is kept under a
size cap by deleting the least recently used files.

The tier is a ``kv_source.KVSource`` (``is_cache``: what it loads counts as prefix-cache hits):
``match`` says how many whole blocks after a prefix hit are on disk, ``start_load`` reads them and
delivers each layer's KV for the range through the engine's sink at once (the worker applies it
at the top of its next iteration); a file that turns out unreadable ends the load there, keeping
the blocks before it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import mlx.core as mx

from mlx_engine.kv_cache.kv_source import KVLoad, KVSink, KVSource
from mlx_engine.kv_cache.prefix_index import prefix_hash


class PrefixDiskTier(KVSource):
    name = "disk"
    is_cache = True

    def __init__(
        self,
        root: str | os.PathLike,
        fingerprint: dict,
        max_bytes: int,
        block_size: int = 16,
        num_layers: int = 1,
    ):
        key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
        self.dir = Path(root) / key
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "model.json").write_text(json.dumps(fingerprint, indent=1, sort_keys=True))
        self.max_bytes = max_bytes
        self.block_size, self.num_layers = block_size, num_layers
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

    # --- KVSource ---------------------------------------------------------------
    def match(self, tokens: list[int], start: int, end: int) -> int:
        """Tokens from ``start`` (a block boundary) up to ``end`` whose whole blocks are on disk."""
        bs = self.block_size
        if start % bs:
            return 0
        k = start // bs
        while (k + 1) * bs <= end and self.has(tokens[: (k + 1) * bs]):
            k += 1
        return k * bs - start

    def _layer_parts(self, arrays: list[mx.array], layer: int) -> list[mx.array]:
        """One layer's parts of a block file (``KVPool.read_block`` order: every layer's K, then
        every layer's V, each one array or an affine triplet)."""
        per = len(arrays) // (2 * self.num_layers)  # arrays per K (or V) of one layer
        k = arrays[layer * per : (layer + 1) * per]
        v = arrays[(self.num_layers + layer) * per : (self.num_layers + layer + 1) * per]
        return k + v

    def start_load(self, load: KVLoad, sink: KVSink) -> None:
        """Read the blocks of ``[load.start, load.end)`` and deliver them, layer by layer."""
        bs = self.block_size
        blocks: list[list[mx.array]] = []
        for k in range(load.start // bs, load.end // bs):
            arrays = self.load(load.tokens[: (k + 1) * bs])
            if arrays is None or len(arrays) % (2 * self.num_layers):
                break
            blocks.append(arrays)
        t1 = load.start + len(blocks) * bs
        if blocks:
            for layer in range(self.num_layers):
                parts = [self._layer_parts(b, layer) for b in blocks]
                sink.layer(
                    load.load_id,
                    layer,
                    load.start,
                    t1,
                    [mx.concatenate(list(p)) for p in zip(*parts, strict=True)],
                )
        if t1 < load.end:
            sink.failed(load.load_id, f"block at token {t1} is no longer readable on disk")
        else:
            sink.done(load.load_id)

    def cancel(self, load_id: int) -> None:
        pass  # every frame was delivered before start_load returned

    def _trim(self) -> None:
        files = [(p.stat().st_mtime, p.stat().st_size, p) for p in self.dir.glob("*.safetensors")]
        total = sum(s for _, s, _ in files)
        for _, size, p in sorted(files):
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size
