// backend/tp_group.h: tensor-parallel groups. A TpGroup is a Backend that stands for N rank
// backends running each forward step together (model/tensor_parallel.h shards the weights and
// KV heads; engine/session.cpp drives the ranks through tp_run). Its own ops run on rank 0,
// so code that only samples or measures through the group needs no change.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include <condition_variable>
#include <mutex>
#include <thread>

namespace kiln {

class TpGroup final : public Backend {
 public:
  // ranks.size() >= 1; each rank's all_reduce_sum must sum over exactly these ranks.
  explicit TpGroup(std::vector<std::unique_ptr<Backend>> ranks);
  ~TpGroup() override;

  std::string_view name() const override { return name_; }
  int tp_size() const override { return static_cast<int>(ranks_.size()); }
  Backend& tp_rank(int r) override;
  void tp_run(const std::function<void(int rank)>& f) override;

  // Everything else: rank 0.
  bool device_memory() const override { return ranks_[0]->device_memory(); }
  // The ranks' shares are summed in rank order whatever the step's size.
  bool batch_invariant() const override { return ranks_[0]->batch_invariant(); }
  // Each rank holds its share of the heads' KV rows: the group can hold n times its fullest
  // rank's free memory (0 if any rank cannot tell).
  uint64_t device_free_bytes() const override;
  BackendBytes alloc_bytes(size_t bytes) override { return ranks_[0]->alloc_bytes(bytes); }
  void upload_bytes(std::span<const std::byte> h, std::span<std::byte> d) override {
    ranks_[0]->upload_bytes(h, d);
  }
  void download_bytes(std::span<const std::byte> d, std::span<std::byte> h) override {
    ranks_[0]->download_bytes(d, h);
  }
  void copy_bytes(std::span<const std::byte> s, std::span<std::byte> d) override {
    ranks_[0]->copy_bytes(s, d);
  }
  void copy_bytes_2d(const std::byte* s, size_t sp, std::byte* d, size_t dp, size_t w,
                     size_t rows) override {
    ranks_[0]->copy_bytes_2d(s, sp, d, dp, w, rows);
  }
  void gather_rows_f32(std::span<const float> s, int64_t w, std::span<const int32_t> ids,
                       std::span<float> d) override {
    ranks_[0]->gather_rows_f32(s, w, ids, d);
  }
  void scale_add_rows_f32(std::span<float> s, int64_t w, std::span<const int32_t> ids,
                          std::span<const float> sc, std::span<float> o) override {
    ranks_[0]->scale_add_rows_f32(s, w, ids, sc, o);
  }
  void zero_bytes(std::span<std::byte> d) override { ranks_[0]->zero_bytes(d); }
  void synchronize() override;  // every rank
  double read_bandwidth_gbps() override { return ranks_[0]->read_bandwidth_gbps(); }
  std::shared_ptr<void> register_host_memory(std::span<std::byte> m) override {
    return ranks_[0]->register_host_memory(m);
  }
  void matmul(const WeightMatrix& w, std::span<const float> x, int64_t n_tok,
              std::span<float> y) override {
    ranks_[0]->matmul(w, x, n_tok, y);
  }
  void matmul_batch(std::span<const MatmulTask> t, int64_t n_tok) override {
    ranks_[0]->matmul_batch(t, n_tok);
  }
  void get_rows(const WeightMatrix& w, std::span<const int32_t> ids,
                std::span<float> out) override {
    ranks_[0]->get_rows(w, ids, out);
  }
  void rmsnorm(std::span<const float> x, std::span<const float> w, int64_t n, float eps,
               std::span<float> y) override {
    ranks_[0]->rmsnorm(x, w, n, eps, y);
  }
  void rope(std::span<float> x, int64_t n_tok, int64_t n_head, int64_t head_dim,
            std::span<const int32_t> pos, const RopeParams& p) override {
    ranks_[0]->rope(x, n_tok, n_head, head_dim, pos, p);
  }
  void softmax(std::span<float> x, int64_t n) override { ranks_[0]->softmax(x, n); }
  void swiglu(std::span<const float> g, std::span<const float> u, std::span<float> o) override {
    ranks_[0]->swiglu(g, u, o);
  }
  void swiglu_oai(std::span<const float> g, std::span<const float> u, std::span<float> o,
                  float alpha, float limit) override {
    ranks_[0]->swiglu_oai(g, u, o, alpha, limit);
  }
  void geglu(std::span<const float> g, std::span<const float> u, std::span<float> o) override {
    ranks_[0]->geglu(g, u, o);
  }
  void add(std::span<const float> a, std::span<const float> b, std::span<float> o) override {
    ranks_[0]->add(a, b, o);
  }
  void mul(std::span<const float> a, std::span<const float> b, std::span<float> o) override {
    ranks_[0]->mul(a, b, o);
  }
  void scale(std::span<float> x, float s) override { ranks_[0]->scale(x, s); }
  void softcap(std::span<float> x, float cap) override { ranks_[0]->softcap(x, cap); }
  void sigmoid(std::span<float> x) override { ranks_[0]->sigmoid(x); }
  void store_rows_f16(std::span<const float> src, int64_t width, std::span<const int32_t> rows,
                      std::span<f16> plane) override {
    ranks_[0]->store_rows_f16(src, width, rows, plane);
  }
  void attention(const AttentionArgs& a) override { ranks_[0]->attention(a); }
  int64_t argmax(std::span<const float> x) override { return ranks_[0]->argmax(x); }
  void top_k(std::span<const float> x, int64_t n, int32_t k, std::span<int32_t> ids,
             std::span<float> vals) override {
    ranks_[0]->top_k(x, n, k, ids, vals);
  }

 private:
  void worker(int rank);

  std::vector<std::unique_ptr<Backend>> ranks_;
  std::string name_;
  // Ranks 1.. run on threads of their own (not core/thread_pool: a rank's CPU backend runs
  // its own pool, which would run inline inside another pool's worker).
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

// N host backends (ref or cpu) in one process, each wrapped so that its all_reduce_sum meets
// the others' in shared memory (summing in rank order: the result is the same on every rank
// and from run to run). Tensor parallelism where there is no GPU: tests and CI check the
// sharding with it; it is not faster than one backend (the ranks share the host's cores).
std::unique_ptr<Backend> make_host_tp_group(std::vector<std::unique_ptr<Backend>> ranks);

}  // namespace kiln
