// tests/cuda/cuda_test_common.h: the CUDA backend under test (one per run, created on first
// use) and the fixture that skips every test with a message when no GPU is present.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "core/check.h"

namespace kiln::testing {

struct CudaUnderTest {
  std::unique_ptr<CudaBackend> cuda;  // null when no device; matmul V2
  // The same with CudaOptions::attention_warp_tiles flipped from its default (the other decode
  // attention kernel; options are fixed for a backend's life).
  std::unique_ptr<CudaBackend> cuda_alt_attention;
  std::string why_not;  // the creation error when null
  std::unique_ptr<Backend> ref = make_ref_backend();
};

inline CudaUnderTest& cuda_under_test() {
  static CudaUnderTest t = [] {
    CudaUnderTest u;
    CudaOptions o;
    // Op parity holds the f32-activation kernels to the f32 bounds (V3's int8 activations,
    // the Auto default's decode path, have their own statistical bound: cuda_matvec_q8_test).
    o.matmul = CudaMatmul::V2;
    // The tests free weight buffers whose addresses the allocator hands out again.
    o.verify_weight_cache = true;
    o.arena_chunk_bytes = size_t(64) << 20;
    auto be = make_cuda_backend(o);
    if (be) {
      u.cuda = std::move(*be);
      o.attention_warp_tiles = !o.attention_warp_tiles;
      auto alt = make_cuda_backend(o);
      KILN_CHECK(alt.has_value(), "the second CUDA backend: {}", alt.error());
      u.cuda_alt_attention = std::move(*alt);
      fprintf(stderr, "cuda device: %s\n", u.cuda->device_name().c_str());
    } else {
      u.why_not = be.error();
    }
    return u;
  }();
  return t;
}

// Skips the test (with the reason) when there is no usable GPU.
#define KILN_REQUIRE_CUDA()                                       \
  do {                                                            \
    if (!::kiln::testing::cuda_under_test().cuda)                 \
      GTEST_SKIP() << "no CUDA device, CUDA tests skipped: "      \
                   << ::kiln::testing::cuda_under_test().why_not; \
  } while (0)

}  // namespace kiln::testing
