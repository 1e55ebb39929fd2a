// backend/tier_policy.h: which entry a backend's cache of streamed weights gives up next (the
// CUDA device tier of MoE experts, backend/cuda; a Metal one would take the same). Kept apart
// from the device code so the order is plain data, tested without a GPU
// (tests/ops/tier_policy_test.cpp).
//
// Two orders (--expert-device-policy):
// - lru: least recently used first.
// - lfu: fewest uses first (ties: least recently used), counting the uses a key had before it
//   was last evicted too. MoE routing is skewed (a few experts of each layer take most of the
//   tokens), and LRU evicts a popular expert as soon as a few unpopular ones pass through:
//   under Zipf(1) routing with a quarter of the experts cached LRU keeps 56 % of the gets on
//   the device, LFU 68 % (the share of the most popular quarter). Counts halve every
//   aging_period uses so a popularity that shifts with the text wins its place back.
// Neither changes what the kernels compute: only which copies are made.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <set>
#include <string_view>
#include <tuple>
#include <unordered_map>

#include "core/status.h"

namespace kiln {

enum class TierEviction : uint8_t { Lru, Lfu };

Expected<TierEviction> parse_tier_eviction(std::string_view name);
std::string_view tier_eviction_name(TierEviction e);

class TierPolicy {
 public:
  // aging_period 0: halve the counts every 16 uses per resident key (at least 4096 uses).
  explicit TierPolicy(TierEviction order, uint64_t aging_period = 0);

  // `key` is resident and was used again / has just become resident / is gone.
  void hit(uint64_t key);
  void insert(uint64_t key);
  void erase(uint64_t key);

  // The resident key to give up next among those usable(key) accepts; nullopt when it
  // accepts none. Scans from the front of the order, so its cost grows with the keys
  // refused before the first accepted one.
  template <class F>
  std::optional<uint64_t> victim(F&& usable) const {
    if (order_ == TierEviction::Lru) {
      for (auto it = lru_.rbegin(); it != lru_.rend(); ++it)
        if (usable(*it)) return *it;
    } else {
      for (const auto& [count, last, key] : by_count_)
        if (usable(key)) return key;
    }
    return std::nullopt;
  }

  size_t size() const { return order_ == TierEviction::Lru ? lru_.size() : by_count_.size(); }
  TierEviction order() const { return order_; }
  // lfu: the key's use count (after aging); 0 for a key never seen. Tests.
  uint64_t count(uint64_t key) const;

 private:
  void use(uint64_t key, bool resident_before);
  void age();

  TierEviction order_;
  uint64_t aging_period_;
  // lru: most recent first; where each resident key sits in it.
  std::list<uint64_t> lru_;
  std::unordered_map<uint64_t, std::list<uint64_t>::iterator> lru_pos_;
  // lfu: every key ever used (resident or not: a popular key keeps its count while evicted),
  // and the resident ones ordered (count, last use, key).
  struct Use {
    uint64_t count = 0, last = 0;
    bool resident = false;
  };
  std::unordered_map<uint64_t, Use> uses_;
  std::set<std::tuple<uint64_t, uint64_t, uint64_t>> by_count_;
  uint64_t clock_ = 0, since_aging_ = 0;
};

}  // namespace kiln
