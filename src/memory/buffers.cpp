// memory/buffers.cpp: aligned allocation and the zero / poison fill policies.
#include "memory/buffers.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "core/check.h"
#include "format/mmap_file.h"

namespace kiln {

namespace detail {

void* aligned_alloc_bytes(size_t n_bytes) {
  if (n_bytes == 0) return nullptr;
  KILN_CHECK(n_bytes <= SIZE_MAX - kBufferAlignment, "buffer of {} bytes is too large", n_bytes);
  void* p = std::aligned_alloc(kBufferAlignment, round_up(n_bytes, kBufferAlignment));
  KILN_CHECK(p != nullptr, "out of memory allocating a {}-byte buffer", n_bytes);
  return p;
}

void aligned_free(void* p) { std::free(p); }

template <typename T>
AlignedArray<T>::AlignedArray(size_t n) : n_(n) {
  KILN_CHECK(n <= SIZE_MAX / sizeof(T), "buffer of {} elements overflows size_t", n);
  p_ = static_cast<T*>(aligned_alloc_bytes(n * sizeof(T)));
}

template class AlignedArray<float>;
template class AlignedArray<f16>;

}  // namespace detail

F32Buffer F32Buffer::zeros(size_t n) {
  F32Buffer b;
  b.a_ = detail::AlignedArray<float>(n);
  if (n) std::memset(b.a_.data(), 0, n * sizeof(float));
  return b;
}

F32Buffer F32Buffer::clone() const {
  F32Buffer b;
  b.a_ = detail::AlignedArray<float>(size());
  if (size()) std::memcpy(b.a_.data(), data(), size() * sizeof(float));
  return b;
}

F16Buffer F16Buffer::zeros(size_t n) {
  F16Buffer b;
  b.a_ = detail::AlignedArray<f16>(n);
  if (n) std::memset(static_cast<void*>(b.a_.data()), 0, n * sizeof(f16));
  return b;
}

F16Buffer F16Buffer::uninitialized(size_t n) {
  F16Buffer b;
  b.a_ = detail::AlignedArray<f16>(n);
  if constexpr (kPoisonEnabled) std::fill_n(b.a_.data(), n, f16{kPoisonF16});
  return b;
}

F16Buffer F16Buffer::clone() const {
  F16Buffer b;
  b.a_ = detail::AlignedArray<f16>(size());
  if (size()) std::memcpy(static_cast<void*>(b.a_.data()), data(), size() * sizeof(f16));
  return b;
}

std::span<f16> F16Buffer::row(size_t r, size_t width) {
  KILN_CHECK(width > 0 && r < size() / width, "row {} of width {} in a plane of {} elements", r,
             width, size());
  return span().subspan(r * width, width);
}

std::span<const f16> F16Buffer::row(size_t r, size_t width) const {
  KILN_CHECK(width > 0 && r < size() / width, "row {} of width {} in a plane of {} elements", r,
             width, size());
  return span().subspan(r * width, width);
}

std::vector<size_t> poisoned_rows(std::span<const f16> plane, size_t width, size_t first_row,
                                  size_t n_rows) {
  KILN_CHECK(
      width > 0 && first_row <= plane.size() / width && n_rows <= plane.size() / width - first_row,
      "rows [{}, +{}) of width {} in a plane of {} elements", first_row, n_rows, width,
      plane.size());
  std::vector<size_t> out;
  for (size_t r = first_row; r < first_row + n_rows; ++r) {
    const f16* p = plane.data() + r * width;
    if (std::any_of(p, p + width, [](f16 h) { return h.bits == kPoisonF16; })) out.push_back(r);
  }
  return out;
}

Status check_not_poisoned(std::span<const f16> values, std::string_view what) {
  for (size_t i = 0; i < values.size(); ++i)
    if (values[i].bits == kPoisonF16)
      return Status::errorf(
          "{}: element {} holds the poison pattern {:#06x}: read before "
          "it was written",
          what, i, kPoisonF16);
  return Status::ok();
}

}  // namespace kiln
