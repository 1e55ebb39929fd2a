// kv/wire.h: the fixed-width field encoding kvpack's byte layout and the remote-prefill
// protocol (src/transfer) share: host-order (little-endian on every supported machine, as
// docs/kvpack.md specifies) integers appended to or read from a byte buffer with memcpy, so
// no field needs alignment.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

namespace kiln::wire {

template <typename T>
void put(std::vector<uint8_t>& out, T v) {
  const size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &v, sizeof(T));
}

template <typename T>
T get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

}  // namespace kiln::wire
