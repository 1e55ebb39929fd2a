// backend/cpu/amx_tiles.h: the AMX tile configuration the CPU kernels' AMX paths load (the
// Q8_0 family's in cpu_matmul_q8.cpp, Q4_K's and Q6_K's in cpu_matmul_kq.cpp).
#pragma once

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

}  // namespace kiln::cpu
