// format/mmap_file.h: a file's bytes, mapped read-only once (or held in memory for fuzzing
// and tests). Everything that reads weights borrows from one of these.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"

namespace kiln {

class MappedFile {
 public:
  // Maps `path` read-only (MAP_SHARED, PROT_READ). A zero-length file is an error.
  static Expected<std::shared_ptr<const MappedFile>> open(const std::string& path);
  // Wraps bytes already in memory (fuzzers, tests); no file behind them.
  static std::shared_ptr<const MappedFile> from_bytes(std::vector<std::byte> bytes,
                                                      std::string name = "<memory>");

  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::span<const std::byte> bytes() const { return {data_, size_}; }
  const std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& name() const { return name_; }
  bool is_mapped() const { return mapped_; }
  // mlock(2) of the whole mapping (the lock ends with the mapping). Errors say why (e.g.
  // RLIMIT_MEMLOCK); callers fall back to pageable weights with a notice.
  Status lock_in_ram() const;

 private:
  MappedFile() = default;
  const std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  bool mapped_ = false;
  std::vector<std::byte> owned_;
  std::string name_;
};

// Page math for device-facing registrations: the registered length rounds up to the page,
// the logical length stays exact.
uint64_t page_size();
constexpr uint64_t round_up(uint64_t n, uint64_t align) { return (n + align - 1) / align * align; }

}  // namespace kiln
