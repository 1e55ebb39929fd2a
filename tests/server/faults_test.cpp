// tests/server/faults_test.cpp: faults injected under a running server. A read error or a
// short read while streaming MoE experts (moe/file_reader.h's test hook) fails the request
// with one line, the server lives on, and the expert cache stays consistent: once the disk
// is well again the same request gets the same text as before the fault. A context whose KV
// cache cannot fit memory is refused at load, not at the first long request.
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <nlohmann/json.hpp>
#include <string>

#include "common/testdata.h"
#include "core/counters.h"
#include "format/gguf.h"
#include "format/gguf_writer.h"
#include "server/server.h"

namespace kiln::server {
namespace {

using json = nlohmann::json;

enum Fault : int { kNone = 0, kEio = 1, kShort = 2 };

TEST(ServerFaults, ExpertReadFaultFailsTheRequestAndTheServerLives) {
  std::atomic<int> fault{kNone};
  std::atomic<int> injected{0};
  ServerOptions o;
  o.model_path = testing::model_path("qwen3moe-q4_k_m.gguf");
  o.host = "127.0.0.1";
  o.port = 0;
  o.engine.threads = 1;
  o.n_ctx = 256;
  o.engine.experts.cap = 2;  // nearly every routed expert is a load
  o.engine.experts.fault_for_testing = [&](uint64_t, uint64_t len) -> int64_t {
    const int f = fault.load();
    if (f == kNone) return int64_t(len);
    injected.fetch_add(1);
    return f == kEio ? -1 : int64_t(len / 2);
  };
  HttpServer srv(o);
  ASSERT_TRUE(srv.start());
  ASSERT_TRUE(srv.load());
  httplib::Client c("127.0.0.1", srv.port());
  c.set_read_timeout(60, 0);
  const json req = {{"prompt", "Once upon a time"}, {"max_tokens", 12}, {"temperature", 0}};
  auto complete = [&] { return c.Post("/v1/completions", req.dump(), "application/json"); };
  auto healthy = complete();
  ASSERT_TRUE(healthy);
  ASSERT_EQ(healthy->status, 200) << healthy->body;
  const std::string text = json::parse(healthy->body)["choices"][0]["text"];

  for (Fault f : {kEio, kShort}) {
    SCOPED_TRACE(f == kEio ? "EIO" : "short read");
    fault.store(f);
    const int before = injected.load();
    auto failed = complete();
    ASSERT_TRUE(failed);
    EXPECT_GT(injected.load(), before) << "no read went through the fault hook";
    EXPECT_EQ(failed->status, 500) << failed->body;
    const json e = json::parse(failed->body, nullptr, false);
    ASSERT_TRUE(e.contains("error")) << failed->body;
    const std::string msg = e["error"]["message"];
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_NE(msg.find("expert"), std::string::npos) << msg;
    EXPECT_NE(msg.find(f == kEio ? "Input/output error" : "file ended after"), std::string::npos)
        << msg;
    // A stream ends with the error event and [DONE].
    json sreq = req;
    sreq["stream"] = true;
    auto stream = c.Post("/v1/completions", sreq.dump(), "application/json");
    ASSERT_TRUE(stream);
    EXPECT_NE(stream->body.find("generation failed"), std::string::npos) << stream->body;
    EXPECT_NE(stream->body.find("data: [DONE]"), std::string::npos) << stream->body;
    // The disk recovers: the server still answers, with the text it gave before.
    fault.store(kNone);
    auto health = c.Get("/health");
    ASSERT_TRUE(health);
    EXPECT_EQ(health->status, 200);
    auto again = complete();
    ASSERT_TRUE(again);
    ASSERT_EQ(again->status, 200) << again->body;
    EXPECT_EQ(json::parse(again->body)["choices"][0]["text"], text);
  }
  srv.stop();
}

// stories260K claiming a training context of 2^24 positions (the most hparams accept): its KV
// cache at full context, 256 slots, is terabytes. The planes grow on demand, so this used to load
// and fail (or be killed) only when a request reached that length.
TEST(ServerFaults, ContextThatCannotFitIsRefusedAtLoad) {
  auto src = GgufFile::open(testing::model_path("stories260K.gguf"));
  ASSERT_TRUE(src.has_value()) << src.error();
  GgufWriter w;
  w.copy_metadata(*src);
  w.set_u32("llama.context_length", 1u << 24);
  for (const TensorInfo& t : src->tensors())
    w.add_tensor(t.name, t.dtype, std::vector<int64_t>(t.ne.begin(), t.ne.begin() + t.n_dims),
                 src->view(t).bytes);
  const std::string path = testing::temp_dir() + "/huge_context.gguf";
  ASSERT_TRUE(w.write(path).is_ok());
  ServerOptions o;
  o.model_path = path;
  o.host = "127.0.0.1";
  o.port = 0;
  o.engine.threads = 1;
  o.n_ctx = 1 << 24;
  o.n_parallel = 256;
  {
    HttpServer srv(o);
    ASSERT_TRUE(srv.start());
    const Status st = srv.load();
    ASSERT_FALSE(st);
    EXPECT_NE(st.message().find("KV cache of 256 slots x 16777216 positions"), std::string::npos)
        << st.message();
    EXPECT_NE(st.message().find("--ctx-size"), std::string::npos) << st.message();
    EXPECT_EQ(st.message().find('\n'), std::string::npos) << st.message();
  }
  // The same file with a context that fits loads and serves.
  o.n_ctx = 256;
  o.n_parallel = 4;
  HttpServer srv(o);
  ASSERT_TRUE(srv.start());
  const Status st = srv.load();
  EXPECT_TRUE(st.is_ok()) << st.message();
}

}  // namespace
}  // namespace kiln::server
