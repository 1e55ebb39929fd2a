// backend/cuda/profiler.h: per-op timing with CUDA events (CudaStats::ops, kiln bench
// --cuda-profile): each op of a chunk, which profile mode runs as a one-off graph with event
// nodes (segment.h). Host-span ops are chunks too (host_span.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <deque>
#include <string_view>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_util.h"

namespace kiln::cuda {

// On or off is run-time state, not an option: CudaOptions::profile is where it starts and
// CudaBackend::set_profile turns it between segments. While on, the segment launches only at
// flush, replays no graph and pads no key list, and launches leave PDL off.
class Profiler {
 public:
  bool on() const { return on_; }
  // Turns timing on or off and clears the times gathered so far.
  void set(bool on) {
    on_ = on;
    times_.clear();
  }

  // Resident chunks: timing events, two per recorded op, made on demand.
  void reserve_chunk_events(size_t n);
  cudaEvent_t chunk_event(size_t i) const { return chunk_ev_[i].get(); }

  // The entry filed under `name`, added (zero) in first-call order.
  CudaOpTime& entry(std::string_view name);
  const std::vector<CudaOpTime>& times() const { return times_; }

 private:
  bool on_ = false;
  std::deque<Event> chunk_ev_;
  std::vector<CudaOpTime> times_;
};

}  // namespace kiln::cuda
