// memory/bytes.cpp: checked slicing and shared ownership of immutable bytes.
#include "memory/bytes.h"

#include <cstring>

#include "core/check.h"

namespace kiln {

namespace {
bool in_range(uint64_t offset, uint64_t length, uint64_t size) {
  return offset <= size && length <= size - offset;  // no overflow: size - offset >= 0
}
}  // namespace

Expected<ByteView> ByteView::slice(uint64_t offset, uint64_t length) const {
  if (!in_range(offset, length, s_.size()))
    return Status::errorf("byte range [{}, {} + {}) lies outside a view of {} bytes", offset,
                          offset, length, s_.size());
  return ByteView(s_.subspan(offset, length));
}

ByteView ByteView::subview(uint64_t offset, uint64_t length) const {
  KILN_CHECK(in_range(offset, length, s_.size()), "subview [{}, {} + {}) of {} bytes", offset,
             offset, length, s_.size());
  return ByteView(s_.subspan(offset, length));
}

Bytes Bytes::of(std::shared_ptr<const MappedFile> file) {
  KILN_CHECK(file != nullptr);
  std::span<const std::byte> s = file->bytes();
  return Bytes(std::move(file), s);
}

Bytes Bytes::of_tensor(const GgufFile& file, const TensorInfo& t) {
  // GgufFile::view is already checked against the validated index.
  return Bytes(file.mapping(), file.view(t).bytes);
}

Expected<Bytes> Bytes::of_tensor(const GgufFile& file, std::string_view name) {
  const TensorInfo* t = file.find_tensor(name);
  if (!t) return Status::errorf("{}: tensor '{}' not found", file.path(), name);
  return of_tensor(file, *t);
}

Bytes Bytes::copy_of(std::span<const std::byte> src) {
  auto store = std::make_shared<std::vector<std::byte>>(src.begin(), src.end());
  std::span<const std::byte> s(store->data(), store->size());
  return Bytes(std::move(store), s);
}

Expected<Bytes> Bytes::slice(uint64_t offset, uint64_t length) const {
  if (!in_range(offset, length, s_.size()))
    return Status::errorf("byte range [{}, {} + {}) lies outside {} owned bytes", offset, offset,
                          length, s_.size());
  return Bytes(owner_, s_.subspan(offset, length));
}

PageRegion page_region(std::span<const std::byte> bytes, uint64_t page) {
  KILN_CHECK(page != 0 && (page & (page - 1)) == 0, "page size {} is not a power of two", page);
  const auto addr = reinterpret_cast<uintptr_t>(bytes.data());
  const uintptr_t base = addr & ~static_cast<uintptr_t>(page - 1);
  PageRegion r;
  r.base = reinterpret_cast<const std::byte*>(base);
  r.offset = addr - base;
  r.logical_bytes = bytes.size();
  r.device_bytes = round_up(r.offset + r.logical_bytes, page);
  return r;
}

}  // namespace kiln
