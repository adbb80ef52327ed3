"""The C heap under the Python one: handing memory that malloc holds free back to the system.

Tokenizing a very long text makes many small allocations at once (the Rust tokenizer keeps a
string, offsets and alignments per token), all freed when the ids are out: a 2 MB prompt (312K
tokens with SmolLM2's tokenizer) took ~280 MB at its peak, and ~180 MB of it stayed resident,
free, afterwards. glibc keeps what is freed inside its heaps (the main arena and one per thread
that allocates, up to 8 per core) and returns only the top of a heap, which anything still in use
above the hole pins. In a server, where the worker threads tokenize in their own arenas while
other requests keep allocating around them, a later long prompt did not always reuse those holes
(it lands in another arena, or a hole was split meanwhile), and the resident size climbed in steps
of ~100-150 MB through a whole run (bench/soak.py at 64 clients: +17% in 10 minutes, ~1.3 GB to
~1.6 GB). It was not live memory: glibc's ``mallinfo2`` showed the bytes in use flat (~450 MB) and
the free ones growing (~400 MB to ~620 MB in 3 minutes), MLX's memory flat, and no more Python
objects; with ``MALLOC_ARENA_MAX=2`` the growth stopped but the free ~600 MB stayed resident.

``release_free`` is glibc's ``malloc_trim(0)``: every arena's free pages are given back
(``madvise``), whatever is in use around them (ctypes lets the GIL go meanwhile). The engine's
input stage calls it after tokenizing a prompt of ``RELEASE_AFTER_TOKENS`` or more, refused or not
(``InputProcessor.prompt_ids``): rare, and such a prompt takes far longer to prefill (or to refuse)
than the trim (20-40 ms after the 2 MB one). With it the soak's server stays at ~700 MB (-0.7% in 3
minutes at 64 clients) instead of climbing from ~1000 MB. Elsewhere than glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

RELEASE_AFTER_TOKENS = 1 << 16  # ~20 MB of the tokenizer's transient allocations


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free() -> bool:
    """Give the free memory in malloc's heaps back to the system (glibc's ``malloc_trim(0)``);
    whether any was (False where there is no ``malloc_trim``). Thread-safe."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
