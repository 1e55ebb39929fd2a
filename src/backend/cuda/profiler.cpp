// backend/cuda/profiler.cpp: per-op timing (profiler.h).
#include "backend/cuda/profiler.h"

#include <algorithm>
#include <string>

namespace kiln::cuda {

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
