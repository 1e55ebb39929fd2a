// backend/cpu/k4_scales.h: a Q4_K/Q5_K block's packed 6-bit scales and mins as plain bytes,
// for the kernels of every target that decode them (kq_avx2-inl.h, the AMX packer of
// cpu_matmul_kq.cpp). Scalar words only, so one copy serves every Highway target.
#pragma once

#include <cstdint>
#include <cstring>

namespace kiln::cpu {

// The 8 six-bit scales (bytes 0..7) and mins (bytes 8..15) of a Q4_K/Q5_K block.
inline void ScalesMinsK4(const uint8_t* packed, uint8_t out[16]) {
  uint32_t u[4];
  std::memcpy(u, packed, 12);
  constexpr uint32_t kMask1 = 0x3f3f3f3f, kMask2 = 0x0f0f0f0f, kMask3 = 0x03030303;
  u[3] = ((u[2] >> 4) & kMask2) | (((u[1] >> 6) & kMask3) << 4);
  const uint32_t aux = u[1] & kMask1;
  u[1] = (u[2] & kMask2) | (((u[0] >> 6) & kMask3) << 4);
  u[2] = aux;
  u[0] &= kMask1;
  std::memcpy(out, u, 16);
}

}  // namespace kiln::cpu
