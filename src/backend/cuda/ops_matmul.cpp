// backend/cuda/ops_matmul.cpp: the op table's matmuls (cuda_backend.h): matmul, the fused
// swiglu_matmul, matmul_batch (one activation quantization, grouped launches) and get_rows,
// resident or on host spans, and the routing between MatmulKernels V2 / V3 and cuBLAS.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "backend/cuda/backend_impl.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_util.h"
#include "backend/cuda/dequant.cuh"
#include "backend/cuda/kernels.h"
#include "core/check.h"
#include "core/log.h"

namespace kiln {

using cuda::check_cuda;

namespace {

// Declared after the op's lock: on every return the op's expert copies have read their host
// slabs before the caller may drop the pins (cuda::ExpertTier).
struct ExpertCopyFence {
  CudaBackend::Impl& impl;
  ~ExpertCopyFence() { impl.experts.fence(); }
};

// Auto: F16 weights above V3's float kernel's token limit go to cuBLAS.
constexpr int64_t kAutoFloatMaxTokens = 8;

// V3: the activation scratch for this matmul (null when the int8 path does not apply).
std::byte* v3_act(CudaBackend::Impl& I, const cuda::DeviceWeight& w, int64_t n_tok, size_t* bytes) {
  *bytes = cuda::matvec_q8_supports(w.dtype) && n_tok <= I.int8_max_tokens()
               ? cuda::act_q8_bytes(w.n_cols, n_tok)
               : 0;
  return *bytes ? I.internal<std::byte>(I.act_q8, *bytes, I.act_q8_cap) : nullptr;
}

// V2 and V3 take the cuBLAS path above 16 tokens, except V3's int8 path (up to 64).
bool takes_gemm(const CudaBackend::Impl& I, cuda::MatmulKernels k, const cuda::DeviceWeight& w,
                int64_t n_tok) {
  // Auto: F16 weights above V3's float kernel (8 tokens) go to cuBLAS, which reads them in
  // place; V2's f32-activation matvec read them at 140-380 GB/s at 16 tokens.
  if (I.auto_routing() && w.dtype == DType::F16 && n_tok > kAutoFloatMaxTokens) return true;
  if (n_tok <= cuda::kMatvecMaxTokens) return false;
  return !(k == cuda::MatmulKernels::V3 && cuda::matvec_q8_supports(w.dtype) &&
           n_tok <= I.int8_max_tokens());
}

// Consecutive tasks of one weight layout (type, row size, alignment) run as one grouped launch
// (launch_matvec_*_group: each output has its own launch's bits); a group the launcher refuses
// goes task by task. `one(i)` launches task i alone, `group(first, n)` a group.
template <typename One, typename Group>
cudaError_t run_grouped(std::span<const cuda::DeviceWeight> ws, One&& one, Group&& group) {
  for (size_t i = 0; i < ws.size();) {
    size_t n = 1;
    while (i + n < ws.size() && n < size_t(cuda::kMatvecGroupMax) &&
           ws[i + n].dtype == ws[i].dtype && ws[i + n].row_bytes == ws[i].row_bytes &&
           (reinterpret_cast<uintptr_t>(ws[i + n].data) % 16 == 0) ==
               (reinterpret_cast<uintptr_t>(ws[i].data) % 16 == 0))
      ++n;
    cudaError_t e = n > 1 ? group(i, n) : cudaErrorNotSupported;
    if (e == cudaErrorNotSupported)
      for (size_t j = i; j < i + n && (e == cudaErrorNotSupported || e == cudaSuccess); ++j)
        e = one(j);
    if (e != cudaSuccess) return e;
    i += n;
  }
  return cudaSuccess;
}

}  // namespace

void CudaBackend::matmul(const WeightMatrix& w, std::span<const float> x, int64_t n_tok,
                         std::span<float> y) {
  KILN_CHECK(static_cast<int64_t>(x.size()) == n_tok * w.n_cols, "x {} != {}x{}", x.size(), n_tok,
             w.n_cols);
  KILN_CHECK(static_cast<int64_t>(y.size()) == n_tok * w.n_rows, "y {} != {}x{}", y.size(), n_tok,
             w.n_rows);
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  ExpertCopyFence fence{I};
  I.enter();
  // Everything that may flush (a host span's twin, weight refresh, workspace growth) before
  // staging anything.
  float* dy = I.host.out(y).data();
  const cuda::DeviceWeight dw = I.weight_resident(w);
  cuda::GemmWorkspace* gemm = nullptr;
  const cuda::MatmulKernels kern = I.kernels();
  cuda::DeviceWeight cached = dw;  // what the cuBLAS path reads: dw or its f16 copy
  const bool wants_gemm = takes_gemm(I, kern, dw, n_tok);
  if (wants_gemm) {
    // Ops recorded against the old workspace run before it grows, and graphs that name
    // the old scratch go with it (as internal() does for the other scratch buffers).
    if (!I.gemm.fits(dw, n_tok)) {
      I.seg.flush();
      I.seg.destroy_graphs();
    }
    if (I.gemm.reserve(dw, n_tok)) gemm = &I.gemm;
    if (gemm) cached = I.f16.cached(w, dw, *I.arena);
  }
  size_t act_bytes = 0;
  std::byte* act = kern == cuda::MatmulKernels::V3 ? v3_act(I, dw, n_tok, &act_bytes) : nullptr;
  I.seg.room(I.float_room(x));
  const float* dx = I.floats(x);
  I.seg.sig("matmul", dw.data, dw.dtype, dw.n_cols, dw.n_rows, dw.row_bytes, dx, n_tok, dy, kern,
            act, cached.data, gemm ? gemm->scratch() : nullptr);
  const bool from_cache = cached.data != dw.data;
  if (I.prof.on()) {
    const char* path = from_cache   ? "gemm, f16 cache"
                       : gemm       ? "gemm"
                       : act        ? "int8"
                       : wants_gemm ? "gemm"
                       : kern == cuda::MatmulKernels::V3 && cuda::float_mma_fits(dw, dx, n_tok)
                           ? "matvec, tensor cores"
                           : "matvec";
    I.seg.label(
        fmt::format("matmul {} {}x{} x{} {}", dtype_name(w.dtype), w.n_cols, w.n_rows, n_tok, path),
        static_cast<uint64_t>(dw.row_bytes) * static_cast<uint64_t>(dw.n_rows));
  }
  // cuBLAS works in a fixed workspace that lives as long as the backend, and the f16 scratch
  // (in the signature above) only moves through the destroy_graphs() above, so a segment
  // with a GEMM is captured like any other. If that workspace could not be allocated, cuBLAS
  // takes its pool's, which a graph must not name: the segment runs op by op. Set here,
  // after everything above that may flush (a flush starts a graphable segment).
  if (wants_gemm && !(gemm && gemm->cublas_workspace())) I.seg.ungraphable();
  const int mma_min = I.mma_min_tokens();
  I.seg.record("matmul", [=](cudaStream_t st) {
    // The f16 copy is what the GEMM would have dequantized into its scratch: cuBLAS reads
    // it in place (gemm.cu) with the same call.
    if (from_cache) return cuda::launch_matmul(cached, dx, n_tok, dy, st, gemm);
    if (kern == cuda::MatmulKernels::V3)
      return cuda::launch_matmul_v3(dw, dx, n_tok, dy, act, act_bytes, st, gemm, mma_min);
    return cuda::launch_matmul(dw, dx, n_tok, dy, st, gemm);
  });
  I.host.done();
}

// SwiGLU inside the down projection's int8 activation quantization, where matmul() would take
// V3's int8 path for w at n_tok (the same conditions, the same scratch, launch_matvec_q8 after
// the quantization as launch_matmul_v3 runs it): the quantized blocks are those of the
// separate swiglu() op's output (the same expression, act.cuh), so y has the unfused bits.
// Anything else: swiglu() then matmul().
void CudaBackend::swiglu_matmul(const WeightMatrix& w, std::span<const float> gate,
                                std::span<const float> up, int64_t n_tok, std::span<float> act,
                                std::span<float> y) {
  KILN_CHECK(static_cast<int64_t>(gate.size()) == n_tok * w.n_cols && up.size() == gate.size() &&
                 act.size() == gate.size(),
             "swiglu_matmul: gate {} up {} act {} for {}x{}", gate.size(), up.size(), act.size(),
             n_tok, w.n_cols);
  KILN_CHECK(static_cast<int64_t>(y.size()) == n_tok * w.n_rows, "y {} != {}x{}", y.size(), n_tok,
             w.n_rows);
  Impl& I = *impl_;
  std::unique_lock lock(I.mu);
  const bool fused = I.kernels() == cuda::MatmulKernels::V3 && cuda::matvec_q8_supports(w.dtype) &&
                     n_tok >= 1 && n_tok <= I.int8_max_tokens() &&
                     cuda::act_q8_bytes(w.n_cols, n_tok) > 0 && I.mem.is_dev(gate.data()) &&
                     I.mem.is_dev(up.data()) && I.mem.is_dev(y.data());
  if (!fused) {
    lock.unlock();
    Backend::swiglu_matmul(w, gate, up, n_tok, act, y);
    return;
  }
  ExpertCopyFence fence{I};
  I.enter();
  const cuda::DeviceWeight dw = I.weight_resident(w);
  size_t act_bytes = 0;
  std::byte* qa = v3_act(I, dw, n_tok, &act_bytes);
  KILN_CHECK(qa != nullptr && act_bytes > 0, "swiglu_matmul: int8 scratch");
  const float* dg = gate.data();
  const float* du = up.data();
  float* dy = y.data();
  const int mma_min = I.mma_min_tokens();
  I.seg.sig("swiglu_matmul", dw.data, dw.dtype, dw.n_cols, dw.n_rows, dw.row_bytes, dg, du, n_tok,
            dy, qa);
  if (I.prof.on()) {
    I.seg.label(fmt::format("matmul {} {}x{} x{} int8, swiglu fused", dtype_name(w.dtype), w.n_cols,
                            w.n_rows, n_tok),
                static_cast<uint64_t>(dw.row_bytes) * static_cast<uint64_t>(dw.n_rows));
  }
  I.seg.record("swiglu_matmul", [=](cudaStream_t st) {
    if (cudaError_t e = cuda::launch_quantize_act_q8(dg, dw.n_cols, n_tok, qa, st, du);
        e != cudaSuccess)
      return e;
    return cuda::launch_matvec_q8(dw, qa, n_tok, dy, st, mma_min);
  });
}

// Tasks that share one resident input (a layer's Q/K/V, gate/up) on V3's int8 path: the input
// is quantized once and every weight reads that (launch_matvec_q8 is what matmul() runs after
// its own quantization of the same x, so each y has matmul()'s bits), same-layout runs of them
// in one grouped launch; float weights take matmul_batch_float below. Anything else: one
// matmul() per task.
void CudaBackend::matmul_batch(std::span<const MatmulTask> tasks, int64_t n_tok) {
  Impl& I = *impl_;
  std::unique_lock lock(I.mu);
  if (matmul_batch_float(tasks, n_tok)) return;
  bool shared = tasks.size() > 1 && I.kernels() == cuda::MatmulKernels::V3 &&
                n_tok <= I.int8_max_tokens() && I.mem.is_dev(tasks[0].x.data());
  for (const MatmulTask& t : tasks) {
    if (!shared) break;
    KILN_CHECK(static_cast<int64_t>(t.x.size()) == n_tok * t.w->n_cols &&
                   static_cast<int64_t>(t.y.size()) == n_tok * t.w->n_rows,
               "matmul_batch task shape");
    shared = t.x.data() == tasks[0].x.data() && t.w->n_cols == tasks[0].w->n_cols &&
             cuda::matvec_q8_supports(t.w->dtype) && I.mem.is_dev(t.y.data());
  }
  if (!shared || cuda::act_q8_bytes(tasks[0].w->n_cols, n_tok) == 0) {
    lock.unlock();
    Backend::matmul_batch(tasks, n_tok);
    return;
  }
  ExpertCopyFence fence{I};
  I.enter();
  struct One {
    cuda::DeviceWeight w;
    float* y;
  };
  std::vector<One> ones;
  ones.reserve(tasks.size());
  for (const MatmulTask& t : tasks) ones.push_back({I.weight_resident(*t.w), t.y.data()});
  size_t act_bytes = 0;
  std::byte* act = v3_act(I, ones[0].w, n_tok, &act_bytes);  // may flush: before staging
  const float* dx = tasks[0].x.data();
  const int64_t n_cols = tasks[0].w->n_cols;
  I.seg.sig("matmul_batch", dx, n_tok, act, ones.size());
  uint64_t bytes = 0;
  for (const One& o : ones) {
    I.seg.sig("matmul_batch", o.w.data, o.w.dtype, o.w.n_cols, o.w.n_rows, o.w.row_bytes, o.y);
    bytes += static_cast<uint64_t>(o.w.row_bytes) * static_cast<uint64_t>(o.w.n_rows);
  }
  if (I.prof.on()) {
    std::string types;
    int64_t rows = 0;
    for (const One& o : ones) {
      types += fmt::format("{}{}", types.empty() ? "" : "+", dtype_name(o.w.dtype));
      rows += o.w.n_rows;
    }
    I.seg.label(fmt::format("matmul {} {}x{} x{} int8 ({} weights, one quantization)", types,
                            n_cols, rows, n_tok, ones.size()),
                bytes);
  }
  std::vector<cuda::DeviceWeight> dws;
  std::vector<float*> dys;
  for (const One& o : ones) dws.push_back(o.w), dys.push_back(o.y);
  const int mma_min = I.mma_min_tokens();
  I.seg.record("matmul_batch", [=](cudaStream_t st) {
    if (cudaError_t e = cuda::launch_quantize_act_q8(dx, n_cols, n_tok, act, st); e != cudaSuccess)
      return e;
    return run_grouped(
        dws,
        [&](size_t i) { return cuda::launch_matvec_q8(dws[i], act, n_tok, dys[i], st, mma_min); },
        [&](size_t i, size_t n) {
          return cuda::launch_matvec_q8_group(
              std::span(dws).subspan(i, n), std::span(dys).subspan(i, n), act, n_tok, st, mma_min);
        });
  });
}

// Float weights sharing one resident input, up to kAutoFloatMaxTokens tokens, on the float
// kernel matmul() runs for each of them there (the tensor-core one, or V3's with the rows per
// warp float_v3_rows gives the first: every choice has the same bits,
// CudaMatvecQ8.FloatRowsAndColumnsKeepBits): one grouped launch per run of the same layout.
// False (nothing recorded) when that is not the path each task would take alone.
bool CudaBackend::matmul_batch_float(std::span<const MatmulTask> tasks, int64_t n_tok) {
  Impl& I = *impl_;
  if (tasks.size() < 2 || I.kernels() != cuda::MatmulKernels::V3 || n_tok < 1 ||
      n_tok > kAutoFloatMaxTokens || !I.mem.is_dev(tasks[0].x.data()))
    return false;
  for (const MatmulTask& t : tasks) {
    KILN_CHECK(static_cast<int64_t>(t.x.size()) == n_tok * t.w->n_cols &&
                   static_cast<int64_t>(t.y.size()) == n_tok * t.w->n_rows,
               "matmul_batch task shape");
    const DType d = t.w->dtype;
    if (t.x.data() != tasks[0].x.data() || t.w->n_cols != tasks[0].w->n_cols ||
        !(d == DType::F16 || d == DType::BF16 || d == DType::F32) || !I.mem.is_dev(t.y.data()) ||
        t.w->content_key != 0)
      return false;
  }
  ExpertCopyFence fence{I};
  I.enter();
  std::vector<cuda::DeviceWeight> dws;
  std::vector<float*> dys;
  for (const MatmulTask& t : tasks) {
    dws.push_back(I.weight_resident(*t.w));
    dys.push_back(t.y.data());
  }
  const float* dx = tasks[0].x.data();
  // matmul()'s own route for each (launch_matmul_v3): the tensor-core kernel where every
  // weight fits it (F16/BF16, widths of 64), else V3's float kernel where every weight takes
  // that (F32, other widths); never cuBLAS nor the V2 fallback, and never a mix (a grouped
  // launch is one kernel).
  bool mma = true, v3 = true;
  for (const cuda::DeviceWeight& w : dws) {
    if (takes_gemm(I, cuda::MatmulKernels::V3, w, n_tok)) return false;
    const bool fits = cuda::float_mma_fits(w, dx, n_tok);
    mma = mma && fits;
    v3 = v3 && !fits && cuda::float_v3_applies(w, dx, n_tok);
  }
  if (!mma && !v3) return false;
  I.seg.sig("matmul_batch_float", dx, n_tok, dws.size());
  uint64_t bytes = 0;
  for (size_t i = 0; i < dws.size(); ++i) {
    const cuda::DeviceWeight& w = dws[i];
    I.seg.sig("matmul_batch_float", w.data, w.dtype, w.n_cols, w.n_rows, w.row_bytes, dys[i]);
    bytes += static_cast<uint64_t>(w.row_bytes) * static_cast<uint64_t>(w.n_rows);
  }
  if (I.prof.on()) {
    int64_t rows = 0;
    for (const cuda::DeviceWeight& w : dws) rows += w.n_rows;
    I.seg.label(fmt::format("matmul {} {}x{} x{} matvec{} ({} weights, grouped launches)",
                            dtype_name(dws[0].dtype), dws[0].n_cols, rows, n_tok,
                            mma ? ", tensor cores" : "", dws.size()),
                bytes);
  }
  if (mma) {
    I.seg.record("matmul_batch_float", [=](cudaStream_t st) {
      return run_grouped(
          dws,
          [&](size_t i) { return cuda::launch_matvec_float_mma(dws[i], dx, n_tok, dys[i], st); },
          [&](size_t i, size_t n) {
            return cuda::launch_matvec_float_mma_group(std::span(dws).subspan(i, n),
                                                       std::span(dys).subspan(i, n), dx, n_tok, st);
          });
    });
    return true;
  }
  I.seg.record("matmul_batch_float", [=](cudaStream_t st) {
    return run_grouped(
        dws,
        [&](size_t i) {
          return cuda::launch_matvec_float_v3(
              dws[i], dx, n_tok, dys[i],
              cuda::float_v3_rows(dws[i].dtype, n_tok, dws[i].n_rows, dws[i].n_cols), st);
        },
        [&](size_t i, size_t n) {
          const cuda::DeviceWeight& w = dws[i];
          return cuda::launch_matvec_float_v3_group(
              std::span(dws).subspan(i, n), std::span(dys).subspan(i, n), dx, n_tok,
              cuda::float_v3_rows(w.dtype, n_tok, w.n_rows, w.n_cols), st);
        });
  });
  return true;
}

void CudaBackend::get_rows(const WeightMatrix& w, std::span<const int32_t> ids,
                           std::span<float> out) {
  KILN_CHECK(out.size() == ids.size() * static_cast<size_t>(w.n_cols));
  for (int32_t id : ids) KILN_CHECK(id >= 0 && id < w.n_rows, "row id {} of {}", id, w.n_rows);
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  ExpertCopyFence fence{I};
  I.enter();
  float* dout = I.host.out(out).data();                // may flush: before staging
  const cuda::DeviceWeight dw = I.weight_resident(w);  // may flush: before staging
  I.seg.room(I.seg.host_bytes(ids));
  const int32_t* dids = I.seg.ints(ids);
  const auto n = static_cast<int64_t>(ids.size());
  I.seg.sig("get_rows", dw.data, dw.dtype, dw.n_cols, dw.n_rows, dids, n, dout);
  I.seg.record("get_rows",
               [=](cudaStream_t st) { return cuda::launch_get_rows(dw, dids, n, dout, st); });
  I.host.done();
}

}  // namespace kiln
