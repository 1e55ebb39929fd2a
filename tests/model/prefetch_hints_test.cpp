// tests/model/prefetch_hints_test.cpp: the forward pass's prefetch hints
// (Backend::prefetch_weights, which a CUDA backend turns into L2 prefetches). A hint is only
// worth its fetches if the weights it names are read soon after, and a decode step gains only
// where each matmul's weight was named before it: both are checked here on the reference
// backend, wrapped to record the hints and the matmuls' weights in order.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <vector>

#include "backend/backend.h"
#include "common/testdata.h"
#include "engine/session.h"

namespace kiln {
namespace {

// Forwards every op to the reference backend; records hints and matmul weights.
class HintRecorder final : public Backend {
 public:
  struct Event {
    bool hint;
    std::vector<const std::byte*> weights;  // a hint's, in order; a matmul's one
  };
  std::vector<Event> events;

  std::string_view name() const override { return "hint-recorder"; }
  void prefetch_weights(std::span<const WeightMatrix* const> ws, int64_t) override {
    Event e{true, {}};
    for (const WeightMatrix* w : ws)
      if (w != nullptr && w->n_rows > 0) e.weights.push_back(w->bytes.data());
    events.push_back(std::move(e));
  }
  void matmul(const WeightMatrix& w, std::span<const float> x, int64_t n,
              std::span<float> y) override {
    read(w);
    ref_->matmul(w, x, n, y);
  }
  void matmul_batch(std::span<const MatmulTask> tasks, int64_t n) override {
    for (const MatmulTask& t : tasks) read(*t.w);
    ref_->matmul_batch(tasks, n);
  }
  void swiglu_matmul(const WeightMatrix& w, std::span<const float> g, std::span<const float> u,
                     int64_t n, std::span<float> act, std::span<float> y) override {
    read(w);
    ref_->swiglu_matmul(w, g, u, n, act, y);
  }
  void get_rows(const WeightMatrix& w, std::span<const int32_t> ids,
                std::span<float> out) override {
    ref_->get_rows(w, ids, out);
  }
  void rmsnorm(std::span<const float> x, std::span<const float> w, int64_t n, float eps,
               std::span<float> y) override {
    ref_->rmsnorm(x, w, n, eps, y);
  }
  void rope(std::span<float> x, int64_t t, int64_t h, int64_t d, std::span<const int32_t> pos,
            const RopeParams& p) override {
    ref_->rope(x, t, h, d, pos, p);
  }
  void softmax(std::span<float> x, int64_t n) override { ref_->softmax(x, n); }
  void swiglu(std::span<const float> g, std::span<const float> u, std::span<float> o) override {
    ref_->swiglu(g, u, o);
  }
  void swiglu_oai(std::span<const float> g, std::span<const float> u, std::span<float> o,
                  float alpha, float limit) override {
    ref_->swiglu_oai(g, u, o, alpha, limit);
  }
  void geglu(std::span<const float> g, std::span<const float> u, std::span<float> o) override {
    ref_->geglu(g, u, o);
  }
  void add(std::span<const float> a, std::span<const float> b, std::span<float> o) override {
    ref_->add(a, b, o);
  }
  void mul(std::span<const float> a, std::span<const float> b, std::span<float> o) override {
    ref_->mul(a, b, o);
  }
  void scale(std::span<float> x, float s) override { ref_->scale(x, s); }
  void softcap(std::span<float> x, float cap) override { ref_->softcap(x, cap); }
  void sigmoid(std::span<float> x) override { ref_->sigmoid(x); }
  void store_rows_f16(std::span<const float> src, int64_t width, std::span<const int32_t> rows,
                      std::span<f16> plane) override {
    ref_->store_rows_f16(src, width, rows, plane);
  }
  void attention(const AttentionArgs& a) override { ref_->attention(a); }
  int64_t argmax(std::span<const float> x) override { return ref_->argmax(x); }

 private:
  void read(const WeightMatrix& w) { events.push_back(Event{false, {w.bytes.data()}}); }
  std::unique_ptr<Backend> ref_ = make_ref_backend();
};

// One decode step's events (after a prompt): every hinted weight is read by a later matmul of
// the step, and (dense FFNs) every matmul's weight was hinted since its previous read.
void check_step(const char* file, bool dense) {
  SCOPED_TRACE(file);
  auto m = Model::load(testing::model_path(file));
  ASSERT_TRUE(m.has_value()) << m.error();
  HintRecorder be;
  Session s(*m, be, 64);
  const std::vector<int32_t> prompt = {1, 5, 9, 13, 17, 21};
  ASSERT_TRUE(s.eval(prompt, false).has_value());
  be.events.clear();
  const int32_t next = 3;
  ASSERT_TRUE(s.eval(std::span<const int32_t>(&next, 1), false).has_value());

  size_t hints = 0, hinted_reads = 0, reads = 0;
  std::set<const std::byte*> named;  // hinted since their last read
  for (size_t i = 0; i < be.events.size(); ++i) {
    const HintRecorder::Event& e = be.events[i];
    if (e.hint) {
      ++hints;
      for (const std::byte* w : e.weights) {
        named.insert(w);
        bool read_later = false;
        for (size_t j = i + 1; j < be.events.size() && !read_later; ++j)
          read_later = !be.events[j].hint && be.events[j].weights[0] == w;
        EXPECT_TRUE(read_later) << "event " << i << ": a hinted weight no later matmul reads";
      }
    } else {
      ++reads;
      if (named.erase(e.weights[0]) > 0) ++hinted_reads;
    }
  }
  const int32_t n_layer = (*m)->hparams().n_layer;
  EXPECT_GE(hints, size_t(2 * n_layer)) << "too few hints for a step";
  if (dense) {
    EXPECT_EQ(hinted_reads, reads) << "a matmul of the decode step read a weight no hint named";
  } else {
    EXPECT_GT(hinted_reads, 0u);
  }
  fmt::print("  {}: {} hints, {} of {} matmul weights named ahead\n", file, hints, hinted_reads,
             reads);
}

TEST(PrefetchHints, EveryHintedWeightIsReadAndEveryDenseMatmulWasHinted) {
  check_step("llama-gqa-q4_k_m.gguf", true);
  check_step("gemma2-swa-q8_0.gguf", true);
  check_step("qwen3moe-q4_k_m.gguf", false);
}

}  // namespace
}  // namespace kiln
