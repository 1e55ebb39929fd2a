// format/page_in.cpp: the stepped mlock of a mapping (see page_in.h).
#include "format/page_in.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

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

}  // namespace kiln
