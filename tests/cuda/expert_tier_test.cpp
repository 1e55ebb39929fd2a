// tests/cuda/expert_tier_test.cpp: the expert tier's contract with the segment that records the
// ops reading its slices (backend/cuda/expert_tier.h): a slice an op looked up is not copied
// over while that op is pending, also when the segment is flushed inside the op (a full
// staging room, cuBLAS workspace growth) after the lookup. Skips without a GPU.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_util.h"
#include "backend/cuda/expert_tier.h"
#include "backend/cuda/profiler.h"
#include "backend/cuda/segment.h"

namespace kiln {
namespace {

constexpr size_t kSlice = 64 << 10;

WeightMatrix slice_of(std::span<const std::byte> host, uint64_t key) {
  WeightMatrix w;
  w.dtype = DType::F32;
  w.n_cols = static_cast<int64_t>(kSlice / 4);
  w.n_rows = 1;
  w.row_bytes = kSlice;
  w.bytes = host;
  w.content_key = key;
  return w;
}

TEST(CudaExpertTier, FlushInsideAnOpKeepsItsSlices) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device, CUDA tests skipped";
  for (bool async : {false, true}) {
    SCOPED_TRACE(async ? "async copies" : "synchronous copies");
    CudaOptions o;
    o.expert_cache_bytes = kSlice + 256;  // room for one slice: B must take A's place
    o.expert_async_copies = async;
    cuda::Stream compute;
    ASSERT_EQ(compute.create(), cudaSuccess);
    cuda::DeviceAllocs mem;
    cuda::Profiler prof;
    cuda::Segment seg(o, compute, mem, prof);
    cuda::ExpertTier tier(o, seg, compute);
    ASSERT_EQ(tier.init(), cudaSuccess);
    seg.set_after_flush([&] { tier.after_flush(); });  // as CudaBackend::Impl wires it

    // Both slices 256-aligned, so B's copy fits the device buffer A leaves (expert_tier.cpp
    // reuses a freed buffer of the size it needs).
    std::vector<std::byte> host(2 * kSlice + 256);
    std::byte* base = host.data() + (256 - reinterpret_cast<uintptr_t>(host.data()) % 256) % 256;
    const std::span<std::byte> a(base, kSlice), b(base + kSlice, kSlice);
    for (size_t i = 0; i < kSlice; ++i) {
      a[i] = std::byte(i * 7 + 1);
      b[i] = std::byte(i * 13 + 5);
    }
    const WeightMatrix wa = slice_of(a, 1), wb = slice_of(b, 2);
    cuda::DeviceBuffer out;
    std::byte* dout = static_cast<std::byte*>(out.ensure(kSlice, "test output"));

    // An op recorded earlier: the flush below then launches a chunk.
    // Each op signs itself (segment.h sig()), as the backend's ops do: chunks of equal
    // signatures would be replayed from one captured graph.
    seg.enter();
    seg.sig("earlier");
    seg.record("earlier", [](cudaStream_t) { return cudaSuccess; });
    // Op X looks A up, the segment is flushed inside X, then X records its read of A.
    seg.enter();
    const std::byte* da = tier.slice(wa);
    seg.flush();
    seg.sig("read A", da, dout, kSlice);
    seg.record("read A", [=](cudaStream_t st) {
      return cudaMemcpyAsync(dout, da, kSlice, cudaMemcpyDeviceToDevice, st);
    });
    tier.fence();
    // Op Y looks B up: it needs A's room while X, still pending, reads A.
    seg.enter();
    tier.slice(wb);
    tier.fence();
    seg.sig("after");
    seg.record("after", [](cudaStream_t) { return cudaSuccess; });
    seg.flush();

    std::vector<std::byte> got(kSlice);
    ASSERT_EQ(cudaMemcpy(got.data(), dout, kSlice, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(std::memcmp(got.data(), a.data(), kSlice), 0)
        << "the pending op read another slice's bytes: B was copied over A before it ran";
    EXPECT_EQ(tier.evictions(), 1u);
  }
}

}  // namespace
}  // namespace kiln
