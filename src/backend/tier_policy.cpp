// backend/tier_policy.cpp: the eviction orders of backend/tier_policy.h.
#include "backend/tier_policy.h"

#include <algorithm>
#include <vector>

#include "core/check.h"

namespace kiln {

Expected<TierEviction> parse_tier_eviction(std::string_view name) {
  if (name == "lru") return TierEviction::Lru;
  if (name == "lfu") return TierEviction::Lfu;
  return Status::errorf("unknown expert device policy '{}' (lru, lfu)", name);
}

std::string_view tier_eviction_name(TierEviction e) {
  return e == TierEviction::Lru ? "lru" : "lfu";
}

TierPolicy::TierPolicy(TierEviction order, uint64_t aging_period)
    : order_(order), aging_period_(aging_period) {}

void TierPolicy::hit(uint64_t key) {
  if (order_ == TierEviction::Lru) {
    auto it = lru_pos_.find(key);
    KILN_CHECK(it != lru_pos_.end(), "tier policy: hit on key {:#x}, which is not resident", key);
    lru_.splice(lru_.begin(), lru_, it->second);
    return;
  }
  use(key, true);
}

void TierPolicy::insert(uint64_t key) {
  if (order_ == TierEviction::Lru) {
    KILN_CHECK(!lru_pos_.contains(key), "tier policy: key {:#x} inserted twice", key);
    lru_.push_front(key);
    lru_pos_[key] = lru_.begin();
    return;
  }
  use(key, false);
}

void TierPolicy::erase(uint64_t key) {
  if (order_ == TierEviction::Lru) {
    auto it = lru_pos_.find(key);
    KILN_CHECK(it != lru_pos_.end(), "tier policy: erase of key {:#x}, which is not resident", key);
    lru_.erase(it->second);
    lru_pos_.erase(it);
    return;
  }
  auto it = uses_.find(key);
  KILN_CHECK(it != uses_.end() && it->second.resident,
             "tier policy: erase of key {:#x}, which is not resident", key);
  by_count_.erase({it->second.count, it->second.last, key});
  it->second.resident = false;
}

uint64_t TierPolicy::count(uint64_t key) const {
  auto it = uses_.find(key);
  return it == uses_.end() ? 0 : it->second.count;
}

void TierPolicy::use(uint64_t key, bool resident_before) {
  Use& u = uses_[key];
  KILN_CHECK(u.resident == resident_before, "tier policy: key {:#x} {}", key,
             resident_before ? "hit while not resident" : "inserted twice");
  if (u.resident) by_count_.erase({u.count, u.last, key});
  u.count += 1;
  u.last = ++clock_;
  u.resident = true;
  by_count_.insert({u.count, u.last, key});
  const uint64_t period =
      aging_period_ != 0 ? aging_period_ : std::max<uint64_t>(4096, 16 * by_count_.size());
  if (++since_aging_ >= period) age();
}

// Halve every count; keys no longer resident whose count reaches 0 are forgotten, which
// bounds the table by the keys used in the last few periods.
void TierPolicy::age() {
  since_aging_ = 0;
  by_count_.clear();
  for (auto it = uses_.begin(); it != uses_.end();) {
    Use& u = it->second;
    u.count /= 2;
    if (u.resident) {
      by_count_.insert({u.count, u.last, it->first});
      ++it;
    } else if (u.count == 0) {
      it = uses_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace kiln
