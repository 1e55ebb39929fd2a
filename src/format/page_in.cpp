// format/page_in.cpp: the stepped page-in and mlock of a mapping (see page_in.h).
#include "format/page_in.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

namespace kiln {

Status lock_in_ram(const MappedFile& file,
                   const std::function<void(uint64_t, uint64_t)>& progress) {
  const uint64_t size = file.size();
  if (size == 0) return Status::ok();
  constexpr uint64_t kStep = uint64_t{64} << 20;
  for (uint64_t at = 0; at < size; at += kStep) {
    const uint64_t n = std::min(kStep, size - at);
    if (::mlock(file.data() + at, n) != 0) {
      const int e = errno;
      if (at > 0) ::munlock(file.data(), at);
      return Status::errorf("mlock of {} bytes of '{}' refused: {}", size, file.name(),
                            std::strerror(e));
    }
    if (progress) progress(at + n, size);
  }
  return Status::ok();
}

void page_in(const MappedFile& file, const std::function<void(uint64_t, uint64_t)>& progress) {
  const uint64_t size = file.size();
  if (file.is_mapped() && size > 0) {
    auto* base = const_cast<std::byte*>(file.data());  // madvise takes a non-const pointer
    // Read-ahead of the whole file first, so the steps below mostly find their pages arriving.
    ::madvise(base, size, MADV_WILLNEED);
    constexpr uint64_t kStep = uint64_t{64} << 20;
    const uint64_t page = page_size();
    for (uint64_t at = 0; at < size; at += kStep) {
      const uint64_t n = std::min(kStep, size - at);
      bool populated = false;
#ifdef MADV_POPULATE_READ
      populated = ::madvise(base + at, n, MADV_POPULATE_READ) == 0;
#endif
      if (!populated) {
        // One read per page faults it in; the volatile sum keeps the reads.
        volatile uint8_t sink = 0;
        for (uint64_t off = 0; off < n; off += page)
          sink = static_cast<uint8_t>(sink + static_cast<uint8_t>(file.data()[at + off]));
        (void)sink;
      }
      if (progress) progress(at + n, size);
    }
    return;
  }
  if (progress) progress(size, size);
}

uint64_t memory_available() {
  std::ifstream f("/proc/meminfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream in(line.substr(13));
    uint64_t kib = 0;
    in >> kib;
    return kib << 10;
  }
  return 0;
}

}  // namespace kiln
