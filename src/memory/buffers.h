// memory/buffers.h: owned, 64-byte-aligned, writable buffers with distinct types per role:
// F32Buffer for activations, F16Buffer for KV planes. zeros() is the default allocator;
// F16Buffer::uninitialized() exists only for KV planes, whose ring metadata guarantees each
// row is written before it is read. Builds with KILN_POISON fill those planes with a poison
// pattern so a premature read is caught (check_not_poisoned / poisoned_rows).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "core/half.h"
#include "core/status.h"

namespace kiln {

inline constexpr size_t kBufferAlignment = 64;  // a cache line; AVX-512 loads are aligned

// A quiet f16 NaN with payload 0x11: arithmetic never produces it (conversions and NaN
// propagation give payload 0x200 = 0x7E00), so finding it means "never written".
inline constexpr uint16_t kPoisonF16 = 0x7E11;
#ifdef KILN_POISON
inline constexpr bool kPoisonEnabled = true;
#else
inline constexpr bool kPoisonEnabled = false;
#endif

namespace detail {
// n_bytes rounded up to the alignment; aborts with the size on allocation failure.
void* aligned_alloc_bytes(size_t n_bytes);
void aligned_free(void* p);

// Move-only owner of n elements of trivially copyable T. Each buffer has its own identity:
// copying is explicit (clone), so two writers never share storage by accident.
template <typename T>
class AlignedArray {
 public:
  AlignedArray() = default;
  explicit AlignedArray(size_t n);  // storage is NOT initialised; callers fill it
  ~AlignedArray() { aligned_free(p_); }
  AlignedArray(AlignedArray&& o) noexcept : p_(o.p_), n_(o.n_) {
    o.p_ = nullptr;
    o.n_ = 0;
  }
  AlignedArray& operator=(AlignedArray&& o) noexcept {
    if (this != &o) {
      aligned_free(p_);
      p_ = o.p_;
      n_ = o.n_;
      o.p_ = nullptr;
      o.n_ = 0;
    }
    return *this;
  }
  AlignedArray(const AlignedArray&) = delete;
  AlignedArray& operator=(const AlignedArray&) = delete;

  T* data() { return p_; }
  const T* data() const { return p_; }
  size_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};
}  // namespace detail

// Activations: [rows][width] f32, zero-initialised.
class F32Buffer {
 public:
  F32Buffer() = default;
  static F32Buffer zeros(size_t n);
  F32Buffer clone() const;

  std::span<float> span() { return {a_.data(), a_.size()}; }
  std::span<const float> span() const { return {a_.data(), a_.size()}; }
  float* data() { return a_.data(); }
  const float* data() const { return a_.data(); }
  size_t size() const { return a_.size(); }
  float& operator[](size_t i) { return a_.data()[i]; }
  float operator[](size_t i) const { return a_.data()[i]; }

 private:
  detail::AlignedArray<float> a_;
};

// KV planes: [n_rows][width] f16.
class F16Buffer {
 public:
  F16Buffer() = default;
  static F16Buffer zeros(size_t n);
  // For KV planes only (see the file comment). With KILN_POISON every element is
  // kPoisonF16; without it the contents are whatever the allocator returned.
  static F16Buffer uninitialized(size_t n);
  F16Buffer clone() const;

  std::span<f16> span() { return {a_.data(), a_.size()}; }
  std::span<const f16> span() const { return {a_.data(), a_.size()}; }
  f16* data() { return a_.data(); }
  const f16* data() const { return a_.data(); }
  size_t size() const { return a_.size(); }
  // Elements [row * width, (row + 1) * width); range-checked (KILN_CHECK).
  std::span<f16> row(size_t row, size_t width);
  std::span<const f16> row(size_t row, size_t width) const;

 private:
  detail::AlignedArray<f16> a_;
};

// Rows in [first_row, first_row + n_rows) of a [*][width] plane holding any poison element.
std::vector<size_t> poisoned_rows(std::span<const f16> plane, size_t width, size_t first_row,
                                  size_t n_rows);
// Ok, or an error naming `what`, the element index and the pattern: a read of never-written
// KV rows. Meaningful in KILN_POISON builds (elsewhere nothing is poisoned, so it passes).
Status check_not_poisoned(std::span<const f16> values, std::string_view what);

}  // namespace kiln
