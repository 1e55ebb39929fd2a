// backend/cuda/host_span.h: the host-span path (cuda_backend.h, "Host spans"): an op whose
// output is host memory runs whatever was recorded first, copies its inputs into scratch
// slots on the compute stream, launches, copies its outputs back and synchronises; with the
// profiler on, events bracket the copies and the kernels.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <initializer_list>
#include <span>
#include <string_view>

#include "backend/cuda/cuda_util.h"
#include "backend/cuda/profiler.h"
#include "backend/cuda/segment.h"
#include "core/check.h"

namespace kiln::cuda {

// An op: begin(), upload()/buffer() per input and output, launch(), download() per output,
// finish(). Callers hold the backend's mutex.
class HostSpan {
 public:
  HostSpan(Segment& seg, Profiler& prof, const DeviceAllocs& mem, const Stream& compute)
      : seg_(seg), prof_(prof), mem_(mem), compute_(compute) {}

  // Whatever is recorded runs first, and no argument may be device memory (that would need
  // the resident path, chosen by the output).
  void begin(std::initializer_list<const void*> inputs, std::string_view op) {
    seg_.enter();
    seg_.flush();
    for (const void* p : inputs)
      KILN_CHECK(!p || !mem_.is_dev(p), "cuda {}: device input with a host output", op);
    prof_.mark(0, s());
  }
  // Scratch slot `slot` (grown on demand) as n values; slot numbers are per op (an op's inputs
  // and outputs never share a slot).
  template <typename T>
  T* buffer(int slot, size_t n) {
    return static_cast<T*>(scratch_[slot].ensure(std::max<size_t>(n, 1) * sizeof(T), "scratch"));
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
  template <typename F>
  void launch(std::string_view op, F&& enqueue) {
    prof_.mark(1, s());
    check_cuda(enqueue(), op);
    prof_.mark(2, s());
  }
  void finish(std::string_view op) {
    prof_.mark(3, s());
    check_cuda(cudaStreamSynchronize(s()), op);
    prof_.host_op_done(op);
  }

 private:
  cudaStream_t s() const { return compute_.get(); }

  Segment& seg_;
  Profiler& prof_;
  const DeviceAllocs& mem_;
  const Stream& compute_;
  static constexpr int kSlots = 9;  // attention: 8 arrays and its sinks
  DeviceBuffer scratch_[kSlots];
};

}  // namespace kiln::cuda
