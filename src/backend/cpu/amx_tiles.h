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

}  // namespace kiln::cpu
