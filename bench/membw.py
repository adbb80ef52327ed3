"""The machine's memory bandwidth on N cores, measured as STREAM does: the limit a decode step meets.

    .venv/bin/python bench/membw.py [--threads 2] [--mb 512]

Two kernels over arrays far larger than the caches, each thread on its own slice (NumPy releases
the GIL inside a ufunc, so ``threads`` threads run on as many cores), best of ``repeats``:

* **read**: ``np.maximum.reduce`` of a float64 array (SIMD; ~44 GB/s per core in cache here, where
  ``np.add.reduce``'s pairwise sum stops at ~27), every byte read once and nothing written: what a
  decode step does to the weights, so the bound for weights read per second;
* **triad**: STREAM's ``a = b + s * c`` as one ufunc pass per slice (``np.multiply(c, s, out=a)``
  then ``a += b`` on cache-sized blocks, so each element of a is written once), counted as STREAM
  counts it (3 arrays x 8 bytes; the write-allocate read of ``a`` is not counted).

A decode step streams the weights once per token, so ``GB read per token x tok/s`` against the read
figure says how close a system is to the memory limit (``bench/cpu.py`` prints both).
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

BLOCK = 1 << 15  # float64 elements per triad block: 256 KiB, within L2


def _slices(n: int, threads: int) -> list[slice]:
    step = -(-n // threads)
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def _triad(a: np.ndarray, b: np.ndarray, c: np.ndarray, s: float) -> None:
    for i in range(0, len(a), BLOCK):
        blk = slice(i, i + BLOCK)
        np.multiply(c[blk], s, out=a[blk])
        a[blk] += b[blk]


def measure(threads: int = 1, mb: int = 512, repeats: int = 5) -> dict[str, float]:
    """GB/s (1e9 bytes) for ``read`` and ``triad`` on ``threads`` threads, arrays of ``mb`` MB each."""
    n = mb * (1 << 20) // 8
    a, b, c = (np.full(n, v, np.float64) for v in (0.0, 1.0, 2.0))  # touched: no first-touch faults
    parts = _slices(n, threads)
    out: dict[str, float] = {}
    with ThreadPoolExecutor(threads) as pool:

        def best(fn, bytes_moved: int) -> float:
            fastest = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                list(pool.map(fn, parts))
                fastest = min(fastest, time.perf_counter() - t0)
            return bytes_moved / fastest / 1e9

        out["read"] = best(lambda sl: np.maximum.reduce(b[sl]), 8 * n)
        out["triad"] = best(lambda sl: _triad(a[sl], b[sl], c[sl], 3.0), 3 * 8 * n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mb", type=int, default=512, help="MB per array")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    print(json.dumps({"threads": a.threads} | measure(a.threads, a.mb, a.repeats)))


if __name__ == "__main__":
    main()
