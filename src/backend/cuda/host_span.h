// backend/cuda/host_span.h: the host-span path (cuda_backend.h, "Host spans"), written once
// for every op: an op called on host memory runs as its resident form. Each host output (and
// in-place array) gets a device twin, backend memory that DeviceAllocs knows, so the resident
// path takes it; an in-place array is uploaded into its twin first. Host inputs stay where
// they are (the resident path stages them like any host input); arrays the resident kernels
// must find on the device (KV planes, the rows argmax and top_k read) are uploaded to twins
// too. done() runs what was recorded, waits, and copies the output twins back.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include "backend/cuda/cuda_util.h"
#include "backend/cuda/segment.h"
#include "core/check.h"

namespace kiln::cuda {

// Callers hold the backend's mutex. Per op: twins first (growing one flushes, which must
// happen before the resident path stages anything: segment.h), then the resident op, then
// done(). An op takes at most kSlots twins.
class HostSpans {
 public:
  HostSpans(Segment& seg, DeviceAllocs& mem, const Stream& compute)
      : seg_(seg), mem_(mem), compute_(compute) {}
  HostSpans(const HostSpans&) = delete;
  HostSpans& operator=(const HostSpans&) = delete;
  ~HostSpans() {
    for (Slot& s : slots_)
      if (s.buf.get()) mem_.remove(s.buf.get());
  }

  // x as is when it is device memory, else a device twin whose contents done() copies back.
  template <typename T>
  std::span<T> out(std::span<T> x) {
    if (x.empty() || mem_.is_dev(x.data())) return x;
    T* d = static_cast<T*>(twin(x.size_bytes()));
    outs_.push_back({std::as_writable_bytes(x), d});
    return {d, x.size()};
  }
  // out() with x's contents uploaded first (an in-place array).
  template <typename T>
  std::span<T> inout(std::span<T> x) {
    if (x.empty() || mem_.is_dev(x.data())) return x;
    std::span<T> d = out(x);
    upload(d.data(), x.data(), x.size_bytes());
    return d;
  }
  // An input the resident kernels read on the device: as is when it is device memory, else
  // uploaded into a twin.
  template <typename T>
  std::span<const T> in(std::span<const T> x) {
    if (x.empty() || mem_.is_dev(x.data())) return x;
    T* d = static_cast<T*>(twin(x.size_bytes()));
    upload(d, x.data(), x.size_bytes());
    return {d, x.size()};
  }
  // Ends the op: without twins nothing (a resident op stays recorded); else everything
  // recorded runs, and the output twins are copied back to their host arrays.
  void done() {
    if (used_ == 0) return;
    seg_.flush();
    for (const Out& o : outs_)
      check_cuda(cudaMemcpy(o.host.data(), o.dev, o.host.size(), cudaMemcpyDeviceToHost),
                 "copy to host");
    outs_.clear();
    used_ = 0;
  }

 private:
  struct Slot {
    DeviceBuffer buf;
    size_t cap = 0;
  };
  struct Out {
    std::span<std::byte> host;
    const void* dev;
  };
  static constexpr int kSlots = 4;  // attention: K and V planes and its output

  // The next free slot, grown to `bytes`. Growing frees memory a captured graph may name:
  // what is recorded runs first and the graphs go (as the backend's internal scratch does).
  void* twin(size_t bytes) {
    KILN_CHECK(used_ < kSlots, "cuda: more than {} host arrays in one op", kSlots);
    Slot& s = slots_[used_++];
    if (bytes > s.cap || !s.buf.get()) {
      seg_.flush();
      seg_.destroy_graphs();
      if (s.buf.get()) mem_.remove(s.buf.get());
      s.buf.reset();
      s.cap = std::max(bytes, s.cap * 2);
      s.buf.ensure(s.cap, "host-span twin");
      mem_.add(s.buf.get(), s.cap);
    }
    return s.buf.get();
  }
  // On the compute stream: after every op launched so far, before the op recorded next.
  void upload(void* dev, const void* host, size_t bytes) {
    check_cuda(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, compute_.get()),
               "copy to device");
  }

  Segment& seg_;
  DeviceAllocs& mem_;
  const Stream& compute_;
  Slot slots_[kSlots];
  int used_ = 0;
  std::vector<Out> outs_;
};

}  // namespace kiln::cuda
