// backend/cuda/prefetch.cu: weight bytes pulled into L2 ahead of the matvec that reads them
// (l2_prefetch.h says when and why). One thread per 16 KiB piece issues one bulk prefetch
// (cp.async.bulk.prefetch.L2, sm_90: the SM's copy engine fetches the lines, the thread does
// not wait), so a few blocks of one warp cover tens of MiB and exit at once; the fetches run on
// while the ops on the compute stream go on. Nothing reads a result of this kernel: it changes
// only where the later loads find their bytes, never what they load. It runs beside the
// compute stream's PDL chain (backend/cuda/launch.cuh), not in it: it touches no activation,
// KV plane or scratch, only weight bytes no kernel writes (cuda_backend.cpp says why that
// holds for every range it is given).
#include <cuda_runtime.h>

#include "backend/cuda/kernels.h"

namespace kiln::cuda {
namespace {

constexpr size_t kPiece = 16 << 10;

__global__ void l2_prefetch_kernel(L2PrefetchArgs a) {
  const int64_t piece = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int r = 0;
#pragma unroll
  for (int i = 1; i < kL2PrefetchMaxRanges; ++i)
    if (i < a.n && piece >= a.first_piece[i]) r = i;
  if (r >= a.n) return;
  const size_t off = size_t(piece - a.first_piece[r]) * kPiece;
  if (off >= a.bytes[r]) return;
  const size_t n = a.bytes[r] - off < kPiece ? a.bytes[r] - off : kPiece;
  const char* p = static_cast<const char*>(a.p[r]) + off;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // the only target (make_cuda_backend)
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(unsigned(n)) : "memory");
#else
  (void)p, (void)n;
#endif
}

}  // namespace

cudaError_t launch_l2_prefetch(std::span<const PrefetchRange> ranges, cudaStream_t s) {
  L2PrefetchArgs a{};
  int64_t pieces = 0;
  for (const PrefetchRange& r : ranges) {
    if (a.n == kL2PrefetchMaxRanges) break;
    if (r.bytes == 0) continue;
    a.p[a.n] = r.p;
    a.bytes[a.n] = r.bytes;
    a.first_piece[a.n] = pieces;
    pieces += int64_t((r.bytes + kPiece - 1) / kPiece);
    ++a.n;
  }
  if (pieces == 0) return cudaSuccess;
  constexpr int kThreads = 32;
  l2_prefetch_kernel<<<unsigned((pieces + kThreads - 1) / kThreads), kThreads, 0, s>>>(a);
  return cudaGetLastError();
}

}  // namespace kiln::cuda
