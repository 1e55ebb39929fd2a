// tests/ops/matmul_tiling_test.cpp: the cpu matmul's per-token bit invariance (docs/determinism.md):
// a token's outputs must be the same bits whether its call holds 1 token or many, whatever
// row/token tile of the kernel it lands in and however many threads split the rows. Fresh
// random inputs each run (seed printed on failure), odd shapes, every weight type.
#include <gtest/gtest.h>

#include <cstring>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#include "core/dtype.h"
#include "ops_common.h"
#include "quant/quant.h"

namespace kiln {
namespace {

using kiln::testing::ops_seed;
using kiln::testing::random_vec;

class MatmulTiling : public ::testing::TestWithParam<DType> {};

TEST_P(MatmulTiling, TokenResultsIndependentOfBatchAndThreads) {
  const DType type = GetParam();
  static std::unique_ptr<Backend> cpu1 = make_cpu_backend(1), cpu2 = make_cpu_backend(2);
  std::mt19937_64 rng(ops_seed() ^ (static_cast<uint64_t>(type) << 8));
  const int64_t blk = traits(type).block_size;
  // k: two blocks of the type (three for 32-wide ones), so every path runs its block loop.
  const int64_t k = blk >= 256 ? 2 * blk : (blk > 1 ? 3 * blk : 67);
  for (int64_t n_rows : {1, 2, 5, 67}) {
    std::vector<std::byte> bytes(*row_bytes(type, k) * n_rows);
    for (int64_t r = 0; r < n_rows; ++r) {
      const std::vector<float> src = random_vec(rng, k, 0.05f);
      quant::quantize_row(type, src,
                          std::span<std::byte>(bytes).subspan(r * *row_bytes(type, k), *row_bytes(type, k)));
    }
    const WeightMatrix w{type, k, n_rows, *row_bytes(type, k), bytes};
    for (int64_t n_tok : {2, 3, 5, 7, 9, 13, 16, 37}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(type) << " rows " << n_rows << " k " << k
                                        << " n_tok " << n_tok << " seed " << ops_seed());
      const std::vector<float> x = random_vec(rng, n_tok * k, 1.0f);
      std::vector<float> y_all(n_tok * n_rows, NAN), y_all2(y_all.size(), NAN);
      cpu1->matmul(w, x, n_tok, y_all);
      cpu2->matmul(w, x, n_tok, y_all2);
      ASSERT_EQ(0, std::memcmp(y_all.data(), y_all2.data(), y_all.size() * sizeof(float)))
          << "1 vs 2 threads differ";
      for (int64_t t = 0; t < n_tok; ++t) {
        std::vector<float> y_one(n_rows, NAN);
        cpu1->matmul(w, std::span<const float>(x).subspan(t * k, k), 1, y_one);
        for (int64_t r = 0; r < n_rows; ++r) {
          const float a = y_all[t * n_rows + r], b = y_one[r];
          ASSERT_FALSE(std::isnan(b)) << "t " << t << " r " << r;
          ASSERT_EQ(0, std::memcmp(&a, &b, sizeof(float)))
              << "t " << t << " r " << r << ": batched " << a << " vs alone " << b;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, MatmulTiling,
                         ::testing::Values(DType::F32, DType::F16, DType::BF16, DType::Q8_0,
                                           DType::Q4_0, DType::Q5_0, DType::Q4_1, DType::Q4_K,
                                           DType::Q5_K, DType::Q6_K, DType::Q3_K),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace kiln
