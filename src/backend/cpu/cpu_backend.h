// backend/cpu/cpu_backend.h: the CPU backend: Highway SIMD kernels (runtime dispatch over
// AVX2 / AVX-512 / AVX-512 VNNI, portable fallbacks elsewhere) run on a fixed thread pool.
#pragma once

#include <memory>

#include "backend/backend.h"

namespace kiln {

// How one CPU backend instance runs; two instances in a process may differ.
struct CpuOptions {
  int threads = 0;  // <= 0: one per hardware thread
  // Tests and bisecting only, set in code (never from the command line): true runs the
  // portable kernels -- what a machine without AVX-512 VNNI / AVX2 gets -- for every op: the
  // oracle each fast kernel's same-bits test compares with. Same bits either way.
  bool portable_kernels = false;
  // Tests and benchmarks only, set in code: Q8_0-family, Q4_K and Q6_K matmuls of kQ8AmxMinTok+
  // tokens run on AMX tiles where the machine has AMX-INT8 (Intel Xeon since Sapphire Rapids:
  // machine-class dispatch); false runs the 512-bit VNNI kernels there instead, so that an AMX
  // machine tests and times both (tests/ops MatmulQ8Vnni, MatmulKRows16, MatmulKQBatch;
  // bench/matvec_bench BM_Q8AmxOnOff). Same bits.
  bool amx = true;
};

// One caller at a time per backend object (calls are serialised by a mutex; scratch buffers
// are owned by the object and reused).
std::unique_ptr<Backend> make_cpu_backend(const CpuOptions& options);

// Name of the SIMD target the kernels dispatch to on this machine ("AVX3_DL", "AVX2", ...).
const char* cpu_simd_target();
// True where the Q8_0-family AMX kernel runs (CpuOptions::amx): AMX-INT8 on the AVX3_DL target.
bool cpu_has_amx();
// True where BF16 weights take the bf16-pair arithmetic (cpu/bf16_pairs.h: activations rounded to
// bf16, as llama.cpp rounds them): AVX512_BF16 on the AVX3_DL target.
bool cpu_bf16_pairs();

}  // namespace kiln
