// engine/host_logits.cpp: page-aligned logits storage, page-locked on device backends.
#include "engine/host_logits.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "core/check.h"

namespace kiln {

namespace {
constexpr size_t kPage = 4096;
}

void HostLogits::Free::operator()(float* p) const { std::free(p); }

std::span<float> HostLogits::resize(size_t n, Backend& be) {
  if (n > cap_) {
    reg_.reset();  // unregister before the old memory goes
    data_.reset();
    const size_t bytes = (std::max<size_t>(n, 1) * sizeof(float) + kPage - 1) / kPage * kPage;
    auto* p = static_cast<float*>(std::aligned_alloc(kPage, bytes));
    KILN_CHECK(p != nullptr, "out of host memory for {} logits", n);
    std::memset(p, 0, bytes);
    data_.reset(p);
    cap_ = bytes / sizeof(float);
    if (be.device_memory())
      reg_ = be.register_host_memory(std::as_writable_bytes(std::span<float>(p, cap_)));
  }
  size_ = n;
  return span();
}

}  // namespace kiln
