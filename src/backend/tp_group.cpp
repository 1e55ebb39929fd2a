// backend/tp_group.cpp: TpGroup and the shared-memory all-reduce of host groups (tp_group.h).
#include "backend/tp_group.h"

#include <algorithm>
#include <barrier>

#include "core/check.h"

namespace kiln {

TpGroup::TpGroup(std::vector<std::unique_ptr<Backend>> ranks) : ranks_(std::move(ranks)) {
  KILN_CHECK(!ranks_.empty(), "a tensor-parallel group needs at least one rank");
  for (const auto& r : ranks_) KILN_CHECK(r != nullptr && r->tp_size() == 1);
  name_ = fmt::format("{} x{}", ranks_[0]->name(), ranks_.size());
  for (int r = 1; r < tp_size(); ++r) threads_.emplace_back([this, r] { worker(r); });
}

TpGroup::~TpGroup() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void TpGroup::worker(int rank) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* job = nullptr;
    {
      std::unique_lock lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    (*job)(rank);
    std::lock_guard lock(mu_);
    if (--pending_ == 0) done_.notify_one();
  }
}

uint64_t TpGroup::device_free_bytes() const {
  uint64_t least = 0;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    const uint64_t f = ranks_[r]->device_free_bytes();
    if (f == 0) return 0;
    least = r == 0 ? f : std::min(least, f);
  }
  return least * ranks_.size();
}

Backend& TpGroup::tp_rank(int r) {
  KILN_CHECK(r >= 0 && r < tp_size(), "rank {} of a group of {}", r, tp_size());
  return *ranks_[static_cast<size_t>(r)];
}

void TpGroup::tp_run(const std::function<void(int rank)>& f) {
  if (tp_size() == 1) return f(0);
  {
    std::lock_guard lock(mu_);
    KILN_CHECK(pending_ == 0, "tp_run called while another runs");
    job_ = &f;
    pending_ = tp_size() - 1;
    ++generation_;
  }
  wake_.notify_all();
  f(0);  // a rank blocked in an all-reduce waits for the others, each on its own thread
  std::unique_lock lock(mu_);
  done_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
}

void TpGroup::synchronize() {
  for (auto& r : ranks_) r->synchronize();
}

namespace {

// The meeting point of a host group's ranks. Each call: every rank publishes its buffer,
// then sums one slice of the elements over all ranks in rank order (so every rank, and every
// run, gets the same bits), then copies the sum back; barriers separate the phases.
class HostCollective {
 public:
  explicit HostCollective(int n) : n_(n), bar_(n), bufs_(static_cast<size_t>(n)) {}

  void all_reduce_sum(int rank, std::span<float> x) {
    bufs_[static_cast<size_t>(rank)] = x;
    bar_.arrive_and_wait();
    const size_t len = bufs_[0].size();
    for (const auto& b : bufs_)
      KILN_CHECK(b.size() == len, "all_reduce_sum of {} and {} elements", b.size(), len);
    if (rank == 0) sum_.resize(len);
    bar_.arrive_and_wait();
    const size_t lo = len * static_cast<size_t>(rank) / static_cast<size_t>(n_);
    const size_t hi = len * static_cast<size_t>(rank + 1) / static_cast<size_t>(n_);
    for (size_t i = lo; i < hi; ++i) {
      float s = bufs_[0][i];
      for (int r = 1; r < n_; ++r) s += bufs_[static_cast<size_t>(r)][i];
      sum_[i] = s;
    }
    bar_.arrive_and_wait();
    std::copy(sum_.begin(), sum_.end(), x.begin());
    bar_.arrive_and_wait();  // nobody reuses sum_ or bufs_ before every rank has copied
  }

 private:
  int n_;
  std::barrier<> bar_;
  std::vector<std::span<float>> bufs_;
  std::vector<float> sum_;
};

// A host backend as one rank of a group: every op is the inner backend's, all_reduce_sum
// meets the other ranks in the collective.
class HostRank final : public Backend {
 public:
  HostRank(std::unique_ptr<Backend> inner, std::shared_ptr<HostCollective> coll, int rank)
      : in_(std::move(inner)), coll_(std::move(coll)), rank_(rank) {
    KILN_CHECK(!in_->device_memory(), "host tensor-parallel ranks must be host backends");
  }
  std::string_view name() const override { return in_->name(); }
  void all_reduce_sum(std::span<float> x) override { coll_->all_reduce_sum(rank_, x); }

  BackendBytes alloc_bytes(size_t bytes) override { return in_->alloc_bytes(bytes); }
  void matmul(const WeightMatrix& w, std::span<const float> x, int64_t n_tok,
              std::span<float> y) override {
    in_->matmul(w, x, n_tok, y);
  }
  void matmul_batch(std::span<const MatmulTask> t, int64_t n_tok) override {
    in_->matmul_batch(t, n_tok);
  }
  void get_rows(const WeightMatrix& w, std::span<const int32_t> ids,
                std::span<float> out) override {
    in_->get_rows(w, ids, out);
  }
  void rmsnorm(std::span<const float> x, std::span<const float> w, int64_t n, float eps,
               std::span<float> y) override {
    in_->rmsnorm(x, w, n, eps, y);
  }
  void add_rmsnorm(std::span<float> x, std::span<const float> a, std::span<const float> w,
                   int64_t n, float eps, std::span<float> y) override {
    in_->add_rmsnorm(x, a, w, n, eps, y);
  }
  void rope(std::span<float> x, int64_t n_tok, int64_t n_head, int64_t head_dim,
            std::span<const int32_t> pos, const RopeParams& p) override {
    in_->rope(x, n_tok, n_head, head_dim, pos, p);
  }
  void softmax(std::span<float> x, int64_t n) override { in_->softmax(x, n); }
  void swiglu(std::span<const float> g, std::span<const float> u, std::span<float> o) override {
    in_->swiglu(g, u, o);
  }
  void swiglu_oai(std::span<const float> g, std::span<const float> u, std::span<float> o,
                  float alpha, float limit) override {
    in_->swiglu_oai(g, u, o, alpha, limit);
  }
  void geglu(std::span<const float> g, std::span<const float> u, std::span<float> o) override {
    in_->geglu(g, u, o);
  }
  void add(std::span<const float> a, std::span<const float> b, std::span<float> o) override {
    in_->add(a, b, o);
  }
  void mul(std::span<const float> a, std::span<const float> b, std::span<float> o) override {
    in_->mul(a, b, o);
  }
  void scale(std::span<float> x, float s) override { in_->scale(x, s); }
  void softcap(std::span<float> x, float cap) override { in_->softcap(x, cap); }
  void sigmoid(std::span<float> x) override { in_->sigmoid(x); }
  void store_rows_f16(std::span<const float> src, int64_t width, std::span<const int32_t> rows,
                      std::span<f16> plane) override {
    in_->store_rows_f16(src, width, rows, plane);
  }
  void attention(const AttentionArgs& a) override { in_->attention(a); }
  int64_t argmax(std::span<const float> x) override { return in_->argmax(x); }
  void top_k(std::span<const float> x, int64_t n, int32_t k, std::span<int32_t> ids,
             std::span<float> vals) override {
    in_->top_k(x, n, k, ids, vals);
  }

 private:
  std::unique_ptr<Backend> in_;
  std::shared_ptr<HostCollective> coll_;
  int rank_;
};

}  // namespace

std::unique_ptr<Backend> make_host_tp_group(std::vector<std::unique_ptr<Backend>> ranks) {
  const int n = static_cast<int>(ranks.size());
  KILN_CHECK(n >= 1);
  auto coll = std::make_shared<HostCollective>(n);
  std::vector<std::unique_ptr<Backend>> wrapped;
  for (int r = 0; r < n; ++r)
    wrapped.push_back(
        std::make_unique<HostRank>(std::move(ranks[static_cast<size_t>(r)]), coll, r));
  return std::make_unique<TpGroup>(std::move(wrapped));
}

}  // namespace kiln
