// backend/cuda/kernel_trace.h: every kernel's own start and end on the GPU, from CUPTI's activity
// records, inside replayed CUDA graphs too: the timeline Nsight Systems would show, for `kiln
// bench --cuda-trace` on machines without it (the H200 device machine has Nsight Compute only).
// `--cuda-profile` times each op between CUDA events in a one-off graph, which keeps the
// kernels apart (no PDL overlap) and adds the events; this leaves the step as it runs and says
// how long each kernel took and how long the GPU sat idle between them.
//
// The summary is a pure function of the records (tested on the host); KernelTrace is the CUPTI
// side, present when the build found CUPTI (KILN_HAVE_CUPTI), else start() says so.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace kiln::cuda {

struct KernelRecord {
  uint64_t start_ns = 0, end_ns = 0;  // GPU timestamps
  std::string name;                   // demangled
};

struct KernelTraceRow {
  std::string name;  // short_kernel_name
  double calls_per_step = 0, us_per_step = 0, us_per_call = 0;
  // The part of the busy time this kernel adds: of each call, what ends after every kernel
  // that started before it. With PDL a kernel starts while the one ahead drains and waits for
  // it, so its own duration counts that wait; this does not. The rows sum to the busy time.
  double added_us_per_step = 0;
};
struct KernelTraceSummary {
  uint64_t kernels = 0;
  double span_us_per_step = 0;       // first kernel's start to last kernel's end, per step
  double busy_us_per_step = 0;       // time at least one kernel ran (the union of the intervals)
  double kernel_us_per_step = 0;     // sum of the kernels' durations (overlaps counted twice)
  std::vector<KernelTraceRow> rows;  // by added_us_per_step, largest first; ties by name
};
// Per-step figures of `steps` steps' records (steps >= 1), kernels grouped by short name.
KernelTraceSummary summarize_kernel_trace(const std::vector<KernelRecord>& records, double steps);

// A demangled kernel name without the return type, the kiln::cuda and anonymous namespaces and
// the parameter list (template arguments kept: they tell the instantiations apart), at most
// `max_len` characters.
std::string short_kernel_name(std::string_view demangled, size_t max_len = 96);

// One trace at a time per process: start() enables CUPTI's kernel records, stop() flushes and
// disables them and returns what ran in between (after the caller synchronised the device).
class KernelTrace {
 public:
  static Expected<std::unique_ptr<KernelTrace>> start();
  ~KernelTrace();
  KernelTrace(const KernelTrace&) = delete;
  KernelTrace& operator=(const KernelTrace&) = delete;
  Expected<std::vector<KernelRecord>> stop();

 private:
  KernelTrace() = default;
  bool stopped_ = false;
};

}  // namespace kiln::cuda
