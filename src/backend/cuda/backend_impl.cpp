// backend/cuda/backend_impl.cpp: the helpers the op table shares (backend_impl.h): weights on
// the device, float inputs, the deleter of alloc_bytes() memory.
#include "backend/cuda/backend_impl.h"

#include "backend/cuda/dequant.cuh"
#include "core/check.h"

namespace kiln {

using cuda::check_cuda;

const std::byte* CudaBackend::Impl::device_weight_bytes(const WeightMatrix& w) {
  if (w.content_key != 0) return experts.slice(w);
  if (w.strided()) return arena->lookup_rows(w.bytes.data(), w.row_bytes, w.stride(), w.n_rows);
  return arena->lookup(w.bytes);
}

cuda::DeviceWeight CudaBackend::Impl::weight_resident(const WeightMatrix& w) {
  KILN_CHECK(cuda::cuda_supports(w.dtype), "cuda: weight type {} has no kernel",
             dtype_name(w.dtype));
  KILN_CHECK(w.bytes.size() == w.span_bytes(), "weight bytes {} != {} rows of {} (stride {})",
             w.bytes.size(), w.n_rows, w.row_bytes, w.stride());
  // verify mode (tests) may refresh a cached weight in place: pending ops must read the
  // bytes they were recorded with.
  if (opts.verify_weight_cache && w.content_key == 0 && !arena->holds(w.bytes)) seg.flush();
  cuda::DeviceWeight d{w.dtype, w.n_cols, w.n_rows, w.row_bytes, nullptr};
  d.data = device_weight_bytes(w);
  weights_ready();
  l2.consumed(d.data);
  return d;
}

bool CudaBackend::Impl::cached_floats(std::span<const std::byte> b) const {
  const std::span<const std::byte> immutable = opts.immutable_region;
  return arena->holds(b) || (!immutable.empty() && b.data() >= immutable.data() &&
                             b.data() + b.size() <= immutable.data() + immutable.size());
}

const float* CudaBackend::Impl::floats(std::span<const float> h) {
  if (h.empty()) return nullptr;
  if (mem.is_dev(h.data())) return h.data();
  const auto b = std::as_bytes(h);
  if (cached_floats(b)) {
    const auto* d = reinterpret_cast<const float*>(arena->lookup(b));
    weights_ready();  // a first use uploads on the copy stream
    return d;
  }
  return reinterpret_cast<const float*>(seg.stage(h.data(), h.size_bytes(), h.size_bytes()));
}

size_t CudaBackend::Impl::float_room(std::span<const float> h) const {
  if (h.empty() || mem.is_dev(h.data()) || cached_floats(std::as_bytes(h))) return 0;
  return h.size_bytes() + 16;
}

void CudaBackend::Impl::weights_ready() {
  const uint64_t u = arena->stats().uploads;
  if (u == uploads_seen) return;
  check_cuda(cudaEventSynchronize(arena->ready()), "wait for weight upload");
  uploads_seen = u;
}

void CudaBackend::Impl::free_dev(std::byte* p) {
  std::lock_guard lock(mu);
  enter();
  seg.flush();  // pending ops may still use it
  mem.remove(p);
  // Graph signatures name memory by address, and the allocator hands a freed address out
  // again: a captured graph whose nodes name this buffer would match a later segment over a
  // different allocation at the same address and replay against the freed one (a memcpy
  // node then fails: cudaErrorInvalidValue at launch, seen on a GPU prefill node whose KV
  // planes grow while kvpack tiles are downloaded). Frees are rare in steady decode (KV
  // growth doubles, scratch is kept), so every graph goes and is captured again.
  seg.destroy_graphs();
  cudaFree(p);
}

}  // namespace kiln
