// engine/read_probe.cpp: see read_probe.h.
#include "engine/read_probe.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <thread>

namespace kiln {
namespace {

// Runs fn(t) on `n` threads at once (t = 0 on the caller).
template <class Fn>
void on_threads(size_t n, Fn&& fn) {
  std::vector<std::thread> ts;
  for (size_t t = 1; t < n; ++t) ts.emplace_back([&fn, t] { fn(t); });
  fn(0);
  for (std::thread& th : ts) th.join();
}

}  // namespace

ReadProbe::ReadProbe(int threads, size_t bytes) {
  const size_t n = static_cast<size_t>(std::max(1, threads));
  bufs_.resize(n);
  const size_t words = std::max<size_t>(bytes / n / sizeof(uint64_t), 1);
  // Each thread maps and fills its own buffer, so its pages are where that thread reads them
  // (first touch); every word is 1, which measure() checks.
  on_threads(n, [&](size_t t) {
    const size_t len = words * sizeof(uint64_t);
    void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return;
#ifdef MADV_HUGEPAGE
    ::madvise(p, len, MADV_HUGEPAGE);  // a hint: refused or not, the buffer works
#endif
    auto* w = static_cast<uint64_t*>(p);
    std::fill(w, w + words, uint64_t{1});
    bufs_[t] = {w, words};
  });
}

ReadProbe::~ReadProbe() {
  for (const Buffer& b : bufs_)
    if (b.words != nullptr) ::munmap(b.words, b.n * sizeof(uint64_t));
}

ReadProbe::Reading ReadProbe::measure(std::span<const cpu::ReadMethod> methods, int passes) {
  Reading best;
  size_t total_words = 0;
  for (const Buffer& b : bufs_) {
    if (b.words == nullptr) return best;  // a buffer could not be mapped: no reading
    total_words += b.n;
  }
  std::vector<uint64_t> sums(bufs_.size());
  for (int p = 0; p < passes; ++p)
    for (cpu::ReadMethod m : methods) {
      const auto t0 = std::chrono::steady_clock::now();
      on_threads(bufs_.size(), [&](size_t t) {
        sums[t] = cpu::read_pass(std::span<const uint64_t>(bufs_[t].words, bufs_[t].n), m);
      });
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      for (size_t t = 0; t < bufs_.size(); ++t)
        if (sums[t] != bufs_[t].n) return Reading{};  // a method that skipped words reads nothing
      const double gbps = double(total_words * sizeof(uint64_t)) / s * 1e-9;
      if (gbps > best.gbps) best = {gbps, m};
    }
  return best;
}

}  // namespace kiln
