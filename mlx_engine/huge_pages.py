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
at once with ``MADV_COLLAPSE`` where the kernel has it (Linux 6.1+): in the calling thread (the
loader's default), or on a thread of its own while the caller goes on (the engine's: ~3.6 s of CPU a
GB on the Zen 4 VM, which would otherwise stand between a cold start and its first token).
Only the 2 MiB-aligned middle of each buffer is advised, so no page outside a weight changes and the
resident size grows by nothing. When a server unloads a model, :func:`release_huge_pages` takes the
mark off again (MLX mallocs most buffers from glibc's heap, whose ranges later small allocations
reuse), once any collapse still moving them has finished. ``DUET_HUGE_PAGES=0`` turns it off (for a comparison). Elsewhere (macOS, where unified memory is not paged this way; THP
``never``) it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
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


# collapses running on their own threads (use_huge_pages(background=True)), each with the arrays it
# moves; release_huge_pages waits for them
_collapses: list[threading.Thread] = []
_collapses_lock = threading.Lock()


def _collapse(madvise: ctypes._CFuncPtr, spans: list[tuple[int, int]]) -> None:  # type: ignore[name-defined]
    """Move each span onto huge pages now, where the kernel can (MADV_COLLAPSE, Linux 6.1+)."""
    for start, length in spans:
        if madvise(start, length, _MADV_COLLAPSE) != 0 and ctypes.get_errno() == 22:
            # EINVAL: a kernel before 6.1, the rest left to khugepaged; EAGAIN / ENOMEM (no free
            # contiguous memory just now): this span likewise, the next ones tried
            return


def use_huge_pages(arrays: Iterable[mx.array], *, background: bool = False) -> int:
    """Ask the kernel to back the (evaluated) ``arrays`` with huge pages; returns the
    bytes advised (0 where THP is unavailable or ``never``). Never fails: a refusal (no contiguous
    memory free for a collapse, say) leaves those pages as they were.

    The mark is set at once; moving the pages (a copy of every 4 KiB page into a 2 MiB one, by the
    kernel: ~3.6 s a GB measured on the Zen 4 VM, where a 3B model took 1.8 s of a 7.3 s cold start
    before its first token) happens in the call, or with ``background`` on a thread of its own,
    while the caller goes on (the kernel keeps the bytes in place and readable throughout; ctypes
    lets go of the GIL during the call). That thread keeps ``arrays`` alive until it is done."""
    mode = thp_mode()
    if mode not in ("always", "madvise") or os.environ.get("DUET_HUGE_PAGES") == "0":
        return 0
    madvise = _madvise()
    if madvise is None:
        return 0
    kept = list(arrays)
    spans = list(_spans(kept))
    for start, length in spans:  # marked: khugepaged may move them later, a collapse now
        madvise(start, length, _MADV_HUGEPAGE)
    advised = sum(length for _, length in spans)
    log.debug("huge pages asked for %.0f MB of weights", advised / 1e6)
    if not background:
        _collapse(madvise, spans)
    elif spans:

        def move() -> None:
            _collapse(madvise, spans)
            kept.clear()  # the arrays' last hold from here, where their model is gone

        thread = threading.Thread(target=move, name="duet-huge-pages", daemon=True)
        with _collapses_lock:
            _collapses[:] = [t for t in _collapses if t.is_alive()] + [thread]
        thread.start()
    return advised


def wait_for_huge_pages() -> None:
    """Return once every background collapse (``use_huge_pages(background=True)``) has finished."""
    with _collapses_lock:
        running = list(_collapses)
    for thread in running:
        thread.join()


def release_huge_pages(arrays: Iterable[mx.array]) -> int:
    """Undo :func:`use_huge_pages`'s mark on ``arrays`` (a model being unloaded), so the heap ranges
    their buffers leave behind take 4 KiB pages again when small allocations reuse them (where THP is
    ``madvise``; under ``always`` huge pages are the default anyway); returns the bytes released."""
    if thp_mode() != "madvise":
        return 0
    wait_for_huge_pages()  # a collapse still moving these buffers ends first
    madvise = _madvise()
    if madvise is None:
        return 0
    released = 0
    for start, length in _spans(arrays):
        if madvise(start, length, _MADV_NOHUGEPAGE) == 0:
            released += length
    return released
