"""Back a loaded model's weights with 2 MiB pages (Linux transparent huge pages), for the CPU's decode.

A decode step on the CPU streams every weight from memory once, so the memory bus sets its speed. With
4 KiB pages a 1 GB model is a quarter of a million pages: a TLB miss and a page walk every 4 KiB of the
stream, which the kernels' loads wait on. The same weights on 2 MiB pages miss 512 times less. Measured
on this project's 2-core Zen 4 VM (``bench/qmatmul.py --gbps --huge-pages``, Llama-3.2-1B's
matrices, every call on a cold copy): the quantized products read 4-12% more bytes per second.

MLX allocates its buffers with ``malloc``, which takes large ones from anonymous ``mmap`` regions: where
the kernel's THP mode is ``madvise`` (the default of most distributions) such a region gets huge pages
only when asked. After a model is loaded, :func:`use_huge_pages` marks its weights with
``madvise(MADV_HUGEPAGE)`` (the ``khugepaged`` daemon then moves them in the background) and moves them
at once with ``MADV_COLLAPSE`` where the kernel has it (Linux 6.1+; in the calling thread, ~0.1 s a
GB).
Only the 2 MiB-aligned middle of each buffer is advised, so no page outside a weight changes and the
resident size grows by nothing. When a server unloads a model, :func:`release_huge_pages` takes the
mark off again (MLX mallocs most buffers from glibc's heap, whose ranges later small allocations
reuse). ``DUET_HUGE_PAGES=0`` turns it off (for a comparison). Elsewhere (macOS, where unified memory is not paged this way; THP
``never``) it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_NOHUGEPAGE = 15
_MADV_COLLAPSE = 25  # Linux 6.1
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``), or None where
    there is none (not Linux, or THP not built in)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return None
    chosen = [w for w in text.split() if w.startswith("[")]
    return chosen[0].strip("[]") if chosen else None


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _spans(arrays: Iterable[mx.array]) -> Iterator[tuple[int, int]]:
    """The 2 MiB-aligned (start, length) inside each array's buffer that holds a whole huge page; a
    smaller array, or a strided view (whose bytes are not one span), has none."""
    for a in arrays:
        if a.nbytes < HUGE_PAGE:
            continue
        view = np.asarray(memoryview(a))  # type: ignore[arg-type]  # mx.array has the buffer protocol: its own bytes, no copy
        if not (view.flags["C_CONTIGUOUS"] or view.flags["F_CONTIGUOUS"]):
            continue
        address = view.ctypes.data
        start = -(-address // HUGE_PAGE) * HUGE_PAGE
        end = (address + a.nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            yield start, end - start


def use_huge_pages(arrays: Iterable[mx.array]) -> int:
    """Ask the kernel to back the (evaluated) ``arrays`` with huge pages; returns the
    bytes advised (0 where THP is unavailable or ``never``). Never fails: a refusal (no contiguous
    memory free for a collapse, say) leaves those pages as they were."""
    mode = thp_mode()
    if mode not in ("always", "madvise") or os.environ.get("DUET_HUGE_PAGES") == "0":
        return 0
    madvise = _madvise()
    if madvise is None:
        return 0
    collapse = True
    advised = 0
    for span in _spans(arrays):
        # marked for huge pages (khugepaged moves them in the background), then moved now where the
        # kernel can (Linux 6.1+)
        madvise(span[0], span[1], _MADV_HUGEPAGE)
        if collapse and madvise(span[0], span[1], _MADV_COLLAPSE) != 0:
            # EINVAL: a kernel before 6.1, left to khugepaged from here on; EAGAIN / ENOMEM: no free
            # contiguous memory just now, likewise for this buffer
            collapse = ctypes.get_errno() != 22
        advised += span[1]
    log.debug("huge pages asked for %.0f MB of weights", advised / 1e6)
    return advised


def release_huge_pages(arrays: Iterable[mx.array]) -> int:
    """Undo :func:`use_huge_pages`'s mark on ``arrays`` (a model being unloaded), so the heap ranges
    their buffers leave behind take 4 KiB pages again when small allocations reuse them (where THP is
    ``madvise``; under ``always`` huge pages are the default anyway); returns the bytes released."""
    if thp_mode() != "madvise":
        return 0
    madvise = _madvise()
    if madvise is None:
        return 0
    released = 0
    for start, length in _spans(arrays):
        if madvise(start, length, _MADV_NOHUGEPAGE) == 0:
            released += length
    return released
