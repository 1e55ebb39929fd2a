// core/log.h: leveled logging to stderr. stdout belongs to program output (generated text,
// token ids, JSON), so nothing here ever writes to it.
#pragma once

#include <fmt/format.h>

#include <utility>

namespace kiln {

enum class LogLevel { debug = 0, info = 1, notice = 2, warn = 3, error = 4, off = 5 };

void set_log_level(LogLevel level);
LogLevel log_level();
void log_line(LogLevel level, std::string_view msg);

template <typename... Args>
void log(LogLevel level, fmt::format_string<Args...> f, Args&&... args) {
  if (level < log_level()) return;
  log_line(level, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void log_info(fmt::format_string<Args...> f, Args&&... args) {
  log(LogLevel::info, f, std::forward<Args>(args)...);
}
// One line when an optional optimisation is unavailable and kiln falls back (fails open).
template <typename... Args>
void log_notice(fmt::format_string<Args...> f, Args&&... args) {
  log(LogLevel::notice, f, std::forward<Args>(args)...);
}
template <typename... Args>
void log_warn(fmt::format_string<Args...> f, Args&&... args) {
  log(LogLevel::warn, f, std::forward<Args>(args)...);
}
template <typename... Args>
void log_debug(fmt::format_string<Args...> f, Args&&... args) {
  log(LogLevel::debug, f, std::forward<Args>(args)...);
}

}  // namespace kiln
