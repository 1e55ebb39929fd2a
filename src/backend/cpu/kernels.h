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
// and kq_batch_matmul is off (default on, faster than the plain kernel by measurement:
// bench/matvec_bench BM_Q4KPackedOnOff; the v2 batched kernels beat it at every size). Its output is the
// plain kernel's bits, so the switch exists for the test that proves it and for bisecting.
void set_q4k_packed_matmul(bool on);
bool q4k_packed_matmul();
// Q4_K and Q6_K matmuls of 4+ tokens (Q4_K: below the packed kernel's minimum) through the
// small-batch 512-bit VNNI kernels where the machine has AVX-512 VNNI (default on, faster by
// measurement: bench/matvec_bench BM_KQPairOnOff). Their output is the plain kernels' bits
// (tests/ops MatmulKQPair), so the switch exists for that test, the benchmark and bisecting.
void set_kq_pair_matmul(bool on);
bool kq_pair_matmul();
// With kq_pair_matmul on, Q4_K/Q6_K matmuls of 2+ tokens, prefill included, through the v2
// batched kernels instead (default on, faster by measurement: bench/matvec_bench
// BM_KQBatchOnOff, BM_LayerStepKQBatch, bench/serve_bench, kiln bench pp512): the same lane
// sums with a cheaper block decode, two tokens per 512-bit float tail and software prefetch.
// Output: the plain kernels' bits (tests/ops MatmulKQBatch); off runs the packed kernel from
// 12 tokens (Q4_K), the small-batch kernels above from 4 and the plain ones below.
void set_kq_batch_matmul(bool on);
bool kq_batch_matmul();
// Q8_0 / Q4_0 / Q5_0 matmuls of kQ8VnniMinTok+ tokens (prefill) through the 512-bit AVX-512
// VNNI kernel (cpu_matmul_q8.cpp) where the machine has AVX-512 VNNI (default on, faster by
// measurement: bench/matvec_bench BM_Q8VnniOnOff, kiln bench pp512). Output: the plain
// kernel's bits (tests/ops MatmulQ8Vnni), so the switch exists for that test, the benchmark
// and bisecting.
void set_q8_vnni_matmul(bool on);
bool q8_vnni_matmul();
// Q4_K and Q6_K matmuls of kKQPrefillMinTok+ tokens (prefill) through the kernels of
// cpu_matmul_kq.cpp (token pairs interleaved in 512-bit registers, each row block decoded once,
// K in chunks whose activation tile stays in L1) where the machine has AVX-512 VNNI; ahead of
// the v2 batched kernels. Output: the plain kernels' bits (tests/ops MatmulKQPrefill), so the
// switch exists for that test, the benchmark and bisecting.
void set_kq_prefill_matmul(bool on);
bool kq_prefill_matmul();
// Q8_K activation encoding (quantize_act_row) with AVX-512 where the machine has it (default on;
// the scalar loop is compiled for the baseline ISA). Output: the scalar loop's bytes (tests/ops
// ActQuant.Q8KSameBytesAsReference, both settings), so the switch exists for that test and
// bisecting.
void set_q8k_quant_simd(bool on);
bool q8k_quant_simd();
// The same for the Q8_0 activation blocks of the Q8_0/Q4_0/Q5_0 matmuls (cpu_matmul_q8.cpp;
// ActQuant.Q8_0SameBytesBothWays; ~2.5 % of a Q8_0 pp512 profile before).
void set_q8_quant_simd(bool on);
bool q8_quant_simd();
// F32/F16/BF16 matmuls of kFloatTileMinTok+ tokens through the register-tiled kernel of
// cpu_matmul_float.cpp (default on, faster by measurement: bench/matvec_bench
// BM_FloatTileOnOff, kiln bench pp512). Output: DotTile's bits (tests/ops MatmulFloatTile), so
// the switch exists for that test, the benchmark and bisecting.
void set_float_tile_matmul(bool on);
bool float_tile_matmul();
inline constexpr int64_t kFloatTileMinTok = 2;
// The tiled kernel itself (matmul_rows calls it); it needs no scratch.
void matmul_float_tiled(const MatmulJob& job, int64_t r0, int64_t r1);
// Q4_K and Q6_K single-token matvecs (decode) through 512-bit AVX-512 VNNI kernels that read the
// token's activation in place (default on; the plain one-token kernels are instruction-bound
// below the DRAM read bandwidth on the Zen 5 dev box: bench/matvec_bench BM_Matvec,
// BM_KQOneOnOff). Output: the plain kernels' bits (tests/ops MatmulKQOne), so the switch exists
// for that test, benchmarks and bisecting.
void set_kq_one_matvec(bool on);
bool kq_one_matvec();
// Q8_0 single-token matvecs through the AVX2 two-row kernel (kq_avx2-inl.h; machines without
// AVX-512 only; default on: bench/matvec_bench BM_Q8OneOnOff). Output: the plain kernel's bits
// (tests/ops MatmulQ8One).
void set_q8_one_matvec(bool on);
bool q8_one_matvec();
// Those one-token kernels and the v2 batched ones software-prefetch this many bytes ahead of
// the rows they work on (0: off; the hardware prefetchers alone leave decode well short of the
// read bandwidth, see cpu_matmul.cpp). Prefetching changes no result. The default is also the literal default of
// --cpu-matvec-prefetch in core/config_entries.h (core cannot see this header): keep them equal.
// 16 KiB is the measured best for the L2 span prefetch below (the L1 burst's was 2048).
inline constexpr int64_t kDefaultMatvecPrefetchBytes = 16384;
void set_matvec_prefetch_bytes(int64_t bytes);
int64_t matvec_prefetch_bytes();
// How they prefetch (default on): on, a span of lines per block step inside the kernels' loop,
// into L2; off, a row group's lines at its start, into L1 (the older way; see MatvecKOne in
// cpu_matmul.cpp). Changes no result (tests/ops MatmulKQPrefetch).
void set_matvec_prefetch_l2(bool on);
bool matvec_prefetch_l2();

// ---- attention (cpu_attention.cpp)
// One (query i, head h) pair. scratch: attention_scratch_floats(head_dim) floats.
void attention_one(const AttentionArgs& a, int64_t i, int64_t h, float* scratch);
// Where heads are narrower than a vector: all heads of KV head kvh for queries [q0, q1), a
// vector of (query, head) pairs at once; each output bit-identical to attention_one's
// (tests/ops AttentionGrouped). attention_group_tokens gives the most queries per call for
// this head_dim and n_head / n_head_kv, 0 where the grouped kernel does not apply.
int64_t attention_group_tokens(int64_t head_dim, int64_t group);
void attention_group(const AttentionArgs& a, int64_t kvh, int64_t q0, int64_t q1, float* scratch);
// scratch floats for either kernel.
size_t attention_scratch_floats(int64_t head_dim);
// The grouped kernel (default on; faster on narrow heads by bench/spec_bench). Its output is
// the per-pair kernel's bits, so the switch exists for the test that proves it and bisecting.
void set_attention_grouped(bool on);
bool attention_grouped();
// Heads a whole number of vectors wide (1, 2, 4 or 8): up to attention_multi_pairs(head_dim)
// (query, head) pairs of KV head kvh per call, entries [e0, e0 + n) of that KV head's pairs
// in (query, head) order (entry e: query e / group, head kvh * group + e % group), sharing
// each K / V row's load; each output bit-identical to attention_one's (tests/ops
// AttentionMulti). 0 where the kernel does not apply or --cpu-attn-multi is off.
int64_t attention_multi_pairs(int64_t head_dim);
void attention_multi(const AttentionArgs& a, int64_t kvh, int64_t e0, int64_t n, float* scratch);
void set_attention_multi(bool on);
bool attention_multi();

}  // namespace kiln::cpu
