// tests/cuda/backends_cuda.cpp: the CUDA backend for the shared op suite
// (tests/ops/backend_ops_test.cpp); without a GPU every case skips with the reason.
#include "cuda_test_common.h"
#include "ops/backend_suite.h"

namespace kiln::testing {

std::vector<BackendUnderTest> backends_under_test() {
  return {{"cuda", []() -> Backend* { return cuda_under_test().cuda.get(); },
           [] { return "no CUDA device, CUDA tests skipped: " + cuda_under_test().why_not; },
           /*rope_rel=*/1e-6}};
}

}  // namespace kiln::testing
