// core/log.cpp: the process-wide log level (the one piece of logging state).
#include "core/log.h"

#include <atomic>
#include <cstdio>

namespace kiln {
namespace {
std::atomic<LogLevel> g_level{LogLevel::notice};
constexpr const char* kNames[] = {"debug", "info", "notice", "warn", "error", "off"};
}  // namespace

void set_log_level(LogLevel level) { g_level.store(level, std::memory_order_relaxed); }
LogLevel log_level() { return g_level.load(std::memory_order_relaxed); }
void log_line(LogLevel level, std::string_view msg) {
  fmt::print(stderr, "kiln: {}: {}\n", kNames[static_cast<int>(level)], msg);
}

}  // namespace kiln
