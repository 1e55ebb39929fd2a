// backend/cpu/cpu_matmul_q8.h: what cpu_matmul.cpp and cpu_matmul_q8.cpp share about the
// Q8_0-family matmuls: the activation block and the 512-bit VNNI kernel's scratch and entry.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kernels.h"

namespace kiln::cpu {
// Activation block for the Q8_0 family: a float scale (not llama.cpp's f16) keeps the only
// error the rounding of the quants themselves.
struct ActQ8_0 {
  float d;
  int8_t qs[32];
};
static_assert(sizeof(ActQ8_0) == 36);

// The 512-bit VNNI Q8_0-family kernel (cpu_matmul_q8.cpp) takes calls of this many tokens or
// more: from two tokens it beats the plain kernel, packing included (bench/matvec_bench
// BM_Q8VnniOnOff; docs/BENCHMARKS.md, session 31). One token: the one-token kernels.
constexpr int64_t kQ8VnniMinTok = 2;
// Its token tile, and its register tile's groups of 16 rows (one 512-bit register per group and
// token holds the 16 rows' sums: cpu_matmul_q8.cpp DotQ8Rows16).
constexpr int64_t kQ8VnniTok = 6, kQ8VnniRowGroups = 2;
// Bytes per block of a token tile: each token's 32 quants, scale and bias correction.
constexpr size_t kQ8TileBlockBytes = kQ8VnniTok * (32 + 4 + 4);
// Rows packed at once (their packed quants and scales, 36 bytes a row and block, stay in L2
// while every token tile sweeps them): a multiple of the register tile's 32 rows.
inline int64_t q8_vnni_rows_per_block(int64_t nb) {
  const int64_t rows = (int64_t{640} << 10) / std::max<int64_t>(1, nb * 36);
  return std::clamp<int64_t>(rows, 32, 256) / 32 * 32;
}
// Tokens whose tiles are built at once (each row block is packed once per such group): up to
// about 512, or fewer so that the tiles take at most ~4 MiB of a thread's scratch.
inline int64_t q8_vnni_group_tokens(int64_t nb) {
  const int64_t tiles =
      (int64_t{4} << 20) / std::max<int64_t>(1, nb * static_cast<int64_t>(kQ8TileBlockBytes));
  return std::clamp<int64_t>(tiles, 1, 512 / kQ8VnniTok) * kQ8VnniTok;
}
// The AMX form of that kernel takes calls of this many tokens or more (a tile of 16 tokens x
// 16 rows per instruction).
constexpr int64_t kQ8AmxMinTok = 16;
// Groups of 16 rows it packs at once: up to 8, their tiles (576 bytes a block) within 512 KiB.
inline int64_t q8_amx_groups(int64_t nb) {
  return std::clamp<int64_t>((int64_t{512} << 10) / std::max<int64_t>(1, nb * 576), 1, 8);
}
// A thread's scratch for those kernels. VNNI: packed rows (quants, scales), the group's token
// tiles, 16 rows' unpacked quants and scales, alignment slack. AMX: 16 rows' unpacked quants
// and scales, q8_amx_groups' B tiles (512 bytes a block) and scales in tile order, slack.
inline size_t q8_vnni_scratch_bytes(int64_t n_cols) {
  const int64_t nb = n_cols / 32;
  const auto rb = static_cast<size_t>(q8_vnni_rows_per_block(nb));
  const auto tiles = static_cast<size_t>(q8_vnni_group_tokens(nb) / kQ8VnniTok);
  const auto unb = static_cast<size_t>(nb);
  const size_t vnni =
      rb * unb * (32 + 4) + tiles * unb * kQ8TileBlockBytes + 16 * unb * (32 + 4) + 8 * 64;
  const size_t amx =
      16 * unb * (32 + 4) + static_cast<size_t>(q8_amx_groups(nb)) * unb * (512 + 64) + 8 * 64;
  return std::max(vnni, amx);
}
// True where the AMX kernel can run: the CPU has AMX-TILE and AMX-INT8 and the OS gave this
// process the tile state (Linux: asked for once, on the first call).
bool amx_usable();
// n / 32 ActQ8_0 blocks of x at dst, quantize_act_row's bytes, where this machine has AVX-512
// (returns false and writes nothing elsewhere).
bool quantize_q8_0_simd(const float* x, int64_t n, std::byte* dst);
}  // namespace kiln::cpu
