// backend/cuda/cp_async.cuh: asynchronous global -> shared copies (cp.async, sm_80+) shared by
// the kernels that stream through shared memory (matvec_q8.cu's tensor-core matmul, the
// warp-tile decode attention). Below sm_80 they are plain copies, so the wait is a no-op.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kiln::cuda {

// BYTES of 4, 8 or 16 from src to dst, both aligned to BYTES. 16-byte copies bypass L1 (.cg);
// the smaller ones can only be issued through it (.ca).
template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned d = unsigned(__cvta_generic_to_shared(dst));
  if constexpr (BYTES == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(d), "l"(src), "n"(BYTES)
                 : "memory");
#else
  if constexpr (BYTES == 16) *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
  if constexpr (BYTES == 8) *static_cast<uint2*>(dst) = *static_cast<const uint2*>(src);
  if constexpr (BYTES == 4) *static_cast<uint32_t*>(dst) = *static_cast<const uint32_t*>(src);
#endif
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) { cp_async<16>(dst, src); }
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

}  // namespace kiln::cuda
