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
#include "common/forwarding_backend.h"
#include "common/testdata.h"
#include "engine/session.h"

namespace kiln {
namespace {

// Forwards every op to the reference backend; records hints and matmul weights.
class HintRecorder final : public testing::ForwardingBackend {
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
    ForwardingBackend::matmul(w, x, n, y);
  }
  void matmul_batch(std::span<const MatmulTask> tasks, int64_t n) override {
    for (const MatmulTask& t : tasks) read(*t.w);
    ForwardingBackend::matmul_batch(tasks, n);
  }
  void swiglu_matmul(const WeightMatrix& w, std::span<const float> g, std::span<const float> u,
                     int64_t n, std::span<float> act, std::span<float> y) override {
    read(w);
    ForwardingBackend::swiglu_matmul(w, g, u, n, act, y);
  }

 private:
  void read(const WeightMatrix& w) { events.push_back(Event{false, {w.bytes.data()}}); }
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
