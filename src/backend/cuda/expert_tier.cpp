// backend/cuda/expert_tier.cpp: the device tier of streamed expert slices (expert_tier.h).
#include "backend/cuda/expert_tier.h"

#include <optional>

#include "core/check.h"

namespace kiln::cuda {

void ExpertTier::note_op_use(uint64_t key) {
  if (op_keys_seq_ != seg_.op_seq()) op_keys_.clear(), op_keys_seq_ = seg_.op_seq();
  op_keys_.push_back(key);
}

void ExpertTier::after_flush() {
  if (op_keys_seq_ == seg_.op_seq())
    for (uint64_t k : op_keys_)
      if (auto it = slots_.find(k); it != slots_.end()) it->second.epoch = seg_.flushes();
}

void ExpertTier::fence() {
  if (!unfenced_) return;
  unfenced_ = false;
  check_cuda(cudaEventRecord(copy_ev_.get(), compute_.get()), "expert copy event");
  check_cuda(cudaEventSynchronize(copy_ev_.get()), "wait for expert copies");
}

const std::byte* ExpertTier::slice(const WeightMatrix& w) {
  KILN_CHECK(!w.strided(), "cuda: a streamed expert slice cannot be strided");
  if (c_hits_ == nullptr) {
    CounterRegistry& r = process_counters();
    c_hits_ = &r.counter("moe.device_hits");
    c_misses_ = &r.counter("moe.device_misses");
    c_bytes_ = &r.counter("moe.device_bytes_copied");
    c_evictions_ = &r.counter("moe.device_evictions");
  }
  if (auto it = slots_.find(w.content_key); it != slots_.end()) {
    Slot& e = it->second;
    KILN_CHECK(e.bytes == w.bytes.size(), "cuda: expert key {:#x} names {} bytes, now {}",
               w.content_key, e.bytes, w.bytes.size());
    policy_.hit(w.content_key);
    e.epoch = seg_.flushes();
    e.op = seg_.op_seq();
    note_op_use(w.content_key);
    ++hits_;
    c_hits_->add();
    return static_cast<const std::byte*>(e.buf.get()) + e.offset;
  }
  if (cap_ == 0) {
    size_t free_b = 0, total_b = 0;
    check_cuda(cudaMemGetInfo(&free_b, &total_b), "device memory info");
    cap_ = opts_.expert_cache_bytes ? opts_.expert_cache_bytes : free_b / 2;
  }
  const size_t need = w.bytes.size();
  KILN_CHECK(need <= cap_,
             "cuda: the expert device cache ({} MiB) is smaller than one "
             "expert slice ({} MiB); raise --expert-device-cache",
             cap_ >> 20, need >> 20);
  while (held_ + need > cap_ && policy_.size() > 0) {
    std::optional<uint64_t> victim =
        policy_.victim([&](uint64_t k) { return slots_.at(k).epoch != seg_.flushes(); });
    if (!victim) {
      // Every entry may be read by pending ops: run them (flushes++). The op being built
      // holds the pointers it looked up (matmul_batch of K experts): never those.
      victim = policy_.victim([&](uint64_t k) { return slots_.at(k).op != seg_.op_seq(); });
      KILN_CHECK(victim.has_value(),
                 "cuda: the expert device cache ({} MiB) cannot hold "
                 "the experts of one op; raise --expert-device-cache",
                 cap_ >> 20);
      seg_.flush();
    }
    Slot& v = slots_.at(*victim);
    held_ -= v.bytes;
    ++evictions_;
    c_evictions_->add();
    free_.emplace(v.buf.size(), std::move(v.buf));
    policy_.erase(*victim);
    slots_.erase(*victim);
  }
  const size_t offset = reinterpret_cast<uintptr_t>(w.bytes.data()) % 256;
  const size_t buf_bytes = need + offset;
  DeviceBuffer buf;
  if (auto f = free_.lower_bound(buf_bytes); f != free_.end() && f->first < 2 * buf_bytes) {
    buf = std::move(f->second);
    free_.erase(f);
  } else {
    if (!free_.empty() && alloc_ + buf_bytes > cap_) {
      // Free buffers of other sizes go back to the driver. Graph signatures name memory by
      // address and cudaMalloc hands freed addresses out again (see free_dev): graphs go.
      seg_.flush();
      seg_.destroy_graphs();
      for (auto& [sz, b] : free_) alloc_ -= b.size();
      free_.clear();
    }
    buf.ensure(buf_bytes, "expert slice");
    alloc_ += buf.size();
  }
  // Landed before the op returns (see above); from page-locked slabs
  // (ExpertStore::register_slabs) a DMA. The slot is read by no pending or running op (the
  // eviction rule above), so the copy may run ahead of the recorded ones.
  std::byte* dst = static_cast<std::byte*>(buf.get()) + offset;
  if (opts_.expert_async_copies) {
    check_cuda(cudaMemcpyAsync(dst, w.bytes.data(), need, cudaMemcpyHostToDevice, compute_.get()),
               "expert slice upload");
    unfenced_ = true;
  } else {
    check_cuda(cudaMemcpy(dst, w.bytes.data(), need, cudaMemcpyHostToDevice),
               "expert slice upload");
  }
  policy_.insert(w.content_key);
  Slot& e = slots_[w.content_key];
  e.buf = std::move(buf);
  e.bytes = need;
  e.offset = offset;
  e.epoch = seg_.flushes();
  e.op = seg_.op_seq();
  note_op_use(w.content_key);
  held_ += need;
  copied_ += need;
  ++misses_;
  c_misses_->add();
  c_bytes_->add(need);
  return static_cast<const std::byte*>(e.buf.get()) + offset;
}

}  // namespace kiln::cuda
