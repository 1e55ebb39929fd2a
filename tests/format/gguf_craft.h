// tests/format/gguf_craft.h: a raw GGUF byte builder for crafting malformed files field by
// field (the writer refuses to produce most of them), plus parse/expect helpers.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "format/gguf.h"
#include "format/mmap_file.h"

namespace kiln::testing {

class RawGguf {
 public:
  RawGguf& u8(uint8_t v) { return put(&v, 1); }
  RawGguf& u32(uint32_t v) { return put(&v, 4); }
  RawGguf& u64(uint64_t v) { return put(&v, 8); }
  RawGguf& i64(int64_t v) { return put(&v, 8); }
  RawGguf& str(std::string_view s) {
    u64(s.size());
    return put(s.data(), s.size());
  }
  RawGguf& zeros(size_t n) {
    b_.resize(b_.size() + n, std::byte{0});
    return *this;
  }
  RawGguf& pad_to(size_t align) {
    b_.resize((b_.size() + align - 1) / align * align);
    return *this;
  }
  // Magic, version, counts.
  RawGguf& header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
    return u32(0x46554747).u32(version).u64(n_tensors).u64(n_kv);
  }
  // One tensor info: name, dims, type, offset.
  RawGguf& tensor(std::string_view name, std::vector<int64_t> ne, uint32_t type, uint64_t offset) {
    str(name).u32(static_cast<uint32_t>(ne.size()));
    for (int64_t d : ne) i64(d);
    return u32(type).u64(offset);
  }
  RawGguf& kv_u32(std::string_view key, uint32_t v) { return str(key).u32(4).u32(v); }
  size_t size() const { return b_.size(); }
  const std::vector<std::byte>& bytes() const { return b_; }

 private:
  RawGguf& put(const void* p, size_t n) {
    const size_t at = b_.size();
    b_.resize(at + n);
    if (n) std::memcpy(b_.data() + at, p, n);
    return *this;
  }
  std::vector<std::byte> b_;
};

inline Expected<GgufFile> parse_bytes(std::vector<std::byte> b, std::string name = "crafted.gguf") {
  return GgufFile::parse(MappedFile::from_bytes(std::move(b), std::move(name)));
}

// The parse failed with one short line that contains every fragment in `want`.
inline ::testing::AssertionResult FailsWith(const Expected<GgufFile>& r,
                                            std::vector<std::string_view> want) {
  if (r) return ::testing::AssertionFailure() << "parsed successfully, expected an error";
  const std::string& m = r.error();
  if (m.find('\n') != std::string::npos)
    return ::testing::AssertionFailure() << "error spans several lines: " << m;
  if (m.size() > 400) return ::testing::AssertionFailure() << "error too long: " << m;
  for (std::string_view w : want)
    if (m.find(w) == std::string::npos)
      return ::testing::AssertionFailure() << "error lacks '" << w << "': " << m;
  return ::testing::AssertionSuccess() << m;
}

}  // namespace kiln::testing
