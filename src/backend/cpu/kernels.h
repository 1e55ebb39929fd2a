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
void swiglu_oai(const float* g, const float* u, float* out, size_t n, float alpha, float limit);
void rmsnorm_row(const float* x, const float* w /*nullable*/, size_t n, float eps, float* y);
void softmax_row(float* x, size_t n);
void f32_to_f16(const float* src, f16* dst, size_t n);
const char* target_name();

// ---- matmul (cpu_matmul.cpp)
// The matmul and attention ops take `portable` from their backend's
// CpuOptions::portable_kernels (a MatmulJob field, a parameter). False: the fastest kernel this
// machine has for the call (chosen at run time by CPU features and call size); true: the plain
// kernels, the ones a machine without the fast kernels' features runs, and their oracle. Every
// fast kernel's output is the plain kernel's bits, so the choice changes only speed; each has a
// same-bits test in tests/ops (named below) and a fast-vs-portable benchmark in
// bench/matvec_bench.
//
// The fast matmul kernels, where the machine has what they need:
// - Q4_K / Q5_K / Q6_K, AVX-512 VNNI: one token, 512-bit one-token kernels that read the
//   token's activation in place (MatmulKQOne); 2+ tokens, the v2 batched kernels (Q4_K, Q6_K;
//   MatmulKQBatch); kKRowsMinTok+ tokens (Q6_K kKRowsMinTokQ6K+), the 16-row-total kernel of
//   cpu_matmul_kq.cpp (MatmulKRows16); from kQ8AmxMinTok tokens, cpu_matmul_kq.cpp's AMX kernels
//   for Q4_K and Q6_K where the machine has AMX-INT8 (CpuOptions::amx; MatmulKRows16 and
//   MatmulKQBatch run with and without).
//   AVX2 machines take kq_avx2-inl.h's kernels for the same calls (the same tests there).
// - Q8_0 / Q4_0 / Q5_0 / IQ4_NL / MXFP4: kQ8VnniMinTok+ tokens, the 512-bit kernel of
//   cpu_matmul_q8.cpp on AVX-512 VNNI (MatmulQ8Vnni), from kQ8AmxMinTok tokens its AMX kernel
//   where the machine has AMX-INT8 (CpuOptions::amx); one Q8_0 token, the AVX2 two-row kernel
//   of kq_avx2-inl.h on machines without AVX-512 (MatmulQ8One).
// - F32 / F16 / BF16: kFloatTileMinTok+ tokens, the register-tiled kernel of
//   cpu_matmul_float.cpp (MatmulFloatTile). BF16 where the CPU has AVX512_BF16 (AVX3_DL target):
//   the bf16-pair arithmetic of bf16_pairs.h in both its kernels, one token and the tiles, and
//   its scalar oracle as the plain kernel (MatmulBF16Pairs).
// - The Q8_K and Q8_0 activation encoders with AVX-512 (ActQuant.*).
//
// Activations for one call, encoded once: `xq` holds n_tok rows of `xq_row_bytes` in the
// weight type's activation format (act_kind), or is unused for f32 paths. BF16: bf16 rows zero-
// padded to whole pair chunks (bf16_pairs.h), for BF16 weights where the pair arithmetic runs.
enum class ActKind { F32, Q8_0, Q8_K, BF16 };
ActKind act_kind(DType weight_type);
// Bytes of one encoded activation row of n (a multiple of the block) elements.
size_t act_row_bytes(ActKind k, int64_t n);
// portable: the scalar loop, else AVX-512 where the machine has it; the same bytes.
void quantize_act_row(ActKind k, const float* x, int64_t n, std::byte* dst, bool portable);

struct MatmulJob {
  const WeightMatrix* w = nullptr;
  const float* x = nullptr;       // [n_tok][n_cols] f32
  const std::byte* xq = nullptr;  // [n_tok][xq_row_bytes], for quantized paths
  size_t xq_row_bytes = 0;
  int64_t n_tok = 0;
  float* y = nullptr;     // [n_tok][n_rows]
  bool portable = false;  // the plain kernels only (see above)
  bool amx = true;        // CpuOptions::amx
};
// Computes y for weight rows [r0, r1) and every token. `scratch` holds at least
// matmul_scratch_floats(w) floats private to the calling thread.
void matmul_rows(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch);
size_t matmul_scratch_floats(const WeightMatrix& w);
// True when weights of this type take an integer-dot path on this machine (else the
// dequantize-row + f32 path).
bool has_int8_path(DType t);
inline constexpr int64_t kFloatTileMinTok = 2;
// The tiled kernel itself (matmul_rows calls it unless job.portable); it needs no scratch.
void matmul_float_tiled(const MatmulJob& job, int64_t r0, int64_t r1);
// The fast kernels that stream weight rows (one-token, v2 batched, AVX2) software-prefetch
// this many bytes ahead of the rows they work on, a span per block step into L2: the hardware
// prefetchers alone leave decode well short of the read bandwidth (see MatvecKOne in
// cpu_matmul.cpp, and docs/BENCHMARKS.md for the distances measured). 32 KiB: on the Zen 4 VM
// decode read a larger fraction of the probe's bandwidth than at 16 KiB for every type measured,
// at 1 and 2 threads (session 33); on the Intel Xeon 4-64 KiB were level (session 28).
// Prefetching changes no result.
inline constexpr int64_t kMatvecPrefetchBytes = 32768;
// The one-token F16/BF16 kernels on AVX-512 machines that prefetch into L2 (not Intel:
// prefetch.h IntelCores) issue each weight line's prefetch this many times (at 16-byte steps
// in the line): on the Zen 4 VM F16 and BF16 decode read a larger fraction of the probe than
// with one or two per line at 1 thread (at 2, BF16 too; F16 mixed between samples), where the
// int8 kernels' spans read no faster with two and slower with four (docs/BENCHMARKS.md,
// session 35; why was not established).
inline constexpr int kPrefetchRepeat = 4;

// ---- attention (cpu_attention.cpp)
// One (query i, head h) pair: the plain kernel, which every head width takes with `portable`
// (CpuOptions::portable_kernels) and the oracle of the two below. scratch:
// attention_scratch_floats(head_dim) floats.
void attention_one(const AttentionArgs& a, int64_t i, int64_t h, float* scratch);
// Where heads are narrower than a vector: all heads of KV head kvh for queries [q0, q1), a
// vector of (query, head) pairs at once; each output bit-identical to attention_one's
// (tests/ops AttentionGrouped). attention_group_tokens gives the most queries per call for
// this head_dim and n_head / n_head_kv, 0 where the grouped kernel does not apply or
// `portable`.
int64_t attention_group_tokens(int64_t head_dim, int64_t group, bool portable);
void attention_group(const AttentionArgs& a, int64_t kvh, int64_t q0, int64_t q1, float* scratch);
// scratch floats for either kernel.
size_t attention_scratch_floats(int64_t head_dim);
// Heads a whole number of vectors wide (1, 2, 4 or 8): up to attention_multi_pairs(head_dim)
// (query, head) pairs of KV head kvh per call, entries [e0, e0 + n) of that KV head's pairs
// in (query, head) order (entry e: query e / group, head kvh * group + e % group), sharing
// each K / V row's load; each output bit-identical to attention_one's (tests/ops
// AttentionMulti). 0 where the kernel does not apply or `portable`.
int64_t attention_multi_pairs(int64_t head_dim, bool portable);
void attention_multi(const AttentionArgs& a, int64_t kvh, int64_t e0, int64_t n, float* scratch);

}  // namespace kiln::cpu
