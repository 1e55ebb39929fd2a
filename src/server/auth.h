// server/auth.h: the API-key check, in time that does not depend on how much of a guessed key
// is right (a byte-by-byte compare that stops at the first difference lets a client find a
// key one byte at a time by timing).
#pragma once

#include <string_view>

namespace kiln::server {

// Whether the Authorization header value is "Bearer <key>". Only the lengths shape the time
// taken, never the contents.
bool bearer_matches(std::string_view authorization, std::string_view key);

// Equality whose time depends on the lengths only.
bool constant_time_equal(std::string_view a, std::string_view b);

}  // namespace kiln::server
