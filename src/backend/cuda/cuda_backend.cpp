// backend/cuda/cuda_backend.cpp: the op table over the CUDA kernels (cuda_backend.h): the
// backend's life (creation with its options validated once, destruction), memory and
// transfers, statistics, and the ops other than matmuls (ops_matmul.cpp) and attention
// (ops_attention.cpp). Each op takes one of two paths, chosen per call by where its output
// lives: resident (output in alloc_bytes() memory: the op is recorded into the segment,
// segment.h) or host spans (the same recorded op on device twins of the host arrays, run and
// copied back at once: host_span.h).
// Calls are serialised by the backend's mutex; the machinery lives in the rooms that
// CudaBackend::Impl composes (backend_impl.h).
#include "backend/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "backend/cuda/backend_impl.h"
#include "backend/cuda/cuda_util.h"
#include "backend/cuda/dequant.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/weight_arena.h"
#include "backend/tier_policy.h"
#include "backend/tp_group.h"
#include "core/check.h"
#include "core/log.h"

namespace kiln {

using cuda::check_cuda;

namespace {

// The kernel's view of RopeParams: YaRN terms derived here, factors at `dev_factors`.
cuda::RopeAngles rope_angles(const RopeParams& p, const float* dev_factors) {
  const RopeYarnTerms y = rope_yarn_terms(p);
  return cuda::RopeAngles{.n_rot = p.n_rot,
                          .freq_base = p.freq_base,
                          .freq_scale = p.freq_scale,
                          .neox = p.style == RopeStyle::NeoX,
                          .factors = dev_factors,
                          .corr_lo = y.corr_lo,
                          .corr_hi = y.corr_hi,
                          .ext_factor = y.ext_factor,
                          .mscale = y.mscale};
}

void check_rope_factors(const RopeParams& p) {
  KILN_CHECK(p.freq_factors.empty() || static_cast<int64_t>(p.freq_factors.size()) == p.n_rot / 2,
             "{} rope factors for n_rot {}", p.freq_factors.size(), p.n_rot);
}

// rope() and rope_qk() on resident memory (k null, n_head_k 0 for one tensor): one launch of
// the rope kernel, which serves both (rope.cu). The factors (a few hundred bytes of the host
// mapping) are staged with the positions. Caller holds mu.
void record_rope(CudaBackend::Impl& I, float* q, int64_t n_head_q, float* k, int64_t n_head_k,
                 int64_t n_tok, int64_t head_dim, std::span<const int32_t> pos,
                 const RopeParams& p) {
  check_rope_factors(p);
  I.enter();
  const std::span<const float> ff = p.freq_factors;
  I.seg.room(I.seg.host_bytes(pos) + I.seg.host_bytes(ff));
  const int32_t* dpos = I.seg.ints(pos);
  const float* dff = nullptr;
  if (!ff.empty())
    dff = I.mem.is_dev(ff.data()) ? ff.data()
                                  : reinterpret_cast<const float*>(
                                        I.seg.stage(ff.data(), ff.size_bytes(), ff.size_bytes()));
  const cuda::RopeAngles a = rope_angles(p, dff);
  I.seg.sig("rope", q, n_head_q, k, n_head_k, n_tok, head_dim, dpos, a.n_rot, a.freq_base,
            a.freq_scale, a.neox, dff, a.corr_lo, a.corr_hi, a.ext_factor, a.mscale);
  I.seg.record("rope", [=](cudaStream_t st) {
    return cuda::launch_rope_qk(q, n_head_q, k, n_head_k, n_tok, head_dim, dpos, a, st);
  });
}

// The resident rmsnorm (add_to null) or add_rmsnorm (add_to: the device rows x that `in` is
// added to, in place): `in` and the weight staged or cached, one recorded launch. Caller holds
// mu.
void record_norm(CudaBackend::Impl& I, std::span<const float> in, float* add_to,
                 std::span<const float> weight, int64_t n, float eps, float* dy) {
  I.enter();
  I.seg.room(I.float_room(in) + I.float_room(weight));
  const float* din = I.floats(in);
  const float* dw = I.floats(weight);
  I.weights_ready();
  const int64_t rows = static_cast<int64_t>(in.size()) / n;
  const char* op = add_to ? "add_rmsnorm" : "rmsnorm";
  I.seg.sig(op, add_to, din, dw, rows, n, eps, dy);
  I.seg.record(op, [=](cudaStream_t st) {
    return add_to ? cuda::launch_add_rmsnorm(add_to, din, dw, rows, n, eps, dy, st)
                  : cuda::launch_rmsnorm(din, dw, rows, n, eps, dy, st);
  });
}

// An elementwise binary op (host spans: host_span.h).
void binary(CudaBackend::Impl& I, std::span<const float> a, std::span<const float> b,
            std::span<float> out, cuda::Binary op, std::string_view name) {
  KILN_CHECK(a.size() == b.size() && out.size() == a.size(), "{}: sizes {} {} {}", name, a.size(),
             b.size(), out.size());
  std::lock_guard lock(I.mu);
  I.enter();
  float* dout = I.host.out(out).data();
  I.seg.room(I.float_room(a) + I.float_room(b));
  const float *da = I.floats(a), *db = I.floats(b);
  const auto n = static_cast<int64_t>(out.size());
  I.seg.sig(name.data(), da, db, dout, n, op);
  I.seg.record(name.data(),
               [=](cudaStream_t st) { return cuda::launch_binary(da, db, dout, n, op, st); });
  I.host.done();
}

// An elementwise unary op in place (host spans: host_span.h).
void unary(CudaBackend::Impl& I, std::span<float> x, cuda::Unary op, float param,
           std::string_view name) {
  std::lock_guard lock(I.mu);
  I.enter();
  float* dx = I.host.inout(x).data();
  const auto n = static_cast<int64_t>(x.size());
  I.seg.sig(name.data(), dx, n, op, param);
  I.seg.record(name.data(),
               [=](cudaStream_t st) { return cuda::launch_unary(dx, n, op, param, st); });
  I.host.done();
}

}  // namespace

CudaBackend::CudaBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CudaBackend::~CudaBackend() {
  if (impl_) {
    cudaSetDevice(impl_->opts.device);
    {
      std::lock_guard lock(impl_->mu);
      impl_->seg.flush();
      impl_->seg.destroy_graphs();
    }
    cudaStreamSynchronize(impl_->compute.get());
#if KILN_HAVE_NCCL
    if (impl_->comm) ncclCommDestroy(impl_->comm);
#endif
    impl_->arena.reset();  // before its streams go
  }
}

const std::string& CudaBackend::device_name() const { return impl_->device_name; }

void CudaBackend::prefetch_weights(std::span<const WeightMatrix* const> ws, int64_t n_tok) {
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.l2.hint(ws, n_tok, *I.arena);
}

void CudaBackend::set_profile(bool on) {
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  I.seg.flush();  // what was recorded so far runs in the old mode
  I.prof.set(on);
}

CudaStats CudaBackend::stats() const {
  const Impl& I = *impl_;
  const cuda::ArenaStats& a = I.arena->stats();
  CudaStats st;
  st.weight_bytes_uploaded = a.bytes_uploaded;
  st.weight_uploads = a.uploads;
  st.weight_cache_hits = a.cache_hits;
  st.arena_bytes = a.arena_bytes;
  st.upload_seconds = a.upload_seconds;
  st.zero_copy = a.zero_copy;
  st.ops = I.prof.times();
  st.segments_eager = I.seg.n_eager();
  st.graph_captures = I.seg.n_captures();
  st.graph_replays = I.seg.n_replays();
  st.segment_waits = I.seg.n_waits();
  st.segment_wait_ms = I.seg.wait_ms();
  st.device_bytes = I.mem.bytes();
  st.expert_hits = I.experts.hits();
  st.expert_misses = I.experts.misses();
  st.expert_evictions = I.experts.evictions();
  st.expert_bytes_copied = I.experts.bytes_copied();
  st.expert_bytes_held = I.experts.bytes_held();
  st.expert_cache_bytes = I.experts.cap();
  st.f16_cache_weights = I.f16.weights();
  st.f16_cache_bytes = I.f16.bytes();
  st.f16_cache_cap = I.f16.cap();
  st.l2_prefetch_hints = I.l2.hints();
  st.l2_prefetch_bytes = I.l2.bytes();
  return st;
}

std::shared_ptr<void> CudaBackend::register_host_memory(std::span<std::byte> mem) {
  if (mem.empty()) return nullptr;
  void* p = mem.data();
  if (cudaError_t e = cudaHostRegister(p, mem.size(), cudaHostRegisterPortable); e != cudaSuccess) {
    cudaGetLastError();
    log_notice(
        "cuda: could not page-lock {} MiB of host memory ({}); copies read pageable "
        "memory",
        mem.size() >> 20, cudaGetErrorString(e));
    return nullptr;
  }
  std::shared_ptr<Impl::Pinned> pinned = impl_->pinned;
  {
    std::lock_guard lk(pinned->mu);
    pinned->ranges[reinterpret_cast<uintptr_t>(p)] = mem.size();
  }
  // cudaHostUnregister is synchronous; the owner releases this before freeing the memory.
  return std::shared_ptr<void>(p, [pinned](void* q) {
    {
      std::lock_guard lk(pinned->mu);
      pinned->ranges.erase(reinterpret_cast<uintptr_t>(q));
    }
    cudaHostUnregister(q);
    cudaGetLastError();
  });
}

bool CudaBackend::groups_few_token_experts() const { return impl_->opts.few_token_moe; }

uint64_t CudaBackend::device_free_bytes() const {
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  size_t free_b = 0, total_b = 0;
  // The runtime keeps the current device per thread (not enter(): no op is being built).
  if (cudaSetDevice(I.opts.device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return free_b;
}

BackendBytes CudaBackend::alloc_bytes(size_t bytes) {
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  const size_t n = std::max<size_t>(bytes, 1);
  void* p = nullptr;
  if (cudaError_t e = cudaMalloc(&p, n); e != cudaSuccess) {
    cudaGetLastError();
    KILN_CHECK(false,
               "cuda: out of device memory allocating {} MiB (holding {} MiB of "
               "activations/KV and {} MiB of weights): {}",
               n >> 20, I.mem.bytes() >> 20, I.arena->stats().arena_bytes >> 20,
               cudaGetErrorString(e));
  }
  // On the compute stream, ahead of the recorded ops (none of which can name this buffer).
  check_cuda(cudaMemsetAsync(p, 0, n, I.s()), "zero new buffer");
  I.mem.add(p, n);
  Impl* impl = impl_.get();
  return BackendBytes(static_cast<std::byte*>(p), [impl](std::byte* q) { impl->free_dev(q); });
}

void CudaBackend::upload_bytes(std::span<const std::byte> host, std::span<std::byte> dst) {
  KILN_CHECK(dst.size() >= host.size());
  if (host.empty()) return;
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  if (!I.mem.is_dev(dst.data())) {  // host memory: a plain copy, in order with what ran before
    I.seg.flush();
    std::memcpy(dst.data(), host.data(), host.size());
    return;
  }
  if (host.size() > (size_t(64) << 20)) {  // too big to stage: a synchronous copy
    I.seg.flush();
    check_cuda(cudaMemcpy(dst.data(), host.data(), host.size(), cudaMemcpyHostToDevice), "upload");
    return;
  }
  I.seg.room(host.size() + 16);
  const std::byte* src = I.seg.stage(host.data(), host.size(), host.size());
  std::byte* d = dst.data();
  const size_t n = host.size();
  I.seg.sig("upload", src, d, n);
  I.seg.record("upload", [=](cudaStream_t st) {
    return cudaMemcpyAsync(d, src, n, cudaMemcpyDeviceToDevice, st);
  });
}

void CudaBackend::download_bytes(std::span<const std::byte> src, std::span<std::byte> host) {
  KILN_CHECK(host.size() >= src.size());
  if (src.empty()) return;
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  if (!I.mem.is_dev(src.data())) {
    I.seg.flush();
    std::memcpy(host.data(), src.data(), src.size());
    return;
  }
  const std::byte* d = src.data();
  const size_t n = src.size();
  // Page-locked destination (register_host_memory: a session's logits): one DMA straight into
  // it, no pinned bounce buffer and host copy (8 MB of logits per step at 64 sequences).
  const bool direct = I.pinned->holds(host.data(), n);
  if (!direct) I.seg.reserve_out(n);
  std::byte* out = direct ? host.data() : I.seg.out();
  I.seg.sig("download", d, n, out);
  I.seg.record("download", [=](cudaStream_t st) {
    return cudaMemcpyAsync(out, d, n, cudaMemcpyDeviceToHost, st);
  });
  I.seg.flush();
  if (!direct) std::memcpy(host.data(), out, n);
}

void CudaBackend::copy_bytes(std::span<const std::byte> src, std::span<std::byte> dst) {
  KILN_CHECK(dst.size() >= src.size());
  if (src.empty()) return;
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  const bool ds = I.mem.is_dev(src.data()), dd = I.mem.is_dev(dst.data());
  if (!ds && !dd) {
    I.seg.flush();
    std::memcpy(dst.data(), src.data(), src.size());
    return;
  }
  KILN_CHECK(ds && dd, "cuda copy between device and host memory: use upload/download");
  const std::byte* a = src.data();
  std::byte* b = dst.data();
  const size_t n = src.size();
  I.seg.sig("copy", a, b, n);
  I.seg.record("copy", [=](cudaStream_t st) {
    return cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, st);
  });
}

void CudaBackend::copy_bytes_2d(const std::byte* src, size_t src_pitch, std::byte* dst,
                                size_t dst_pitch, size_t width, size_t rows) {
  if (width == 0 || rows == 0) return;
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  const bool ds = I.mem.is_dev(src), dd = I.mem.is_dev(dst);
  if (!ds && !dd) {
    I.seg.flush();
    Backend::copy_bytes_2d(src, src_pitch, dst, dst_pitch, width, rows);
    return;
  }
  KILN_CHECK(ds && dd, "cuda copy between device and host memory: use upload/download");
  I.seg.sig("copy2d", src, dst, src_pitch, dst_pitch, width, rows);
  I.seg.record("copy", [=](cudaStream_t st) {
    return cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDeviceToDevice,
                             st);
  });
}

void CudaBackend::zero_bytes(std::span<std::byte> dst) {
  if (dst.empty()) return;
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  if (!I.mem.is_dev(dst.data())) {
    I.seg.flush();
    std::memset(dst.data(), 0, dst.size());
    return;
  }
  std::byte* b = dst.data();
  const size_t n = dst.size();
  I.seg.sig("zero", b, n);
  I.seg.record("zero", [=](cudaStream_t st) { return cudaMemsetAsync(b, 0, n, st); });
}

void CudaBackend::synchronize() {
  std::lock_guard lock(impl_->mu);
  impl_->seg.flush();
}

double CudaBackend::read_bandwidth_gbps() {
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  I.seg.flush();
  constexpr size_t kBytes = size_t(1) << 30;
  cuda::DeviceBuffer buf, sink;
  buf.ensure(kBytes, "bandwidth probe");
  const int blocks = I.n_sm * 8;
  sink.ensure(size_t(blocks) * sizeof(float), "bandwidth probe");
  check_cuda(cudaMemsetAsync(buf.get(), 0, kBytes, I.s()), "bandwidth probe");
  cuda::Event a, b;
  check_cuda(a.create(true), "event");
  check_cuda(b.create(true), "event");
  float best = 0;
  for (int i = 0; i < 6; ++i) {
    check_cuda(cudaEventRecord(a.get(), I.s()), "event record");
    check_cuda(
        cuda::launch_read_probe(buf.get(), kBytes, static_cast<float*>(sink.get()), blocks, I.s()),
        "bandwidth probe");
    check_cuda(cudaEventRecord(b.get(), I.s()), "event record");
    check_cuda(cudaEventSynchronize(b.get()), "bandwidth probe");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, a.get(), b.get()), "event time");
    if (i > 0 && ms > 0) best = std::max(best, float(kBytes / (ms * 1e-3) / 1e9));
  }
  return best;
}

void CudaBackend::rmsnorm(std::span<const float> x, std::span<const float> weight, int64_t n,
                          float eps, std::span<float> y) {
  KILN_CHECK(n > 0 && x.size() % n == 0 && y.size() == x.size());
  KILN_CHECK(weight.empty() || static_cast<int64_t>(weight.size()) == n);
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  record_norm(I, x, nullptr, weight, n, eps, I.host.out(y).data());
  I.host.done();
}

void CudaBackend::add_rmsnorm(std::span<float> x, std::span<const float> a,
                              std::span<const float> weight, int64_t n, float eps,
                              std::span<float> y) {
  KILN_CHECK(n > 0 && x.size() % n == 0 && y.size() == x.size() && a.size() == x.size());
  KILN_CHECK(weight.empty() || static_cast<int64_t>(weight.size()) == n);
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  float* dx = I.host.inout(x).data();
  record_norm(I, a, dx, weight, n, eps, I.host.out(y).data());
  I.host.done();
}

void CudaBackend::rope(std::span<float> x, int64_t n_tok, int64_t n_head, int64_t head_dim,
                       std::span<const int32_t> pos, const RopeParams& p) {
  KILN_CHECK(static_cast<int64_t>(x.size()) == n_tok * n_head * head_dim);
  KILN_CHECK(static_cast<int64_t>(pos.size()) == n_tok);
  KILN_CHECK(p.n_rot > 0 && p.n_rot % 2 == 0 && p.n_rot <= head_dim, "n_rot {}", p.n_rot);
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  record_rope(I, I.host.inout(x).data(), n_head, nullptr, 0, n_tok, head_dim, pos, p);
  I.host.done();
}

void CudaBackend::rope_qk(std::span<float> q, int64_t n_head_q, std::span<float> k,
                          int64_t n_head_k, int64_t n_tok, int64_t head_dim,
                          std::span<const int32_t> pos, const RopeParams& p) {
  KILN_CHECK(static_cast<int64_t>(q.size()) == n_tok * n_head_q * head_dim);
  KILN_CHECK(static_cast<int64_t>(k.size()) == n_tok * n_head_k * head_dim);
  KILN_CHECK(static_cast<int64_t>(pos.size()) == n_tok);
  KILN_CHECK(p.n_rot > 0 && p.n_rot % 2 == 0 && p.n_rot <= head_dim, "n_rot {}", p.n_rot);
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  float* dq = I.host.inout(q).data();
  record_rope(I, dq, n_head_q, I.host.inout(k).data(), n_head_k, n_tok, head_dim, pos, p);
  I.host.done();
}

void CudaBackend::softmax(std::span<float> x, int64_t n) {
  KILN_CHECK(n > 0 && x.size() % n == 0);
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  float* dx = I.host.inout(x).data();
  const int64_t rows = static_cast<int64_t>(x.size()) / n;
  I.seg.sig("softmax", dx, rows, n);
  I.seg.record("softmax", [=](cudaStream_t st) { return cuda::launch_softmax(dx, rows, n, st); });
  I.host.done();
}

void CudaBackend::swiglu(std::span<const float> gate, std::span<const float> up,
                         std::span<float> out) {
  binary(*impl_, gate, up, out, cuda::Binary::SwiGLU, "swiglu");
}
void CudaBackend::swiglu_oai(std::span<const float> gate, std::span<const float> up,
                             std::span<float> out, float alpha, float limit) {
  // The kernel has gpt-oss's constants built in; any other pair is refused, never approximated.
  KILN_CHECK(alpha == cuda::kOaiAlpha && limit == cuda::kOaiLimit,
             "cuda swiglu_oai: alpha {} limit {} (only gpt-oss's 1.702 / 7 are implemented)", alpha,
             limit);
  binary(*impl_, gate, up, out, cuda::Binary::SwiGLUOai, "swiglu_oai");
}

void CudaBackend::geglu(std::span<const float> gate, std::span<const float> up,
                        std::span<float> out) {
  binary(*impl_, gate, up, out, cuda::Binary::GeGLU, "geglu");
}
void CudaBackend::add(std::span<const float> a, std::span<const float> b, std::span<float> out) {
  binary(*impl_, a, b, out, cuda::Binary::Add, "add");
}
void CudaBackend::mul(std::span<const float> a, std::span<const float> b, std::span<float> out) {
  binary(*impl_, a, b, out, cuda::Binary::Mul, "mul");
}
// One launch each (the MoE general path's gather and weighted add-back of the rows routed to
// one expert); the ids and scales are staged like any host array.
void CudaBackend::gather_rows_f32(std::span<const float> src, int64_t width,
                                  std::span<const int32_t> ids, std::span<float> dst) {
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  float* ddst = I.host.out(dst).data();
  I.seg.room(I.float_room(src) + I.seg.host_bytes(ids));
  const float* dsrc = I.floats(src);
  const int32_t* dids = I.seg.ints(ids);
  const auto n = static_cast<int64_t>(ids.size());
  I.seg.sig("gather_rows", dsrc, width, dids, n, ddst);
  I.seg.record("gather_rows", [=](cudaStream_t st) {
    return cuda::launch_gather_rows(dsrc, width, dids, n, ddst, st);
  });
  I.host.done();
}
void CudaBackend::scale_add_rows_f32(std::span<float> src, int64_t width,
                                     std::span<const int32_t> ids, std::span<const float> scales,
                                     std::span<float> out) {
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  float* dsrc = I.host.inout(src).data();
  float* dout = I.host.inout(out).data();
  I.seg.room(I.float_room(scales) + I.seg.host_bytes(ids));
  const float* dscales = I.floats(scales);
  const int32_t* dids = I.seg.ints(ids);
  const auto n = static_cast<int64_t>(ids.size());
  I.seg.sig("scale_add_rows", dsrc, width, dids, dscales, n, dout);
  I.seg.record("scale_add_rows", [=](cudaStream_t st) {
    return cuda::launch_scale_add_rows(dsrc, width, dids, dscales, n, dout, st);
  });
  I.host.done();
}
void CudaBackend::scale(std::span<float> x, float s) {
  unary(*impl_, x, cuda::Unary::Scale, s, "scale");
}
void CudaBackend::softcap(std::span<float> x, float cap) {
  KILN_CHECK(cap > 0);
  unary(*impl_, x, cuda::Unary::Softcap, cap, "softcap");
}
void CudaBackend::sigmoid(std::span<float> x) {
  unary(*impl_, x, cuda::Unary::Sigmoid, 0, "sigmoid");
}

int64_t CudaBackend::argmax(std::span<const float> x) {
  KILN_CHECK(!x.empty());
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  const float* dx = I.host.in(x).data();
  const auto n = static_cast<int64_t>(x.size());
  int64_t* dbest = I.internal<int64_t>(I.argmax_out, 1, I.argmax_cap);
  I.seg.reserve_out(sizeof(int64_t));
  std::byte* out = I.seg.out();
  I.seg.sig("argmax", dx, n, dbest, out);
  I.seg.record("argmax", [=](cudaStream_t st) {
    if (cudaError_t e = cuda::launch_argmax(dx, n, dbest, st); e != cudaSuccess) return e;
    return cudaMemcpyAsync(out, dbest, sizeof(int64_t), cudaMemcpyDeviceToHost, st);
  });
  I.seg.flush();
  I.host.done();
  int64_t best = 0;
  std::memcpy(&best, out, sizeof(best));
  return best;
}

void CudaBackend::top_k(std::span<const float> x, int64_t n, int32_t k, std::span<int32_t> ids,
                        std::span<float> vals) {
  static_assert(cuda::kTopKMax == kTopKMost);
  const auto rows = static_cast<int64_t>(top_k_rows(x, n, k, ids, vals));
  Impl& I = *impl_;
  if (k > cuda::kTopKMax || rows > 65535) {  // beyond the kernel: the whole rows, sorted here
    std::vector<float> host(x.size());
    download(x, std::span<float>(host));
    Backend::top_k(host, n, k, ids, vals);
    return;
  }
  const size_t half = cuda::top_k_scratch(rows, n, k), n_out = static_cast<size_t>(rows * k);
  std::lock_guard lock(I.mu);
  I.enter();
  const float* dx = I.host.in(x).data();
  // Scratch and the download buffer first: growing either flushes.
  float* sv = I.internal<float>(I.topk_v, 2 * half + n_out, I.topk_v_cap);
  int32_t* si = I.internal<int32_t>(I.topk_i, 2 * half + n_out, I.topk_i_cap);
  I.seg.reserve_out(n_out * (sizeof(float) + sizeof(int32_t)));
  std::byte* out = I.seg.out();
  float* ov = sv + 2 * half;
  int32_t* oi = si + 2 * half;
  I.seg.sig("top_k", dx, rows, n, k, sv, si, out);
  I.seg.record("top_k", [=](cudaStream_t st) {
    if (cudaError_t e = cuda::launch_top_k(dx, rows, n, k, sv, si, ov, oi, st); e != cudaSuccess)
      return e;
    if (cudaError_t e = cudaMemcpyAsync(out, ov, n_out * sizeof(float), cudaMemcpyDeviceToHost, st);
        e != cudaSuccess)
      return e;
    return cudaMemcpyAsync(out + n_out * sizeof(float), oi, n_out * sizeof(int32_t),
                           cudaMemcpyDeviceToHost, st);
  });
  I.seg.flush();
  I.host.done();
  std::memcpy(vals.data(), out, n_out * sizeof(float));
  std::memcpy(ids.data(), out + n_out * sizeof(float), n_out * sizeof(int32_t));
}

void CudaBackend::all_reduce_sum(std::span<float> x) {
#if KILN_HAVE_NCCL
  Impl& I = *impl_;
  if (I.comm == nullptr || x.empty()) return;
  std::lock_guard lock(I.mu);
  I.enter();
  KILN_CHECK(I.mem.is_dev(x.data()),
             "cuda all_reduce_sum of host memory (a group's ranks compute "
             "resident)");
  float* d = x.data();
  const size_t n = x.size();
  ncclComm_t comm = I.comm;
  I.seg.sig("all_reduce", d, n);
  // NCCL calls are captured into the segment's graph like kernels (NCCL supports stream
  // capture); every rank records the same sequence, so the graphs match across ranks.
  I.seg.record("all_reduce", [=](cudaStream_t st) {
    const ncclResult_t r = ncclAllReduce(d, d, n, ncclFloat, ncclSum, comm, st);
    if (r != ncclSuccess) {
      log_notice("cuda: ncclAllReduce of {} floats: {}", n, ncclGetErrorString(r));
      return cudaErrorUnknown;
    }
    return cudaSuccess;
  });
#else
  (void)x;
#endif
}

Expected<std::unique_ptr<Backend>> make_cuda_tp_group(int n, const CudaOptions& options) {
  if (n < 1) return Status::errorf("--tensor-parallel {}: must be at least 1", n);
#if KILN_HAVE_NCCL
  const int have = cuda_device_count();
  if (have < n)
    return Status::errorf("--tensor-parallel {} needs {} CUDA devices, {} present", n, n, have);
  // NVLink multicast (NVLS) can take a shared host's GPUs out of service; kiln never needs it,
  // so it is off in every process that makes a group, whatever the environment said.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/1);
  std::vector<std::unique_ptr<Backend>> ranks;
  std::vector<CudaBackend::Impl*> impls;
  for (int r = 0; r < n; ++r) {
    CudaOptions o = options;
    o.device = r;
    o.weight_region = {};  // each rank uploads its own shard's weights on first use
    o.zero_copy = false;
    auto be = make_cuda_backend(o);
    if (!be) return be.status().context(fmt::format("tensor-parallel rank {}", r));
    impls.push_back((*be)->impl_.get());
    ranks.push_back(std::move(*be));
  }
  std::vector<ncclComm_t> comms(static_cast<size_t>(n));
  std::vector<int> devs(static_cast<size_t>(n));
  std::iota(devs.begin(), devs.end(), 0);
  if (ncclResult_t r = ncclCommInitAll(comms.data(), n, devs.data()); r != ncclSuccess)
    return Status::errorf("NCCL: ncclCommInitAll over {} GPUs: {}", n, ncclGetErrorString(r));
  for (int r = 0; r < n; ++r) impls[static_cast<size_t>(r)]->comm = comms[static_cast<size_t>(r)];
  return std::unique_ptr<Backend>(std::make_unique<TpGroup>(std::move(ranks)));
#else
  (void)options;
  if (n == 1) return Status::error("--tensor-parallel: this kiln was built without NCCL");
  return Status::errorf("--tensor-parallel {}: this kiln was built without NCCL", n);
#endif
}

namespace {
// CudaOptions' ranges, checked once at creation: one line naming the option and the range.
Status validate(const CudaOptions& o) {
  if (o.auto_int8_max_tokens < 1 || o.auto_int8_max_tokens > cuda::kQ8MaxTokens)
    return Status::errorf("cuda: int8 matmul token limit {} (1..{})", o.auto_int8_max_tokens,
                          cuda::kQ8MaxTokens);
  if (o.int8_mma_min_tokens < 0 || o.int8_mma_min_tokens > cuda::kQ8MaxTokens)
    return Status::errorf("cuda: int8 tensor-core token threshold {} (0..{}; 0: never)",
                          o.int8_mma_min_tokens, cuda::kQ8MaxTokens);
  if (o.graph_kv_bucket < 1)
    return Status::errorf("cuda: graph KV bucket {} keys (at least 1; 1: no padding)",
                          o.graph_kv_bucket);
  return Status::ok();
}
}  // namespace

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error for later calls
    return 0;
  }
  return n;
}

Expected<std::unique_ptr<CudaBackend>> make_cuda_backend(const CudaOptions& options) {
  int n = 0;
  if (cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess) {
    cudaGetLastError();
    return Status::errorf("no CUDA device: {}", cudaGetErrorString(e));
  }
  if (n == 0) return Status::error("no CUDA device: the driver reports none");
  if (options.device < 0 || options.device >= n)
    return Status::errorf("CUDA device {} does not exist ({} present)", options.device, n);
  KILN_TRY(validate(options));
  auto impl = std::make_unique<CudaBackend::Impl>(options);
  if (cudaError_t e = cudaSetDevice(options.device); e != cudaSuccess)
    return Status::errorf("CUDA device {}: {}", options.device, cudaGetErrorString(e));
  cudaDeviceProp prop{};
  if (cudaError_t e = cudaGetDeviceProperties(&prop, options.device); e != cudaSuccess)
    return Status::errorf("CUDA device {}: {}", options.device, cudaGetErrorString(e));
  impl->n_sm = prop.multiProcessorCount;
  impl->device_name =
      fmt::format("{} (sm_{}{}, {} SMs, {:.1f} GiB)", prop.name, prop.major, prop.minor,
                  prop.multiProcessorCount, prop.totalGlobalMem / 1073741824.0);
  if (prop.major < 9)
    return Status::errorf("CUDA device {} is {} but kiln is built for sm_90", options.device,
                          impl->device_name);
  if (cudaError_t e = impl->compute.create(); e != cudaSuccess)
    return Status::errorf("CUDA stream: {}", cudaGetErrorString(e));
  if (cudaError_t e = impl->copy.create(); e != cudaSuccess)
    return Status::errorf("CUDA stream: {}", cudaGetErrorString(e));
  if (options.l2_prefetch_bytes > 0) {
    KILN_TRY(impl->seg.init_branches());
    // Hinted bytes not yet read stay within 3/4 of the L2: the matvec that reads them, and
    // the small ops before it, keep the rest.
    impl->l2.start(options.l2_prefetch_bytes, size_t(prop.l2CacheSize) / 4 * 3);
  }
  if (cudaError_t e = impl->experts.init(); e != cudaSuccess)
    return Status::errorf("CUDA event: {}", cudaGetErrorString(e));
  if (options.profile) impl->prof.set(true);
  impl->arena = std::make_unique<cuda::WeightArena>(impl->copy.get(), options.arena_chunk_bytes,
                                                    options.verify_weight_cache);
  KILN_TRY(impl->arena->init());
  bool placed = false;
  if (options.zero_copy && !options.weight_region.empty()) {
    const Status reg = impl->arena->register_region(options.weight_region);
    if (reg) {
      placed = true;
    } else {
      log_notice("cuda: zero-copy weights unavailable ({}); uploading them to the device",
                 reg.message());
    }
  }
  if (!placed) KILN_TRY(impl->arena->upload_region(options.weight_region, options.progress));
  // Resident ops wait on the host for arena uploads made after this point (weights_ready).
  if (cudaError_t e = cudaEventSynchronize(impl->arena->ready()); e != cudaSuccess)
    return Status::errorf("cuda: weight upload: {}", cudaGetErrorString(e));
  impl->uploads_seen = impl->arena->stats().uploads;
  return std::make_unique<CudaBackend>(std::move(impl));
}

}  // namespace kiln
