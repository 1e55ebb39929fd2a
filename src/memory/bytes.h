// memory/bytes.h: immutable weight bytes. `Bytes` owns (shares) its backing store, usually the
// GGUF mapping, which stays mapped while any Bytes refers to it; `ByteView` borrows. Both are
// made only through checked constructors, so a view past the end of its parent cannot exist.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "format/gguf.h"
#include "format/mmap_file.h"

namespace kiln {

// A borrowed, immutable, bounds-checked slice. Cheap to copy; never outlives what it borrows
// from (the owner's lifetime is the caller's business, as with std::span).
class ByteView {
 public:
  ByteView() = default;
  explicit ByteView(std::span<const std::byte> s) : s_(s) {}

  // [offset, offset + length) of this view, or an error naming the numbers.
  Expected<ByteView> slice(uint64_t offset, uint64_t length) const;
  // Same, for callers whose bounds are an invariant they already proved: aborts if not.
  ByteView subview(uint64_t offset, uint64_t length) const;

  std::span<const std::byte> span() const { return s_; }
  const std::byte* data() const { return s_.data(); }
  uint64_t size() const { return s_.size(); }
  bool empty() const { return s_.empty(); }

 private:
  std::span<const std::byte> s_;
};

// Shared ownership of immutable bytes: a slice of a mapped file or of a heap copy. Copies
// share the backing store; the last one releases it (unmapping the file).
class Bytes {
 public:
  Bytes() = default;
  // The whole mapping.
  static Bytes of(std::shared_ptr<const MappedFile> file);
  // One tensor's bytes of an opened GGUF; they keep the mapping alive after the GgufFile goes.
  static Bytes of_tensor(const GgufFile& file, const TensorInfo& t);
  static Expected<Bytes> of_tensor(const GgufFile& file, std::string_view name);
  // A private heap copy (tests, small derived tables).
  static Bytes copy_of(std::span<const std::byte> src);

  Expected<Bytes> slice(uint64_t offset, uint64_t length) const;
  ByteView view() const { return ByteView(s_); }
  std::span<const std::byte> span() const { return s_; }
  const std::byte* data() const { return s_.data(); }
  uint64_t size() const { return s_.size(); }
  // Number of Bytes (and GgufFiles) sharing the backing store; for tests of the lifetime rule.
  long owners() const { return owner_.use_count(); }

 private:
  Bytes(std::shared_ptr<const void> owner, std::span<const std::byte> s)
      : owner_(std::move(owner)), s_(s) {}
  std::shared_ptr<const void> owner_;
  std::span<const std::byte> s_;
};

// Device-facing registration of host memory (cudaHostRegister, Metal no-copy buffers) needs
// a page-aligned base and a whole number of pages; consumers still use the exact logical
// length. Bytes past the logical end inside the last page belong to the same mapping (the
// kernel zero-fills a file's last page), so registering them is safe for mapped files.
struct PageRegion {
  const std::byte* base = nullptr;  // page-aligned, <= the first logical byte
  uint64_t offset = 0;              // first logical byte is base + offset
  uint64_t logical_bytes = 0;       // exact
  uint64_t device_bytes = 0;        // multiple of page, covers offset + logical_bytes
};
// `page` must be a power of two (default: the OS page size).
PageRegion page_region(std::span<const std::byte> bytes, uint64_t page = page_size());

}  // namespace kiln
