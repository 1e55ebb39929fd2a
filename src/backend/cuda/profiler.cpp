// backend/cuda/profiler.cpp: per-op timing (profiler.h).
#include "backend/cuda/profiler.h"

#include <algorithm>
#include <string>

namespace kiln::cuda {

cudaError_t Profiler::set(bool on) {
  if (on && !events_made_) {
    for (Event& e : ev_)
      if (cudaError_t err = e.create(/*timing=*/true); err != cudaSuccess) return err;
    events_made_ = true;
  }
  on_ = on;
  times_.clear();
  return cudaSuccess;
}

void Profiler::host_op_done(std::string_view op) {
  if (!on_) return;
  float in_ms = 0, kernel_ms = 0, out_ms = 0;
  check_cuda(cudaEventElapsedTime(&in_ms, ev_[0].get(), ev_[1].get()), "event time");
  check_cuda(cudaEventElapsedTime(&kernel_ms, ev_[1].get(), ev_[2].get()), "event time");
  check_cuda(cudaEventElapsedTime(&out_ms, ev_[2].get(), ev_[3].get()), "event time");
  CudaOpTime& t = entry(op);
  t.calls += 1;
  t.kernel_ms += kernel_ms;
  t.copy_ms += in_ms + out_ms;
}

void Profiler::reserve_chunk_events(size_t n) {
  while (chunk_ev_.size() < n) {
    chunk_ev_.emplace_back();
    check_cuda(chunk_ev_.back().create(/*timing=*/true), "event");
  }
}

CudaOpTime& Profiler::entry(std::string_view name) {
  auto it =
      std::find_if(times_.begin(), times_.end(), [&](const CudaOpTime& t) { return t.op == name; });
  if (it == times_.end()) it = times_.insert(times_.end(), CudaOpTime{std::string(name), 0, 0, 0});
  return *it;
}

}  // namespace kiln::cuda
