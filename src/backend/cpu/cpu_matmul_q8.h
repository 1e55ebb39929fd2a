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

// The 512-bit VNNI Q8_0/Q4_0/Q5_0 kernel (cpu_matmul_q8.cpp) takes calls of this many tokens
// or more (fewer: the plain kernel; packing the rows costs about a token tile: bench/matvec_bench
// BM_Q8VnniOnOff at 2048 x 2048, 1 thread: 4 tokens 0.86x, 8 tokens 1.24x, 16 tokens 1.6x).
constexpr int64_t kQ8VnniMinTok = 8;
// Its token tile (pairs of tokens share a 512-bit register) and widest register tile of rows.
constexpr int64_t kQ8VnniTok = 8, kQ8VnniRows = 4;
// Bytes per packed weight block: 32 biased quants with every dword twice (one per token of a
// pair), then its f32 scale in a separate array.
constexpr size_t kQ8PackBytes = 64;
// Bytes per block of one token pair in the activation tile: the interleaved quants, then the
// bias correction as 16 int32.
constexpr size_t kQ8ActPairBytes = 128;
// Bytes of one token tile's activations per block: 4 pairs' quants and corrections, 8 scales.
constexpr size_t kQ8TileBlockBytes = kQ8VnniTok / 2 * kQ8ActPairBytes + kQ8VnniTok * 4;
// Rows packed at once: their packed blocks (68 bytes per block) stay in L2 while every token
// tile sweeps them; a multiple of the register tile.
inline int64_t q8_vnni_rows_per_block(int64_t nb) {
  const int64_t rows = (int64_t{640} << 10) / std::max<int64_t>(1, nb * 68);
  return std::clamp<int64_t>(rows, kQ8VnniRows, 128) / kQ8VnniRows * kQ8VnniRows;
}
// Tokens whose activation tiles are built at once (each row block is packed once per such
// group): up to 512, or fewer so that the tiles take at most ~4 MiB of a thread's scratch.
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
// tiles, one row's unpacked quants, alignment slack. AMX: 16 rows' unpacked quants and
// scales, q8_amx_groups' B tiles (512 bytes a block) and scales in tile order, slack.
inline size_t q8_vnni_scratch_bytes(int64_t n_cols) {
  const int64_t nb = n_cols / 32;
  const auto rb = static_cast<size_t>(q8_vnni_rows_per_block(nb));
  const auto tiles = static_cast<size_t>(q8_vnni_group_tokens(nb) / kQ8VnniTok);
  const auto unb = static_cast<size_t>(nb);
  const size_t vnni =
      rb * unb * (kQ8PackBytes + 4) + tiles * unb * kQ8TileBlockBytes + unb * 32 + 8 * 64;
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
