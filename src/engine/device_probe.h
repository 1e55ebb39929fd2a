// engine/device_probe.h: what a benchmark asks of a device backend beyond the op table: the
// step machinery's counters (segments, graphs, host waits, L2 prefetch hints), one pass timed
// op by op, one pass under the kernel trace. Front ends call these without knowing which
// backend runs; on a backend without the facility they say so in one line.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "backend/backend.h"
#include "core/status.h"

namespace kiln {

// A single-GPU CUDA backend's counters; `available` is false on every other backend.
struct DeviceCounters {
  bool available = false;
  uint64_t segment_waits = 0;  // the host waited for the GPU at a segment's end
  double segment_wait_ms = 0;
  uint64_t graph_captures = 0, graph_replays = 0, segments_eager = 0;
  uint64_t l2_prefetch_hints = 0, l2_prefetch_bytes = 0;
};
DeviceCounters device_counters(const Backend& backend);

// What one pass of a benchmark is, for the tables below.
struct ProbePass {
  std::string test;     // "tg128", "pp512 @ d4096", ...
  double steps = 1;     // steps in one pass (tokens generated, or 1 for a prompt)
  bool decode = false;  // a step is one decode step (else the whole prompt)
  double step_us = 0;   // the timed runs' time per step
  // Runs the pass once; returns its tokens/s.
  std::function<Expected<double>()> run;
};
// One extra pass op by op with CUDA events (--cuda-profile): per kernel the time per step,
// its share and the weight GB/s, then the kernels' sum against the timed step. A markdown
// table, or one line saying why there is none.
Expected<std::string> profile_pass(Backend& backend, const ProbePass& pass);
// One extra pass under CUPTI's kernel records (--cuda-trace): each kernel's own GPU time and
// what it adds to the busy time per step, and the GPU's idle time.
Expected<std::string> trace_pass(Backend& backend, const ProbePass& pass);

}  // namespace kiln
