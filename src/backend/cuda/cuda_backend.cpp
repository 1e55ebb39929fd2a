// backend/cuda/cuda_backend.cpp: the op table on host spans over the CUDA kernels. Each op
// copies its inputs to device scratch on the compute stream, waits for the weight uploads it
// needs (copy stream -> event), launches through kernels.h, copies the outputs back and
// synchronises: correct with any host memory, one op at a time (calls are serialised).
#include "backend/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <mutex>
#include <numeric>
#include <vector>

#include "backend/cuda/cuda_util.h"
#include "backend/cuda/dequant.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/weight_arena.h"
#include "core/check.h"
#include "core/log.h"

namespace kiln {

using cuda::check_cuda;

struct CudaBackend::Impl {
  int device = 0;
  int n_sm = 1;
  std::string device_name;
  cuda::Stream compute, copy;
  cuda::MatmulKernels matmul_kernels = cuda::MatmulKernels::V2;
  cuda::GemmWorkspace gemm;  // V2's prefill path, grown on demand
  std::unique_ptr<cuda::WeightArena> arena;
  // Scratch slots, grown on demand; slot numbers are per op (an op's inputs and outputs never
  // share a slot).
  static constexpr int kSlots = 8;
  cuda::DeviceBuffer scratch[kSlots];
  std::mutex mu;

  cudaStream_t s() const { return compute.get(); }

  // Makes this thread's current device ours: the runtime keeps it per thread, and the backend
  // may be called from any thread.
  void enter() { check_cuda(cudaSetDevice(device), "set device"); }

  template <typename T>
  T* buffer(int slot, size_t n) {
    return static_cast<T*>(scratch[slot].ensure(std::max<size_t>(n, 1) * sizeof(T), "scratch"));
  }
  template <typename T>
  T* upload(int slot, std::span<const T> host) {
    T* d = buffer<T>(slot, host.size());
    if (!host.empty())
      check_cuda(cudaMemcpyAsync(d, host.data(), host.size_bytes(), cudaMemcpyHostToDevice, s()),
                 "copy to device");
    return d;
  }
  template <typename T>
  void download(std::span<T> host, const T* d) {
    if (!host.empty())
      check_cuda(cudaMemcpyAsync(host.data(), d, host.size_bytes(), cudaMemcpyDeviceToHost, s()),
                 "copy to host");
  }
  // Optional per-op timing (CudaOptions::profile): events 0..3 bracket the input copies, the
  // kernels and the output copies of the op in flight.
  bool profile = false;
  cuda::Event ev[4];
  std::vector<CudaOpTime> times;
  void mark(int i) {
    if (profile) check_cuda(cudaEventRecord(ev[i].get(), s()), "event record");
  }
  template <typename F>
  void launch(std::string_view op, F&& enqueue) {
    mark(1);
    check_cuda(enqueue(), op);
    mark(2);
  }
  void finish(std::string_view op) {
    mark(3);
    check_cuda(cudaStreamSynchronize(s()), op);
    if (!profile) return;
    float in_ms = 0, kernel_ms = 0, out_ms = 0;
    check_cuda(cudaEventElapsedTime(&in_ms, ev[0].get(), ev[1].get()), "event time");
    check_cuda(cudaEventElapsedTime(&kernel_ms, ev[1].get(), ev[2].get()), "event time");
    check_cuda(cudaEventElapsedTime(&out_ms, ev[2].get(), ev[3].get()), "event time");
    auto it =
        std::find_if(times.begin(), times.end(), [&](const CudaOpTime& t) { return t.op == op; });
    if (it == times.end()) it = times.insert(times.end(), CudaOpTime{std::string(op), 0, 0, 0});
    it->calls += 1;
    it->kernel_ms += kernel_ms;
    it->copy_ms += in_ms + out_ms;
  }

  cuda::DeviceWeight weight(const WeightMatrix& w) {
    KILN_CHECK(cuda::cuda_supports(w.dtype), "cuda: weight type {} has no kernel",
               dtype_name(w.dtype));
    KILN_CHECK(w.bytes.size() == static_cast<size_t>(w.n_rows) * w.row_bytes,
               "weight bytes {} != {} x {}", w.bytes.size(), w.n_rows, w.row_bytes);
    cuda::DeviceWeight d{w.dtype, w.n_cols, w.n_rows, w.row_bytes, nullptr};
    d.data = arena->lookup(w.bytes);
    // Kernels on the compute stream must not read the weight before its upload lands.
    check_cuda(cudaStreamWaitEvent(s(), arena->ready(), 0), "wait for weight upload");
    return d;
  }

  // Elementwise binary op on host spans.
  void binary(std::span<const float> a, std::span<const float> b, std::span<float> out,
              cuda::Binary op, std::string_view name) {
    KILN_CHECK(a.size() == b.size() && out.size() == a.size(), "{}: sizes {} {} {}", name, a.size(),
               b.size(), out.size());
    std::lock_guard lock(mu);
    enter();
    mark(0);
    const float* da = upload<float>(0, a);
    const float* db = upload<float>(1, b);
    float* dout = buffer<float>(2, out.size());
    launch(name, [&] {
      return cuda::launch_binary(da, db, dout, static_cast<int64_t>(out.size()), op, s());
    });
    download(out, static_cast<const float*>(dout));
    finish(name);
  }
  void unary(std::span<float> x, cuda::Unary op, float param, std::string_view name) {
    std::lock_guard lock(mu);
    enter();
    mark(0);
    float* dx = upload<float>(0, std::span<const float>(x));
    launch(name,
           [&] { return cuda::launch_unary(dx, static_cast<int64_t>(x.size()), op, param, s()); });
    download(x, static_cast<const float*>(dx));
    finish(name);
  }
};

CudaBackend::CudaBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CudaBackend::~CudaBackend() {
  if (impl_) {
    cudaSetDevice(impl_->device);
    cudaStreamSynchronize(impl_->compute.get());
    impl_->arena.reset();  // before its streams go
  }
}

const std::string& CudaBackend::device_name() const { return impl_->device_name; }

CudaStats CudaBackend::stats() const {
  const cuda::ArenaStats& a = impl_->arena->stats();
  CudaStats st;
  st.weight_bytes_uploaded = a.bytes_uploaded;
  st.weight_uploads = a.uploads;
  st.weight_cache_hits = a.cache_hits;
  st.arena_bytes = a.arena_bytes;
  st.upload_seconds = a.upload_seconds;
  st.zero_copy = a.zero_copy;
  st.ops = impl_->times;
  return st;
}

void CudaBackend::matmul(const WeightMatrix& w, std::span<const float> x, int64_t n_tok,
                         std::span<float> y) {
  KILN_CHECK(static_cast<int64_t>(x.size()) == n_tok * w.n_cols, "x {} != {}x{}", x.size(), n_tok,
             w.n_cols);
  KILN_CHECK(static_cast<int64_t>(y.size()) == n_tok * w.n_rows, "y {} != {}x{}", y.size(), n_tok,
             w.n_rows);
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  I.mark(0);
  const cuda::DeviceWeight dw = I.weight(w);
  const float* dx = I.upload<float>(0, x);
  float* dy = I.buffer<float>(1, y.size());
  cuda::GemmWorkspace* gemm = nullptr;
  if (I.matmul_kernels == cuda::MatmulKernels::V2 && n_tok > cuda::kMatvecMaxTokens &&
      I.gemm.reserve(dw, n_tok))
    gemm = &I.gemm;
  I.launch("matmul", [&] {
    return cuda::launch_matmul(dw, dx, n_tok, dy, I.s(), I.matmul_kernels, gemm);
  });
  I.download(y, static_cast<const float*>(dy));
  I.finish("matmul");
}

void CudaBackend::get_rows(const WeightMatrix& w, std::span<const int32_t> ids,
                           std::span<float> out) {
  KILN_CHECK(out.size() == ids.size() * static_cast<size_t>(w.n_cols));
  for (int32_t id : ids) KILN_CHECK(id >= 0 && id < w.n_rows, "row id {} of {}", id, w.n_rows);
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  I.mark(0);
  const cuda::DeviceWeight dw = I.weight(w);
  const int32_t* dids = I.upload<int32_t>(0, ids);
  float* dout = I.buffer<float>(1, out.size());
  I.launch("get_rows", [&] {
    return cuda::launch_get_rows(dw, dids, static_cast<int64_t>(ids.size()), dout, I.s());
  });
  I.download(out, static_cast<const float*>(dout));
  I.finish("get_rows");
}

void CudaBackend::rmsnorm(std::span<const float> x, std::span<const float> weight, int64_t n,
                          float eps, std::span<float> y) {
  KILN_CHECK(n > 0 && x.size() % n == 0 && y.size() == x.size());
  KILN_CHECK(weight.empty() || static_cast<int64_t>(weight.size()) == n);
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  I.mark(0);
  const float* dx = I.upload<float>(0, x);
  const float* dw = weight.empty() ? nullptr : I.upload<float>(1, weight);
  float* dy = I.buffer<float>(2, y.size());
  I.launch("rmsnorm", [&] {
    return cuda::launch_rmsnorm(dx, dw, static_cast<int64_t>(x.size()) / n, n, eps, dy, I.s());
  });
  I.download(y, static_cast<const float*>(dy));
  I.finish("rmsnorm");
}

void CudaBackend::rope(std::span<float> x, int64_t n_tok, int64_t n_head, int64_t head_dim,
                       std::span<const int32_t> pos, const RopeParams& p) {
  KILN_CHECK(static_cast<int64_t>(x.size()) == n_tok * n_head * head_dim);
  KILN_CHECK(static_cast<int64_t>(pos.size()) == n_tok);
  KILN_CHECK(p.n_rot > 0 && p.n_rot % 2 == 0 && p.n_rot <= head_dim, "n_rot {}", p.n_rot);
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  I.mark(0);
  float* dx = I.upload<float>(0, std::span<const float>(x));
  const int32_t* dpos = I.upload<int32_t>(1, pos);
  I.launch("rope", [&] {
    return cuda::launch_rope(dx, n_tok, n_head, head_dim, dpos, p.n_rot, p.freq_base, p.freq_scale,
                             p.style == RopeStyle::NeoX, I.s());
  });
  I.download(x, static_cast<const float*>(dx));
  I.finish("rope");
}

void CudaBackend::softmax(std::span<float> x, int64_t n) {
  KILN_CHECK(n > 0 && x.size() % n == 0);
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  I.mark(0);
  float* dx = I.upload<float>(0, std::span<const float>(x));
  I.launch("softmax",
           [&] { return cuda::launch_softmax(dx, static_cast<int64_t>(x.size()) / n, n, I.s()); });
  I.download(x, static_cast<const float*>(dx));
  I.finish("softmax");
}

void CudaBackend::swiglu(std::span<const float> gate, std::span<const float> up,
                         std::span<float> out) {
  impl_->binary(gate, up, out, cuda::Binary::SwiGLU, "swiglu");
}
void CudaBackend::geglu(std::span<const float> gate, std::span<const float> up,
                        std::span<float> out) {
  impl_->binary(gate, up, out, cuda::Binary::GeGLU, "geglu");
}
void CudaBackend::add(std::span<const float> a, std::span<const float> b, std::span<float> out) {
  impl_->binary(a, b, out, cuda::Binary::Add, "add");
}
void CudaBackend::mul(std::span<const float> a, std::span<const float> b, std::span<float> out) {
  impl_->binary(a, b, out, cuda::Binary::Mul, "mul");
}
void CudaBackend::scale(std::span<float> x, float s) {
  impl_->unary(x, cuda::Unary::Scale, s, "scale");
}
void CudaBackend::softcap(std::span<float> x, float cap) {
  KILN_CHECK(cap > 0);
  impl_->unary(x, cuda::Unary::Softcap, cap, "softcap");
}
void CudaBackend::sigmoid(std::span<float> x) {
  impl_->unary(x, cuda::Unary::Sigmoid, 0, "sigmoid");
}

void CudaBackend::store_rows_f16(std::span<const float> src, int64_t width,
                                 std::span<const int32_t> rows, std::span<f16> plane) {
  KILN_CHECK(width > 0 && src.size() == rows.size() * static_cast<size_t>(width));
  KILN_CHECK(plane.size() % width == 0);
  const int64_t n_phys = static_cast<int64_t>(plane.size()) / width;
  for (int32_t r : rows) KILN_CHECK(r >= 0 && r < n_phys, "row {} of {}", r, n_phys);
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  I.mark(0);
  // The plane lives on the host here: convert into dense rows on the device, then scatter on
  // the host; a device-resident plane passes its own rows to the same kernel.
  std::vector<int32_t> dense(rows.size());
  std::iota(dense.begin(), dense.end(), 0);
  const float* dsrc = I.upload<float>(0, src);
  const int32_t* drows = I.upload<int32_t>(1, std::span<const int32_t>(dense));
  uint16_t* dout = I.buffer<uint16_t>(2, src.size());
  I.launch("store_rows_f16", [&] {
    return cuda::launch_store_rows_f16(dsrc, width, drows, static_cast<int64_t>(rows.size()), dout,
                                       I.s());
  });
  std::vector<f16> host(src.size());
  check_cuda(
      cudaMemcpyAsync(host.data(), dout, host.size() * sizeof(f16), cudaMemcpyDeviceToHost, I.s()),
      "copy to host");
  I.finish("store_rows_f16");
  for (size_t i = 0; i < rows.size(); ++i)
    std::copy_n(host.begin() + static_cast<ptrdiff_t>(i * width), width,
                plane.begin() + static_cast<ptrdiff_t>(rows[i] * width));
}

void CudaBackend::attention(const AttentionArgs& a) {
  KILN_CHECK(a.n_head > 0 && a.n_head_kv > 0 && a.n_head % a.n_head_kv == 0);
  KILN_CHECK(a.head_dim > 0 && a.head_dim <= 256, "cuda attention: head_dim {} (at most 256)",
             a.head_dim);
  const int64_t hd = a.head_dim, q_w = a.n_head * hd, kv_w = a.n_head_kv * hd;
  const int64_t n_kv = static_cast<int64_t>(a.kv_rows.size());
  KILN_CHECK(static_cast<int64_t>(a.q.size()) == a.n_q * q_w);
  KILN_CHECK(a.out.size() == a.q.size());
  KILN_CHECK(static_cast<int64_t>(a.q_pos.size()) == a.n_q);
  KILN_CHECK(static_cast<int64_t>(a.kv_pos.size()) == n_kv);
  KILN_CHECK(a.k.size() == a.v.size() && a.k.size() % kv_w == 0);
  const int64_t n_phys = static_cast<int64_t>(a.k.size()) / kv_w;
  for (int32_t r : a.kv_rows) KILN_CHECK(r >= 0 && r < n_phys, "kv row {} of {}", r, n_phys);
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  I.mark(0);
  cuda::DeviceAttention d;
  d.q = I.upload<float>(0, a.q);
  d.k = reinterpret_cast<const uint16_t*>(I.upload<f16>(1, a.k));
  d.v = reinterpret_cast<const uint16_t*>(I.upload<f16>(2, a.v));
  d.kv_rows = I.upload<int32_t>(3, a.kv_rows);
  d.kv_pos = I.upload<int32_t>(4, a.kv_pos);
  d.q_pos = I.upload<int32_t>(5, a.q_pos);
  d.n_q = a.n_q;
  d.n_kv = n_kv;
  d.n_head = a.n_head;
  d.n_head_kv = a.n_head_kv;
  d.head_dim = hd;
  d.window = a.window;
  d.scale = a.scale;
  d.softcap = a.softcap;
  float* dout = I.buffer<float>(6, a.out.size());
  d.out = dout;
  float* part = I.buffer<float>(7, cuda::attention_scratch_floats(d, I.n_sm));
  I.launch("attention", [&] { return cuda::launch_attention(d, part, I.n_sm, I.s()); });
  I.download(a.out, static_cast<const float*>(dout));
  I.finish("attention");
}

int64_t CudaBackend::argmax(std::span<const float> x) {
  KILN_CHECK(!x.empty());
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  I.mark(0);
  const float* dx = I.upload<float>(0, x);
  int64_t* dbest = I.buffer<int64_t>(1, 1);
  I.launch("argmax",
           [&] { return cuda::launch_argmax(dx, static_cast<int64_t>(x.size()), dbest, I.s()); });
  int64_t best = 0;
  I.download(std::span<int64_t>(&best, 1), static_cast<const int64_t*>(dbest));
  I.finish("argmax");
  return best;
}

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
  auto impl = std::make_unique<CudaBackend::Impl>();
  impl->device = options.device;
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
  impl->profile = options.profile;
  impl->matmul_kernels =
      options.matmul == CudaMatmul::V1 ? cuda::MatmulKernels::V1 : cuda::MatmulKernels::V2;
  if (options.profile) {
    for (cuda::Event& e : impl->ev)
      if (cudaError_t err = e.create(/*timing=*/true); err != cudaSuccess)
        return Status::errorf("CUDA event: {}", cudaGetErrorString(err));
  }
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
  return std::make_unique<CudaBackend>(std::move(impl));
}

}  // namespace kiln
