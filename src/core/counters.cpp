// core/counters.cpp: the counter registry and its text rendering.
#include "core/counters.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"

namespace kiln {

Counter& CounterRegistry::counter(std::string_view name) {
  std::lock_guard lock(mu_);
  KILN_CHECK(!timer_index_.count(std::string(name)), "'{}' is already a timer", name);
  auto it = counter_index_.find(std::string(name));
  if (it != counter_index_.end()) return *it->second;
  Counter& c = counters_.emplace_back();
  counter_index_.emplace(std::string(name), &c);
  return c;
}

Timer& CounterRegistry::timer(std::string_view name) {
  std::lock_guard lock(mu_);
  KILN_CHECK(!counter_index_.count(std::string(name)), "'{}' is already a counter", name);
  auto it = timer_index_.find(std::string(name));
  if (it != timer_index_.end()) return *it->second;
  Timer& t = timers_.emplace_back();
  timer_index_.emplace(std::string(name), &t);
  return t;
}

std::vector<CounterSample> CounterRegistry::snapshot() const {
  std::vector<CounterSample> out;
  {
    std::lock_guard lock(mu_);
    out.reserve(counter_index_.size() + timer_index_.size());
    for (const auto& [name, c] : counter_index_) out.push_back({name, false, c->value(), 0});
    for (const auto& [name, t] : timer_index_)
      out.push_back({name, true, t->total_ns(), t->count()});
  }
  std::sort(out.begin(), out.end(),
            [](const CounterSample& a, const CounterSample& b) { return a.name < b.name; });
  return out;
}

CounterRegistry& process_counters() {
  static CounterRegistry* r = new CounterRegistry();  // never destroyed: usable at exit
  return *r;
}

std::string format_counters(const std::vector<CounterSample>& samples) {
  size_t w = 8;
  for (const CounterSample& s : samples) w = std::max(w, s.name.size());
  std::string out;
  for (const CounterSample& s : samples) {
    if (s.is_timer)
      out += fmt::format("{:<{}}  {:.3f} ms / {} = {:.1f} us\n", s.name, w, s.value / 1e6,
                         s.n_events, s.n_events ? s.value / 1e3 / double(s.n_events) : 0.0);
    else
      out += fmt::format("{:<{}}  {}\n", s.name, w, s.value);
  }
  return out;
}

}  // namespace kiln
