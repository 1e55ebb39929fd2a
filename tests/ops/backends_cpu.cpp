// tests/ops/backends_cpu.cpp: the CPU backends the shared op suite runs over: 1 thread, 3
// threads (more than the cores: odd row splits), and the portable kernels (what a machine
// without AVX-512 or AVX2 runs).
#include <memory>

#include "backend/cpu/cpu_backend.h"
#include "ops/backend_suite.h"

namespace kiln::testing {

std::vector<BackendUnderTest> backends_under_test() {
  auto cpu = [](CpuOptions o) {
    return [o]() -> Backend* {
      static std::unique_ptr<Backend> keep[3];
      const int slot = o.portable_kernels ? 2 : (o.threads == 1 ? 0 : 1);
      if (!keep[slot]) keep[slot] = make_cpu_backend(o);
      return keep[slot].get();
    };
  };
  auto none = [] { return std::string(); };
  return {{"cpu1", cpu({.threads = 1}), none},
          {"cpu3", cpu({.threads = 3}), none},
          {"cpu_portable", cpu({.threads = 2, .portable_kernels = true}), none}};
}

}  // namespace kiln::testing
