// core/progress.cpp: the in-place progress line (see progress.h).
#include "core/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>

namespace kiln {

ProgressLine::ProgressLine(std::string label, uint64_t total_bytes, std::FILE* out, bool tty)
    : label_(std::move(label)), total_(total_bytes), out_(out), tty_(tty) {}

ProgressLine::ProgressLine(std::string label, uint64_t total_bytes)
    : ProgressLine(std::move(label), total_bytes, stderr, ::isatty(STDERR_FILENO) != 0) {}

void ProgressLine::update(uint64_t done_bytes) {
  done_ = std::min(done_bytes, total_);
  if (!tty_ || finished_) return;
  const auto now = std::chrono::steady_clock::now();
  if (drawn_ && now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  draw();
}

void ProgressLine::draw() {
  const double pct = total_ ? 100.0 * double(done_) / double(total_) : 100.0;
  constexpr double kMiB = 1024.0 * 1024.0;
  fmt::print(out_, "\r{}: {:5.1f}% ({:.0f} / {:.0f} MiB)", label_, pct, double(done_) / kMiB,
             double(total_) / kMiB);
  std::fflush(out_);
  drawn_ = true;
}

void ProgressLine::finish() {
  if (finished_) return;
  finished_ = true;
  if (!tty_) return;
  draw();
  fmt::print(out_, "\n");
  std::fflush(out_);
}

}  // namespace kiln
