// backend/cpu/cpu_backend.h: the CPU backend: Highway SIMD kernels (runtime dispatch over
// AVX2 / AVX-512 / AVX-512 VNNI, portable fallbacks elsewhere) run on a fixed thread pool.
#pragma once

#include <memory>

#include "backend/backend.h"

namespace kiln {

// n_threads <= 0: one per hardware thread. One caller at a time per backend object (calls
// are serialised by a mutex; scratch buffers are owned by the object and reused).
std::unique_ptr<Backend> make_cpu_backend(int n_threads);

// Name of the SIMD target the kernels dispatch to on this machine ("AVX3_DL", "AVX2", ...).
const char* cpu_simd_target();

}  // namespace kiln
