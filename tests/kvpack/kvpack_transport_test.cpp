// tests/kvpack/kvpack_transport_test.cpp: remote prefill through each transport and every
// failure it must survive: a producer of another model (refused with the field named), a
// stalled producer (timeout), a flipped byte, a cut stream, no listener at all. Each failure
// falls back to local prefill with one notice line and the same logits; TCP and UCX run on
// loopback.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "backend/cpu/cpu_backend.h"
#include "common/testdata.h"
#include "engine/session.h"
#include "transfer/remote_prefill.h"

namespace kiln::transfer {
namespace {

struct Fixture {
  std::shared_ptr<const Model> model;
  std::unique_ptr<Backend> be, be_remote;
  std::vector<int32_t> prompt;
  std::vector<float> local_logits;  // last-token logits of a plain local prefill
};

Fixture& fixture() {
  static Fixture f = [] {
    Fixture x;
    auto m = Model::load(testing::model_path("stories260K.gguf"));
    KILN_CHECK(m.has_value(), "{}", m.error());
    x.model = *m;
    x.be = make_cpu_backend({.threads = 1});
    x.be_remote = make_cpu_backend({.threads = 1});
    std::mt19937 rng(7);
    for (int i = 0; i < 60; ++i) x.prompt.push_back(int32_t(rng() % 500 + 1));
    Session s(x.model, *x.be, 128, 16);
    auto l = s.eval(x.prompt, false);
    KILN_CHECK(l.has_value());
    x.local_logits.assign(l->begin(), l->end());
    return x;
  }();
  return f;
}

struct Outcome {
  std::vector<float> logits;
  std::string stderr_text;
  double seconds = 0;
  RemoteStats stats;
};

// Runs prefill() on a fresh session of the fixture model with `peer`.
Outcome consume(const PrefillPeer& peer) {
  Fixture& f = fixture();
  Session s(f.model, *f.be, 128, 16);
  Outcome o;
  ::testing::internal::CaptureStderr();
  const auto t0 = std::chrono::steady_clock::now();
  auto l = prefill(s, f.prompt, &peer, &o.stats);
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  o.stderr_text = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(l.has_value()) << l.error();
  if (l) o.logits.assign(l->begin(), l->end());
  EXPECT_EQ(s.n_pos(), int32_t(f.prompt.size()));
  return o;
}

void expect_local_result(const Outcome& o) {
  const auto& want = fixture().local_logits;
  ASSERT_EQ(o.logits.size(), want.size());
  EXPECT_EQ(std::memcmp(o.logits.data(), want.data(), want.size() * sizeof(float)), 0);
}
int count_lines(const std::string& s) { return int(std::count(s.begin(), s.end(), '\n')); }

// An in-memory producer/consumer pair with faults on the producer -> consumer direction.
Outcome run_memory(MemoryFaults faults, std::shared_ptr<const Model> producer_model,
                   Millis timeout) {
  auto [p, c] = memory_pair(faults);
  Fixture& f = fixture();
  std::thread producer([&, link = p.get()] {
    (void)serve_prefill(*link, producer_model, *f.be_remote, {.io_timeout = Millis(3000)});
  });
  auto held = std::make_shared<std::unique_ptr<Link>>(std::move(c));
  PrefillPeer peer{
      .name = "memory",
      .connect = [held]() -> Expected<std::unique_ptr<Link>> { return std::move(*held); },
      .timeout = timeout};
  Outcome o = consume(peer);
  p->close();  // unblock a producer still waiting for the acknowledgement
  producer.join();
  return o;
}

TEST(RemotePrefill, MemoryLinkNoFallback) {
  Outcome o = run_memory({}, fixture().model, Millis(20000));
  EXPECT_EQ(o.stderr_text, "");
  expect_local_result(o);
  EXPECT_GT(o.stats.bytes, 0u);
}

TEST(RemotePrefill, ProducerOfAnotherModelIsRefusedAndFallsBack) {
  auto q = Model::load(testing::model_path("stories260K-q8_0.gguf"));
  ASSERT_TRUE(q.has_value());
  Outcome o = run_memory({}, *q, Millis(20000));
  EXPECT_EQ(count_lines(o.stderr_text), 1) << o.stderr_text;
  EXPECT_NE(o.stderr_text.find("model fingerprint"), std::string::npos) << o.stderr_text;
  EXPECT_NE(o.stderr_text.find("prefilling locally"), std::string::npos) << o.stderr_text;
  expect_local_result(o);
}

TEST(RemotePrefill, StalledProducerTimesOutAndFallsBack) {
  Outcome o = run_memory({.stall_after = 3000}, fixture().model, Millis(300));
  EXPECT_EQ(count_lines(o.stderr_text), 1) << o.stderr_text;
  EXPECT_NE(o.stderr_text.find("timed out"), std::string::npos) << o.stderr_text;
  EXPECT_LT(o.seconds, 5.0);
  expect_local_result(o);
}

TEST(RemotePrefill, CorruptOrCutStreamFallsBack) {
  // Byte 4 is the first byte of the pack (after "KVOK"); 2000 lands inside a tile.
  for (uint64_t at : {4u, 60u, 2000u, 9000u}) {
    Outcome o = run_memory({.flip_at = at}, fixture().model, Millis(2000));
    EXPECT_EQ(count_lines(o.stderr_text), 1) << "flip at " << at << ": " << o.stderr_text;
    expect_local_result(o);
  }
  for (uint64_t at : {0u, 3u, 100u, 5000u}) {
    Outcome o = run_memory({.cut_after = at}, fixture().model, Millis(2000));
    EXPECT_EQ(count_lines(o.stderr_text), 1) << "cut at " << at << ": " << o.stderr_text;
    expect_local_result(o);
  }
}

TEST(RemotePrefill, NoListenerFallsBack) {
  // Bind a port, then close the listener so nothing answers there.
  int port = 0;
  {
    auto l = tcp_listen("127.0.0.1", 0);
    ASSERT_TRUE(l.has_value()) << l.error();
    port = (*l)->port();
  }
  PrefillPeer peer = tcp_or_ucx_peer(TransportKind::Tcp, "127.0.0.1", port, Millis(1000));
  Outcome o = consume(peer);
  EXPECT_EQ(count_lines(o.stderr_text), 1) << o.stderr_text;
  expect_local_result(o);
}

void loopback(TransportKind kind) {
  Fixture& f = fixture();
  auto l = listen(kind, "127.0.0.1", 0);
  ASSERT_TRUE(l.has_value()) << l.error();
  Listener& listener = **l;
  std::thread producer([&] {
    auto link = listener.accept(Millis(10000));
    ASSERT_TRUE(link.has_value()) << link.error();
    Status s = serve_prefill(**link, f.model, *f.be_remote, {.max_batch = 16});
    EXPECT_TRUE(s) << s.message();
  });
  PrefillPeer peer = tcp_or_ucx_peer(kind, "127.0.0.1", listener.port(), Millis(10000));
  Outcome o = consume(peer);
  producer.join();
  EXPECT_EQ(o.stderr_text, "");
  expect_local_result(o);
  std::printf("[kvpack] %s loopback: %llu bytes in %.3f s\n", peer.name.c_str(),
              (unsigned long long)o.stats.bytes, o.stats.seconds);
}

TEST(RemotePrefill, TcpLoopback) { loopback(TransportKind::Tcp); }

TEST(RemotePrefill, UcxLoopback) {
  if (!ucx_built()) GTEST_SKIP() << "built without UCX (libucx-dev not found at configure time)";
  loopback(TransportKind::Ucx);
}

TEST(RemotePrefill, HostPortParsing) {
  auto a = parse_host_port("10.0.0.2:7070");
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->first, "10.0.0.2");
  EXPECT_EQ(a->second, 7070);
  for (const char* bad : {"", "host", ":80", "host:", "host:0", "host:70000", "host:8x"})
    EXPECT_FALSE(parse_host_port(bad).has_value()) << bad;
  EXPECT_FALSE(transport_from_name("carrier-pigeon").has_value());
}

}  // namespace
}  // namespace kiln::transfer
