// core/check.h: KILN_CHECK for internal invariants. Aborts with file:line; never used to
// validate input (input errors are Status values), and unlike assert it stays in release.
#pragma once

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

namespace kiln::detail {
[[noreturn]] inline void check_failed(const char* file, int line, const char* cond,
                                      const std::string& msg) {
  fmt::print(stderr, "kiln: invariant failed at {}:{}: {}{}{}\n", file, line, cond,
             msg.empty() ? "" : ": ", msg);
  std::fflush(stderr);
  std::abort();
}
inline std::string check_msg() { return {}; }
template <typename... Args>
std::string check_msg(fmt::format_string<Args...> f, Args&&... args) {
  return fmt::format(f, std::forward<Args>(args)...);
}
}  // namespace kiln::detail

#define KILN_CHECK(cond, ...)                                               \
  do {                                                                      \
    if (!(cond)) [[unlikely]]                                               \
      ::kiln::detail::check_failed(__FILE__, __LINE__, #cond,               \
                                   ::kiln::detail::check_msg(__VA_ARGS__)); \
  } while (0)
