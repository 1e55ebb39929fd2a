// core/counters.h: named monotonic counters and scoped timers, safe to bump from any thread.
// Each subsystem registers its counters once (by name) and keeps the returned reference;
// `--stats` prints a snapshot and the server exports the same snapshot at /metrics.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kiln {

// A monotonic count (events, bytes). Increments are relaxed atomics: cheap, exact totals.
class Counter {
 public:
  void add(uint64_t n = 1) { v_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t value() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> v_{0};
};

// Accumulated wall time of some activity and how many times it ran.
class Timer {
 public:
  void record(std::chrono::nanoseconds d) {
    ns_.fetch_add(static_cast<uint64_t>(d.count() < 0 ? 0 : d.count()), std::memory_order_relaxed);
    n_.fetch_add(1, std::memory_order_relaxed);
  }
  uint64_t total_ns() const { return ns_.load(std::memory_order_relaxed); }
  uint64_t count() const { return n_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> ns_{0};
  std::atomic<uint64_t> n_{0};
};

// Adds the time from construction to destruction to a Timer.
class ScopedTimer {
 public:
  explicit ScopedTimer(Timer& t) : t_(t), start_(std::chrono::steady_clock::now()) {}
  ~ScopedTimer() { t_.record(std::chrono::steady_clock::now() - start_); }
  ScopedTimer(const ScopedTimer&) = delete;
  ScopedTimer& operator=(const ScopedTimer&) = delete;

 private:
  Timer& t_;
  std::chrono::steady_clock::time_point start_;
};

struct CounterSample {
  std::string name;
  bool is_timer = false;
  uint64_t value = 0;     // counters: the count; timers: total nanoseconds
  uint64_t n_events = 0;  // timers: number of recorded intervals
};

// A set of named counters and timers. References returned stay valid for the registry's
// lifetime (entries are never removed), so hot paths look a name up once.
class CounterRegistry {
 public:
  Counter& counter(std::string_view name);
  Timer& timer(std::string_view name);
  // Consistent per entry (not across entries), sorted by name.
  std::vector<CounterSample> snapshot() const;

 private:
  mutable std::mutex mu_;
  std::deque<Counter> counters_;  // deque: growth never moves existing entries
  std::deque<Timer> timers_;
  std::unordered_map<std::string, Counter*> counter_index_;
  std::unordered_map<std::string, Timer*> timer_index_;
};

// The process-wide registry that --stats and /metrics read.
CounterRegistry& process_counters();

// Human-readable table: "name  value" per line; timers as "total ms / n = mean us".
std::string format_counters(const std::vector<CounterSample>& samples);

}  // namespace kiln
