// backend/cuda/kernels.h: the kernel launchers, one family per .cu file. Every launcher takes
// device pointers and a stream and only enqueues work (no synchronisation, no allocation), so
// the host-span Backend (cuda_backend.cpp) and a later device-resident forward pass call the
// same code. Launchers return the launch's cudaError_t; nothing throws.
//
// Layouts are backend.h's: activations f32 row-major [n_tok][width], KV planes f16
// [n_phys][n_head_kv * head_dim], weights in their GGUF bytes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include "backend/cuda/l2_prefetch.h"
#include "core/dtype.h"

namespace kiln::cuda {

// A weight matrix already on the device (an offset into the weight arena).
struct DeviceWeight {
  DType dtype = DType::F32;
  int64_t n_cols = 0;
  int64_t n_rows = 0;
  size_t row_bytes = 0;
  const std::byte* data = nullptr;
};

// --- matvec.cu: y[t][r] = sum_c W[r][c] x[t][c], dequantization fused.
// V2: activations staged once per block in padded shared memory (conflict-free 16-byte reads),
// float rows read with lane-contiguous 16-byte loads, several rows per warp; above 16 tokens
// the weight is dequantized to f16 and cuBLAS runs the product on tensor cores (f16 inputs, f32
// accumulation; needs a GemmWorkspace reserved for the shape). Its fallbacks are the first
// kernels (once selectable as V1, removed as a choice in issue 31): one row per warp with the
// activations read per lane from global memory where they do not fit in shared memory, and
// the 64x64 f32 tile kernel above 16 tokens without a workspace (no cuBLAS, or it refused).
// V3 (matvec_q8.cu): decode and batched decode up to kQ8MaxTokens tokens with the activations
// quantized once per call into int8 blocks of 32 (scale and sum, per token) and __dp4a dot
// products for Q8_0 Q4_0 Q5_0 Q4_K Q5_K Q6_K; float weights up to 8 tokens with 16-byte loads
// and f32 FMAs. Each output is one fixed reduction order whatever the number of tokens (bit-
// identical per token, docs/determinism.md). Other types and shapes run V2. Needs the
// activation scratch of launch_matmul_v3.
enum class MatmulKernels { V2, V3 };

// The cuBLAS handle and f16 scratch of V2's many-token path. reserve() allocates (synchronous,
// never inside a launcher); launch_matmul only uses what was reserved.
class GemmWorkspace {
 public:
  GemmWorkspace() = default;
  ~GemmWorkspace();
  GemmWorkspace(const GemmWorkspace&) = delete;
  GemmWorkspace& operator=(const GemmWorkspace&) = delete;
  // Makes room for w times n_tok activations; false (and the f32 tile-kernel fallback) when
  // cuBLAS is missing from the build or refuses.
  bool reserve(const DeviceWeight& w, int64_t n_tok);
  bool fits(const DeviceWeight& w, int64_t n_tok) const;
  void* handle() const { return handle_; }
  void* scratch() const { return scratch_; }
  // cuBLAS's workspace of its own, allocated once with the handle and never moved
  // (cublasSetWorkspace after every cublasSetStream, which resets it), so a GEMM captured into
  // a CUDA graph names memory that outlives the graph. Null only if that allocation failed:
  // cuBLAS then takes its workspace from its own pool, which a captured graph must not rely
  // on, and the caller keeps such segments out of graphs.
  void* cublas_workspace() const { return cublas_ws_; }
  static constexpr size_t kCublasWorkspaceBytes = size_t(32) << 20;  // cuBLAS's Hopper default

 private:
  void* handle_ = nullptr;  // cublasHandle_t
  void* scratch_ = nullptr;
  void* cublas_ws_ = nullptr;
  size_t bytes_ = 0;
  bool failed_ = false;
};

// w dequantized into n_rows x n_cols halves at `out` (rows back to back, 16-byte aligned):
// the kernels the GEMM path runs into its scratch on every call, here for a cached copy.
cudaError_t launch_dequant_f16(const DeviceWeight& w, void* out, cudaStream_t s);

// Above this many tokens V2 uses the GEMM path (without a workspace: the f32 tile kernel).
inline constexpr int64_t kMatvecMaxTokens = 16;

// V2 (MatmulKernels::V3 without its activation scratch runs this too: launch_matmul_v3).
cudaError_t launch_matmul(const DeviceWeight& w, const float* x, int64_t n_tok, float* y,
                          cudaStream_t s, GemmWorkspace* gemm = nullptr);
// --- matvec_q8.cu: MatmulKernels::V3.
inline constexpr int64_t kQ8MaxTokens = 64;
// Bytes of activation scratch launch_matmul_v3 needs for n_tok rows of n_cols (0 when the
// int8 path does not apply: n_cols not a multiple of 32 or more than kQ8MaxTokens tokens).
size_t act_q8_bytes(int64_t n_cols, int64_t n_tok);
// True when launch_matvec_q8 reads this weight type with int8 activations.
bool matvec_q8_supports(DType t);
// x [n_tok][n_cols] f32 -> act (act_q8_bytes): per token, n_cols int8 then (d, d * sum q)
// per 32-element block. NaN or inf in a block makes the block's scale NaN (propagates).
// With up: the input is silu(x) * up (the bits of launch_binary(SwiGLU) then this).
cudaError_t launch_quantize_act_q8(const float* x, int64_t n_cols, int64_t n_tok, void* act,
                                   cudaStream_t s, const float* up = nullptr);
// y = W x from activations launch_quantize_act_q8 wrote (so one quantization serves several
// weights of the same input); w.dtype must be matvec_q8_supports and n_tok <= kQ8MaxTokens.
// From mma_min_tokens tokens on (0: never) Q4_K (16-byte aligned rows) and Q6_K run on the
// int8 tensor cores (mma.sync, sm_80+) with the same bits as the dp4a kernels: the exact
// integer dot of each unit, then the dp4a kernels' float operations in their order
// (matvec_q8.cu). From 8 tokens by default: on the H200 the shared-memory form is 1.2-2.2x
// dp4a at 8-16 tokens (slower at 4), and the 8B Q4_K_M decode of 16 sequences went 1392 ->
// 2075 t/s (docs/BENCHMARKS.md, CUDA session 13). Q8_0 stays on dp4a (its tensor-core kernel
// is slower; launch_matvec_q8_mma still runs it).
inline constexpr int kQ8MmaMinTokens = 8;
cudaError_t launch_matvec_q8(const DeviceWeight& w, const void* act, int64_t n_tok, float* y,
                             cudaStream_t s, int mma_min_tokens = kQ8MmaMinTokens);
// The tensor-core path alone (Q8_0 included), with nb (1, 2 or 4) tiles of 8 tokens per block
// column whatever n_tok is (every nb has the same bits; for tests and cuda_matvec_bench).
// cudaErrorInvalidValue where it does not apply (type, alignment, device).
cudaError_t launch_matvec_q8_mma(const DeviceWeight& w, const void* act, int64_t n_tok, float* y,
                                 int nb, cudaStream_t s);
// Several weights of one type, width and row size against the same input in one launch (a
// layer's Q/K/V or gate/up, ys[i] for ws[i]): each output has the bits launch_matvec_q8 /
// launch_matvec_float_v3 write for that weight alone (the same kernel body per row, the same
// launch shape); one grid instead of several saves the kernel boundaries and partial last
// waves. cudaErrorNotSupported (nothing launched) when the weights differ in layout, there are
// more than kMatvecGroupMax, or the rows pass one grid: launch them one by one then.
inline constexpr int kMatvecGroupMax = 4;
cudaError_t launch_matvec_q8_group(std::span<const DeviceWeight> ws, std::span<float* const> ys,
                                   const void* act, int64_t n_tok, cudaStream_t s,
                                   int mma_min_tokens = kQ8MmaMinTokens);
cudaError_t launch_matvec_float_v3_group(std::span<const DeviceWeight> ws,
                                         std::span<float* const> ys, const float* x, int64_t n_tok,
                                         int rows, cudaStream_t s);
// V3's float-weight kernel (F32/F16/BF16 rows 16-byte aligned, n_cols % 8 == 0, 1-8 tokens)
// with `rows` (1, 2 or 4) rows per warp sharing each activation load. Every `rows` gives the
// same bits (one accumulation order per output); launch_matmul_v3 takes float_v3_rows's choice
// for the shape, measured by bench/cuda/cuda_matvec_bench --float-rows-ab.
cudaError_t launch_matvec_float_v3(const DeviceWeight& w, const float* x, int64_t n_tok, float* y,
                                   int rows, cudaStream_t s);
int float_v3_rows(DType t, int64_t n_tok, int64_t n_rows, int64_t n_cols);
// True when V3's float kernel takes this weight, input and token count (launch_matmul_v3
// takes the tensor-core kernel first where float_mma_fits).
bool float_v3_applies(const DeviceWeight& w, const float* x, int64_t n_tok);
// --- matvec_mma_float.cu: F16/BF16 weights against 1-8 tokens on the tensor cores (tf32 mma
// with each activation split into two tf32 terms): launch_matmul_v3 takes it where it fits. One
// accumulation order per output whatever the token count (bit-identical per token), a
// different one from V3's float kernel. Needs rows and x 16-byte aligned, n_cols % 64 == 0.
bool float_mma_fits(const DeviceWeight& w, const float* x, int64_t n_tok);
// A launch's shape: warps per block splitting the columns (4, 8 or 16: the bits depend on
// it), steps each warp loads together (unroll) and 16-row tiles per block (mtiles), pairs
// (2, 1), (4, 1), (1, 2), (2, 2); those two change no bit.
struct FloatMmaShape {
  int warps = 0, unroll = 0, mtiles = 0;
};
// The shape launches take for a weight (from its shape only).
FloatMmaShape float_mma_shape(int64_t n_rows, int64_t n_cols);
// Another shape for this thread's launches (cuda_matvec_bench's sweep); warps 0: the policy.
void set_float_mma_shape(FloatMmaShape shape);
cudaError_t launch_matvec_float_mma(const DeviceWeight& w, const float* x, int64_t n_tok, float* y,
                                    cudaStream_t s);
// Several F16/BF16 weights of one type and width against one input in one grid (a layer's
// Q/K/V or gate/up), each output with its own launch's bits; cudaErrorNotSupported (nothing
// launched) when their shapes differ or there are more than kMatvecGroupMax.
cudaError_t launch_matvec_float_mma_group(std::span<const DeviceWeight> ws,
                                          std::span<float* const> ys, const float* x, int64_t n_tok,
                                          cudaStream_t s);
// The V3 matmul: the int8 path when it applies (act_scratch of act_q8_bytes), for float
// weights up to 8 tokens the tensor-core kernel where it fits (float_mma_fits) else V3's float
// kernel, else V2 (with gemm above kMatvecMaxTokens).
cudaError_t launch_matmul_v3(const DeviceWeight& w, const float* x, int64_t n_tok, float* y,
                             void* act_scratch, size_t scratch_bytes, cudaStream_t s,
                             GemmWorkspace* gemm = nullptr, int mma_min_tokens = kQ8MmaMinTokens);

// --- get_rows.cu: out[i][:] = row ids[i] of w, dequantized.
cudaError_t launch_get_rows(const DeviceWeight& w, const int32_t* ids, int64_t n_ids, float* out,
                            cudaStream_t s);

// --- norm.cu
// weight may be null (no scaling).
cudaError_t launch_rmsnorm(const float* x, const float* weight, int64_t n_rows, int64_t n,
                           float eps, float* y, cudaStream_t s);
// x += a, then y = rmsnorm(x): the bits of launch_binary(Add) followed by launch_rmsnorm, in
// one kernel where the row fits the float4 path (else it launches those two).
cudaError_t launch_add_rmsnorm(float* x, const float* a, const float* weight, int64_t n_rows,
                               int64_t n, float eps, float* y, cudaStream_t s);
cudaError_t launch_softmax(float* x, int64_t n_rows, int64_t n, cudaStream_t s);

// --- rope.cu (neox: rotate (i, i + n_rot/2) instead of adjacent pairs)
// The angles of one rope op: backend.h's RopeParams with its YaRN terms already derived on the
// host (rope_yarn_terms) and the per-pair factors in device memory (or null).
struct RopeAngles {
  int64_t n_rot = 0;
  float freq_base = 10000, freq_scale = 1;
  bool neox = false;
  const float* factors = nullptr;  // [n_rot / 2] frequency divisors, or null
  float corr_lo = 0, corr_hi = 0, ext_factor = 0, mscale = 1;
};
cudaError_t launch_rope(float* x, int64_t n_tok, int64_t n_head, int64_t head_dim,
                        const int32_t* pos, const RopeAngles& a, cudaStream_t s);
// Q [n_tok][n_head_q][head_dim] and K [n_tok][n_head_k][head_dim] by the same angles in one
// launch; the bits of launch_rope on each (the same kernel).
cudaError_t launch_rope_qk(float* q, int64_t n_head_q, float* k, int64_t n_head_k, int64_t n_tok,
                           int64_t head_dim, const int32_t* pos, const RopeAngles& a,
                           cudaStream_t s);

// --- elementwise.cu
enum class Unary { Scale, Softcap, Sigmoid };
// SwiGLUOai: gpt-oss's clamped SwiGLU with llama.cpp's constants (kOaiAlpha, kOaiLimit).
enum class Binary { Add, Mul, SwiGLU, GeGLU, SwiGLUOai };
inline constexpr float kOaiAlpha = 1.702f, kOaiLimit = 7.0f;
cudaError_t launch_unary(float* x, int64_t n, Unary op, float param, cudaStream_t s);
// out may alias a or b.
cudaError_t launch_binary(const float* a, const float* b, float* out, int64_t n, Binary op,
                          cudaStream_t s);
// dst[i][:] = src[ids[i]][:], rows of `width` floats.
cudaError_t launch_gather_rows(const float* src, int64_t width, const int32_t* ids, int64_t n,
                               float* dst, cudaStream_t s);
// src[i][:] *= scales[i], then out[ids[i]][:] += src[i][:]: launch_unary(Scale) then
// launch_binary(Add) on each row, the same bits (no fused multiply-add); ids distinct.
cudaError_t launch_scale_add_rows(float* src, int64_t width, const int32_t* ids,
                                  const float* scales, int64_t n, float* out, cudaStream_t s);
// plane[rows[i]][:] = f16(src[i][:]); plane rows hold `width` f16 values (uint16_t bits).
cudaError_t launch_store_rows_f16(const float* src, int64_t width, const int32_t* rows,
                                  int64_t n_rows, uint16_t* plane, cudaStream_t s);

// --- argmax.cu: *out = index of the largest x (first on ties).
cudaError_t launch_argmax(const float* x, int64_t n, int64_t* out, cudaStream_t s);

// --- top_k.cu: the k largest of each row of x ([rows][n]) in sampling order (descending
// value, ascending index on ties) into out_v/out_i [rows][k]; 1 <= k <= min(n, kTopKMax).
// scratch_v/scratch_i: 2 * top_k_scratch(rows, n, k) entries each.
inline constexpr int32_t kTopKMax = 256;
size_t top_k_scratch(int64_t rows, int64_t n, int32_t k);
cudaError_t launch_top_k(const float* x, int64_t rows, int64_t n, int32_t k, float* scratch_v,
                         int32_t* scratch_i, float* out_v, int32_t* out_i, cudaStream_t s);

// --- attention.cu: split-K flash attention over f16 planes through the row map.
// The widest head (K and V row per head) the kernels take: latent attention's absorbed rows,
// kv_lora 512 + rope 64 (DeepSeek-V3, Kimi-K2). Heads up to 256 take the split / warp-tile /
// tile kernels; wider ones (a multiple of 8, 16-byte aligned planes) the wide kernel, which
// is planned as warp tiles: DeviceAttention::warp_tiles must be set for them.
inline constexpr int64_t kAttentionMaxHeadDim = 576;
struct DeviceAttention {
  const float* q = nullptr;     // [n_q][n_head * head_dim]
  const uint16_t* k = nullptr;  // [n_phys][n_head_kv * head_dim], f16 bits
  const uint16_t* v = nullptr;
  const int32_t* kv_rows = nullptr;  // [n_kv]
  const int32_t* kv_pos = nullptr;   // [n_kv]
  const int32_t* q_pos = nullptr;    // [n_q]
  int64_t n_q = 0, n_kv = 0, n_head = 0, n_head_kv = 0, head_dim = 0;
  int32_t window = 0;
  float scale = 1, softcap = 0;
  float* out = nullptr;          // [n_q][n_head * head_dim]
  const float* sinks = nullptr;  // [n_head] attention sinks (gpt-oss), or null
  // Decode (the split path) by the warp-tile kernel: a warp scores 32 keys at a time, one per
  // lane, and slices are 256+ keys (a short context needs no merge kernel). Different
  // summation order from the split kernel: a flag with a measured default
  // (CudaOptions::attention_warp_tiles). Needs attention_warp_tiles_fit. Part of the plan, so
  // set before attention_scratch_floats / plan_attention_batch.
  bool warp_tiles = false;
};
// Floats of scratch launch_attention needs for these shapes on this device (partial results
// of the key splits); pass at least that many in `scratch`.
size_t attention_scratch_floats(const DeviceAttention& a, int n_sm);
cudaError_t launch_attention(const DeviceAttention& a, float* scratch, int n_sm, cudaStream_t s);
// True when launch_attention takes the tensor-core prefill kernel for these shapes (f16 Q and
// P: a looser bound than the split kernel's f32 path).
bool attention_uses_tiles(const DeviceAttention& a);
// Whether the warp-tile decode kernel (or, above 256, the wide kernel) can serve these planes
// (head size a multiple of 8 up to kAttentionMaxHeadDim, 16-byte aligned planes).
bool attention_warp_tiles_fit(int64_t head_dim, const void* k, const void* v);
// Several sequences' attention in one launch pair (a batched decode step: each sequence a few
// queries over its own planes). Each item's output has the bits of launch_attention of that
// item alone: the same split plan and the same block code. Items must not take the tile path
// and must share n_head, n_head_kv and head_dim.
struct AttentionBatchItem {
  DeviceAttention a;
  float* part = nullptr;                    // attention_scratch_floats(a) floats of its own
  int64_t n_split = 0, keys_per_split = 0;  // plan_attention_batch fills these and the next
  int64_t block0 = 0, merge0 = 0;           // first block of the item in each grid
};
// Plans every item as launch_attention would alone; returns the split grid's block count.
int64_t plan_attention_batch(std::span<AttentionBatchItem> items, int n_sm);
// items: the planned table in device memory; host_items: the same table on the host.
cudaError_t launch_attention_batch(const AttentionBatchItem* items,
                                   std::span<const AttentionBatchItem> host_items, cudaStream_t s);
// Several row scatters into f16 planes in one launch (rows of item i: src[r] -> plane row
// rows[r]); the same conversion as launch_store_rows_f16.
struct StoreRowsItem {
  const float* src = nullptr;
  const int32_t* rows = nullptr;
  int64_t n_rows = 0, width = 0;
  uint16_t* plane = nullptr;
};
cudaError_t launch_store_rows_f16_batch(const StoreRowsItem* items, int n_items, int64_t max_elems,
                                        cudaStream_t s);

// --- launch.cuh / probe.cu: programmatic dependent launch (launch.cuh says why and how it stays
// safe). While set on the calling thread, the decode-path launchers (quantization, V3 matvecs,
// rmsnorm, rope, elementwise, KV stores, split attention, argmax, get_rows) start their kernel
// with the PDL attribute; results are the same bits either way. Off unless set: the backend
// sets it around its own enqueues, except in profile mode, whose event nodes separate every
// kernel anyway (on by measurement: 8B Q4_K_M tg128 on the H200 299.5 -> 321 t/s, CUDA
// session 8).
void set_launch_pdl(bool on);
bool launch_pdl();
// Which kernel the int8 tensor-core path runs for Q4_K and Q6_K rows of whole stages (512 /
// 256 columns) at 8-16 tokens per block column: 3, 4 or 6, the one that streams rows and
// activations through a ring of that many stages of shared memory; 0, the one that reads its
// fragments from global memory (matvec_q8.cu). Same bits either way
// (CudaMatvecQ8.MmaHasTheDp4aBits runs them all); per thread, for cuda_matvec_bench's A/B.
inline constexpr int kMmaStagesDefault = 4;  // 3 / 4 / 6 measured: 4 (session 13)
void set_mma_stages(int stages);
int mma_stages();
// That kernel's warps per block (16 rows): 4, each summing 8 of the butterfly's 32 lanes, or
// 8, each summing 4 (half the sums in registers per thread, 16 warps per SM instead of 12).
// Same bits. 8: the 8B Q4_K_M decode of 16 sequences 1.30x dp4a with 4, 1.49x with 8
// (docs/BENCHMARKS.md, CUDA session 13).
inline constexpr int kMmaWarpsDefault = 8;
void set_mma_warps(int warps);
int mma_warps();

// DeviceAttention::warp_tiles's default (CudaOptions::attention_warp_tiles mirrors it). On by
// measurement: 8B Q4_K_M on the H200 x64 6792 -> 9038 t/s, x16 2188 -> 2307, tg128 the same
// (docs/BENCHMARKS.md, CUDA session 16).
inline constexpr bool kAttentionWarpTilesDefault = true;

// --- prefetch.cu: the ranges' bytes pulled into L2 (l2_prefetch.h), at most
// kL2PrefetchMaxRanges ranges per launch (more are dropped). A hint to the cache: it returns at
// once and no result depends on it. Launched on a stream of its own (cuda_backend.cpp).
inline constexpr int kL2PrefetchMaxRanges = 8;
// Hints of steps with more tokens are ignored: measured at one token only, where the matvecs
// alternate with latency-bound small ops. Batched steps' int8 tensor-core matmuls are bound
// by instruction issue, not by the weights' reads: 16 sequences lost 2 % with hints on
// (docs/BENCHMARKS.md, CUDA session 17).
inline constexpr int64_t kL2PrefetchMaxTokens = 1;
// CudaOptions::l2_prefetch_bytes's default: on by measurement for the K-quants (8B Q4_K_M
// tg128 on the H200 +0.5 to +3.0 % in six alternations over three device runs; 16 MiB and
// more lose 2-6 %: docs/BENCHMARKS.md, CUDA session 17).
inline constexpr uint64_t kL2PrefetchBytesDefault = uint64_t(8) << 20;
// The weight types hints prefetch: the K-quants, whose one-token kernels read at 45-65 % of the
// bandwidth and gain from L2 hits. Q8_0 (71 %) and F16 (77-98 %) measured no gain (Q8_0 tg128
// 317-320 t/s either way) or a loss (F16 -2 %): their hints are dropped.
constexpr bool l2_prefetch_type(DType t) {
  return t == DType::Q4_K || t == DType::Q5_K || t == DType::Q6_K;
}
struct L2PrefetchArgs {
  const void* p[kL2PrefetchMaxRanges];
  size_t bytes[kL2PrefetchMaxRanges];
  int64_t first_piece[kL2PrefetchMaxRanges];  // the range's first 16 KiB piece in the grid
  int n;
};
cudaError_t launch_l2_prefetch(std::span<const PrefetchRange> ranges, cudaStream_t s);

// --- probe.cu: reads `bytes` (16-byte aligned) with `blocks` blocks; sink holds `blocks` floats.
cudaError_t launch_read_probe(const void* data, size_t bytes, float* sink, int blocks,
                              cudaStream_t s);

}  // namespace kiln::cuda
