// server/auth.cpp: constant-time API-key comparison (see auth.h).
#include "server/auth.h"

#include <algorithm>

namespace kiln::server {

bool constant_time_equal(std::string_view a, std::string_view b) {
  // Every byte of the longer string is visited and differences are OR-ed, never branched on;
  // volatile keeps the compiler from turning the loop into an early exit.
  volatile unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff = diff | static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

bool bearer_matches(std::string_view authorization, std::string_view key) {
  static constexpr std::string_view kBearer = "Bearer ";
  // The prefix is public: checking it first leaks nothing of the key.
  if (authorization.substr(0, kBearer.size()) != kBearer) return false;
  return constant_time_equal(authorization.substr(kBearer.size()), key);
}

}  // namespace kiln::server
