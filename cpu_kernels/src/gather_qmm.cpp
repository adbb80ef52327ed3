// The gather over experts: every (batch row, x row) pair is multiplied by its expert's matrix with
// the quantized matmul's row kernel (kernels_impl.inc, the variant qmm.cpp chose).
//
// The pairs are sorted by expert (a counting sort, stable), and each expert's x rows are copied into
// one contiguous block, so an expert's weights are read once per call for all the pairs that chose
// it: a tile of the kernel holds up to 8 rows of x in registers while the unpacked weights pass. With
// int8 math an expert with as many rows as quantized_matmul gives the int8 GEMM (prefill) takes it.
// The pool's tasks split (expert, 8-row block of N) units evenly by their cost: a block's weight
// reading plus its rows of x. x rows are converted (and, for one or two rows on an expert, quantized
// for the integer kernel; with int8 math, every row to int8 for the int8 kernel) once per distinct
// input row, not once per pair: gate and up see each token's row once for its k experts.
#include "gather_qmm.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "dispatch.h"
#include "kernels.h"
#include "panels.h"
#include "pool.h"
#include "qmm_shared.h"

namespace duet_cpu {

namespace {

// The element offset in a of each index of the batch shape `batch` (row-major), a's leading
// a.ndim() - trailing dims broadcast against it (NumPy's rules: aligned on the right, size 1 repeats).
std::vector<int64_t> batch_offsets(const mx::Shape& batch, const mx::array& a, int trailing) {
  const int nd = int(batch.size());
  const int lead = a.ndim() - trailing;
  std::vector<int64_t> stride(nd, 0);
  for (int d = 0; d < nd; ++d) {
    const int j = d - (nd - lead);
    if (j >= 0 && a.shape(j) != 1) {
      stride[d] = a.strides()[j];
    }
  }
  size_t count = 1;
  for (int d = 0; d < nd; ++d) {
    count *= size_t(batch[d]);
  }
  std::vector<int64_t> out(count);
  std::vector<int> idx(nd, 0);
  int64_t off = 0;
  for (size_t r = 0; r < count; ++r) {
    out[r] = off;
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < batch[d]) {
        off += stride[d];
        break;
      }
      off -= stride[d] * (batch[d] - 1);
      idx[d] = 0;
    }
  }
  return out;
}

// The batch shape of the product: x's dims but its last two, broadcast with the indices' shape.
mx::Shape batch_shape(const mx::array& x, const mx::array& indices) {
  const mx::Shape xbatch(x.shape().begin(), x.shape().end() - 2);
  return mx::broadcast_shapes(xbatch, indices.shape());
}

// One expert's share of the call: its weights and the block of sorted pairs [p0, p0 + count).
struct Active {
  int expert;
  int p0;
  int count;
  int64_t cost0; // the cost of every unit before this expert's first
};

void run_gather(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    const mx::array& indices,
    mx::array& out,
    int group_size,
    int bits,
    int planes) {
  const bool int8 = planes == 1;
  const int E = w.shape(0);
  const int N = w.shape(1);
  const int K = x.shape(-1);
  const int M = x.shape(-2);
  const int G = K / group_size;
  const size_t P = out.size() / std::max<size_t>(1, size_t(N)); // (batch row, x row) pairs
  if (P == 0 || N == 0) {
    return;
  }
  const bool panels = is_panel_form(w, scales, group_size, bits);
  if (panels && !panel_kernel_runs(int8)) {
    // the row form's paths (no AVX-512 VNNI) on a row-form copy of every expert
    const auto [rw, rs, rb] = row_form(w, scales, biases);
    return run_gather(x, rw, rs, rb, indices, out, group_size, bits, planes);
  }

  // Distinct rows of x (broadcasting repeats one row for the k experts of a token).
  const mx::Shape batch(out.shape().begin(), out.shape().end() - 2);
  const std::vector<int64_t> xbatch = batch_offsets(batch, x, 2);
  std::vector<int64_t> offsets(P);
  for (size_t p = 0; p < P; ++p) {
    offsets[p] = xbatch[p / M] + int64_t(p % M) * x.strides()[x.ndim() - 2];
  }
  const int64_t kstep = x.strides().back();
  std::unordered_map<int64_t, int> row_of;
  std::vector<int> source(P);
  std::vector<int64_t> unique;
  for (size_t p = 0; p < P; ++p) {
    auto [it, fresh] = row_of.try_emplace(offsets[p], int(unique.size()));
    if (fresh) {
      unique.push_back(offsets[p]);
    }
    source[p] = it->second;
  }
  // Pairs sorted by expert, stable; an index outside [0, E) leaves its rows zero.
  std::vector<uint32_t> expert_of_row(P / M);
  {
    const std::vector<int64_t> at = batch_offsets(batch, indices, 0);
    const uint32_t* src = indices.data<uint32_t>();
    for (size_t r = 0; r < at.size(); ++r) {
      expert_of_row[r] = src[at[r]];
    }
  }
  std::vector<int> count(E + 1, 0);
  for (size_t p = 0; p < P; ++p) {
    const uint32_t e = expert_of_row[p / M];
    ++count[e < uint32_t(E) ? e : E];
  }
  std::vector<int> start(E + 1, 0);
  for (int e = 1; e <= E; ++e) {
    start[e] = start[e - 1] + count[e - 1];
  }
  const int sorted = start[E]; // pairs with a valid expert
  std::vector<int> order(P);
  {
    std::vector<int> next(start);
    for (size_t p = 0; p < P; ++p) {
      const uint32_t e = expert_of_row[p / M];
      order[next[e < uint32_t(E) ? e : E]++] = int(p);
    }
  }

  const int U = int(unique.size());
  std::vector<float> y(size_t(sorted) * N);
  // Back to the pairs' order, in the output dtype; rows of an out-of-range expert are zero.
  auto write_back = [&]() {
    std::vector<int> slot(P, -1);
    for (int q = 0; q < sorted; ++q) {
      slot[order[q]] = q;
    }
    with_float_type(out.dtype(), [&](auto zero) {
      using T = decltype(zero);
      T* o = out.data<T>();
      for (size_t p = 0; p < P; ++p) {
        T* row = o + p * N;
        if (slot[p] < 0) {
          std::fill(row, row + N, T(0.0f));
          continue;
        }
        const float* src = y.data() + size_t(slot[p]) * N;
        for (int n = 0; n < N; ++n) {
          row[n] = static_cast<T>(src[n]);
        }
      }
    });
  };
  if (panels) { // AVX-512 VNNI: the panel kernel per expert (panels.cpp), int8 math or exact
    check_panel_biases(biases, bits);
    const DenseBytes wd = dense_bytes(w), sd = dense_bytes(scales), bd = dense_bytes(biases);
    gather_panels(
        {x.data<void>(), x.dtype(), kstep, unique, source, order, start, count},
        static_cast<const uint8_t*>(wd.data),
        static_cast<const uint8_t*>(sd.data),
        static_cast<const uint8_t*>(bd.data),
        y.data(),
        E,
        N,
        K,
        bits,
        planes);
    return write_back();
  }
  std::vector<float> xf(size_t(U) * K);
  std::vector<float> xs(size_t(U) * G);
  const void* xdata = x.data<void>();
  for (int u = 0; u < U; ++u) {
    prepare_x_row(xdata, x.dtype(), size_t(unique[u]), kstep, K, group_size, bits, xf.data() + size_t(u) * K, xs.data() + size_t(u) * G, planes);
  }

  // With int8 math every distinct row is quantized to int8 once (quantize_row_q8, which also makes its
  // group sums those of the quantized values). Otherwise an expert with one or two rows takes the
  // integer kernel where the CPU has one, as quantized_matmul does for one or two rows; each distinct
  // row is quantized once.
  const QuantizeXFn quantize = quantize_x_fn();
  const bool integer = !int8 && quantize != nullptr && K % (bits == 4 ? 64 : 32) == 0;
  std::vector<int8_t> uq;
  std::vector<float> ud;
  if (int8) {
    const Q8QuantizeFn q8 = q8_quantize_fn();
    uq.resize(size_t(U) * K);
    ud.resize(size_t(U) * (K / 8));
    for (int u = 0; u < U; ++u) {
      quantize_row_q8(
          q8, xf.data() + size_t(u) * K, K, group_size, bits, uq.data() + size_t(u) * K, ud.data() + size_t(u) * (K / 8), xs.data() + size_t(u) * G);
    }
  }

  // Each expert's rows of x (and group sums) side by side, as the kernel reads one matrix's x.
  std::vector<float> xsorted(int8 ? 0 : size_t(sorted) * K);
  std::vector<float> gsorted(size_t(sorted) * G);
  std::vector<int8_t> xq(int8 ? size_t(sorted) * K : 0);
  std::vector<float> xunit(int8 ? size_t(sorted) * (K / 8) : 0);
  for (int q = 0; q < sorted; ++q) {
    const int u = source[order[q]];
    std::memcpy(gsorted.data() + size_t(q) * G, xs.data() + size_t(u) * G, sizeof(float) * G);
    if (int8) {
      std::memcpy(xq.data() + size_t(q) * K, uq.data() + size_t(u) * K, size_t(K));
      std::memcpy(xunit.data() + size_t(q) * (K / 8), ud.data() + size_t(u) * (K / 8), sizeof(float) * (K / 8));
    } else {
      std::memcpy(xsorted.data() + size_t(q) * K, xf.data() + size_t(u) * K, sizeof(float) * K);
    }
  }
  if (integer) {
    std::vector<int> done(U, -1); // the sorted row holding row u's bytes, once quantized
    for (int e = 0; e < E; ++e) {
      if (count[e] == 0 || count[e] > kIntegerRows) {
        continue;
      }
      if (xq.empty()) {
        xq.resize(size_t(3) * K * sorted);
        xunit.resize(size_t(K) / 8 * sorted);
      }
      for (int q = start[e]; q < start[e] + count[e]; ++q) {
        const int u = source[order[q]];
        int8_t* dq = xq.data() + size_t(3) * K * q;
        float* du = xunit.data() + size_t(K) / 8 * q;
        if (done[u] < 0) {
          quantize(xf.data() + size_t(u) * K, K, bits, dq, du);
          if (planes == 2) { // int16 math, as quantized_matmul's
            drop_third_piece(dq, K, bits);
          }
          done[u] = q;
        } else {
          std::memcpy(dq, xq.data() + size_t(3) * K * done[u], size_t(3) * K);
          std::memcpy(du, xunit.data() + size_t(K) / 8 * done[u], sizeof(float) * (K / 8));
        }
      }
    }
  }

  // an expert's one row (decode) also with each two steps side by side (QmmArgs::xq_pairs)
  std::vector<int8_t> xpairs;
  std::vector<char> paired(E, 0);
  for (int e = 0; e < E; ++e) {
    if (count[e] != 1) {
      continue;
    }
    if (int8 && bits == 4) { // the int8 kernel's 4-bit order, the middle of each 128 bytes swapped
      xpairs.resize(size_t(K) * sorted);
      pair_runs_x8(xq.data() + size_t(K) * start[e], K, xpairs.data() + size_t(K) * start[e]);
      paired[e] = 1;
    } else if (integer) {
      xpairs.resize(size_t(3) * K * sorted);
      const size_t at = size_t(3) * K * start[e];
      paired[e] = pair_steps_x(xq.data() + at, K, bits, xpairs.data() + at) ? 1 : 0;
    }
  }

  const DenseBytes wd = dense_bytes(w);
  const DenseBytes sd = dense_bytes(scales);
  const Biases bd = biases_of(biases);
  // Q6_K's bias term in integers, as quantized_matmul takes it (QmmArgs::x8_offset, xq_offset)
  std::vector<int32_t> bias_offsets;
  const int32_t* offset = nullptr;
  if (integer_offsets(group_size, bd)) {
    if (int8) {
      offset = offsets_int8(xq, sorted, K, int32_t(bd.ratio), bias_offsets);
    } else if (!xq.empty()) {
      offset = offsets_three_byte(xq, sorted, K, int32_t(bd.ratio), bias_offsets);
    }
  }
  const size_t row_bytes = size_t(K) * bits / 8;
  const size_t srow = scale_row_bytes(scale_type(scales.dtype(), group_size), G); // bytes of scales per weight row
  // an expert's scales and biases (null for the one-element form, whose ratio serves every expert)
  auto expert_scales = [&](int e) -> const void* {
    return static_cast<const uint8_t*>(sd.data) + size_t(e) * N * srow;
  };
  auto expert_biases = [&](int e) -> const void* {
    return bd.data == nullptr ? nullptr : static_cast<const uint8_t*>(bd.data) + size_t(e) * N * srow;
  };

  // An expert with many rows (prefill) takes the int8 GEMM, as quantized_matmul does, its rows side by
  // side as one x: with int8 math x in element order per run of 32 (for 4-bit weights the rows above
  // are in the row kernel's order, so they are quantized again, once per distinct row); with exact
  // (or int16) math from kExactGemmRows rows, x split into three (two) planes (split_rows_planes), a
  // row of the GEMM a plane, whose products are added.
  const Q8GemmFn gemm = q8_gemm_fn();
  const QuantizeXFn split = quantize_x_fn();
  std::vector<char> by_gemm(E, 0);
  for (int e = 0; e < E; ++e) {
    by_gemm[e] = (int8 ? takes_q8_gemm(gemm, count[e], bits) : takes_x3_gemm(gemm, split, count[e])) ? 1 : 0;
  }
  if (std::any_of(by_gemm.begin(), by_gemm.end(), [](char g) { return g != 0; })) {
    Q8Rows e8;
    if (!int8) {
      e8 = split_rows_planes(split, xdata, x.dtype(), unique, kstep, K, group_size, planes);
    } else if (bits != 8) {
      e8 = quantize_rows_q8(q8_quantize_fn(), xdata, x.dtype(), unique, kstep, K, group_size);
    }
    const bool reuse = int8 && bits == 8; // the rows quantized above are already in element order
    const int8_t* qsrc = reuse ? uq.data() : e8.q.data();
    const float* usrc = reuse ? ud.data() : e8.unit.data();
    const float* ssrc = reuse ? xs.data() : e8.sum.data();
    std::vector<int8_t> bq;
    std::vector<float> bu, bs, yp;
    for (int e = 0; e < E; ++e) {
      if (!by_gemm[e]) {
        continue;
      }
      const int rows = count[e];
      const int R = planes * rows;
      bq.resize(size_t(R) * K);
      bu.resize(size_t(R) * (K / 8));
      bs.resize(size_t(R) * G);
      for (int j = 0; j < planes; ++j) {
        for (int i = 0; i < rows; ++i) {
          const size_t from = size_t(j) * U + size_t(source[order[start[e] + i]]); // plane j of the row
          const size_t to = size_t(j) * rows + size_t(i);
          std::memcpy(bq.data() + to * K, qsrc + from * K, size_t(K));
          std::memcpy(bu.data() + to * (K / 8), usrc + from * (K / 8), sizeof(float) * (K / 8));
          std::memcpy(bs.data() + to * G, ssrc + from * G, sizeof(float) * G);
        }
      }
      float* ye = y.data() + size_t(start[e]) * N;
      if (planes > 1) {
        yp.resize(size_t(R) * N);
      }
      q8_gemm_on_pool(
          gemm,
          {bq.data(),
           bu.data(),
           bs.data(),
           static_cast<const uint8_t*>(wd.data) + size_t(e) * N * row_bytes,
           expert_scales(e),
           expert_biases(e),
           planes > 1 ? yp.data() : ye,
           R,
           N,
           K,
           group_size,
           bits,
           scale_type(scales.dtype(), group_size),
           bd.ratio});
      if (planes > 1) {
        sum_planes(yp.data(), planes, rows, N, ye);
      }
    }
  }

  // The other experts' units: (active expert, block of 8 output rows), each costing its weights (~4
  // rows of x's multiply-adds for the unpacking) plus one per row of x.
  const int blocks = (N + 7) / 8;
  std::vector<Active> active;
  int64_t total = 0;
  int most = 0;
  for (int e = 0; e < E; ++e) {
    if (count[e] > 0 && !by_gemm[e]) {
      active.push_back({e, start[e], count[e], total});
      total += int64_t(blocks) * (4 + count[e]);
      most = std::max(most, count[e]);
    }
  }

  const RowsFn fn = int8 ? q8_rows_fn() : qmm_rows_fn();
  auto args_for = [&](const Active& act) {
    QmmArgs a{
        int8 ? nullptr : xsorted.data() + size_t(act.p0) * K, // the int8 kernel reads x8 instead
        gsorted.data() + size_t(act.p0) * G,
        static_cast<const uint8_t*>(wd.data) + size_t(act.expert) * N * row_bytes,
        expert_scales(act.expert),
        expert_biases(act.expert),
        y.data() + size_t(act.p0) * N,
        act.count,
        N,
        K,
        group_size,
        bits,
        scale_type(scales.dtype(), group_size)};
    a.bias_ratio = bd.ratio;
    if (int8) {
      a.x8 = xq.data() + size_t(act.p0) * K;
      a.x8_scale = xunit.data() + size_t(act.p0) * (K / 8);
      a.x8_offset = offset == nullptr ? nullptr : offset + size_t(act.p0) * (K / 16);
      a.x8_pairs = paired[act.expert] ? xpairs.data() + size_t(act.p0) * K : nullptr;
    } else if (integer && act.count <= kIntegerRows) {
      a.xq = xq.data() + size_t(3) * K * act.p0;
      a.xunit = xunit.data() + size_t(K) / 8 * act.p0;
      a.xq_pairs = paired[act.expert] ? xpairs.data() + size_t(3) * K * act.p0 : nullptr;
      a.xq_offset = offset == nullptr ? nullptr : offset + size_t(act.p0) * (K / 4);
    }
    return a;
  };

  auto pool = shared_pool();
  const size_t weight_bytes = active.size() * size_t(N) * (row_bytes + 2 * srow);
  const int tasks = std::min<int64_t>(task_count(weight_bytes, most, pool->size()), std::max<int64_t>(1, total));
  // Task t runs the units whose cost starts in [total * t / tasks, total * (t + 1) / tasks): the first
  // block j of an expert with cost0 + j * c >= total * t / tasks.
  auto first_block = [&](const Active& act, int t) {
    const int64_t c = 4 + act.count;
    const int64_t need = total * t - act.cost0 * tasks; // (cost0 + j c) tasks >= total t
    if (need <= 0) {
      return 0;
    }
    return int(std::min<int64_t>(blocks, (need + c * tasks - 1) / (c * tasks)));
  };
  auto run_task = [&](int t) {
    for (const Active& act : active) {
      const int j0 = first_block(act, t);
      const int j1 = first_block(act, t + 1);
      if (j0 < j1) {
        fn(args_for(act), j0 * 8, std::min(N, j1 * 8));
      }
    }
  };
  if (tasks <= 1) {
    for (const Active& act : active) {
      fn(args_for(act), 0, N);
    }
  } else {
    pool->run(tasks, run_task);
  }

  write_back();
}

} // namespace

mx::array gather_quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    const mx::array& indices,
    int group_size,
    int bits,
    int planes,
    mx::StreamOrDevice s) {
  check_bits_and_groups(bits, group_size);
  check_planes(planes);
  if (w.dtype() != mx::uint32 || w.ndim() != 3) {
    throw std::invalid_argument("w must be a 3-D uint32 array (experts, N, K * bits / 32)");
  }
  check_scale_format(scales, biases, group_size, bits);
  if (x.ndim() < 2 || !supported_float(x.dtype())) {
    throw std::invalid_argument("x must be float32, float16 or bfloat16 (..., M, K)");
  }
  if (!mx::issubdtype(indices.dtype(), mx::integer)) {
    throw std::invalid_argument("indices must be integers");
  }
  const int K = x.shape(-1);
  if (int64_t(w.shape(2)) * 32 != int64_t(K) * bits) {
    throw std::invalid_argument(
        "x has K=" + std::to_string(K) + " but w packs " + std::to_string(int64_t(w.shape(2)) * 32 / bits) +
        " values per row");
  }
  if (K % group_size != 0) {
    throw std::invalid_argument("K must be a multiple of group_size");
  }
  if (is_panel_form(w, scales, group_size, bits)) {
    check_panel_shapes(scales, biases, K, bits);
  } else {
    check_scale_shapes(scales, biases, {w.shape(0), w.shape(1)}, K, group_size);
  }
  // Broadcasting happens in eval_cpu, not through broadcast ops: those fix their shapes, and
  // mx.compile(shapeless=True) could not reuse the graph for another number of tokens.
  const auto stream = mx::to_stream(s, mx::Device::cpu);
  mx::Shape out_shape = batch_shape(x, indices);
  out_shape.push_back(x.shape(-2));
  out_shape.push_back(w.shape(1));
  return mx::array(
      out_shape,
      mx::promote_types(x.dtype(), scales.dtype()),
      std::make_shared<GatherQuantizedMatmulCPU>(stream, group_size, bits, planes),
      {x, w, scales, biases, mx::astype(indices, mx::uint32, stream)});
}

void GatherQuantizedMatmulCPU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  dispatch_cpu(stream(), inputs, out, [x = inputs[0], w = inputs[1], scales = inputs[2], biases = inputs[3],
                                       indices = inputs[4], out, group_size = group_size_, bits = bits_,
                                       planes = planes_]() mutable {
    run_gather(x, w, scales, biases, indices, out, group_size, bits, planes);
  });
}

void GatherQuantizedMatmulCPU::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("DuetGatherQuantizedMatmulCPU runs on the CPU stream only");
}

bool GatherQuantizedMatmulCPU::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GatherQuantizedMatmulCPU&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && planes_ == o.planes_;
}

std::vector<mx::Shape> GatherQuantizedMatmulCPU::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = batch_shape(inputs[0], inputs[4]);
  shape.push_back(inputs[0].shape(-2));
  shape.push_back(inputs[1].shape(1));
  return {shape};
}

} // namespace duet_cpu
