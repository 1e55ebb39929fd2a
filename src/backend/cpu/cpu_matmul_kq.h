// backend/cpu/cpu_matmul_kq.h: what cpu_matmul.cpp and cpu_matmul_kq.cpp share about the Q4_K /
// Q5_K / Q6_K kernels of many tokens (their minimum call sizes, row blocking and scratch) and the
// AVX-512 Q8_K activation encoder.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "kernels.h"

namespace kiln::cpu {
// The 16-row-total kernel for Q4_K, Q5_K and Q6_K (cpu_matmul_kq.cpp MatmulKRows16): its token
// tile and its register tile's groups of 16 rows; per (16-row group, block) the codes (64 chunks
// of 64 bytes) and the decode (KRowsMeta: 16 scale groups' and 8 word pairs' int32 per row, d
// and -dmin).
constexpr int64_t kKRowsTok = 4, kKRowsRowGroups = 2;
// Calls of this many tokens or more take it (Q4_K, Q5_K; Q6_K, whose row decode costs more);
// fewer, the v2 batched kernels (Q5_K: the plain one), which the decode of each call's rows
// does not outweigh there (bench/matvec_bench BM_KQBatchOnOff / BM_KQPrefillOnOff, old and new
// binaries; docs/BENCHMARKS.md, session 31).
constexpr int64_t kKRowsMinTok = 16, kKRowsMinTokQ6K = 64;
constexpr size_t kKRowsCodeBytes = 64 * 64, kKRowsMetaBytes = (16 + 8) * 64 + 2 * 64;
// Rows decoded at once (a multiple of the register tile's 32): their codes and decode stay in
// L2 (1 MiB per core on the Zen 4 box) while every token tile sweeps them.
inline int64_t k_rows_rows_per_block(int64_t nb) {
  const int64_t per_row = nb * static_cast<int64_t>(kKRowsCodeBytes + kKRowsMetaBytes) / 16;
  return std::clamp<int64_t>((int64_t{640} << 10) / std::max<int64_t>(1, per_row), 32, 256) / 32 *
         32;
}
// A thread's scratch: a row block's codes and decode, one block of 16 rows' codes, slack.
inline size_t k_rows_scratch_bytes(int64_t nb) {
  const auto groups = static_cast<size_t>(k_rows_rows_per_block(nb) / 16 * nb);
  return groups * (kKRowsCodeBytes + kKRowsMetaBytes) + 16 * 256 + 4 * 64;
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
