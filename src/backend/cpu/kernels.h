// backend/cpu/kernels.h: the dispatch-level entry points of the cpu kernels (each one picks
// the best Highway target at run time). Internal to backend/cpu; ranges come from the pool.
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend/backend.h"

namespace kiln::cpu {

// ---- elementwise (cpu_ops.cpp), each over a range of n elements
void add(const float* a, const float* b, float* out, size_t n);
void mul(const float* a, const float* b, float* out, size_t n);
void scale(float* x, size_t n, float s);
void softcap(float* x, size_t n, float cap);
void sigmoid(float* x, size_t n);
void swiglu(const float* g, const float* u, float* out, size_t n);
void geglu(const float* g, const float* u, float* out, size_t n);
void rmsnorm_row(const float* x, const float* w /*nullable*/, size_t n, float eps, float* y);
void softmax_row(float* x, size_t n);
void f32_to_f16(const float* src, f16* dst, size_t n);
const char* target_name();

// ---- matmul (cpu_matmul.cpp)
// Activations for one call, encoded once: `xq` holds n_tok rows of `xq_row_bytes` in the
// weight type's activation format (act_kind), or is unused for f32 paths.
enum class ActKind { F32, Q8_0, Q8_K };
ActKind act_kind(DType weight_type);
// Bytes of one encoded activation row of n (a multiple of the block) elements.
size_t act_row_bytes(ActKind k, int64_t n);
void quantize_act_row(ActKind k, const float* x, int64_t n, std::byte* dst);

struct MatmulJob {
  const WeightMatrix* w = nullptr;
  const float* x = nullptr;         // [n_tok][n_cols] f32
  const std::byte* xq = nullptr;    // [n_tok][xq_row_bytes], for quantized paths
  size_t xq_row_bytes = 0;
  int64_t n_tok = 0;
  float* y = nullptr;               // [n_tok][n_rows]
};
// Computes y for weight rows [r0, r1) and every token. `scratch` holds at least
// matmul_scratch_floats(w) floats private to the calling thread.
void matmul_rows(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch);
size_t matmul_scratch_floats(const WeightMatrix& w);
// True when weights of this type take an integer-dot path on this machine (else the
// dequantize-row + f32 path).
bool has_int8_path(DType t);
// Q4_K prefill (12+ tokens) through the packed VNNI kernel where the machine has AVX-512 VNNI
// (default on, faster by measurement: bench/matvec_bench BM_Q4KPackedOnOff). Its output is the
// plain kernel's bits, so the switch exists for the test that proves it and for bisecting.
void set_q4k_packed_matmul(bool on);
bool q4k_packed_matmul();
// Q4_K and Q6_K matmuls of 4+ tokens (Q4_K: below the packed kernel's minimum) through the
// small-batch 512-bit VNNI kernels where the machine has AVX-512 VNNI (default on, faster by
// measurement: bench/matvec_bench BM_KQPairOnOff). Their output is the plain kernels' bits
// (tests/ops MatmulKQPair), so the switch exists for that test, the benchmark and bisecting.
void set_kq_pair_matmul(bool on);
bool kq_pair_matmul();

// ---- attention (cpu_attention.cpp)
// One (query i, head h) pair. scratch: attention_scratch_floats(head_dim) floats.
void attention_one(const AttentionArgs& a, int64_t i, int64_t h, float* scratch);
size_t attention_scratch_floats(int64_t head_dim);

}  // namespace kiln::cpu
