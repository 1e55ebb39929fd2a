// bench/gguf_open_bench.cpp: opening a ~2 GB GGUF with 300 tensors maps, never reads. Writes a
// sparse file with GgufWriter, then measures GgufFile::open (map + full validation) and the
// process RSS growth it causes. Targets (issue 2): RSS grows < 16 MB, open < 50 ms.
// Usage: gguf_open_bench [DIR] (default /tmp); the file is deleted afterwards.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <vector>

#include "format/gguf.h"
#include "format/gguf_writer.h"

namespace {

// Resident set size in bytes, from /proc/self/statm (second field, in pages).
uint64_t rss_bytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  unsigned long size = 0, resident = 0;
  const int n = std::fscanf(f, "%lu %lu", &size, &resident);
  std::fclose(f);
  return n == 2 ? resident * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)) : 0;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kiln;
  const std::string dir = argc > 1 ? argv[1] : "/tmp";
  const std::string path = dir + "/kiln-open-bench.gguf";

  // A llama-like layout: 300 f16 tensors of 4096 x 896 (7.3 MB each, 2.2 GB in all) and a
  // 32k-entry vocabulary, so metadata parsing is part of the measurement too.
  GgufWriter w;
  w.set_str("general.architecture", "llama");
  w.set_u32("llama.block_count", 32);
  std::vector<std::string> tokens;
  std::vector<float> scores;
  for (int i = 0; i < 32000; ++i) {
    tokens.push_back(fmt::format("tok{}", i));
    scores.push_back(-float(i));
  }
  w.set_str_array("tokenizer.ggml.tokens", tokens);
  w.set_f32_array("tokenizer.ggml.scores", scores);
  for (int i = 0; i < 300; ++i)
    w.add_tensor_zeros(fmt::format("blk.{}.w{}.weight", i / 10, i % 10), DType::F16, {4096, 896});
  auto t_write = std::chrono::steady_clock::now();
  if (Status s = w.write(path); !s) {
    fmt::print(stderr, "gguf_open_bench: {}\n", s.message());
    return 1;
  }
  const double write_ms = ms_since(t_write);
  const uint64_t file_bytes = std::filesystem::file_size(path);

  // First open (cold for our process; the header pages are in the page cache from writing).
  const uint64_t rss0 = rss_bytes();
  auto t0 = std::chrono::steady_clock::now();
  auto g = GgufFile::open(path);
  const double first_ms = ms_since(t0);
  if (!g) {
    fmt::print(stderr, "gguf_open_bench: {}\n", g.error());
    std::filesystem::remove(path);
    return 1;
  }
  const uint64_t rss1 = rss_bytes();
  const size_t n_tensors = g->tensors().size();

  // Repeated opens: the median is the steady figure.
  std::vector<double> times;
  for (int i = 0; i < 21; ++i) {
    auto t = std::chrono::steady_clock::now();
    auto again = GgufFile::open(path);
    times.push_back(ms_since(t));
    if (!again) return 1;
  }
  std::sort(times.begin(), times.end());
  std::filesystem::remove(path);

  const double rss_mb = (double(rss1) - double(rss0)) / (1 << 20);
  const double median_ms = times[times.size() / 2];
  fmt::print("file: {} bytes ({:.2f} GiB), {} tensors, written in {:.0f} ms (sparse)\n", file_bytes,
             file_bytes / double(1 << 30), n_tensors, write_ms);
  fmt::print(
      "open + validate: first {:.2f} ms, median of {} {:.2f} ms, max {:.2f} ms  "
      "(target < 50 ms: {})\n",
      first_ms, times.size(), median_ms, times.back(),
      std::max(first_ms, median_ms) < 50 ? "met" : "MISSED");
  fmt::print("RSS growth after open: {:.2f} MiB (target < 16 MB: {})\n", rss_mb,
             rss_mb < 16 ? "met" : "MISSED");
  return 0;
}
