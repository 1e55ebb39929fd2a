// backend/cuda/backend_impl.h: CudaBackend::Impl, what the op table (cuda_backend.cpp,
// ops_matmul.cpp, ops_attention.cpp) works with: the options, held once; the device and its
// streams; the rooms, each with its own state (segment.h: recording, staging and graphs;
// host_span.h; profiler.h; expert_tier.h; f16_cache.h; l2_prefetcher.h; weight_arena.h); and
// the few helpers the ops share (weights on the device, float inputs, internal scratch).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>

#if KILN_HAVE_NCCL
#include <nccl.h>
#endif

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_util.h"
#include "backend/cuda/expert_tier.h"
#include "backend/cuda/f16_cache.h"
#include "backend/cuda/host_span.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/l2_prefetcher.h"
#include "backend/cuda/profiler.h"
#include "backend/cuda/segment.h"
#include "backend/cuda/weight_arena.h"

namespace kiln {

// Calls are serialised by mu; every member function expects it held.
struct CudaBackend::Impl {
  explicit Impl(const CudaOptions& options) : opts(options) {
    seg.set_after_flush([this] {
      experts.after_flush();
      l2.reset();
    });
  }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  // Validated once, by make_cuda_backend, and read from here by the op table and every room.
  // Profiling is run-time state of the profiler (CudaBackend::set_profile), not an option.
  const CudaOptions opts;
  // What CudaOptions::matmul and auto_int8_max_tokens make of a matmul: V3's kernels (V3 and
  // Auto) or V2's; the most tokens that take V3's int8 path (Auto: auto_int8_max_tokens; V3:
  // as many as its kernels take; more go to the V2 paths, cuBLAS); Auto's routing of F16.
  cuda::MatmulKernels kernels() const {
    return opts.matmul == CudaMatmul::V2 ? cuda::MatmulKernels::V2 : cuda::MatmulKernels::V3;
  }
  int64_t int8_max_tokens() const {
    return opts.matmul == CudaMatmul::Auto ? opts.auto_int8_max_tokens : cuda::kQ8MaxTokens;
  }
  bool auto_routing() const { return opts.matmul == CudaMatmul::Auto; }
  int mma_min_tokens() const { return int(opts.int8_mma_min_tokens); }

#if KILN_HAVE_NCCL
  ncclComm_t comm = nullptr;  // a rank of a tensor-parallel group: owned, destroyed first
#endif
  int n_sm = 1;
  std::string device_name;
  cuda::Stream compute, copy;
  std::mutex mu;
  std::unique_ptr<cuda::WeightArena> arena;
  cuda::GemmWorkspace gemm;  // V2's prefill path, grown on demand

  // The rooms. seg runs flush's follow-ups in the rooms that keep per-segment state (the
  // constructor's after_flush).
  cuda::DeviceAllocs mem;
  cuda::Profiler prof;
  cuda::Segment seg{opts, compute, mem, prof};
  cuda::HostSpans host{seg, mem, compute};
  cuda::ExpertTier experts{opts, seg, compute};
  cuda::F16Cache f16{opts, seg, prof};
  cuda::L2Prefetcher l2{seg};

  // Host ranges page-locked through register_host_memory, by start address; shared with the
  // handles' deleters, which may run after this backend is gone (an expert store's slabs).
  struct Pinned {
    std::mutex mu;
    std::map<uintptr_t, size_t> ranges;
    // True when [p, p + n) lies inside one registered range.
    bool holds(const void* p, size_t n) {
      const auto a = reinterpret_cast<uintptr_t>(p);
      std::lock_guard lk(mu);
      auto it = ranges.upper_bound(a);
      if (it == ranges.begin()) return false;
      --it;
      return a + n <= it->first + it->second;
    }
  };
  std::shared_ptr<Pinned> pinned = std::make_shared<Pinned>();

  // Internal device scratch of the resident ops (internal()).
  cuda::DeviceBuffer attn_part, argmax_out;
  size_t attn_cap = 0, argmax_cap = 0;
  cuda::DeviceBuffer topk_v, topk_i;  // top_k's passes and result
  size_t topk_v_cap = 0, topk_i_cap = 0;
  cuda::DeviceBuffer act_q8;  // MatmulKernels::V3's quantized activations
  size_t act_q8_cap = 0;
  uint64_t uploads_seen = 0;  // arena uploads known to have landed

  cudaStream_t s() const { return compute.get(); }
  void enter() { seg.enter(); }

  // The kernels read rows back to back: a strided matrix (a column block) gets a compact
  // copy of its own, gathered at upload; a streamed expert slice comes from the expert tier.
  const std::byte* device_weight_bytes(const WeightMatrix& w);
  // w on the device for a resident op; may flush (verify mode's refresh, the expert tier):
  // call before staging anything.
  cuda::DeviceWeight weight_resident(const WeightMatrix& w);
  // Device address of a read-only float input: device memory as is, weights (norm weights,
  // biases) from the arena, any other host array staged; float_room() is what room() must
  // hold for it.
  const float* floats(std::span<const float> h);
  size_t float_room(std::span<const float> h) const;
  // Arena uploads run on the copy stream; a recorded op must not read a weight before its
  // upload landed. Waiting on the host here (only after new uploads) keeps cross-stream
  // waits out of captured graphs.
  void weights_ready();
  // Grow-only internal device scratch; growing moves it, so pending ops run first and graphs
  // that read the old one go.
  template <typename T>
  T* internal(cuda::DeviceBuffer& b, size_t n, size_t& cap) {
    const size_t bytes = std::max<size_t>(n, 1) * sizeof(T);
    if (bytes > cap || !b.get()) {
      seg.flush();
      seg.destroy_graphs();
      b.reset();
      cap = std::max(bytes, cap * 2);
      b.ensure(cap, "scratch");
    }
    return static_cast<T*>(b.get());
  }
  // alloc_bytes()'s deleter (takes mu).
  void free_dev(std::byte* p);

 private:
  bool cached_floats(std::span<const std::byte> b) const;
};

}  // namespace kiln
