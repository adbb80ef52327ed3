"""Converted GGUF weights, cached on disk: a later start reads them instead of decoding the GGUF again.

A GGUF's quantized blocks are not MLX's layout, so every load decodes them (NumPy, seconds for the
bundled model on a busy CPU) before anything runs; the result only depends on the file, on the
variant asked for (dense or quantized) and on the decoding code. ``load_or_build`` keeps it as one
safetensors file named by a hash of the three: the model's identity
(``identity.model_fingerprint``, a hash of the file's bytes, so a changed model never reads a stale
entry), the variant, and the loader's own source code and MLX's version (a fixed decoder never
serves what the old one made). Reading it back is a plain file read (~0.2 s for the bundled
model's 109 MiB).

Only files of at least ``MIN_FILE_BYTES`` are cached (small ones decode faster than a file is
written). The cache lives in ``$DUET_DATA_DIR/converted-weights`` when that is set, else in the
user cache directory (``~/.cache/duet/converted-weights`` on Linux); it holds at most
``$DUET_WEIGHT_CACHE_GB`` GiB (default 8: a Llama-3.1-8B Q4_K_M's converted weights, ~5.6 GB, fit),
least recently used entries removed first (an entry as large as the whole cap is kept, alone; a
larger one is not stored), and
``DUET_WEIGHT_CACHE=0`` turns it off. Writing is best effort: a full disk or a read-only directory
only means the next start decodes again. An entry that is not whole (its header against its size) is
deleted and rebuilt. A hit is returned unevaluated: each array is read when first used.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import xxhash
from safetensors import SafetensorError, safe_open

from mlx_engine.loading.identity import model_fingerprint, package_version

log = logging.getLogger("duet.loading")

MIN_FILE_BYTES = 16 << 20
DEFAULT_CAP_GB = 8.0
# the code whose output is cached: a change to any of these files is a new cache key
_SOURCES = ("gguf_loader.py", "gguf_tensors.py", "ggml_blocks.py", "gguf_file.py", "weight_cache.py")

Weights = dict[str, mx.array]


def enabled() -> bool:
    return os.environ.get("DUET_WEIGHT_CACHE", "1") != "0"


def cache_dir() -> Path:
    base = os.environ.get("DUET_DATA_DIR")
    if base:
        return Path(base) / "converted-weights"
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("duet", appauthor=False)) / "converted-weights"


def cap_bytes() -> int:
    try:
        gb = float(os.environ.get("DUET_WEIGHT_CACHE_GB", DEFAULT_CAP_GB))
    except ValueError:
        gb = DEFAULT_CAP_GB
    return int(max(gb, 0.0) * 2**30)


def code_version() -> str:
    h = xxhash.xxh3_64()
    here = Path(__file__).parent
    for name in _SOURCES:
        f = here / name
        h.update(name.encode() + b"\0" + (f.read_bytes() if f.is_file() else b"-") + b"\0")
    h.update(package_version("mlx").encode())
    return h.hexdigest()


def entry_path(model: Path, variant: str) -> Path:
    key = xxhash.xxh3_128(f"{model_fingerprint(model)}|{variant}|{code_version()}".encode()).hexdigest()
    return cache_dir() / f"{key}.safetensors"


def load_or_build(model: str | os.PathLike, variant: str, build: Callable[[], Weights]) -> Weights:
    """``build()``'s weights for ``model`` (a GGUF file) and ``variant``, from the cache when an
    entry exists (evaluated, so a damaged file is found here), else built and stored."""
    model = Path(model)
    if not enabled() or model.stat().st_size < MIN_FILE_BYTES:
        return build()
    entry = entry_path(model, variant)
    if entry.is_file():
        try:
            _check_whole(entry)
            # not evaluated: each array is read from the file when first used, so a loader that
            # converts the model layer by layer (loader.py, the CPU's scales) never holds all of the
            # unconverted arrays at once (a 1B Q8_0 model's load peaked 330 MB above its final size)
            weights = mx.load(str(entry))
            assert isinstance(weights, dict)
            os.utime(entry)  # most recently used
            return weights
        except (RuntimeError, ValueError, OSError, AssertionError, SafetensorError) as e:
            log.warning("converted-weights cache entry %s is damaged (%s); converting again", entry.name, e)
            entry.unlink(missing_ok=True)
    weights = build()
    _store(entry, weights)
    return weights


def _check_whole(entry: Path) -> None:
    """Raise ``SafetensorError`` unless ``entry`` is a whole safetensors file: the ``safetensors``
    library reads its header and checks that the tensors' data covers the file exactly (a torn write,
    a truncated copy), without reading the data."""
    with safe_open(str(entry), "numpy"):
        pass


def _store(entry: Path, weights: Weights) -> None:
    size = sum(a.nbytes for a in weights.values())
    cap = cap_bytes()
    if size > cap:
        return  # larger than the whole cache: not kept
    # (Entries were once kept only up to half the cap, so that none crowded out the others: a 3B
    # model's 2.1 GB then never stayed under the 4 GiB cap, and every start re-converted it, 14 s.)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        _trim(entry.parent, cap - size)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, suffix=".tmp.safetensors")
        os.close(fd)
        try:
            mx.save_safetensors(tmp, weights)
            os.replace(tmp, entry)  # whole or absent: a concurrent reader never sees half a file
        finally:
            Path(tmp).unlink(missing_ok=True)
    except (OSError, RuntimeError, ValueError) as e:
        log.info("converted weights not cached (%s)", e)


def _trim(directory: Path, room: int) -> None:
    """Delete least recently used entries until the rest fit in ``room`` bytes."""
    entries = sorted(directory.glob("*.safetensors"), key=lambda f: f.stat().st_mtime)
    total = sum(f.stat().st_size for f in entries)
    for f in entries:
        if total <= room:
            break
        total -= f.stat().st_size
        f.unlink(missing_ok=True)
