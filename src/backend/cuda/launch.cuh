// backend/cuda/launch.cuh: kernel launches with programmatic dependent launch (PDL, sm_90+),
// for the kernels of a decode step. A decode step is ~18 kernels per layer, most of them a few
// microseconds long, and inside a CUDA graph each still waits for the one before it to drain
// and flush before its first block starts: the figures in docs/BENCHMARKS.md ("CUDA session 4")
// put ~1 ms of an 8B Q4_K_M step (3.3 ms) in such gaps. With PDL the next kernel's blocks are
// scheduled while the current one's last wave runs; they prefetch what does not depend on it
// (weights) and then wait in pdl_wait().
//
// The safety argument, which every kernel started through launch() must keep:
// - it calls pdl_wait() before its first read or write of any memory another kernel of the step
//   writes or reads (activations, KV planes, scratch); before that point it may only read
//   memory no kernel writes (the weight arena) and prefetch it;
// - pdl_wait() returns once the kernel ahead of it in the stream has completed and its writes
//   are visible; that kernel itself passed its own pdl_wait() (or was launched without PDL and
//   so started after its predecessor finished), so by induction every earlier kernel of the
//   stream has completed too;
// - pdl_launch_dependents() is called only after pdl_wait(), so at most two grids of the chain
//   overlap: the one running and the next one waiting.
// A kernel launched without the attribute (flag off, or a launcher that does not use launch())
// runs as before: griddepcontrol.wait is then a no-op and the stream orders it fully. Copies,
// event records and cuBLAS kernels between two of ours keep their full dependencies; that is
// also why reading weights before the wait is safe: no kernel writes weight memory, only copies
// do (the arena upload, the MoE expert tier filling a slot), and a kernel after such a copy
// starts after it, while the copy itself waits for every kernel queued before it.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "backend/cuda/kernels.h"

namespace kiln::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// Both at the top of a kernel that has nothing to do before its inputs are ready.
__device__ __forceinline__ void pdl_enter() {
  pdl_wait();
  pdl_launch_dependents();
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
// The warp's lanes prefetch [p, p + bytes) into L2, one 128-byte line per lane and step.
__device__ __forceinline__ void prefetch_l2_warp(const void* p, size_t bytes, int lane) {
  const char* c = static_cast<const char*>(p);
  for (size_t o = size_t(lane) * 128; o < bytes; o += 32 * 128) prefetch_l2(c + o);
}

// kernel<<<grid, block, smem, s>>>(args...), with the PDL attribute while launch_pdl() is set
// on this thread.
template <typename... P, typename... A>
cudaError_t launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                   A&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = attr;
  cfg.numAttrs = launch_pdl() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
}

}  // namespace kiln::cuda
