// backend/cuda/kernel_trace.cpp: kernel_trace.h's summary and its CUPTI activity collector.
#include "backend/cuda/kernel_trace.h"

#include <cxxabi.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>

#if KILN_HAVE_CUPTI
#include <cupti.h>
#endif

namespace kiln::cuda {

KernelTraceSummary summarize_kernel_trace(const std::vector<KernelRecord>& records, double steps) {
  KernelTraceSummary s;
  if (steps < 1) steps = 1;
  s.kernels = records.size();
  if (records.empty()) return s;
  struct Acc {
    uint64_t calls = 0, ns = 0, added = 0;
  };
  std::map<std::string, Acc> by_name;  // node addresses stay valid as it grows
  struct Rec {
    uint64_t begin, end;
    Acc* acc;
  };
  std::vector<Rec> recs;
  recs.reserve(records.size());
  uint64_t total_ns = 0;
  for (const KernelRecord& r : records) {
    const uint64_t end = std::max(r.end_ns, r.start_ns);
    Acc& a = by_name[short_kernel_name(r.name)];
    ++a.calls;
    a.ns += end - r.start_ns;
    total_ns += end - r.start_ns;
    recs.push_back({r.start_ns, end, &a});
  }
  // One sweep by start (ties by end): each record is credited with what it extends the union
  // of those before it by; those credits sum to the union, the busy time.
  std::sort(recs.begin(), recs.end(), [](const Rec& x, const Rec& y) {
    return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
  });
  uint64_t reach = 0, busy = 0;
  for (const Rec& r : recs) {
    const uint64_t from = std::max(r.begin, reach);
    if (r.end > from) r.acc->added += r.end - from, busy += r.end - from;
    reach = std::max(reach, r.end);
  }
  s.span_us_per_step = double(reach - recs.front().begin) * 1e-3 / steps;  // reach: last end
  s.busy_us_per_step = double(busy) * 1e-3 / steps;
  s.kernel_us_per_step = double(total_ns) * 1e-3 / steps;
  for (const auto& [name, a] : by_name)
    s.rows.push_back(KernelTraceRow{name, double(a.calls) / steps, double(a.ns) * 1e-3 / steps,
                                    double(a.ns) * 1e-3 / double(a.calls),
                                    double(a.added) * 1e-3 / steps});
  std::sort(s.rows.begin(), s.rows.end(), [](const KernelTraceRow& a, const KernelTraceRow& b) {
    return a.added_us_per_step != b.added_us_per_step ? a.added_us_per_step > b.added_us_per_step
                                                      : a.name < b.name;
  });
  return s;
}

std::string short_kernel_name(std::string_view n, size_t max_len) {
  std::string s(n);
  const auto erase_all = [&](std::string_view what) {
    for (size_t p; (p = s.find(what)) != std::string::npos;) s.erase(p, what.size());
  };
  if (s.rfind("void ", 0) == 0) s.erase(0, 5);
  erase_all("(anonymous namespace)::");
  erase_all("kiln::cuda::");
  erase_all("kiln::");
  // The parameter list: the first '(' outside template brackets that follows the name (a
  // "(DType)12"-style template argument sits inside the brackets).
  int depth = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '<')
      ++depth;
    else if (s[i] == '>')
      --depth;
    else if (s[i] == '(' && depth == 0 && i > 0) {
      s.erase(i);
      break;
    }
  }
  if (s.size() > max_len) s.resize(max_len);
  return s;
}

namespace {
std::string demangle(const char* mangled) {
  if (mangled == nullptr) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string out = status == 0 && d ? std::string(d) : std::string(mangled);
  std::free(d);
  return out;
}

std::atomic<bool> g_active{false};  // one trace at a time
std::mutex g_mu;                    // guards g_records (CUPTI calls back on its own thread)
std::vector<KernelRecord> g_records;

#if KILN_HAVE_CUPTI
constexpr size_t kBufferBytes = size_t(8) << 20;

void CUPTIAPI on_buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;  // as many as fit
}

void CUPTIAPI on_buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  {
    std::lock_guard lock(g_mu);
    while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
      if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL &&
          rec->kind != CUPTI_ACTIVITY_KIND_KERNEL)
        continue;
      // The layout this build's cupti.h names for its CUPTI version (the library of the same
      // toolkit hands out that record).
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
      g_records.push_back(KernelRecord{k->start, k->end, demangle(k->name)});
    }
  }
  std::free(buffer);
}

Status cupti_error(const char* what, CUptiResult r) {
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  return Status::errorf("CUPTI: {}: {}", what, msg ? msg : "unknown error");
}
#endif
}  // namespace

Expected<std::unique_ptr<KernelTrace>> KernelTrace::start() {
#if KILN_HAVE_CUPTI
  if (g_active.exchange(true)) return Status::error("CUPTI: a kernel trace is already running");
  {
    std::lock_guard lock(g_mu);
    g_records.clear();
  }
  static const CUptiResult registered =
      cuptiActivityRegisterCallbacks(on_buffer_requested, on_buffer_completed);
  if (registered != CUPTI_SUCCESS) {
    g_active = false;
    return cupti_error("cuptiActivityRegisterCallbacks", registered);
  }
  if (const CUptiResult r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
      r != CUPTI_SUCCESS) {
    g_active = false;
    return cupti_error("cuptiActivityEnable(CONCURRENT_KERNEL)", r);
  }
  return std::unique_ptr<KernelTrace>(new KernelTrace());
#else
  return Status::error("kernel tracing needs CUPTI, which this build did not find");
#endif
}

Expected<std::vector<KernelRecord>> KernelTrace::stop() {
  if (stopped_) return Status::error("CUPTI: trace already stopped");
  stopped_ = true;
#if KILN_HAVE_CUPTI
  const CUptiResult f = cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  const CUptiResult d = cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  g_active = false;
  if (f != CUPTI_SUCCESS) return cupti_error("cuptiActivityFlushAll", f);
  if (d != CUPTI_SUCCESS) return cupti_error("cuptiActivityDisable", d);
  std::lock_guard lock(g_mu);
  return std::move(g_records);
#else
  return std::vector<KernelRecord>();
#endif
}

KernelTrace::~KernelTrace() {
  if (!stopped_) (void)stop();
}

}  // namespace kiln::cuda
