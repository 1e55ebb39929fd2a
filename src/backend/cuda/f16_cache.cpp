// backend/cuda/f16_cache.cpp: f16 copies of region weights for the cuBLAS path (f16_cache.h).
#include "backend/cuda/f16_cache.h"

#include <fmt/format.h>

namespace kiln::cuda {

DeviceWeight F16Cache::cached(const WeightMatrix& w, const DeviceWeight& dw,
                              const WeightArena& arena) {
  if (opts_.f16_cache_bytes == 0 || dw.dtype == DType::F16 || w.content_key != 0 || w.strided() ||
      !arena.holds(w.bytes))
    return dw;
  const size_t bytes = size_t(dw.n_rows) * size_t(dw.n_cols) * sizeof(uint16_t);
  auto it = copies_.find(dw.data);
  if (it == copies_.end()) {
    if (!capped_) {
      capped_ = true;
      cap_ = opts_.f16_cache_bytes;
      if (opts_.f16_cache_bytes == CudaOptions::kF16CacheAuto) {
        size_t free_b = 0, total_b = 0;
        cap_ = cudaMemGetInfo(&free_b, &total_b) == cudaSuccess ? free_b / 4 : 0;
      }
    }
    if (used_ + bytes > cap_) return dw;
    DeviceBuffer buf;
    if (!buf.try_ensure(bytes)) {
      cap_ = used_;  // the device is full: take no more
      return dw;
    }
    used_ += bytes;
    void* out = buf.get();
    it = copies_.emplace(dw.data, std::move(buf)).first;
    seg_.sig("f16_cache", dw.data, out);
    if (prof_.on())
      seg_.label(fmt::format("f16 cache copy {} {}x{}", dtype_name(dw.dtype), dw.n_cols, dw.n_rows),
                 uint64_t(dw.row_bytes) * uint64_t(dw.n_rows));
    seg_.record("f16_cache", [=](cudaStream_t st) { return launch_dequant_f16(dw, out, st); });
  }
  return DeviceWeight{DType::F16, dw.n_cols, dw.n_rows, size_t(dw.n_cols) * sizeof(uint16_t),
                      static_cast<const std::byte*>(it->second.get())};
}

}  // namespace kiln::cuda
