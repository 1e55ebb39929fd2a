// backend/cuda/cuda_backend.h: the CUDA backend behind the op table. A plain C++ header (no
// CUDA types), so model and app code can create one without CUDA headers; everything CUDA
// lives behind the pimpl (backend_impl.h and the rooms it composes; the file map is in
// docs/architecture.md) and the kernels in *.cu.
//
// Two ways to call the ops. Resident (the forward pass): activations and KV planes live in
// memory from alloc_bytes(), weights in the device arena; ops only enqueue work on one stream
// (small host arrays such as token ids and KV row lists go up through pinned staging), and the
// queue runs at the next download or synchronize(), as a CUDA graph when the same sequence of
// ops (same pointers, sizes and parameters) ran before. Host spans (tests, other callers): the
// same resident op runs on device twins of the host arrays and synchronises; its outputs are
// copied back (host_span.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/tier_policy.h"
#include "core/status.h"

namespace kiln {

// The matmul kernels (backend/cuda/kernels.h's MatmulKernels): V2, shared-memory activations
// for decode and f16 tensor-core GEMM (cuBLAS) for more than 16 tokens (the first slice's f32
// kernels, once selectable as V1, remain only as its fallbacks). V3 (matvec_q8.cu):
// up to 64 tokens with int8-quantized activations and dp4a for Q8_0 Q4_0 Q5_0 Q4_K Q5_K Q6_K
// (token-invariant bits), else V2. Auto (the default): V3 up to kAutoInt8MaxTokens tokens,
// V2's cuBLAS GEMM above: at 64 tokens the dp4a kernels take 2.4-2.9x the GEMM's time while at
// 16 they take 0.3x of V2's (docs/BENCHMARKS.md, "CUDA decode kernels V3"); F16 weights take
// the GEMM above 8 tokens (V3's float kernel's limit).
enum class CudaMatmul { V2, V3, Auto };
inline constexpr int64_t kAutoInt8MaxTokens = 16;
// From 8 tokens: the shared-memory tensor-core kernels took the 8B Q4_K_M x16 decode from 1392
// to 2075 t/s and x8 from 1173 to 1373 on the H200 (docs/BENCHMARKS.md, CUDA session 13); at 4
// tokens they are slower than dp4a (x4 855 -> 598 t/s).
inline constexpr int64_t kInt8MmaMinTokens = 8;

// Copied once by make_cuda_backend, which checks the ranges below (one line per bad value), and
// fixed for the backend's life; a different setting is a second backend.
struct CudaOptions {
  int device = 0;
  CudaMatmul matmul = CudaMatmul::Auto;
  // Auto: the most tokens a quantized matmul runs on V3's int8 kernels (more: cuBLAS), 1..64
  // (checked whatever `matmul` is).
  int64_t auto_int8_max_tokens = kAutoInt8MaxTokens;
  // V3/Auto: int8 matmuls of at least this many tokens (Q4_K, Q6_K) on the int8 tensor cores
  // instead of dp4a, the same bits either way (kernels.h, launch_matvec_q8); 0: never; 0..64.
  int64_t int8_mma_min_tokens = kInt8MmaMinTokens;
  // Optional: the whole weight region (e.g. the GGUF mapping's tensor data). When set, it is
  // uploaded once, at creation, into one arena allocation through pinned staging on a copy
  // stream, and every WeightMatrix inside it is an offset into that arena.
  std::span<const std::byte> weight_region;
  // Optional: host memory that never changes while the backend lives (the GGUF mapping) but
  // is not uploaded as a whole: float vectors inside it (norm weights, biases) are cached in
  // the arena on first use like weights, instead of being staged again by every op. A
  // tensor-parallel rank, which uploads only its shard, sets it to the mapping.
  std::span<const std::byte> immutable_region;
  // Weights outside the region are uploaded on first use into arena chunks of at least this
  // many bytes.
  size_t arena_chunk_bytes = size_t(256) << 20;
  // Compare cached weights with the host bytes on every use (a shadow copy) and re-upload if
  // they changed. Only for tests, whose weight buffers are freed and their addresses reused;
  // the mapping never changes.
  bool verify_weight_cache = false;
  bool progress = false;  // print upload progress (GB/s) for the region upload
  // Map weight_region in place (cudaHostRegister, no copy) instead of uploading it: the mode
  // of unified-memory GPUs; on discrete ones every read crosses PCIe (slow, but it must be
  // correct). Fails open: if the driver refuses, one notice line and the arena upload.
  bool zero_copy = false;
  // Time every op with CUDA events (kernels vs the host<->device copies of this host-span
  // backend); adds a few microseconds per op. Read with CudaBackend::stats(). Only where the
  // profiler starts: CudaBackend::set_profile turns it on and off later.
  bool profile = false;
  // Replay a resident segment (the ops between two downloads) as a CUDA graph the second time
  // it is seen, and pad attention key lists to buckets of this many keys so a decode step's
  // graph survives a growing context. Off: every segment is launched op by op (profile mode
  // always is). Segments with cuBLAS GEMMs (prefill, batches above auto_int8_max_tokens) are
  // captured too, cuBLAS working in a fixed workspace of its own (CudaGemmGraphs.SameBitsAsEager).
  bool graphs = true;
  int64_t graph_kv_bucket = 256;  // keys, at least 1 (1: no padding)
  // Device tier of streamed MoE experts (WeightMatrix::content_key != 0): at most this many
  // bytes of expert slices stay on the device. 0: half of the device memory free when the
  // first one arrives.
  uint64_t expert_cache_bytes = 0;
  // Which slice it gives up first (backend/tier_policy.h); the kernels' results are the same.
  TierEviction expert_policy = TierEviction::Lfu;
  // Queue an op's expert copies back to back and wait once for the last, instead of one
  // synchronous copy each; same results.
  bool expert_async_copies = true;
  // Decode attention by the warp-tile kernel (kernels.h DeviceAttention::warp_tiles): a warp
  // scores 32 keys at a time, one per lane, over slices of 256+ keys; a different summation
  // order from the split kernel (results within the same bound of the reference), so a flag
  // with its default set by measurement (on: 8B Q4_K_M x64 +33 %, x16 +5 % on the H200).
  // Every sequence of a step takes the same kernel, alone or batched. Head sizes that are not
  // a multiple of 8 keep the split kernel.
  bool attention_warp_tiles = true;  // kernels.h kAttentionWarpTilesDefault (asserted)
  // Matmuls that take the cuBLAS path (above auto_int8_max_tokens tokens: prefill, large
  // batches) read an f16 copy of the weight kept on the device, written once at its first such
  // call, instead of dequantizing it into scratch on every call. At most this many bytes of
  // copies (weights of the region only: they never change); 0: off; kF16CacheAuto: a quarter
  // of the device memory free at the first copy. Same results (the same dequantization and
  // the same cuBLAS call on the same halves; CudaF16Cache.SameBitsAsWithout).
  static constexpr uint64_t kF16CacheAuto = ~uint64_t(0);
  uint64_t f16_cache_bytes = 0;
  // Backend::prefetch_weights hints: each pulls up to this many more leading bytes of the
  // named weights into L2 (backend/cuda/l2_prefetch.h), by a kernel on a second stream while
  // the latency-bound ops before their matvecs run; hinted bytes not yet read stay within 3/4
  // of the L2. One-token steps and K-quant weights only (kernels.h l2_prefetch_type). 0: hints
  // are ignored. Same results (only where loads find their bytes changes;
  // CudaL2Prefetch.SameBitsAsWithout). 8 MiB by measurement (kernels.h
  // kL2PrefetchBytesDefault, asserted): 8B Q4_K_M tg128 +0.5 to +3.0 % on the H200.
  uint64_t l2_prefetch_bytes = uint64_t(8) << 20;
  // On trial: Backend::groups_few_token_experts (MoE steps of 2-8 tokens as grouped gate/up
  // launches, one activation quantization per chunk of experts). Same bits (the matvecs are
  // token-invariant; ResidentAlloc checks the path against host memory on the CPU kernels);
  // not yet measured on a GPU, so off until the MTP verify A/B (docs/BENCHMARKS.md, session 36).
  bool few_token_moe = false;
};

// The widest attention head (K and V rows per head) the CUDA attention kernels take: latent
// attention's absorbed MQA rows of DeepSeek-V3 / Kimi-K2 (kv_lora 512 + rope 64). Heads wider
// than 256 must be a multiple of 8 (kernels.h kAttentionMaxHeadDim, asserted equal).
inline constexpr int64_t kCudaMaxHeadDim = 576;
inline constexpr int64_t kCudaNarrowHeadDim = 256;  // wider: a multiple of 8

struct CudaOpTime {
  std::string op;
  uint64_t calls = 0;
  double kernel_ms = 0;  // the op's kernels
  uint64_t bytes = 0;    // weight bytes the calls read (matmuls; resident ops)
};

struct CudaStats {
  uint64_t weight_bytes_uploaded = 0;
  uint64_t weight_uploads = 0;     // matrices (or the region) uploaded
  uint64_t weight_cache_hits = 0;  // lookups served from the arena
  uint64_t arena_bytes = 0;        // device bytes reserved for weights
  double upload_seconds = 0;
  bool zero_copy = false;       // weight_region is mapped in place (registration succeeded)
  std::vector<CudaOpTime> ops;  // profile mode: per op, in first-call order
  // Resident segments (the ops between two synchronisations): launched op by op, captured into
  // a graph, replayed from one.
  uint64_t segments_eager = 0, graph_captures = 0, graph_replays = 0;
  // Resident segments' end: how often the host waited for the GPU to finish one, and for how
  // long in all. A decode step whose wait is near zero is bound by the host's recording of its
  // ops, not by the GPU (kiln bench prints the share).
  uint64_t segment_waits = 0;
  double segment_wait_ms = 0;
  uint64_t device_bytes = 0;  // held now by alloc_bytes() buffers (scratch, KV planes)
  // The expert tier: slices found on the device, copied in, evicted; bytes copied and held.
  uint64_t expert_hits = 0, expert_misses = 0, expert_evictions = 0;
  uint64_t expert_bytes_copied = 0, expert_bytes_held = 0, expert_cache_bytes = 0;
  // CudaOptions::f16_cache_bytes: weights copied to f16, the bytes they hold, and the cap.
  uint64_t f16_cache_weights = 0, f16_cache_bytes = 0, f16_cache_cap = 0;
  // CudaOptions::l2_prefetch_bytes: hints that launched a prefetch, and the bytes they named.
  uint64_t l2_prefetch_hints = 0, l2_prefetch_bytes = 0;
};

class CudaBackend final : public Backend {
 public:
  struct Impl;
  explicit CudaBackend(std::unique_ptr<Impl> impl);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string_view name() const override { return "cuda"; }
  const std::string& device_name() const;  // "NVIDIA H200 (sm_90, 132 SMs, 140.4 GiB)"
  CudaStats stats() const;
  // Turns per-op timing on or off between segments and clears the times gathered so far:
  // `kiln bench --cuda-profile` times one extra pass of each test. Run-time state of the
  // profiler, not an option: CudaOptions::profile is only where it starts; every other
  // CudaOptions field is fixed for the backend's life.
  void set_profile(bool on);

  bool device_memory() const override { return true; }
  bool batch_invariant() const override { return false; }  // docs/determinism.md, CUDA
  bool groups_few_token_experts() const override;          // CudaOptions::few_token_moe
  uint64_t device_free_bytes() const override;             // cudaMemGetInfo's free bytes
  BackendBytes alloc_bytes(size_t bytes) override;
  // cudaHostRegister (page-locked, portable); the handle's release unregisters.
  std::shared_ptr<void> register_host_memory(std::span<std::byte> mem) override;
  void upload_bytes(std::span<const std::byte> host, std::span<std::byte> dst) override;
  void download_bytes(std::span<const std::byte> src, std::span<std::byte> host) override;
  void copy_bytes(std::span<const std::byte> src, std::span<std::byte> dst) override;
  void copy_bytes_2d(const std::byte* src, size_t src_pitch, std::byte* dst, size_t dst_pitch,
                     size_t width, size_t rows) override;
  void gather_rows_f32(std::span<const float> src, int64_t width, std::span<const int32_t> ids,
                       std::span<float> dst) override;
  void scale_add_rows_f32(std::span<float> src, int64_t width, std::span<const int32_t> ids,
                          std::span<const float> scales, std::span<float> out) override;
  void zero_bytes(std::span<std::byte> dst) override;
  void synchronize() override;
  double read_bandwidth_gbps() override;  // 1 GiB streamed by the probe kernel, best of 5

  void matmul(const WeightMatrix& w, std::span<const float> x, int64_t n_tok,
              std::span<float> y) override;
  void matmul_batch(std::span<const MatmulTask> tasks, int64_t n_tok) override;
  void get_rows(const WeightMatrix& w, std::span<const int32_t> ids, std::span<float> out) override;
  void rmsnorm(std::span<const float> x, std::span<const float> weight, int64_t n, float eps,
               std::span<float> y) override;
  void add_rmsnorm(std::span<float> x, std::span<const float> a, std::span<const float> weight,
                   int64_t n, float eps, std::span<float> y) override;
  void rope(std::span<float> x, int64_t n_tok, int64_t n_head, int64_t head_dim,
            std::span<const int32_t> pos, const RopeParams& p) override;
  void rope_qk(std::span<float> q, int64_t n_head_q, std::span<float> k, int64_t n_head_k,
               int64_t n_tok, int64_t head_dim, std::span<const int32_t> pos,
               const RopeParams& p) override;
  void softmax(std::span<float> x, int64_t n) override;
  void swiglu(std::span<const float> gate, std::span<const float> up,
              std::span<float> out) override;
  void swiglu_matmul(const WeightMatrix& w, std::span<const float> gate, std::span<const float> up,
                     int64_t n_tok, std::span<float> act, std::span<float> y) override;
  void geglu(std::span<const float> gate, std::span<const float> up, std::span<float> out) override;
  void swiglu_oai(std::span<const float> gate, std::span<const float> up, std::span<float> out,
                  float alpha, float limit) override;
  void add(std::span<const float> a, std::span<const float> b, std::span<float> out) override;
  void mul(std::span<const float> a, std::span<const float> b, std::span<float> out) override;
  void scale(std::span<float> x, float s) override;
  void softcap(std::span<float> x, float cap) override;
  void sigmoid(std::span<float> x) override;
  void store_rows_f16(std::span<const float> src, int64_t width, std::span<const int32_t> rows,
                      std::span<f16> plane) override;
  void attention(const AttentionArgs& a) override;
  void attention_batch(std::span<const AttentionArgs> seqs) override;
  void store_rows_f16_batch(std::span<const StoreRowsTask> tasks) override;
  int64_t argmax(std::span<const float> x) override;
  void top_k(std::span<const float> x, int64_t n, int32_t k, std::span<int32_t> ids,
             std::span<float> vals) override;
  // On a rank of make_cuda_tp_group(): an NCCL all-reduce (sum) on the compute stream,
  // recorded like any resident op. Alone: nothing.
  void all_reduce_sum(std::span<float> x) override;
  // CudaOptions::l2_prefetch_bytes > 0: the leading bytes of the weights (region weights that
  // the matvec kernels read for n_tok tokens) pulled into L2 after the ops recorded so far.
  void prefetch_weights(std::span<const WeightMatrix* const> ws, int64_t n_tok) override;

 private:
  friend Expected<std::unique_ptr<Backend>> make_cuda_tp_group(int n, const CudaOptions& options);
  // matmul_batch's float-weight path (grouped float-kernel launches); false: not taken.
  bool matmul_batch_float(std::span<const MatmulTask> tasks, int64_t n_tok);
  std::unique_ptr<Impl> impl_;
};

Expected<std::unique_ptr<Backend>> make_cuda_tp_group(int n, const CudaOptions& options);

// Number of usable CUDA devices; 0 when there is no driver, no device, or the runtime refuses
// (never an error: callers fall back to the CPU).
int cuda_device_count();

// A tensor-parallel group (backend/tp_group.h) of n CUDA backends on devices 0..n-1, joined
// by NCCL (one communicator per rank, ncclCommInitAll). options.device and weight_region are
// not used: each rank uploads only the weights of its shard, on first use. Errors: fewer
// than n devices, a build without NCCL, NCCL refusing. Sets NCCL_NVLS_ENABLE=0 (NVLink
// multicast off) before NCCL starts.
Expected<std::unique_ptr<Backend>> make_cuda_tp_group(int n, const CudaOptions& options = {});

// A backend on options.device, or an error ("no CUDA device: ...") that callers report in one
// notice line before falling back to the CPU backend.
Expected<std::unique_ptr<CudaBackend>> make_cuda_backend(const CudaOptions& options = {});

}  // namespace kiln
