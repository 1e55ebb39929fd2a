// backend/cpu/cpu_matmul_kq.h: what cpu_matmul.cpp and cpu_matmul_kq.cpp share about the Q4_K
// prefill kernel: its minimum call size, row blocking and scratch.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kernels.h"

namespace kiln::cpu {
// Calls of this many tokens or more take the prefill kernel (fewer: the v2 batched kernels, whose
// 8-token tile is built once per call and whose weights are not re-read from L2 per tile).
constexpr int64_t kQ4KPrefillMinTok = 16;
// Token pairs per register tile (2 tokens share a 512-bit register), and blocks per K chunk:
// the chunk's activation tile (pairs x 576 bytes + 64 per block) stays in L1 while every row of
// the row block sweeps it.
constexpr int64_t kQ4KPrefillPairs = 4, kQ4KPrefillChunk = 8;
// Bytes per (row, block) of the per-row-block decode (scales as vpdpwssd words, mins, d, dmin).
constexpr size_t kQ4KMetaBytes = 48;
// Rows per row block: their weights and decoded scales stay in L2 (1 MiB per core on the dev
// box) while every token tile sweeps them.
inline int64_t q4k_prefill_rows_per_block(int64_t nb, size_t row_bytes) {
  const auto per_row = static_cast<int64_t>(row_bytes + static_cast<size_t>(nb) * kQ4KMetaBytes);
  return std::clamp<int64_t>((int64_t{384} << 10) / std::max<int64_t>(1, per_row), 2, 512);
}
// Activation tile bytes per block for `pairs` token pairs.
inline size_t q4k_prefill_tile_block_bytes(int64_t pairs) {
  return static_cast<size_t>(pairs) * (8 * 64 + 64) + static_cast<size_t>((pairs + 3) / 4) * 64;
}
// A thread's scratch: decoded scales of a row block, one K chunk's tile, the row block's
// float accumulators between K chunks, two rows' scale products, alignment slack.
inline size_t q4k_prefill_scratch_bytes(int64_t nb, size_t row_bytes) {
  const auto rb = static_cast<size_t>(q4k_prefill_rows_per_block(nb, row_bytes));
  const auto chunk = static_cast<size_t>(std::min(nb, kQ4KPrefillChunk));
  const auto groups = static_cast<size_t>((kQ4KPrefillPairs + 3) / 4);
  return rb * static_cast<size_t>(nb) * kQ4KMetaBytes + chunk * q4k_prefill_tile_block_bytes(kQ4KPrefillPairs) +
         rb * static_cast<size_t>(kQ4KPrefillPairs) * 64 + 2 * chunk * groups * 64 + 8 * 64;
}
}  // namespace kiln::cpu
