// tests/ops/backend_suite.h: the backends the shared op suite (backend_ops_test.cpp) runs over.
// Each test executable that compiles the suite links one definition of backends_under_test():
// tests/ops/backends_cpu.cpp (the CPU backend with 1 and 3 threads and its portable kernels) or
// tests/cuda/backends_cuda.cpp (the CUDA backend, skipped with its reason without a GPU). Every
// op is checked against the scalar reference backend with the bound its arithmetic allows.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace kiln::testing {

struct BackendUnderTest {
  std::string name;
  // The backend (created once, kept for the run), or nullptr when this machine has none; then
  // `why` says why and the test skips.
  std::function<Backend*()> get;
  std::function<std::string()> why;
  // RoPE's relative bound: the CPU computes sinf/cosf of a double-reduced angle (4e-6); the
  // CUDA kernel the angle in double as the reference does (1e-6).
  double rope_rel = 4e-6;
};

std::vector<BackendUnderTest> backends_under_test();

}  // namespace kiln::testing
