"""The Metal emulator's execution model: collectives, barriers, poisoning, strict mode, limits."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from metal_kernels.emulator import EmulatorCompileError, EmulatorError, metal_kernel, options

ORDERS = ("forward", "reverse", "random")

TREE_SUM = """
  threadgroup float buf[256];
  uint tid = thread_index_in_threadgroup;
  uint n = threads_per_threadgroup.x;
  uint gid = thread_position_in_grid.x;
  buf[tid] = gid < uint(count) ? float(a[gid]) : 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = 128; stride > 0; stride >>= 1) {
    if (tid < stride && tid + stride < n) {
      buf[tid] += buf[tid + stride];
    }
    BARRIER
  }
  if (tid == 0) {
    out[threadgroup_position_in_grid.x] = buf[0];
  }
"""


def tree_sum(barrier: bool):
    src = TREE_SUM.replace("BARRIER", "threadgroup_barrier(mem_flags::mem_threadgroup);" if barrier else "")
    return metal_kernel("tree_sum" + ("" if barrier else "_nobarrier"), ["a", "count"], ["out"], src)


def run_tree(kernel, a: np.ndarray, order: str) -> np.ndarray:
    groups = -(-len(a) // 256)
    (out,) = kernel(
        inputs=[mx.array(a), mx.array(len(a), dtype=mx.int32)],
        output_shapes=[(groups,)],
        output_dtypes=[mx.float32],
        grid=(len(a), 1, 1),
        threadgroup=(256, 1, 1),
        order=order,
    )
    return np.array(out)


def test_tree_reduction_with_barriers_is_correct_in_every_order():
    a = np.arange(600, dtype=np.float32) % 7 - 3
    expected = [a[i : i + 256].sum() for i in range(0, 600, 256)]
    k = tree_sum(barrier=True)
    for order in ORDERS:
        np.testing.assert_allclose(run_tree(k, a, order), expected, rtol=1e-6)


def test_missing_barrier_is_caught_by_thread_orders():
    """Without the loop barrier, reverse order reads partial sums before they are written."""
    a = np.arange(600, dtype=np.float32) % 7 - 3
    expected = np.array([a[i : i + 256].sum() for i in range(0, 600, 256)])
    k = tree_sum(barrier=False)
    results = [run_tree(k, a, order) for order in ORDERS]
    assert any(not np.allclose(r, expected) for r in results)


COLLECTIVES = """
  uint lane = thread_index_in_simdgroup;
  uint i = thread_position_in_grid.x;
  float v = a[i];
  uint base = i * 14;
  out[base + 0] = simd_sum(v);
  out[base + 1] = simd_max(v);
  out[base + 2] = simd_min(v);
  out[base + 3] = simd_prefix_exclusive_sum(v);
  out[base + 4] = simd_prefix_inclusive_sum(v);
  out[base + 5] = simd_shuffle(v, (lane + 5) % 32);
  out[base + 6] = simd_shuffle_down(v, 3);
  out[base + 7] = simd_shuffle_up(v, 2);
  out[base + 8] = simd_shuffle_xor(v, 9);
  out[base + 9] = simd_broadcast(v, 7);
  out[base + 10] = quad_sum(v);
  out[base + 11] = quad_shuffle(v, 3);
  out[base + 12] = simd_broadcast_first(v);
  out[base + 13] = float(simd_sum(int(lane)));
"""


def test_simd_and_quad_collectives_match_metal_semantics():
    k = metal_kernel("collectives", ["a"], ["out"], COLLECTIVES)
    rng = np.random.default_rng(0)
    a = rng.integers(-50, 50, size=64).astype(np.float32)
    for order in ORDERS:
        (out,) = k(
            inputs=[mx.array(a)],
            output_shapes=[(64 * 14,)],
            output_dtypes=[mx.float32],
            grid=(64, 1, 1),
            threadgroup=(64, 1, 1),
            order=order,
        )
        got = np.array(out).reshape(64, 14)
        for i in range(64):
            s = a[(i // 32) * 32 : (i // 32) * 32 + 32]
            lane = i % 32
            quad = a[(i // 4) * 4 : (i // 4) * 4 + 4]
            exp = [
                s.sum(),
                s.max(),
                s.min(),
                s[:lane].sum(),
                s[: lane + 1].sum(),
                s[(lane + 5) % 32],
                s[lane + 3] if lane + 3 < 32 else s[lane],
                s[lane - 2] if lane >= 2 else s[lane],
                s[lane ^ 9],
                s[7],
                quad.sum(),
                quad[3],
                s[0],
                sum(range(32)),
            ]
            np.testing.assert_array_equal(got[i], np.array(exp, dtype=np.float32), err_msg=f"thread {i}")


def test_thread_attributes_for_edge_threadgroups():
    src = """
  uint i = thread_position_in_grid.x + threads_per_grid.x * thread_position_in_grid.y;
  out[i * 8 + 0] = thread_position_in_threadgroup.x;
  out[i * 8 + 1] = thread_position_in_threadgroup.y;
  out[i * 8 + 2] = threadgroup_position_in_grid.x;
  out[i * 8 + 3] = threadgroup_position_in_grid.y;
  out[i * 8 + 4] = threads_per_threadgroup.x * 100 + threads_per_threadgroup.y;
  out[i * 8 + 5] = thread_index_in_threadgroup;
  out[i * 8 + 6] = simdgroup_index_in_threadgroup * 100 + thread_index_in_simdgroup;
  out[i * 8 + 7] = threadgroups_per_grid.x * 100 + simdgroups_per_threadgroup;
"""
    k = metal_kernel("attrs", ["dummy"], ["out"], src)
    gx, gy, tx, ty = 13, 5, 8, 4
    (out,) = k(
        inputs=[mx.zeros((1,))],
        output_shapes=[(gx * gy * 8,)],
        output_dtypes=[mx.uint32],
        grid=(gx, gy, 1),
        threadgroup=(tx, ty, 1),
    )
    got = np.array(out).reshape(gy, gx, 8)
    for y in range(gy):
        for x in range(gx):
            ax = min(tx, gx - (x // tx) * tx)
            ay = min(ty, gy - (y // ty) * ty)
            lx, ly = x % tx, y % ty
            idx = lx + ly * ax
            nthreads = ax * ay
            exp = [
                lx,
                ly,
                x // tx,
                y // ty,
                ax * 100 + ay,
                idx,
                (idx // 32) * 100 + idx % 32,
                2 * 100 + -(-nthreads // 32),
            ]
            assert list(got[y, x]) == exp, (x, y)


DIVERGENT = """
  uint lane = thread_index_in_simdgroup;
  float v = a[thread_position_in_grid.x];
  if (lane < 16) {
    v = simd_sum(v);
  }
  out[thread_position_in_grid.x] = v;
"""


def test_divergent_collective_flagged_in_strict_mode_and_uses_active_lanes_otherwise():
    k = metal_kernel("divergent", ["a"], ["out"], DIVERGENT)
    a = np.ones(32, dtype=np.float32)
    args = dict(
        inputs=[mx.array(a)],
        output_shapes=[(32,)],
        output_dtypes=[mx.float32],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
    )
    (out,) = k(**args)
    np.testing.assert_array_equal(np.array(out), [16.0] * 16 + [1.0] * 16)
    with pytest.raises(EmulatorError, match="divergent"), options(strict=True):
        k(**args)


def test_barrier_after_early_return_flagged_in_strict_mode():
    src = """
  threadgroup float t[64];
  uint i = thread_index_in_threadgroup;
  if (i >= 40) return;
  t[i] = a[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[i] = t[(i + 1) % 40];
"""
    k = metal_kernel("early_return", ["a"], ["out"], src)
    a = np.arange(64, dtype=np.float32)
    args = dict(
        inputs=[mx.array(a)],
        output_shapes=[(64,)],
        output_dtypes=[mx.float32],
        grid=(64, 1, 1),
        threadgroup=(64, 1, 1),
    )
    (out,) = k(**args)
    got = np.array(out)
    np.testing.assert_array_equal(got[:40], (np.arange(40) + 1) % 40)
    assert np.isnan(got[40:]).all()  # never written: poison stays
    with pytest.raises(EmulatorError, match="returned early"), options(strict=True):
        k(**args)


def test_unwritten_outputs_are_poisoned_and_init_value_fills():
    src = "if (thread_position_in_grid.x % 2 == 0) out[thread_position_in_grid.x] = 1.0f;"
    k = metal_kernel("half_written", ["a"], ["out"], src)
    args = dict(
        inputs=[mx.zeros((1,))],
        output_shapes=[(8,)],
        output_dtypes=[mx.float16],
        grid=(8, 1, 1),
        threadgroup=(8, 1, 1),
    )
    got = np.array(k(**args)[0])
    assert (got[::2] == 1).all() and np.isnan(got[1::2]).all()
    got = np.array(k(**args, init_value=3.0)[0])
    np.testing.assert_array_equal(got, [1, 3] * 4)


def test_threadgroup_memory_is_poisoned_between_groups():
    src = """
  threadgroup float t[32];
  uint i = thread_index_in_threadgroup;
  if (threadgroup_position_in_grid.x == 0) t[i] = 5.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[thread_position_in_grid.x] = t[i];
"""
    k = metal_kernel("tg_poison", ["a"], ["out"], src)
    (out,) = k(
        inputs=[mx.zeros((1,))],
        output_shapes=[(64,)],
        output_dtypes=[mx.float32],
        grid=(64, 1, 1),
        threadgroup=(32, 1, 1),
    )
    got = np.array(out)
    assert (got[:32] == 5).all() and np.isnan(got[32:]).all()


def test_threadgroup_memory_limit_and_thread_limit():
    src = """
  threadgroup float big[8192];
  threadgroup float more[4];
  big[thread_index_in_threadgroup] = 1.0f;
  more[0] = 2.0f;
  out[0] = big[0] + more[0];
"""
    k = metal_kernel("too_much_tg", ["a"], ["out"], src)
    args = dict(
        inputs=[mx.zeros((1,))],
        output_shapes=[(1,)],
        output_dtypes=[mx.float32],
        grid=(1, 1, 1),
        threadgroup=(1, 1, 1),
    )
    with pytest.raises(EmulatorError, match="threadgroup memory limit"):
        k(**args)
    k2 = metal_kernel("too_many_threads", ["a"], ["out"], "out[0] = a[0];")
    with pytest.raises(EmulatorError, match="exceeds the maximum"):
        k2(
            inputs=[mx.zeros((1,))],
            output_shapes=[(1,)],
            output_dtypes=[mx.float32],
            grid=(2048, 1, 1),
            threadgroup=(2048, 1, 1),
        )


def test_out_of_bounds_write_and_wild_access_raise():
    k = metal_kernel("oob_write", ["a"], ["out"], "out[thread_position_in_grid.x + 1] = a[0];")
    args = dict(
        inputs=[mx.zeros((4,))],
        output_shapes=[(4,)],
        output_dtypes=[mx.float32],
        grid=(4, 1, 1),
        threadgroup=(4, 1, 1),
    )
    with pytest.raises(EmulatorError, match="out-of-bounds write"):
        k(**args)
    wild = metal_kernel("wild_read", ["a"], ["out"], "out[0] = a[1u << 30];")
    with pytest.raises(EmulatorError, match="memory fault"):
        wild(**args)
    # the process survived and the emulator still works
    ok = metal_kernel(
        "ok_after_fault", ["a"], ["out"], "out[thread_position_in_grid.x] = a[thread_position_in_grid.x] + 1;"
    )
    np.testing.assert_array_equal(np.array(ok(**args)[0]), [1, 1, 1, 1])


def test_msl_numerics_round_half_and_bfloat():
    src = """
  uint i = thread_position_in_grid.x;
  out[i] = round(a[i]);
  bf[i] = bfloat16_t(a[i] * 1.0001f);
  h[i] = half(a[i]) + 0.5h;
"""
    k = metal_kernel("numerics", ["a"], ["out", "bf", "h"], src)
    a = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 3.3, 1e-3, 1000.7], dtype=np.float32)
    out, bf, h = k(
        inputs=[mx.array(a)],
        output_shapes=[a.shape] * 3,
        output_dtypes=[mx.float32, mx.bfloat16, mx.float16],
        grid=(8, 1, 1),
        threadgroup=(8, 1, 1),
    )
    np.testing.assert_array_equal(np.array(out), [1, 2, 3, -1, -3, 3, 0, 1001])
    expected_bf = (mx.array(a) * mx.array(1.0001, dtype=mx.float32)).astype(mx.bfloat16)
    assert mx.array_equal(bf, expected_bf).item()
    expected_h = mx.array(a).astype(mx.float16) + mx.array(0.5, dtype=mx.float16)
    assert mx.array_equal(h, expected_h).item()


def test_atomic_outputs_histogram():
    src = """
  uint i = thread_position_in_grid.x;
  atomic_fetch_add_explicit(&hist[a[i]], 1u, memory_order_relaxed);
"""
    k = metal_kernel("hist", ["a"], ["hist"], src, atomic_outputs=True)
    a = np.random.default_rng(1).integers(0, 10, size=300).astype(np.uint32)
    (h,) = k(
        inputs=[mx.array(a)],
        output_shapes=[(10,)],
        output_dtypes=[mx.uint32],
        grid=(300, 1, 1),
        threadgroup=(64, 1, 1),
        init_value=0,
    )
    np.testing.assert_array_equal(np.array(h), np.bincount(a, minlength=10))


def test_compile_errors_are_reported():
    k = metal_kernel("broken", ["a"], ["out"], "out[0] = undefined_name;")
    with pytest.raises(EmulatorCompileError, match="undefined_name"):
        k(
            inputs=[mx.zeros((1,))],
            output_shapes=[(1,)],
            output_dtypes=[mx.float32],
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
        )


def test_vector_types_and_swizzles():
    src = """
  uint i = thread_position_in_grid.x;
  float4 v = float4(a[4 * i], a[4 * i + 1], float2(a[4 * i + 2], a[4 * i + 3]));
  half4 hv = half4(v);
  float2 s = v.xy + v.zw;
  v.xy = float2(s.y, s.x);
  float4 w = select(v, float4(hv) * 2.0f, v > 1.0f);
  out[i] = dot(w, float4(1.0f)) + max(s.x, s.y);
"""
    k = metal_kernel("vectors", ["a"], ["out"], src)
    a = np.arange(8, dtype=np.float32) / 2
    (out,) = k(
        inputs=[mx.array(a)],
        output_shapes=[(2,)],
        output_dtypes=[mx.float32],
        grid=(2, 1, 1),
        threadgroup=(2, 1, 1),
    )
    exp = []
    for i in range(2):
        v = a[4 * i : 4 * i + 4].copy()
        s = np.array([v[0] + v[2], v[1] + v[3]])
        v[:2] = [s[1], s[0]]
        w = np.where(v > 1, a[4 * i : 4 * i + 4] * 2, v)
        exp.append(w.sum() + s.max())
    np.testing.assert_allclose(np.array(out), exp)


def test_partial_simdgroup_shuffles_from_missing_lanes_are_poison():
    """A 40-thread group has a second SIMD-group of 8 lanes; lanes 8-31 do not exist there."""
    src = """
  float v = a[thread_position_in_grid.x];
  out[thread_position_in_grid.x] = simd_shuffle_down(v, 8) + simd_sum(v) * 0.0f;
"""
    k = metal_kernel("partial_simd", ["a"], ["out"], src)
    a = np.arange(40, dtype=np.float32)
    with options(strict=True):
        (out,) = k(
            inputs=[mx.array(a)],
            output_shapes=[(40,)],
            output_dtypes=[mx.float32],
            grid=(40, 1, 1),
            threadgroup=(40, 1, 1),
        )
    got = np.array(out)
    np.testing.assert_array_equal(got[:24], a[8:32])  # first SIMD-group: lanes 8..31 exist
    np.testing.assert_array_equal(got[24:32], a[24:32])  # shifted past lane 31: own value
    assert np.isnan(got[32:]).all()  # second SIMD-group: source lanes 8..15 were never launched
