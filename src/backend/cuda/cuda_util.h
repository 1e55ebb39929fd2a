// backend/cuda/cuda_util.h: host-side CUDA helpers: the fatal check for runtime errors inside
// ops (the op table returns no Status, and a failed launch or copy on a working device is a
// broken invariant, not bad input) and RAII owners for device, pinned and stream objects.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string_view>
#include <utility>

#include "core/check.h"

namespace kiln::cuda {

// Aborts with "<what>: <CUDA error name>: <message>" when err is not cudaSuccess.
inline void check_cuda(cudaError_t err, std::string_view what) {
  KILN_CHECK(err == cudaSuccess, "cuda: {}: {}: {}", what, cudaGetErrorName(err),
             cudaGetErrorString(err));
}

// A grow-only device allocation (scratch space reused across calls).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  size_t size() const { return bytes_; }

  // At least `bytes` bytes (contents not kept when it grows).
  void* ensure(size_t bytes, std::string_view what) {
    check_cuda(grow(bytes), what);
    return ptr_;
  }
  // ensure() that reports a refused allocation instead of aborting (the error is cleared).
  bool try_ensure(size_t bytes) {
    if (grow(bytes) == cudaSuccess) return true;
    cudaGetLastError();
    return false;
  }
  void reset() {
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  void* get() const { return ptr_; }

 private:
  cudaError_t grow(size_t bytes) {
    if (bytes <= bytes_ && ptr_) return cudaSuccess;
    reset();
    const size_t want = bytes < 256 ? 256 : bytes;
    if (cudaError_t e = cudaMalloc(&ptr_, want); e != cudaSuccess) {
      ptr_ = nullptr;
      return e;
    }
    bytes_ = want;
    return cudaSuccess;
  }
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() {
    if (ptr_) cudaFreeHost(ptr_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  cudaError_t allocate(size_t bytes) {
    bytes_ = bytes;
    return cudaHostAlloc(&ptr_, bytes, cudaHostAllocDefault);
  }
  std::byte* data() const { return static_cast<std::byte*>(ptr_); }
  size_t size() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class Stream {
 public:
  Stream() = default;
  ~Stream() {
    if (s_) cudaStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaError_t create() { return cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking); }
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

class Event {
 public:
  Event() = default;
  ~Event() {
    if (e_) cudaEventDestroy(e_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaError_t create(bool timing = false) {
    return cudaEventCreateWithFlags(&e_, timing ? cudaEventDefault : cudaEventDisableTiming);
  }
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

}  // namespace kiln::cuda
