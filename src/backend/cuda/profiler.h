// backend/cuda/profiler.h: per-op timing with CUDA events (CudaStats::ops, kiln bench
// --cuda-profile): a host-span op's input copies, kernels and output copies, and each op of a
// resident chunk, which profile mode runs as a one-off graph with event nodes (segment.h).
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
  // Turns timing on or off and clears the times gathered so far; the first time it is turned
  // on it creates the host-span events (the first error of those, if any).
  cudaError_t set(bool on);

  // Host-span ops: events 0..3 bracket the input copies, the kernels and the output copies of
  // the op in flight (recorded only while on).
  void mark(int i, cudaStream_t s) {
    if (on_) check_cuda(cudaEventRecord(ev_[i].get(), s), "event record");
  }
  // After the host-span op's synchronisation: its kernel and copy times filed under `op`.
  void host_op_done(std::string_view op);

  // Resident chunks: timing events, two per recorded op, made on demand.
  void reserve_chunk_events(size_t n);
  cudaEvent_t chunk_event(size_t i) const { return chunk_ev_[i].get(); }

  // The entry filed under `name`, added (zero) in first-call order.
  CudaOpTime& entry(std::string_view name);
  const std::vector<CudaOpTime>& times() const { return times_; }

 private:
  bool on_ = false;
  bool events_made_ = false;  // ev_[] created
  Event ev_[4];
  std::deque<Event> chunk_ev_;
  std::vector<CudaOpTime> times_;
};

}  // namespace kiln::cuda
