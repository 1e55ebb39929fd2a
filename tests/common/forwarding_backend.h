// tests/common/forwarding_backend.h: a Backend that forwards every op to an inner host backend
// (the reference one by default), for tests that watch or alter what the engine asks of a
// backend: subclass it, override the ops to watch, call ForwardingBackend's to compute.
#pragma once

#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "backend/backend.h"

namespace kiln::testing {

class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(std::unique_ptr<Backend> inner = make_ref_backend())
      : inner_(std::move(inner)) {}

  std::string_view name() const override { return inner_->name(); }
  bool batch_invariant() const override { return inner_->batch_invariant(); }
  void matmul(const WeightMatrix& w, std::span<const float> x, int64_t n,
              std::span<float> y) override {
    inner_->matmul(w, x, n, y);
  }
  void matmul_batch(std::span<const MatmulTask> tasks, int64_t n) override {
    inner_->matmul_batch(tasks, n);
  }
  void get_rows(const WeightMatrix& w, std::span<const int32_t> ids,
                std::span<float> out) override {
    inner_->get_rows(w, ids, out);
  }
  void rmsnorm(std::span<const float> x, std::span<const float> w, int64_t n, float eps,
               std::span<float> y) override {
    inner_->rmsnorm(x, w, n, eps, y);
  }
  void add_rmsnorm(std::span<float> x, std::span<const float> a, std::span<const float> w,
                   int64_t n, float eps, std::span<float> y) override {
    inner_->add_rmsnorm(x, a, w, n, eps, y);
  }
  void prefetch_weights(std::span<const WeightMatrix* const> ws, int64_t n) override {
    inner_->prefetch_weights(ws, n);
  }
  void rope(std::span<float> x, int64_t t, int64_t h, int64_t d, std::span<const int32_t> pos,
            const RopeParams& p) override {
    inner_->rope(x, t, h, d, pos, p);
  }
  void rope_qk(std::span<float> q, int64_t hq, std::span<float> k, int64_t hk, int64_t t, int64_t d,
               std::span<const int32_t> pos, const RopeParams& p) override {
    inner_->rope_qk(q, hq, k, hk, t, d, pos, p);
  }
  void softmax(std::span<float> x, int64_t n) override { inner_->softmax(x, n); }
  void swiglu(std::span<const float> g, std::span<const float> u, std::span<float> o) override {
    inner_->swiglu(g, u, o);
  }
  void swiglu_matmul(const WeightMatrix& w, std::span<const float> g, std::span<const float> u,
                     int64_t n, std::span<float> act, std::span<float> y) override {
    inner_->swiglu_matmul(w, g, u, n, act, y);
  }
  void geglu(std::span<const float> g, std::span<const float> u, std::span<float> o) override {
    inner_->geglu(g, u, o);
  }
  void swiglu_oai(std::span<const float> g, std::span<const float> u, std::span<float> o,
                  float alpha, float limit) override {
    inner_->swiglu_oai(g, u, o, alpha, limit);
  }
  void add(std::span<const float> a, std::span<const float> b, std::span<float> o) override {
    inner_->add(a, b, o);
  }
  void mul(std::span<const float> a, std::span<const float> b, std::span<float> o) override {
    inner_->mul(a, b, o);
  }
  void scale(std::span<float> x, float s) override { inner_->scale(x, s); }
  void softcap(std::span<float> x, float cap) override { inner_->softcap(x, cap); }
  void sigmoid(std::span<float> x) override { inner_->sigmoid(x); }
  void store_rows_f16(std::span<const float> src, int64_t width, std::span<const int32_t> rows,
                      std::span<f16> plane) override {
    inner_->store_rows_f16(src, width, rows, plane);
  }
  void store_rows_f16_batch(std::span<const StoreRowsTask> tasks) override {
    inner_->store_rows_f16_batch(tasks);
  }
  void attention(const AttentionArgs& a) override { inner_->attention(a); }
  void attention_batch(std::span<const AttentionArgs> seqs) override {
    inner_->attention_batch(seqs);
  }
  int64_t argmax(std::span<const float> x) override { return inner_->argmax(x); }
  void top_k(std::span<const float> x, int64_t n, int32_t k, std::span<int32_t> ids,
             std::span<float> vals) override {
    inner_->top_k(x, n, k, ids, vals);
  }

 private:
  std::unique_ptr<Backend> inner_;
};

// The forwarding backend told to say whether it is batch-invariant, recording each forward
// step's token count (its embedding lookup): how the engine splits its steps.
class StepRecorder final : public ForwardingBackend {
 public:
  explicit StepRecorder(bool invariant) : invariant_(invariant) {}
  std::vector<size_t> steps;

  bool batch_invariant() const override { return invariant_; }
  void get_rows(const WeightMatrix& w, std::span<const int32_t> ids,
                std::span<float> out) override {
    steps.push_back(ids.size());
    ForwardingBackend::get_rows(w, ids, out);
  }

 private:
  bool invariant_;
};

}  // namespace kiln::testing
