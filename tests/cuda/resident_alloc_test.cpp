// tests/cuda/resident_alloc_test.cpp: the backend allocation API (Backend::alloc_bytes, upload,
// download, copy, zero) on the CPU, no GPU needed. A wrapper backend plays a device: the memory
// it hands out is an inaccessible (PROT_NONE) address range, and each op translates those
// addresses to a private backing store before calling the CPU backend. So any place where the
// forward pass, the KV cache or the session still touches activation or KV memory from the host
// faults here, and every result must be bit-identical to the CPU backend used directly (the
// same kernels run on the same values in the same order).
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "common/testdata.h"
#include "engine/dflash_drafter.h"
#include "engine/scheduler.h"
#include "engine/session.h"
#include "transfer/session_pack.h"

namespace kiln {
namespace {

class FakeDeviceBackend final : public Backend {
 public:
  explicit FakeDeviceBackend(Backend& inner) : inner_(inner) {}
  ~FakeDeviceBackend() override { EXPECT_EQ(live_bytes_, 0u) << "buffers outlived the backend"; }

  std::string_view name() const override { return "fake-device"; }
  bool device_memory() const override { return true; }
  // The few-token MoE path on the CPU kernels, against host memory's general path.
  bool groups_few_token_experts() const override { return true; }

  BackendBytes alloc_bytes(size_t bytes) override {
    const size_t n = (std::max<size_t>(bytes, 1) + 4095) / 4096 * 4096;
    void* fake = mmap(nullptr, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    KILN_CHECK(fake != MAP_FAILED);
    auto real = std::make_unique<std::byte[]>(n);  // zero-filled, as the API promises
    regions_[reinterpret_cast<uintptr_t>(fake)] = Region{std::move(real), n};
    live_bytes_ += n;
    allocated_bytes_ += n;
    return BackendBytes(static_cast<std::byte*>(fake), [this, n](std::byte* p) {
      regions_.erase(reinterpret_cast<uintptr_t>(p));
      live_bytes_ -= n;
      munmap(p, n);
    });
  }
  void upload_bytes(std::span<const std::byte> host, std::span<std::byte> dst) override {
    ++uploads_;
    const auto d = real(dst);
    EXPECT_FALSE(is_fake(host.data()));
    std::memcpy(d.data(), host.data(), host.size());
  }
  void download_bytes(std::span<const std::byte> src, std::span<std::byte> host) override {
    ++downloads_;
    if (is_registered(host)) ++pinned_downloads_;
    EXPECT_FALSE(is_fake(host.data()));
    const auto s = real(src);
    std::memcpy(host.data(), s.data(), s.size());
  }
  void copy_bytes(std::span<const std::byte> src, std::span<std::byte> dst) override {
    EXPECT_TRUE(is_fake(src.data()) && is_fake(dst.data())) << "copy must stay on the device";
    const auto s = real(src);
    std::memcpy(real(dst).data(), s.data(), s.size());
  }
  void zero_bytes(std::span<std::byte> dst) override {
    const auto d = real(dst);
    std::memset(d.data(), 0, d.size());
  }
  void copy_bytes_2d(const std::byte* src, size_t src_pitch, std::byte* dst, size_t dst_pitch,
                     size_t width, size_t rows) override {
    for (size_t r = 0; r < rows; ++r)
      copy_bytes({src + r * src_pitch, width}, {dst + r * dst_pitch, width});
  }

  void matmul(const WeightMatrix& w, std::span<const float> x, int64_t n_tok,
              std::span<float> y) override {
    inner_.matmul(w, real(x), n_tok, real(y));
  }
  void get_rows(const WeightMatrix& w, std::span<const int32_t> ids,
                std::span<float> out) override {
    inner_.get_rows(w, real(ids), real(out));
  }
  void rmsnorm(std::span<const float> x, std::span<const float> weight, int64_t n, float eps,
               std::span<float> y) override {
    inner_.rmsnorm(real(x), real(weight), n, eps, real(y));
  }
  void rope(std::span<float> x, int64_t n_tok, int64_t n_head, int64_t head_dim,
            std::span<const int32_t> pos, const RopeParams& p) override {
    inner_.rope(real(x), n_tok, n_head, head_dim, real(pos), p);
  }
  void softmax(std::span<float> x, int64_t n) override { inner_.softmax(real(x), n); }
  void swiglu(std::span<const float> g, std::span<const float> u, std::span<float> o) override {
    inner_.swiglu(real(g), real(u), real(o));
  }
  void swiglu_oai(std::span<const float> g, std::span<const float> u, std::span<float> o,
                  float alpha, float limit) override {
    inner_.swiglu_oai(real(g), real(u), real(o), alpha, limit);
  }
  void geglu(std::span<const float> g, std::span<const float> u, std::span<float> o) override {
    inner_.geglu(real(g), real(u), real(o));
  }
  void add(std::span<const float> a, std::span<const float> b, std::span<float> o) override {
    inner_.add(real(a), real(b), real(o));
  }
  void mul(std::span<const float> a, std::span<const float> b, std::span<float> o) override {
    inner_.mul(real(a), real(b), real(o));
  }
  void scale(std::span<float> x, float s) override { inner_.scale(real(x), s); }
  void softcap(std::span<float> x, float cap) override { inner_.softcap(real(x), cap); }
  void sigmoid(std::span<float> x) override { inner_.sigmoid(real(x)); }
  void store_rows_f16(std::span<const float> src, int64_t width, std::span<const int32_t> rows,
                      std::span<f16> plane) override {
    EXPECT_TRUE(is_fake(plane.data())) << "KV planes must come from the backend";
    inner_.store_rows_f16(real(src), width, real(rows), real(plane));
  }
  void attention(const AttentionArgs& a) override {
    AttentionArgs r = a;
    r.q = real(a.q);
    r.k = real(a.k);
    r.v = real(a.v);
    r.kv_rows = real(a.kv_rows);
    r.kv_pos = real(a.kv_pos);
    r.q_pos = real(a.q_pos);
    r.out = real(a.out);
    inner_.attention(r);
  }
  int64_t argmax(std::span<const float> x) override { return inner_.argmax(real(x)); }
  void top_k(std::span<const float> x, int64_t n, int32_t k, std::span<int32_t> ids,
             std::span<float> vals) override {
    ++top_ks_;
    EXPECT_FALSE(is_fake(ids.data()) || is_fake(vals.data())) << "top_k writes host arrays";
    inner_.top_k(real(x), n, k, ids, vals);
  }
  uint64_t top_ks() const { return top_ks_; }

  // Page-locking, as the CUDA backend does it: the ranges are remembered until the handle goes;
  // registering a page already registered fails (cudaHostRegister's rule).
  std::shared_ptr<void> register_host_memory(std::span<std::byte> mem) override {
    const auto a = reinterpret_cast<uintptr_t>(mem.data());
    for (const auto& [b, n] : registered_)
      if (a / 4096 <= (b + n - 1) / 4096 && b / 4096 <= (a + mem.size() - 1) / 4096) {
        ADD_FAILURE() << "a page registered twice";
        return nullptr;
      }
    registered_[a] = mem.size();
    return std::shared_ptr<void>(mem.data(), [this, a](void*) { registered_.erase(a); });
  }
  bool is_registered(std::span<const std::byte> host) const {
    const auto a = reinterpret_cast<uintptr_t>(host.data());
    auto it = registered_.upper_bound(a);
    if (it == registered_.begin()) return false;
    --it;
    return a + host.size() <= it->first + it->second;
  }
  // What device_free_bytes() reports (0: cannot tell, as the default).
  uint64_t free_bytes = 0;
  uint64_t device_free_bytes() const override { return free_bytes; }

  size_t n_registered() const { return registered_.size(); }
  uint64_t pinned_downloads() const { return pinned_downloads_; }
  uint64_t downloads() const { return downloads_; }
  uint64_t allocated_bytes() const { return allocated_bytes_; }

 private:
  struct Region {
    std::unique_ptr<std::byte[]> real;
    size_t bytes = 0;
  };
  std::map<uintptr_t, size_t> registered_;
  uint64_t pinned_downloads_ = 0, top_ks_ = 0;
  bool is_fake(const void* p) const { return find(p) != nullptr; }
  const std::pair<const uintptr_t, Region>* find(const void* p) const {
    const auto a = reinterpret_cast<uintptr_t>(p);
    auto it = regions_.upper_bound(a);
    if (it == regions_.begin()) return nullptr;
    --it;
    return a < it->first + it->second.bytes ? &*it : nullptr;
  }
  // The backing store of a span in fake memory; host spans (weights, row lists) as they are.
  template <typename T>
  std::span<T> real(std::span<T> s) const {
    if (s.empty()) return s;
    const auto* r = find(s.data());
    if (!r) return s;
    const size_t off = reinterpret_cast<uintptr_t>(s.data()) - r->first;
    KILN_CHECK(off + s.size_bytes() <= r->second.bytes, "span past its buffer");
    return {reinterpret_cast<T*>(r->second.real.get() + off), s.size()};
  }

  Backend& inner_;
  std::map<uintptr_t, Region> regions_;
  uint64_t uploads_ = 0, downloads_ = 0, live_bytes_ = 0, allocated_bytes_ = 0;
};

bool have(const std::string& file) {
  return std::filesystem::exists(testing::shared_dir() + "/testdata/models/" + file);
}

// Prefill (every position's logits) then greedy decode steps; returns all logits produced.
std::vector<float> run(Session& s, std::span<const int32_t> prompt, int steps) {
  std::vector<float> all;
  auto l = s.eval(prompt, true);
  KILN_CHECK(l.has_value(), "{}", l.error());
  all.insert(all.end(), l->begin(), l->end());
  std::vector<float> last(l->end() - s.n_vocab(), l->end());
  for (int i = 0; i < steps; ++i) {
    const auto best =
        static_cast<int32_t>(std::max_element(last.begin(), last.end()) - last.begin());
    auto d = s.eval(std::span<const int32_t>(&best, 1), false);
    KILN_CHECK(d.has_value(), "{}", d.error());
    last.assign(d->begin(), d->end());
    all.insert(all.end(), d->begin(), d->end());
  }
  return all;
}

class ResidentAlloc : public ::testing::TestWithParam<const char*> {};

// Architectures: llama (GQA), gemma2 (sliding-window rings, softcaps, post norms), qwen3 (q/k
// norms), qwen3moe (router decisions downloaded, rows gathered by device copies; the prompt's
// last chunk of 8 tokens takes the device backends' few-token MoE path, forward.cpp
// moe_few_tokens).
TEST_P(ResidentAlloc, BitIdenticalToHostMemory) {
  const std::string file = std::string(GetParam()) + ".gguf";
  if (!have(file)) GTEST_SKIP() << file << " not present";
  auto m = Model::load(testing::model_path(file));
  ASSERT_TRUE(m.has_value()) << m.error();
  auto cpu = make_cpu_backend({.threads = 2});
  FakeDeviceBackend dev(*cpu);
  // A prompt longer than the chunk (max_batch 16) and the gemma2 window: several chunks, ring
  // wrap-around, and plane growth (a device copy of the old rows).
  std::vector<int32_t> prompt;
  for (int i = 0; i < 40; ++i) prompt.push_back(1 + (i * 37) % ((*m)->n_vocab() - 1));
  std::vector<float> want, got;
  std::vector<uint8_t> pack_host, pack_dev;
  // kvpack tiles of 7 rows: with the gemma2 window some tiles straddle the ring's wrap, which
  // the device path downloads as two runs of rows.
  {
    Session host(*m, *cpu, 128, 16);
    want = run(host, prompt, 6);
    auto p = transfer::save_session(host, 7);
    ASSERT_TRUE(p.has_value()) << p.error();
    pack_host = std::move(*p);
  }
  uint64_t downloads_before = 0;
  {
    Session resident(*m, dev, 128, 16);
    got = run(resident, prompt, 6);
    // A prefill node on a GPU saves its KV from device planes (downloaded row runs): the
    // same pack, byte for byte.
    auto p = transfer::save_session(resident, 7);
    ASSERT_TRUE(p.has_value()) << p.error();
    pack_dev = std::move(*p);
    EXPECT_EQ(pack_dev, pack_host) << "kvpack from device planes differs from host planes";
    downloads_before = dev.downloads();
    const uint64_t pinned_before = dev.pinned_downloads();
    // A decode step downloads its logits once, into the session's page-locked buffer (engine/
    // host_logits.h); nothing else crosses for a dense model.
    const int32_t tok = 3;
    auto step = resident.eval(std::span<const int32_t>(&tok, 1), false);
    ASSERT_TRUE(step.has_value());
    EXPECT_TRUE(dev.is_registered(std::as_bytes(*step))) << "logits not in page-locked memory";
    EXPECT_EQ(dev.pinned_downloads() - pinned_before, 1u);
    if ((*m)->hparams().layers[0].n_expert == 0) {
      EXPECT_EQ(dev.downloads() - downloads_before, 1u);
    } else {  // plus one router download per MoE layer
      EXPECT_GT(dev.downloads() - downloads_before, 1u);
    }
    EXPECT_GT(dev.allocated_bytes(), resident.kv_bytes());
  }
  {
    // A candidates step: the backend's top_k on the device rows, no logits downloaded (a
    // dense model downloads nothing), the candidates those of host memory.
    Session on_host(*m, *cpu, 128, 16), on_dev(*m, dev, 128, 16);
    ASSERT_TRUE(on_host.eval(prompt, false).has_value());
    ASSERT_TRUE(on_dev.eval(prompt, false).has_value());
    const int32_t tok = 5;
    auto want = on_host.eval_top_k(std::span<const int32_t>(&tok, 1), 8);
    ASSERT_TRUE(want.has_value()) << want.error();
    const uint64_t d0 = dev.downloads(), t0 = dev.top_ks();
    auto top = on_dev.eval_top_k(std::span<const int32_t>(&tok, 1), 8);
    ASSERT_TRUE(top.has_value()) << top.error();
    EXPECT_EQ(dev.top_ks() - t0, 1u);
    if ((*m)->hparams().layers[0].n_expert == 0) EXPECT_EQ(dev.downloads(), d0);
    EXPECT_TRUE(std::equal(top->ids.begin(), top->ids.end(), want->ids.begin(), want->ids.end()));
    EXPECT_EQ(std::memcmp(top->logits.data(), want->logits.data(), 8 * sizeof(float)), 0);
  }
  EXPECT_EQ(dev.n_registered(), 0u) << "a session left host memory page-locked";
  ASSERT_EQ(want.size(), got.size());
  EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0)
      << "logits differ between host memory and backend-allocated memory";
}

INSTANTIATE_TEST_SUITE_P(Models, ResidentAlloc,
                         ::testing::Values("stories260K", "gemma2-swa-q8_0", "qwen3-bpe-q8_0",
                                           "qwen3moe-q4_k_m"));

// Captured activations equal the host path's: copied to the host by download, or (a capture
// with the device as its device) kept in device memory with nothing downloaded but the logits.
TEST(ResidentAllocCapture, SameNodesAsHostMemory) {
  if (!have("stories260K.gguf")) GTEST_SKIP() << "stories260K.gguf not present";
  auto m = Model::load(testing::model_path("stories260K.gguf"));
  ASSERT_TRUE(m.has_value()) << m.error();
  auto cpu = make_cpu_backend({.threads = 2});
  FakeDeviceBackend dev(*cpu);
  const std::vector<int32_t> prompt = {1, 300, 42, 7, 99};
  model::Capture a, b, c;
  c.device = &dev;
  c.only = {"inp_embd", "blk.0.l_out", "blk.1.ffn_out", "result_norm"};
  const auto eval = [&](Backend& be, model::Capture& cap) {
    Session s(*m, be, 64);
    s.set_capture(&cap);
    const uint64_t before = dev.downloads();
    ASSERT_TRUE(s.eval(prompt, false).has_value());
    if (cap.device) EXPECT_EQ(dev.downloads() - before, 1u) << "only the logits cross";
  };
  eval(*cpu, a);
  eval(dev, b);
  eval(dev, c);
  ASSERT_EQ(a.nodes.size(), b.nodes.size());
  ASSERT_GT(a.nodes.size(), 10u);
  for (const auto& [name, node] : a.nodes) {
    auto it = b.nodes.find(name);
    ASSERT_NE(it, b.nodes.end()) << name;
    ASSERT_EQ(node.data.size(), it->second.data.size()) << name;
    EXPECT_EQ(std::memcmp(node.data.data(), it->second.data.data(), node.data.size() * 4), 0)
        << name;
  }
  ASSERT_EQ(c.nodes.size(), c.only.size());
  for (const auto& [name, node] : c.nodes) {
    ASSERT_TRUE(node.on_device()) << name;
    EXPECT_TRUE(node.data.empty()) << name;
    std::vector<float> got(node.device.size());
    dev.download(node.device, std::span<float>(got));
    EXPECT_EQ(node.n_rows, a.nodes.at(name).n_rows) << name;
    EXPECT_EQ(got, a.nodes.at(name).data) << name;
  }
}

// DFlash on a device: the target's features stay in device memory from the verify to the
// drafter's fc, and both the verify rows and the drafts cross as ids (two top-k calls a
// step), so a step downloads nothing; the ids equal the CPU run's.
TEST(ResidentAllocDflash, FeaturesStayOnTheDevice) {
  if (!have("dflash-target-f16.gguf")) GTEST_SKIP() << "dflash-target-f16.gguf not present";
  auto m = Model::load(testing::model_path("dflash-target-f16.gguf"));
  ASSERT_TRUE(m.has_value()) << m.error();
  std::shared_ptr<const Model> target = std::move(*m);
  auto cpu = make_cpu_backend({.threads = 2});
  FakeDeviceBackend dev(*cpu);
  std::vector<int32_t> prompt;
  for (int32_t i = 0; i < 24; ++i) prompt.push_back((i * 37 + 11) % 200 + 1);
  const auto generate = [&](Backend& be, std::vector<int32_t>& ids, uint64_t* downloads) {
    Session s(target, be, 128);
    auto d = DflashDrafter::create(testing::model_path("dflash-drafter-f16.gguf"), target, be, 128,
                                   s.max_batch());
    ASSERT_TRUE(d.has_value()) << d.error();
    SpecParams sp;
    sp.n_draft = 4;
    sp.sampling.temperature = 0;
    auto dec = SpeculativeDecoder::create(s, **d, sp);
    ASSERT_TRUE(dec.has_value()) << dec.error();
    ASSERT_TRUE((*dec)->start(prompt));
    while (ids.size() < 40) {
      const uint64_t before = dev.downloads(), top_ks = dev.top_ks();
      auto st = (*dec)->step();
      ASSERT_TRUE(st.has_value()) << st.error();
      if (downloads) {
        *downloads += dev.downloads() - before;
        EXPECT_EQ(dev.top_ks() - top_ks, 2u) << "the verify's and the draft's top-1";
      }
      ids.insert(ids.end(), st->tokens.begin(), st->tokens.end());
    }
    ids.resize(40);
  };
  std::vector<int32_t> on_cpu, on_dev;
  uint64_t downloads = 0;
  generate(*cpu, on_cpu, nullptr);
  generate(dev, on_dev, &downloads);
  EXPECT_EQ(on_dev, on_cpu);
  EXPECT_EQ(downloads, 0u) << "decode steps downloaded features or logits";
}

// A context whose KV planes cannot fit the device's free memory is refused when the scheduler is
// made (the planes grow as positions arrive, so it would otherwise fail at the first long
// request), in one line naming device memory and what to lower; one that fits is taken, and a
// device that cannot tell its free memory (0) is not checked (issue 37, point 5).
TEST(DeviceKvFit, ContextThatCannotFitIsRefusedAtLoad) {
  if (!have("stories260K.gguf")) GTEST_SKIP() << "stories260K.gguf not present";
  auto m = Model::load(testing::model_path("stories260K.gguf"));
  ASSERT_TRUE(m.has_value()) << m.error();
  std::shared_ptr<const Model> model = std::move(*m);
  auto cpu = make_cpu_backend({.threads = 1});
  FakeDeviceBackend dev(*cpu);
  SchedulerConfig cfg;
  cfg.n_slots = 8;
  cfg.n_ctx = model->n_ctx_train();
  dev.free_bytes = 64 << 10;  // far below 8 slots' KV at full context
  auto refused = Scheduler::create(model, dev, cfg);
  ASSERT_FALSE(refused.has_value());
  const std::string& msg = refused.error();
  EXPECT_NE(msg.find("KV cache of 8 slots"), std::string::npos) << msg;
  EXPECT_NE(msg.find("of device memory is available"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--ctx-size"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  dev.free_bytes = uint64_t{1} << 30;
  EXPECT_TRUE(Scheduler::create(model, dev, cfg).has_value());
  dev.free_bytes = 0;
  EXPECT_TRUE(Scheduler::create(model, dev, cfg).has_value());
}

// The host defaults of the API on a plain backend: zero-filled aligned memory, and copies.
TEST(BackendAlloc, HostDefaults) {
  auto cpu = make_cpu_backend({.threads = 1});
  EXPECT_FALSE(cpu->device_memory());
  BackendBuffer<float> b = cpu->alloc<float>(1000);
  ASSERT_EQ(b.size(), 1000u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 64, 0u);
  for (float f : b.span()) ASSERT_EQ(f, 0.0f);
  std::vector<float> src(1000);
  for (size_t i = 0; i < src.size(); ++i) src[i] = float(i) * 0.5f;
  cpu->upload(std::span<const float>(src), b.span());
  BackendBuffer<float> c = cpu->alloc<float>(1000);
  cpu->copy(std::span<const float>(b.span()), c.span());
  std::vector<float> back(1000);
  cpu->download(std::span<const float>(c.span()), std::span<float>(back));
  EXPECT_EQ(back, src);
  cpu->zero(c.span().subspan(10, 5));
  EXPECT_EQ(c.span()[9], 4.5f);
  EXPECT_EQ(c.span()[10], 0.0f);
  EXPECT_EQ(c.span()[15], 7.5f);
}

}  // namespace
}  // namespace kiln
