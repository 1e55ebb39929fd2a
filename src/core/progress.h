// core/progress.h: one progress line on stderr, redrawn in place while a long step runs
// (paging a model's weights into RAM). On a terminal it updates at most every 100 ms and ends
// with a newline; when stderr is not a terminal (logs, CI, a service) it prints nothing.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace kiln {

class ProgressLine {
 public:
  // `out`: where the line goes (stderr); `tty`: whether to draw at all (isatty of `out`).
  ProgressLine(std::string label, uint64_t total_bytes, std::FILE* out, bool tty);
  // On stderr when it is a terminal.
  ProgressLine(std::string label, uint64_t total_bytes);
  ~ProgressLine() { finish(); }
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  void update(uint64_t done_bytes);
  // Draws the last state and ends the line (idempotent).
  void finish();

 private:
  void draw();
  std::string label_;
  uint64_t total_ = 0, done_ = 0;
  std::FILE* out_ = nullptr;
  bool tty_ = false, drawn_ = false, finished_ = false;
  std::chrono::steady_clock::time_point last_{};
};

}  // namespace kiln
