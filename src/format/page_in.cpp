// format/page_in.cpp: the stepped page-in and mlock of a mapping (see page_in.h).
#include "format/page_in.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

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

namespace {

// THP's `enabled` is "[always]" or "[madvise]": an madvise(MADV_HUGEPAGE) region gets them.
bool huge_pages_on() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  std::getline(f, line);
  return line.find("[always]") != std::string::npos || line.find("[madvise]") != std::string::npos;
}

}  // namespace

bool move_into_huge_pages(const MappedFile& file,
                          const std::function<void(uint64_t, uint64_t)>& progress) {
#if defined(MADV_HUGEPAGE) && defined(MREMAP_FIXED)
  constexpr uint64_t kHuge = uint64_t{2} << 20;
  const uint64_t size = file.size();
  if (!file.is_mapped() || size < kHuge || !huge_pages_on()) return false;
  auto* base = const_cast<std::byte*>(file.data());  // mremap and madvise take non-const pointers
  // The copy starts at the same offset within a huge page as the mapping (mremap moves a huge
  // page whole only between ranges aligned alike); the slack around it is unmapped at once.
  const uint64_t skew = reinterpret_cast<uintptr_t>(base) & (kHuge - 1);
  const uint64_t page = page_size();
  const uint64_t len = (size + page - 1) / page * page;  // the mapping's length in pages
  const uint64_t span = len + 2 * kHuge;
  void* region = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (region == MAP_FAILED) return false;
  auto* r = static_cast<std::byte*>(region);
  const uint64_t lead =
      ((kHuge - (reinterpret_cast<uintptr_t>(r) & (kHuge - 1))) & (kHuge - 1)) + skew;
  std::byte* copy = r + lead;
  const uint64_t tail = span - lead - len;
  if (lead > 0) ::munmap(r, lead);
  if (tail > 0) ::munmap(copy + len, tail);
  ::madvise(copy, size, MADV_HUGEPAGE);
  constexpr uint64_t kStep = uint64_t{64} << 20;
  for (uint64_t at = 0; at < size; at += kStep) {
    const uint64_t n = std::min(kStep, size - at);
    std::memcpy(copy + at, base + at, n);
    if (progress) progress(at + n, size);
  }
  // Read-only as the file mapping was; then over the old range, which that unmaps. The system
  // call itself, not libc's mremap: UCX (linked for kvpack transfers) interposes mremap with
  // a hook that does not pass MREMAP_FIXED's new address on, which moved the copy to wherever
  // a stale register pointed and left the file mapping in place (tests/format
  // HugePages.MovedBytesStayAtTheirAddresses).
  if (::mprotect(copy, len, PROT_READ) != 0) {
    ::munmap(copy, len);
    return false;
  }
  const long moved = ::syscall(SYS_mremap, copy, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, base);
  if (moved != reinterpret_cast<long>(base)) {
    if (moved == -1) ::munmap(copy, len);  // still where it was: nothing else changed
    return false;
  }
  return true;
#else
  (void)file;
  (void)progress;
  return false;
#endif
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
