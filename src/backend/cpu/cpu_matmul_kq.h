// backend/cpu/cpu_matmul_kq.h: what cpu_matmul.cpp and cpu_matmul_kq.cpp share about the Q4_K /
// Q6_K prefill kernels (their minimum call size, row blocking and scratch) and the AVX-512 Q8_K
// activation encoder.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "kernels.h"

namespace kiln::cpu {
// Calls of this many tokens or more take the prefill kernels; fewer take the v2 batched kernels, as
// decoding a row block costs about as much as a few token tiles save (bench/matvec_bench,
// 2026-12-02, when these benchmarks compared the two: BM_KQPrefillOnOff, 2048 x 2048, 1 thread:
// Q4_K 16 tokens 0.84x, 32 0.96x, 64 1.03x; Q6_K 16 tokens 0.49x; BM_LayerStepKQPrefill, 2 threads:
// 64 tokens 0.97x, 128 1.09x, 512 1.14x).
constexpr int64_t kKQPrefillMinTok = 128;
// Token pairs per register tile (2 tokens share a 512-bit register), and blocks per K chunk:
// the chunk's activation tile (pairs x 576 bytes + 64 per block) stays in L1 while every row of
// the row block sweeps it.
constexpr int64_t kKQPrefillPairs = 4, kKQPrefillChunk = 8;
// Bytes per (row, block) of the per-row-block decode: Q4_K its scales as vpdpwssd words, mins,
// d and dmin (the quants are read from the row); Q6_K also its quants, unpacked.
constexpr size_t kQ4KMetaBytes = 48, kQ6KMetaBytes = 896;
// The bytes per row a row block keeps: its weights (Q4_K) and decode.
inline size_t kq_prefill_row_bytes(DType t, int64_t nb, size_t row_bytes) {
  return t == DType::Q4_K ? row_bytes + static_cast<size_t>(nb) * kQ4KMetaBytes
                          : static_cast<size_t>(nb) * kQ6KMetaBytes;
}
// Rows per row block: what they keep stays in L2 (1 MiB per core on the dev box) while every
// token tile sweeps them.
inline int64_t kq_prefill_rows_per_block(size_t per_row) {
  return std::clamp<int64_t>(
      (int64_t{384} << 10) / std::max<int64_t>(1, static_cast<int64_t>(per_row)), 2, 512);
}
// Activation tile bytes per block for `pairs` token pairs.
inline size_t kq_prefill_tile_block_bytes(int64_t pairs) {
  return static_cast<size_t>(pairs) * (8 * 64 + 64) + static_cast<size_t>((pairs + 3) / 4) * 64;
}
// A thread's scratch: a row block's decode, one K chunk's tile, the row block's float
// accumulators between K chunks, two rows' scale products, alignment slack.
inline size_t kq_prefill_scratch_bytes(DType t, int64_t nb, size_t row_bytes) {
  const size_t meta = t == DType::Q4_K ? kQ4KMetaBytes : kQ6KMetaBytes;
  const auto rb =
      static_cast<size_t>(kq_prefill_rows_per_block(kq_prefill_row_bytes(t, nb, row_bytes)));
  const auto chunk = static_cast<size_t>(std::min(nb, kKQPrefillChunk));
  const auto groups = static_cast<size_t>((kKQPrefillPairs + 3) / 4);
  return rb * static_cast<size_t>(nb) * meta +
         chunk * kq_prefill_tile_block_bytes(kKQPrefillPairs) +
         rb * static_cast<size_t>(kKQPrefillPairs) * 64 + 2 * chunk * groups * 64 + 8 * 64;
}
// The AMX Q4_K and Q6_K kernels (cpu_matmul_kq.cpp MatmulQ4KAmx, MatmulQ6KAmx), from
// kQ8AmxMinTok tokens where the
// machine has AMX-INT8: per (16-row group, block) its packed B tiles (8 sub-blocks x 512 bytes),
// scales and min words as int32 (2 x 16 x 8 x 4 bytes) and d / -dmin (2 x 16 floats). Groups
// packed at once: up to 8, within ~1.5 MiB.
constexpr size_t kQ4KAmxGroupBlockBytes = 8 * 512 + 2 * 8 * 16 * 4 + 2 * 16 * 4;
inline int64_t q4k_amx_groups(int64_t nb) {
  return std::clamp<int64_t>(
      (int64_t{3} << 19) / std::max<int64_t>(1, nb * int64_t{kQ4KAmxGroupBlockBytes}), 1, 8);
}
inline size_t q4k_amx_scratch_bytes(int64_t nb) {
  return static_cast<size_t>(q4k_amx_groups(nb) * nb) * kQ4KAmxGroupBlockBytes + 4 * 64;
}
// Q6_K's (MatmulQ6KAmx): per (16-row group, block) B tiles of its 16 groups of 16 quants (16 x 256
// bytes), the groups' scales as int32 (16 x 16 x 4) and d (16 floats).
constexpr size_t kQ6KAmxGroupBlockBytes = 16 * 256 + 16 * 16 * 4 + 16 * 4;
inline int64_t q6k_amx_groups(int64_t nb) {
  return std::clamp<int64_t>(
      (int64_t{3} << 19) / std::max<int64_t>(1, nb * int64_t{kQ6KAmxGroupBlockBytes}), 1, 8);
}
inline size_t q6k_amx_scratch_bytes(int64_t nb) {
  return static_cast<size_t>(q6k_amx_groups(nb) * nb) * kQ6KAmxGroupBlockBytes + 4 * 64;
}
// n / 256 Q8_K blocks of x at dst, quantize_act_row's bytes, where this machine has AVX-512
// (returns false and writes nothing elsewhere).
bool quantize_q8k_simd(const float* x, int64_t n, std::byte* dst);
}  // namespace kiln::cpu
