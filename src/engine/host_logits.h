// engine/host_logits.h: the host buffer a session's (or a batch's) logits land in. On a
// backend that computes in device memory it is page-locked once through
// Backend::register_host_memory, so each step's download is one DMA straight into it (the
// CUDA backend otherwise copies through its own pinned buffer and then memcpy()s: at 64
// sequences, 8 MB per step on the host while the GPU waits). Page-aligned and page-rounded, so
// the registration never shares a page with other memory (registering a page twice fails).
#pragma once

#include <cstddef>
#include <memory>
#include <span>

#include "backend/backend.h"

namespace kiln {

class HostLogits {
 public:
  // n floats, registered with `be` when it computes in device memory. Growing gives fresh
  // zero-filled memory (callers overwrite every value they read); shrinking keeps the memory.
  std::span<float> resize(size_t n, Backend& be);
  std::span<float> span() const { return {data_.get(), size_}; }
  void clear() { size_ = 0; }

 private:
  struct Free {
    void operator()(float* p) const;
  };
  std::unique_ptr<float[], Free> data_;
  size_t size_ = 0, cap_ = 0;
  // Declared after data_: released (unregistered) before the memory is freed.
  std::shared_ptr<void> reg_;
};

}  // namespace kiln
