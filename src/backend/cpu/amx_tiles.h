// backend/cpu/amx_tiles.h: the AMX tile configuration the CPU kernels' AMX paths load (the
// Q8_0 family's in cpu_matmul_q8.cpp, Q4_K's and Q6_K's in cpu_matmul_kq.cpp), and the
// transposition that packs their B tiles.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace kiln::cpu {

// Palette 1: per tile its rows and bytes per row.
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void set(int tile, int n_rows, int bytes_per_row) {
    rows[tile] = static_cast<uint8_t>(n_rows);
    colsb[tile] = static_cast<uint16_t>(bytes_per_row);
  }
};

// ldtilecfg as asm with the config as a memory operand: GCC 12's _tile_loadconfig builtin does
// not tell the optimiser that it reads the struct, which then dropped the rows/colsb stores as
// dead (tilezero on unconfigured tiles: SIGILL). Only where amx_usable().
inline void load_tile_config(const AmxTileConfig& c) { asm volatile("ldtilecfg %0" : : "m"(c)); }

// The kernels' layout: tiles 0..3 C (m tokens x 16 rows of int32), 4 and 5 A (m tokens x
// a_bytes), 6 and 7 B (b_rows x 64 bytes: 16 rows' quants, 4 consecutive ones side by side).
inline void configure_amx_tiles(int m, int a_bytes, int b_rows) {
  AmxTileConfig c;
  for (int k = 0; k < 4; ++k) c.set(k, m, 64);
  for (int k = 4; k < 6; ++k) {
    c.set(k, m, a_bytes);
    c.set(k + 2, b_rows, 64);
  }
  load_tile_config(c);
}

// The B-tile layout of 16 rows: base[d * 64 + k * 4 ..] = dword d of v[k] (rows 0..7 at
// d * 64, rows 8..15 at d * 64 + 32), for 8 dwords (32 int8 quants) per row: a row's quants
// become 8 tile rows of 4 bytes. Two 8x8 dword transposes in registers (unpacks and 128-bit
// permutes) and 32-byte stores; one scatter (or 8 dword copies) per row did the same and took
// most of a 16-token call's time (docs/BENCHMARKS.md, session 29). AVX2 instructions: only
// the AMX kernels (AVX-512 targets) call it.
__attribute__((target("avx2"), always_inline)) inline void amx_transpose8x8(const __m256i* in,
                                                                            __m256i* out) {
  const __m256i t0 = _mm256_unpacklo_epi32(in[0], in[1]), t1 = _mm256_unpackhi_epi32(in[0], in[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(in[2], in[3]), t3 = _mm256_unpackhi_epi32(in[2], in[3]);
  const __m256i t4 = _mm256_unpacklo_epi32(in[4], in[5]), t5 = _mm256_unpackhi_epi32(in[4], in[5]);
  const __m256i t6 = _mm256_unpacklo_epi32(in[6], in[7]), t7 = _mm256_unpackhi_epi32(in[6], in[7]);
  // u0: column 0 of rows 0..3 | column 4 of rows 0..3; u1: columns 1 | 5; u2: 2 | 6; u3: 3 | 7;
  // u4..u7 the same of rows 4..7.
  const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
  const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
  const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
  out[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
  out[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
  out[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
  out[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
  out[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
  out[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
  out[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
  out[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}
__attribute__((target("avx2"), always_inline)) inline void amx_store_b_columns(const __m256i* v,
                                                                               int8_t* base) {
  __m256i a[8], b[8];
  amx_transpose8x8(v, a);
  amx_transpose8x8(v + 8, b);
  for (int d = 0; d < 8; ++d) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(base + d * 64), a[d]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(base + d * 64 + 32), b[d]);
  }
}

}  // namespace kiln::cpu
