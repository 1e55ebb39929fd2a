// engine/device_probe.cpp: the CUDA backend's benchmark facilities behind a backend-neutral
// interface (device_probe.h); builds without CUDA answer that there is none.
#include "engine/device_probe.h"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

#if KILN_WITH_CUDA
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/kernel_trace.h"
#endif

namespace kiln {

#if KILN_WITH_CUDA
DeviceCounters device_counters(const Backend& backend) {
  DeviceCounters c;
  const auto* cuda = dynamic_cast<const CudaBackend*>(&backend);
  if (cuda == nullptr) return c;
  const CudaStats s = cuda->stats();
  c.available = true;
  c.segment_waits = s.segment_waits;
  c.segment_wait_ms = s.segment_wait_ms;
  c.graph_captures = s.graph_captures;
  c.graph_replays = s.graph_replays;
  c.segments_eager = s.segments_eager;
  c.l2_prefetch_hints = s.l2_prefetch_hints;
  c.l2_prefetch_bytes = s.l2_prefetch_bytes;
  return c;
}

Expected<std::string> profile_pass(Backend& backend, const ProbePass& pass) {
  auto* cuda = dynamic_cast<CudaBackend*>(&backend);
  if (!cuda) return std::string("(--cuda-profile: not a single-GPU CUDA backend)\n");
  cuda->set_profile(true);
  Expected<double> ts = pass.run();
  std::vector<CudaOpTime> ops = cuda->stats().ops;
  cuda->set_profile(false);
  if (!ts) return ts.status();
  const double steps = pass.steps;
  std::sort(ops.begin(), ops.end(),
            [](const CudaOpTime& a, const CudaOpTime& b) { return a.kernel_ms > b.kernel_ms; });
  double total_ms = 0;
  for (const CudaOpTime& op : ops) total_ms += op.kernel_ms;
  std::string out = fmt::format(
      "\n{} per kernel (one pass op by op with CUDA events; per step = {}):\n\n"
      "| kernel | calls/step | µs/step | share | weight GB/s |\n|---|---:|---:|---:|---:|\n",
      pass.test, pass.decode ? "one decode step" : "the whole prompt");
  for (const CudaOpTime& op : ops)
    out +=
        fmt::format("| {} | {:.1f} | {:.1f} | {:.1f} % | {} |\n", op.op, double(op.calls) / steps,
                    op.kernel_ms * 1e3 / steps, total_ms > 0 ? 100 * op.kernel_ms / total_ms : 0.0,
                    op.bytes > 0 && op.kernel_ms > 0
                        ? fmt::format("{:.0f}", double(op.bytes) / (op.kernel_ms * 1e-3) * 1e-9)
                        : std::string("-"));
  const double kernel_us = total_ms * 1e3 / steps;
  out += fmt::format(
      "\nkernels {:.1f} µs per step; the timed runs (graphs as configured) took {:.1f} µs per "
      "step: {:.1f} µs ({:.1f} %) outside any kernel\n",
      kernel_us, pass.step_us, pass.step_us - kernel_us,
      pass.step_us > 0 ? 100 * (pass.step_us - kernel_us) / pass.step_us : 0.0);
  return out;
}

Expected<std::string> trace_pass(Backend& backend, const ProbePass& pass) {
  if (!dynamic_cast<CudaBackend*>(&backend))
    return std::string("(--cuda-trace: not a single-GPU CUDA backend)\n");
  Expected<std::unique_ptr<cuda::KernelTrace>> trace = cuda::KernelTrace::start();
  if (!trace) return fmt::format("(--cuda-trace: {})\n", trace.status().message());
  Expected<double> ts = pass.run();
  Expected<std::vector<cuda::KernelRecord>> recs = (*trace)->stop();
  if (!ts) return ts.status();
  if (!recs) return fmt::format("(--cuda-trace: {})\n", recs.status().message());
  const cuda::KernelTraceSummary s = cuda::summarize_kernel_trace(*recs, pass.steps);
  std::string out = fmt::format(
      "\n{} kernel trace (CUPTI: each kernel's GPU start and end in one more pass; per step = "
      "{}): {} kernels; busy added = what each kernel adds to the time the GPU is busy (its "
      "own duration also counts its PDL wait for the kernel ahead)\n\n| kernel | calls/step | "
      "µs/step | µs/call | busy added µs/step | of busy |\n|---|---:|---:|---:|---:|---:|\n",
      pass.test, pass.decode ? "one decode step" : "the whole prompt", s.kernels);
  for (const cuda::KernelTraceRow& row : s.rows)
    out += fmt::format(
        "| {} | {:.1f} | {:.1f} | {:.2f} | {:.1f} | {:.1f} % |\n", row.name, row.calls_per_step,
        row.us_per_step, row.us_per_call, row.added_us_per_step,
        s.busy_us_per_step > 0 ? 100 * row.added_us_per_step / s.busy_us_per_step : 0.0);
  out += fmt::format(
      "\nper step: kernels {:.1f} µs (overlaps counted twice), the GPU busy {:.1f} µs of a "
      "{:.1f} µs span (idle {:.1f} µs, {:.1f} %); this pass {:.1f} t/s\n",
      s.kernel_us_per_step, s.busy_us_per_step, s.span_us_per_step,
      s.span_us_per_step - s.busy_us_per_step,
      s.span_us_per_step > 0 ? 100 * (s.span_us_per_step - s.busy_us_per_step) / s.span_us_per_step
                             : 0.0,
      *ts);
  return out;
}
#else
DeviceCounters device_counters(const Backend&) { return {}; }

Expected<std::string> profile_pass(Backend&, const ProbePass&) {
  return std::string("(--cuda-profile: this kiln was built without CUDA)\n");
}

Expected<std::string> trace_pass(Backend&, const ProbePass&) {
  return std::string("(--cuda-trace: this kiln was built without CUDA)\n");
}
#endif

}  // namespace kiln
