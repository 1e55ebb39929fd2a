// tests/cuda/kernel_trace_test.cpp: kernel_trace.h's summary of kernel records (pure host code:
// runs without a GPU) and its kernel names; and, on a GPU, that a trace around a few launches
// records them.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "backend/cuda/cuda_util.h"
#include "backend/cuda/kernel_trace.h"
#include "backend/cuda/kernels.h"

namespace kiln {
namespace {

using cuda::KernelRecord;

TEST(KernelTrace, ShortNamesDropNamespacesAndParameters) {
  EXPECT_EQ(cuda::short_kernel_name(
                "void kiln::cuda::(anonymous namespace)::matvec_q8_kernel<(kiln::DType)12, 1, 2, "
                "1, 2, true>(unsigned char const*, unsigned long, long, long, signed char const*, "
                "float2 const*, long, float*)"),
            "matvec_q8_kernel<(DType)12, 1, 2, 1, 2, true>");
  EXPECT_EQ(cuda::short_kernel_name("void kiln::cuda::(anonymous namespace)::argmax_kernel(float "
                                    "const*, long, long*)"),
            "argmax_kernel");
  EXPECT_EQ(cuda::short_kernel_name("sm90_xmma_gemm_f16f16_f32f32"),
            "sm90_xmma_gemm_f16f16_f32f32");
  EXPECT_EQ(cuda::short_kernel_name("void f<int>(int)", 3), "f<i");
}

TEST(KernelTrace, SummaryPerStepBusyAndIdle) {
  // Two steps. Step 1: a [0, 10) and b [10, 30); step 2: a [100, 110), b [105, 125) (overlap:
  // PDL lets the next kernel start early), c [200, 204). Nanoseconds.
  const std::vector<KernelRecord> recs = {{100, 110, "void kiln::cuda::a_kernel(int)"},
                                          {0, 10, "void kiln::cuda::a_kernel(int)"},
                                          {10, 30, "b_kernel"},
                                          {105, 125, "b_kernel"},
                                          {200, 204, "c_kernel"}};
  const cuda::KernelTraceSummary s = cuda::summarize_kernel_trace(recs, 2);
  EXPECT_EQ(s.kernels, 5u);
  // span 0..204; busy: [0, 30) + [100, 125) + [200, 204) = 59; durations 10+10+20+20+4 = 64.
  EXPECT_DOUBLE_EQ(s.span_us_per_step, 204e-3 / 2);
  EXPECT_DOUBLE_EQ(s.busy_us_per_step, 59e-3 / 2);
  EXPECT_DOUBLE_EQ(s.kernel_us_per_step, 64e-3 / 2);
  ASSERT_EQ(s.rows.size(), 3u);
  // Busy added: b 20 + 15 (its [105, 110) overlaps a), a 10 + 10, c 4: rows by that, and they
  // sum to the busy time.
  EXPECT_EQ(s.rows[0].name, "b_kernel");
  EXPECT_DOUBLE_EQ(s.rows[0].us_per_step, 40e-3 / 2);
  EXPECT_DOUBLE_EQ(s.rows[0].added_us_per_step, 35e-3 / 2);
  EXPECT_DOUBLE_EQ(s.rows[0].calls_per_step, 1.0);
  EXPECT_DOUBLE_EQ(s.rows[0].us_per_call, 20e-3);
  EXPECT_EQ(s.rows[1].name, "a_kernel");
  EXPECT_DOUBLE_EQ(s.rows[1].added_us_per_step, 20e-3 / 2);
  EXPECT_EQ(s.rows[2].name, "c_kernel");
  EXPECT_DOUBLE_EQ(s.rows[2].calls_per_step, 0.5);
  EXPECT_DOUBLE_EQ(s.rows[2].added_us_per_step, 4e-3 / 2);
  // A kernel started early (PDL) that waits inside the one ahead adds only what it runs past it.
  const cuda::KernelTraceSummary w =
      cuda::summarize_kernel_trace({{0, 100, "big"}, {10, 104, "waits"}, {104, 110, "next"}}, 1);
  ASSERT_EQ(w.rows.size(), 3u);
  EXPECT_EQ(w.rows[0].name, "big");
  EXPECT_DOUBLE_EQ(w.rows[0].added_us_per_step, 100e-3);
  EXPECT_DOUBLE_EQ(w.rows[1].added_us_per_step, 6e-3);  // "next" 6 beats "waits" 4
  EXPECT_EQ(w.rows[1].name, "next");
  EXPECT_DOUBLE_EQ(w.rows[2].us_per_step, 94e-3);
  EXPECT_DOUBLE_EQ(w.rows[2].added_us_per_step, 4e-3);
  // No records: zeros, no rows; a record ending before it starts counts as empty.
  const cuda::KernelTraceSummary e = cuda::summarize_kernel_trace({}, 3);
  EXPECT_EQ(e.kernels, 0u);
  EXPECT_TRUE(e.rows.empty());
  const cuda::KernelTraceSummary bad = cuda::summarize_kernel_trace({{50, 40, "x"}}, 1);
  EXPECT_DOUBLE_EQ(bad.busy_us_per_step, 0.0);
  EXPECT_DOUBLE_EQ(bad.kernel_us_per_step, 0.0);
}

TEST(KernelTrace, RecordsLaunchesOnTheGpu) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    GTEST_SKIP() << "no CUDA device, CUDA tests skipped";
  }
  auto trace = cuda::KernelTrace::start();
  if (!trace) GTEST_SKIP() << trace.status().message();  // a build without CUPTI
  EXPECT_FALSE(cuda::KernelTrace::start()) << "two traces at once";
  cuda::DeviceBuffer xb, ob;
  auto* x = static_cast<float*>(xb.ensure(4096 * sizeof(float), "x"));
  auto* out = static_cast<int64_t*>(ob.ensure(sizeof(int64_t), "out"));
  cuda::check_cuda(cudaMemset(x, 0, 4096 * sizeof(float)), "memset");
  for (int i = 0; i < 3; ++i)
    cuda::check_cuda(cuda::launch_argmax(x, 4096, out, nullptr), "argmax");
  cuda::check_cuda(cudaDeviceSynchronize(), "sync");
  auto recs = (*trace)->stop();
  ASSERT_TRUE(recs) << recs.status().message();
  int argmax = 0;
  for (const KernelRecord& r : *recs) {
    EXPECT_LE(r.start_ns, r.end_ns);
    if (cuda::short_kernel_name(r.name) == "argmax_kernel") ++argmax;
  }
  EXPECT_EQ(argmax, 3);
}

}  // namespace
}  // namespace kiln
