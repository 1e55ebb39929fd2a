// engine/read_probe.h: this machine's streaming read bandwidth, the ceiling of `kiln bench`'s
// decode roofline on the CPU (issue 32). Each thread reads a buffer of its own (allocated and
// first touched by that thread, huge pages asked for) by every read method of
// backend/cpu/read_probe.h; the reading is the best method's, so a decode that prefetches, or
// a peer that repacks its weights into huge pages, is measured against what the memory gives
// and not against one loop's habits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "backend/cpu/read_probe.h"

namespace kiln {

class ReadProbe {
 public:
  struct Reading {
    double gbps = 0;
    cpu::ReadMethod method = cpu::ReadMethod::kScalar;  // the method that read fastest
  };
  // `bytes` split over `threads` buffers (far larger than the caches by default: 512 MiB).
  explicit ReadProbe(int threads, size_t bytes = size_t{512} << 20);
  ~ReadProbe();
  ReadProbe(const ReadProbe&) = delete;
  ReadProbe& operator=(const ReadProbe&) = delete;

  // Every method `passes` times, all threads at once on their own buffers; the best pass.
  Reading measure(int passes = 2) { return measure(cpu::kReadMethods, passes); }
  Reading measure(std::span<const cpu::ReadMethod> methods, int passes);

 private:
  struct Buffer {
    uint64_t* words = nullptr;
    size_t n = 0;
  };
  std::vector<Buffer> bufs_;
};

}  // namespace kiln
