"""Validate the emulator's barriers and threadgroup memory on MLX's own ``sdpa_vector`` kernel.

``qmv_fast`` (test_emulator_mlx_qmv.py) has no barriers; MLX's single-pass decode attention kernel,
taken verbatim from the installed ``sdpa_vector.h``, exchanges partial results through threadgroup
memory between barriers. It must match a float64 reference in every thread order, and removing any
of its barriers must be caught.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from metal_kernels import numpy_reference as ref
from metal_kernels.emulator import metal_kernel, options
from metal_kernels.emulator import mlx_headers as mh

EPS = {mx.float16: 2.0**-11, mx.float32: 2.0**-23}


def problem(dtype, dim, n=70, heads=8, gqa=2, seed=0):
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((heads, dim)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((heads // gqa, n, dim)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((heads // gqa, n, dim)).astype(np.float32)).astype(dtype)
    return q, k, v, gqa


def run_sdpa_vector(header, q, k, v, gqa, name):
    heads, dim = q.shape
    n = k.shape[1]
    kernel = metal_kernel(name, list(mh.SDPA_VECTOR_INPUTS), ["out"], mh.SDPA_VECTOR_BODY, header=header)
    u64 = mx.uint64
    inputs = [q, k, v, mx.array(gqa, dtype=mx.int32), mx.array(n, dtype=mx.int32), mx.array(n * dim, dtype=u64),
              mx.array(dim, dtype=u64), mx.array(n * dim, dtype=u64), mx.array(dim, dtype=u64),
              mx.array(dim**-0.5, dtype=mx.float32)]  # fmt: skip
    # MLX dispatches one 1024-thread threadgroup (32 SIMD-groups) per query head and position.
    (out,) = kernel(
        inputs=inputs,
        output_shapes=[(heads, dim)],
        output_dtypes=[q.dtype],
        grid=(1024 * heads, 1, 1),
        threadgroup=(1024, 1, 1),
        template=[("T", q.dtype), ("D", dim)],
    )
    return out


def expected(q, k, v, gqa):
    qf, kf, vf = ref.to_f64(q), ref.to_f64(k), ref.to_f64(v)
    out = np.zeros_like(qf)
    for h in range(qf.shape[0]):
        s = kf[h // gqa] @ qf[h] * qf.shape[1] ** -0.5
        p = np.exp(s - s.max())
        out[h] = p @ vf[h // gqa] / p.sum()
    return out


def correct(out, q, k, v, gqa) -> bool:
    want = expected(q, k, v, gqa)
    got = ref.to_f64(out)
    tol = (4 * EPS[q.dtype] + 1e-6) * np.abs(ref.to_f64(v)).max()
    return bool(np.isfinite(got).all() and (np.abs(got - want) <= tol).all())


@pytest.mark.parametrize("dtype,dim", [(mx.float16, 64), (mx.float32, 128)])
@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
def test_mlx_sdpa_vector_matches_float64(dtype, dim, order):
    q, k, v, gqa = problem(dtype, dim)
    with options(order=order, strict=True):
        out = run_sdpa_vector(mh.sdpa_vector_header(), q, k, v, gqa, "mlx_sdpa_vector")
    assert correct(out, q, k, v, gqa)


BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"


@pytest.mark.parametrize("which", [0, 1, 2])
def test_each_removed_barrier_is_caught(which):
    """sdpa_vector has three barriers; without any one of them some thread order goes wrong."""
    header = mh.sdpa_vector_header()
    assert header.count(BARRIER) == 3
    pos = -1
    for _ in range(which + 1):
        pos = header.index(BARRIER, pos + 1)
    broken = header[:pos] + header[pos + len(BARRIER) :]
    q, k, v, gqa = problem(mx.float32, 64, seed=1)
    outcomes = []
    for order in ("forward", "reverse", "random"):
        with options(order=order):
            outcomes.append(
                correct(run_sdpa_vector(broken, q, k, v, gqa, f"sdpa_nobarrier{which}"), q, k, v, gqa)
            )
    assert not all(outcomes)
