// tests/ops/test_weights.h: a weight matrix of random quantized values with its dequantized
// copy (what the reference backend computes with), shared by every backend's op tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "core/dtype.h"
#include "ops/ops_common.h"
#include "quant/quant.h"

namespace kiln::testing {

struct TestWeights {
  std::vector<std::byte> bytes;
  std::vector<float> deq;  // [n_rows][n_cols], what the ref backend sees
  WeightMatrix m;          // views `bytes`: move the struct, never copy it
};

inline TestWeights make_weights(DType type, int64_t n_rows, int64_t n_cols, std::mt19937_64& rng) {
  TestWeights w;
  const size_t rb = *row_bytes(type, n_cols);
  w.bytes.resize(rb * n_rows);
  w.deq.resize(static_cast<size_t>(n_rows * n_cols));
  for (int64_t r = 0; r < n_rows; ++r) {
    const std::vector<float> src = random_vec(rng, n_cols, 0.05f);
    auto dst = std::span<std::byte>(w.bytes).subspan(r * rb, rb);
    quant::quantize_row(type, src, dst);
    quant::dequantize_row(type, dst, std::span<float>(w.deq).subspan(r * n_cols, n_cols));
  }
  w.m = WeightMatrix{
      .dtype = type, .n_cols = n_cols, .n_rows = n_rows, .row_bytes = rb, .bytes = w.bytes};
  return w;
}

}  // namespace kiln::testing
