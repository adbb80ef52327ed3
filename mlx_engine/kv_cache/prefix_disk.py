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

What comes back from disk becomes the model's context, so the tier trusts only what it wrote:

- **Its directories**: ``disk_cache_dir`` (created 0700 when missing) must belong to this user and
  be writable by nobody else, or the engine refuses to start (``ConfigError``: the user asked for a
  cache there, and a cache that silently turned itself off would only show as slower prompts); the
  fingerprint directory inside it is 0700, and every file in it is created 0600
  (``mlx_engine.private_files``): the KV of a prompt tells much of what the prompt said.
- **Its files**: each block file carries, in its safetensors metadata, an HMAC-SHA256 of the prefix's
  tokens and of every tensor (its dtype, shape and bytes), keyed by a random secret kept 0600 in the
  fingerprint directory (``key``). A file whose MAC does not verify (planted, corrupted, renamed to
  another prefix, written before files were signed) is a miss: logged once, removed if it is this
  user's, and its blocks are recomputed. The MAC costs ~0.75 ms per MiB of block, on loading and
  on saving (1.3 GiB/s on one x86 core with SHA extensions): a 16-token block of an 8B model with
  fp16 KV (2 MiB) loads in ~3 ms instead of ~1.3 ms from the page cache, still far below computing
  those 16 tokens again.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import struct
import time
from pathlib import Path

import mlx.core as mx

from mlx_engine.errors import ConfigError
from mlx_engine.kv_cache.kv_source import KVLoad, KVSink, KVSource
from mlx_engine.kv_cache.prefix_index import prefix_hash
from mlx_engine.private_files import private_dir, private_file, unsafe_dir_reason, write_private

log = logging.getLogger("mlx_engine.engine")

KEY_FILE = "key"  # the secret the tier's files are signed with (0600, in the fingerprint directory)
KEY_BYTES = 32
MAC_META = "duet_mac"  # the safetensors metadata entry holding a block file's MAC (hex)
_MAC_DOMAIN = b"duet prefix-disk block v1\0"


def _secret(directory: Path) -> bytes:
    """The tier's signing key: read, or made (``O_CREAT | O_EXCL``, 0600) by the first process to
    use ``directory``; one that finds it half-written waits for the rest, and a key file that is
    malformed for good is replaced (every file signed with it becomes a miss)."""
    path = directory / KEY_FILE
    for _ in range(100):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            key = path.read_bytes()
            if len(key) == KEY_BYTES:
                return key
            time.sleep(0.01)  # another process is writing it
            continue
        key = secrets.token_bytes(KEY_BYTES)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        return key
    log.warning("prefix disk cache: %s is malformed; a new key replaces it", path)
    key = secrets.token_bytes(KEY_BYTES)
    write_private(path, key)
    return key


def _bytes(a: mx.array) -> memoryview | bytes:
    view = memoryview(a)  # type: ignore[arg-type]  # mx.array is a buffer; its stubs omit it
    return view if view.c_contiguous else view.tobytes()


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
        top = Path(root)
        top.mkdir(parents=True, exist_ok=True, mode=0o700)  # an existing one is the user's choice: kept
        self._check_dir(top)
        self.dir = private_dir(top / key)
        self._check_dir(self.dir)
        write_private(self.dir / "model.json", json.dumps(fingerprint, indent=1, sort_keys=True))
        self._key = _secret(self.dir)
        self.max_bytes = max_bytes
        self.block_size, self.num_layers = block_size, num_layers
        self.saved = 0
        self.loaded = 0
        self.rejected = 0  # files that failed their check (unreadable, or a MAC that does not verify)
        self._reported: set[str] = set()  # files already logged as rejected

    @staticmethod
    def _check_dir(d: Path) -> None:
        why = unsafe_dir_reason(d)
        if why is not None:
            raise ConfigError(
                f"disk_cache_dir: {d} is not safe for the prefix cache's disk tier: {why}, so its "
                "files could be someone else's; use a directory of your own that only you can write "
                "to (`chmod go-w` it, or name a new one: it is created 0700)",
                "disk_cache_dir",
            )

    def _mac(self, tokens: list[int], arrays: list[mx.array]) -> str:
        """HMAC-SHA256 of the prefix's tokens and of every array's dtype, shape and bytes."""
        h = hmac.new(self._key, _MAC_DOMAIN, "sha256")
        h.update(struct.pack(f"<Q{len(tokens)}I", len(tokens), *tokens))
        h.update(struct.pack("<Q", len(arrays)))
        for a in arrays:
            h.update(f"{a.dtype}{tuple(a.shape)}".encode())
            h.update(struct.pack("<Q", a.nbytes))
            h.update(_bytes(a))
        return h.hexdigest()

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
        meta = {MAC_META: self._mac(tokens, arrays)}
        # created 0600, then renamed into place: a crash never leaves a half-written block behind
        with private_file(path, suffix=".tmp.safetensors") as tmp:
            mx.save_safetensors(str(tmp), {str(i): a for i, a in enumerate(arrays)}, metadata=meta)
        self.saved += 1
        self._trim()

    def load(self, tokens: list[int]) -> list[mx.array] | None:
        """The block's arrays, or None (a miss) when the file is missing, unreadable or its MAC
        does not verify; such a file is removed (when it is this user's) and logged once."""
        path = self._path(tokens)
        try:
            data, meta = mx.load(str(path), return_metadata=True)
            # a .safetensors file always loads as ({name: array}, {name: text})
            assert isinstance(data, dict) and isinstance(meta, dict)
            arrays = [data[str(i)] for i in range(len(data))]
            mx.eval(arrays)  # one read of the file (an array at a time would read it piecemeal)
            signed = hmac.compare_digest(meta.get(MAC_META, "").encode(), self._mac(tokens, arrays).encode())
            why = None if signed else "not signed by this cache"
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            if not path.exists():
                return None  # gone (trimmed, or by another process): a plain miss
            why = f"unreadable ({e})"
        if why is not None:
            self._reject(path, why)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)
        self.loaded += 1
        return arrays

    def _reject(self, path: Path, why: str) -> None:
        """A block file that failed its check: dropped (recomputed instead), logged once."""
        self.rejected += 1
        if path.name not in self._reported:
            self._reported.add(path.name)
            log.warning("prefix disk cache: %s is %s: ignored, its blocks are recomputed", path, why)
        with contextlib.suppress(OSError):
            if not hasattr(os, "geteuid") or path.stat().st_uid == os.geteuid():
                path.unlink()  # ours: drop it (one of someone else's is left, and ignored)

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
