// tests/server/server_test.cpp: the HTTP server in-process on an ephemeral loopback port
// with stories260K, driven by httplib::Client: every route, SSE streaming parsed event by
// event, validation errors with the OpenAI error shape, 413, API keys, queue overflow (503 +
// Retry-After), a client that disconnects mid-stream freeing its slot, determinism across
// concurrent requests, and /health 503 before the model loads.
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/testdata.h"
#include "core/counters.h"
#include "format/gguf.h"
#include "format/gguf_writer.h"
#include "engine/session.h"
#include "server/server.h"
#include "tokenizer/jinja/chat_template.h"

namespace kiln::server {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

struct Running {
  std::unique_ptr<HttpServer> srv;
  std::unique_ptr<httplib::Client> cli;
};

Running start(ServerOptions o, bool load = true) {
  if (o.model_path.empty()) o.model_path = testing::model_path("stories260K.gguf");
  o.host = "127.0.0.1";
  o.port = 0;
  o.engine.threads = 1;
  if (o.n_ctx == 0) o.n_ctx = 256;
  Running r;
  r.srv = std::make_unique<HttpServer>(o);
  Status st = r.srv->start();
  EXPECT_TRUE(st.is_ok()) << st.message();
  if (load) {
    st = r.srv->load();
    EXPECT_TRUE(st.is_ok()) << st.message();
  }
  r.cli = std::make_unique<httplib::Client>("127.0.0.1", r.srv->port());
  r.cli->set_read_timeout(30, 0);
  return r;
}

json post_json(httplib::Client& c, const std::string& path, const json& body, int want_status) {
  auto res = c.Post(path.c_str(), body.dump(), "application/json");
  EXPECT_TRUE(res) << path;
  if (!res) return {};
  EXPECT_EQ(res->status, want_status) << path << " " << res->body;
  return json::parse(res->body, nullptr, false);
}

// Ban end-of-sequence so a generation runs to max_tokens.
const json kNoEos = {{"2", -100}};

// SSE: "data: ...\n\n" events.
struct Sse {
  std::vector<json> chunks;
  bool done = false;
  std::string text;
  std::string finish;
  json usage;
};
Sse parse_sse(const std::string& body, bool chat) {
  Sse s;
  size_t at = 0;
  while (at < body.size()) {
    size_t end = body.find("\n\n", at);
    if (end == std::string::npos) break;
    std::string ev = body.substr(at, end - at);
    at = end + 2;
    EXPECT_EQ(ev.rfind("data: ", 0), 0u) << ev;
    ev = ev.substr(6);
    if (ev == "[DONE]") {
      s.done = true;
      continue;
    }
    EXPECT_FALSE(s.done) << "event after [DONE]";
    json j = json::parse(ev);
    s.chunks.push_back(j);
    if (!j["usage"].is_null() && j.contains("usage")) s.usage = j["usage"];
    for (const json& c : j["choices"]) {
      if (chat && c["delta"].contains("content"))
        s.text += c["delta"]["content"].get<std::string>();
      if (!chat) s.text += c["text"].get<std::string>();
      if (!c["finish_reason"].is_null()) s.finish = c["finish_reason"];
    }
  }
  EXPECT_EQ(at, body.size()) << "trailing bytes in the SSE body";
  return s;
}

double metric(httplib::Client& c, const std::string& name) {
  auto res = c.Get("/metrics");
  if (!res) return -1;
  const std::string key = "\nkiln_" + name + " ";
  const size_t at = ("\n" + res->body).find(key);
  if (at == std::string::npos) return -1;
  return std::stod(res->body.substr(at + key.size() - 1));
}

TEST(Server, HealthIs503UntilLoadedThenServesEveryRoute) {
  Running r = start({}, /*load=*/false);
  auto h = r.cli->Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 503);
  EXPECT_EQ(json::parse(h->body)["error"]["code"], "loading");
  EXPECT_EQ(r.cli->Get("/v1/models")->status, 503);
  ASSERT_TRUE(r.srv->load().is_ok());
  EXPECT_EQ(r.cli->Get("/health")->status, 200);

  auto models = r.cli->Get("/v1/models");
  ASSERT_TRUE(models);
  const json m = json::parse(models->body);
  EXPECT_EQ(m["object"], "list");
  EXPECT_EQ(m["data"][0]["id"], "stories260K");

  // Tokenize / detokenize round trip.
  const json t =
      post_json(*r.cli, "/tokenize", {{"content", "Once upon a time"}, {"add_special", true}}, 200);
  ASSERT_TRUE(t["tokens"].is_array());
  EXPECT_EQ(t["tokens"][0], 1);  // BOS
  std::vector<int> ids = t["tokens"];
  ids.erase(ids.begin());
  const json d = post_json(*r.cli, "/detokenize", {{"tokens", ids}}, 200);
  EXPECT_EQ(d["content"], "Once upon a time");

  // Completions: usage counts agree with /tokenize.
  const json c = post_json(*r.cli, "/v1/completions",
                           {{"prompt", "Once upon a time"},
                            {"max_tokens", 12},
                            {"seed", 1},
                            {"logit_bias", kNoEos},
                            {"logprobs", 2}},
                           200);
  EXPECT_EQ(c["object"], "text_completion");
  EXPECT_EQ(c["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(c["usage"]["prompt_tokens"], t["tokens"].size());
  EXPECT_EQ(c["usage"]["completion_tokens"], 12);
  EXPECT_EQ(c["choices"][0]["logprobs"]["tokens"].size(), 12u);
  for (const json& lp : c["choices"][0]["logprobs"]["token_logprobs"])
    EXPECT_LE(lp.get<double>(), 0.0);
  EXPECT_FALSE(c["choices"][0]["text"].get<std::string>().empty());

  // Chat, non-streaming.
  const json chat = post_json(*r.cli, "/v1/chat/completions",
                              {{"model", "anything"},
                               {"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                               {"max_tokens", 5},
                               {"logit_bias", kNoEos},
                               {"logprobs", true},
                               {"top_logprobs", 3}},
                              200);
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_EQ(chat["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(chat["usage"]["completion_tokens"], 5);
  ASSERT_EQ(chat["choices"][0]["logprobs"]["content"].size(), 5u);
  EXPECT_EQ(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"].size(), 3u);

  // Metrics in Prometheus text.
  EXPECT_GE(metric(*r.cli, "requests_total"), 2);
  EXPECT_GE(metric(*r.cli, "generated_tokens_total"), 17);
  EXPECT_EQ(metric(*r.cli, "slots_total"), 4);
  EXPECT_GT(metric(*r.cli, "kv_cache_bytes"), 0);
  // The process counter registry is exported too (expert store, speculative decoder, ...).
  process_counters().counter("test.server-metrics").add(3);
  process_counters().timer("test.server_timer").record(std::chrono::milliseconds(1500));
  EXPECT_GE(metric(*r.cli, "registry_test_server_metrics_total"), 3);
  EXPECT_GE(metric(*r.cli, "registry_test_server_timer_seconds_total"), 1.5);
  EXPECT_GE(metric(*r.cli, "registry_test_server_timer_count"), 1);
}

// A busy port is refused with one line naming it (cpp-httplib's SO_REUSEPORT would let two
// servers share it and split the requests), and stop() right after start() returns at once
// (it was a no-op until the listen loop ran, which then never ended).
TEST(Server, BusyPortIsRefusedAndStopRightAfterStartReturns) {
  Running a = start({}, /*load=*/false);
  ServerOptions o;
  o.model_path = testing::model_path("stories260K.gguf");
  o.host = "127.0.0.1";
  o.port = a.srv->port();
  HttpServer b(o);
  const Status st = b.start();
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("port " + std::to_string(o.port) + " in use"), std::string::npos)
      << st.message();
  for (int i = 0; i < 20; ++i) {
    ServerOptions quick;
    quick.host = "127.0.0.1";
    quick.port = 0;
    HttpServer srv(quick);
    ASSERT_TRUE(srv.start());
    srv.stop();
  }
}

// --max-body-kib holds for chunked bodies (httplib bounded only Content-Length ones: 150 MiB
// chunked got 200), reading stops at the limit, and a JSON body sent as curl -d's default
// x-www-form-urlencoded is read as JSON, not refused over 8 KiB with a misleading 413.
TEST(Server, BodyLimitHoldsForChunkedBodiesAndAnyContentType) {
  ServerOptions o;
  o.limits.max_body_bytes = 64 << 10;
  Running r = start(o);
  // 20 KiB of JSON, form content type: read and answered.
  const std::string text(20 << 10, 'a');
  const std::string small = json{{"content", text}}.dump();
  auto form = r.cli->Post("/tokenize", small, "application/x-www-form-urlencoded");
  ASSERT_TRUE(form);
  EXPECT_EQ(form->status, 200) << form->body;
  // 1 MiB chunked: 413 naming the limit, without reading it all.
  size_t sent = 0;
  httplib::Client c("127.0.0.1", r.srv->port());
  auto chunked = c.Post(
      "/v1/completions",
      [&](size_t, httplib::DataSink& sink) {
        const std::string piece(16 << 10, ' ');
        if (sent >= (size_t(1) << 20)) {
          sink.done();
          return true;
        }
        sent += piece.size();
        return sink.write(piece.data(), piece.size());
      },
      "application/json");
  if (chunked) {  // the server may close before the client has sent everything
    EXPECT_EQ(chunked->status, 413) << chunked->body;
    EXPECT_NE(chunked->body.find("64 KiB"), std::string::npos) << chunked->body;
  }
  // Content-Length over the limit: the same answer.
  auto big = r.cli->Post("/tokenize", std::string(100 << 10, ' '), "application/json");
  ASSERT_TRUE(big);
  EXPECT_EQ(big->status, 413);
  EXPECT_NE(big->body.find("request_too_large"), std::string::npos) << big->body;
}

// A non-streaming request whose client goes away is cancelled within about a second, as a
// stream's is (it used to generate to max_tokens).
TEST(Server, NonStreamingRequestOfAGoneClientIsCancelled) {
  ServerOptions o;
  o.n_ctx = 2048;  // 2000 tokens take ~0.8 s on one thread here, far more under sanitizers
  Running r = start(o);
  auto cancelled = [&] {
    const std::string m = r.cli->Get("/metrics")->body;
    const std::string key = "\nkiln_requests_cancelled_total ";
    const size_t at = m.find(key);
    return at == std::string::npos ? -1.0 : std::stod(m.substr(at + key.size()));
  };
  const double before = cancelled();
  ASSERT_GE(before, 0);
  {
    httplib::Client c("127.0.0.1", r.srv->port());
    c.set_read_timeout(0, 50000);  // gives up after 50 ms and closes the connection
    auto res = c.Post("/v1/completions",
                      json{{"prompt", "Once"}, {"max_tokens", 2000}, {"logit_bias", kNoEos}}.dump(),
                      "application/json");
    EXPECT_FALSE(res) << "a 2000-token answer in 50 ms?";
  }
  double after = before;
  for (int i = 0; i < 50 && after == before; ++i) {
    std::this_thread::sleep_for(100ms);
    after = cancelled();
  }
  EXPECT_EQ(after, before + 1) << "the request kept generating after its client left";
}

// The llama.cpp sampling fields are honoured, not ignored: top_k 1 at a high temperature is
// greedy decoding, whatever the seed.
TEST(Server, TopKIsHonoured) {
  Running r = start({});
  auto text = [&](const json& extra) {
    json body = {{"prompt", "Once upon a time"}, {"max_tokens", 24}};
    body.update(extra);
    return post_json(*r.cli, "/v1/completions", body, 200)["choices"][0]["text"].get<std::string>();
  };
  const std::string greedy = text({{"temperature", 0}});
  EXPECT_EQ(text({{"temperature", 1.5}, {"top_k", 1}, {"seed", 1}}), greedy);
  EXPECT_EQ(text({{"temperature", 1.5}, {"top_k", 1}, {"seed", 2}}), greedy);
  // Without the cut the same seeds wander off (the check above would pass if top_k were
  // ignored only by luck).
  EXPECT_NE(text({{"temperature", 1.5}, {"seed", 1}}), greedy);
}

// Structured output on a model that writes nonsense: the text must still parse as JSON and
// validate against the schema, and the request ends (stop) when the grammar is complete.
TEST(Server, ResponseFormatJsonSchemaGivesValidJson) {
  Running r = start({});
  const json schema = {
      {"type", "object"},
      {"properties",
       {{"name", {{"type", "string"}, {"maxLength", 12}}},
        {"mood", {{"enum", {"happy", "sad", 3}}}},
        {"age", {{"type", "integer"}}},
        {"ok", {{"type", "boolean"}}},
        {"tags",
         {{"type", "array"}, {"items", {{"type", "string"}, {"maxLength", 4}}}, {"maxItems", 3}}}}},
      {"required", {"name", "mood", "ok"}},
      {"additionalProperties", false}};
  auto check = [&](const std::string& text) {
    SCOPED_TRACE(text);
    const json j = json::parse(text, nullptr, false);
    ASSERT_TRUE(j.is_object());
    for (const char* k : {"name", "mood", "ok"}) EXPECT_TRUE(j.contains(k)) << k;
    for (auto it = j.begin(); it != j.end(); ++it)
      EXPECT_TRUE(schema["properties"].contains(it.key())) << it.key();
    EXPECT_TRUE(j["name"].is_string() && j["name"].get<std::string>().size() <= 12 * 6);
    EXPECT_TRUE(j["mood"] == "happy" || j["mood"] == "sad" || j["mood"] == 3);
    EXPECT_TRUE(j["ok"].is_boolean());
    if (j.contains("age")) EXPECT_TRUE(j["age"].is_number_integer());
    if (j.contains("tags")) {
      ASSERT_TRUE(j["tags"].is_array());
      EXPECT_LE(j["tags"].size(), 3u);
      for (const json& t : j["tags"]) EXPECT_TRUE(t.is_string());
    }
  };
  const json rf = {{"type", "json_schema"},
                   {"json_schema", {{"name", "person"}, {"strict", true}, {"schema", schema}}}};
  for (const json& sampling : {json{{"temperature", 0}}, json{{"temperature", 1.0}, {"seed", 1}},
                               json{{"temperature", 1.5}, {"seed", 7}, {"top_k", 0}}}) {
    json body = {{"messages", {{{"role", "user"}, {"content", "Tell me about a cat."}}}},
                 {"max_tokens", 200},
                 {"response_format", rf}};
    body.update(sampling);
    const json out = post_json(*r.cli, "/v1/chat/completions", body, 200);
    ASSERT_TRUE(out.is_object());
    check(out["choices"][0]["message"]["content"].get<std::string>());
    EXPECT_EQ(out["choices"][0]["finish_reason"], "stop");
    // Streamed: the same text for the same seed.
    body["stream"] = true;
    auto res = r.cli->Post("/v1/chat/completions", body.dump(), "application/json");
    ASSERT_TRUE(res);
    const Sse sse = parse_sse(res->body, true);
    EXPECT_EQ(sse.text, out["choices"][0]["message"]["content"].get<std::string>());
    EXPECT_EQ(sse.finish, "stop");
  }
  // json_object and a GBNF grammar on /v1/completions.
  const json obj = post_json(*r.cli, "/v1/completions",
                             {{"prompt", "Once upon a time"},
                              {"max_tokens", 64},
                              {"temperature", 0},
                              {"grammar", "root ::= \"{\\\"word\\\": \\\"\" [a-z]{1,8} \"\\\"}\""}},
                             200);
  const json word = json::parse(obj["choices"][0]["text"].get<std::string>(), nullptr, false);
  ASSERT_TRUE(word.is_object()) << obj.dump();
  EXPECT_EQ(obj["choices"][0]["finish_reason"], "stop");
  // An unsupported schema keyword is a 400 naming it, before anything runs.
  json bad = {
      {"prompt", "x"},
      {"response_format",
       {{"type", "json_schema"},
        {"json_schema", {{"name", "n"}, {"schema", {{"type", "string"}, {"format", "email"}}}}}}}};
  const json err = post_json(*r.cli, "/v1/completions", bad, 400);
  EXPECT_NE(err["error"]["message"].get<std::string>().find("'format' is not supported"),
            std::string::npos);
}

// Batch invariance with grammars: constrained and free requests decoding in the same steps
// each get the text they get alone (a grammar masks only its own request's row).
TEST(Server, GrammarRequestsAndFreeOnesShareStepsUnchanged) {
  ServerOptions o;
  o.n_parallel = 4;
  Running r = start(o);
  std::vector<json> bodies;
  for (int i = 0; i < 4; ++i) {
    json b = {{"prompt", i % 2 ? "Once upon a time" : "The little dog"},
              {"max_tokens", 40},
              {"seed", 200 + i},
              {"temperature", 0.9}};
    if (i < 2) b["response_format"] = {{"type", "json_object"}};
    if (i == 2) b["grammar"] = "root ::= ([a-z]+ \" \"){2,12}";
    bodies.push_back(b);
  }
  std::vector<std::string> alone;
  for (const json& b : bodies)
    alone.push_back(post_json(*r.cli, "/v1/completions", b, 200)["choices"][0]["text"]);
  for (int i = 0; i < 2; ++i)
    EXPECT_TRUE(alone[size_t(i)].empty() || alone[size_t(i)][0] == '{') << alone[size_t(i)];
  std::vector<std::string> together(bodies.size());
  std::vector<std::thread> ts;
  for (size_t i = 0; i < bodies.size(); ++i)
    ts.emplace_back([&, i] {
      httplib::Client c("127.0.0.1", r.srv->port());
      auto res = c.Post("/v1/completions", bodies[i].dump(), "application/json");
      ASSERT_TRUE(res);
      together[i] = json::parse(res->body)["choices"][0]["text"];
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(together, alone);
}

TEST(Server, StreamsSseWithUsageAndDone) {
  Running r = start({});
  const json body = {{"messages", {{{"role", "user"}, {"content", "Tell me a story"}}}},
                     {"max_tokens", 20},
                     {"seed", 5},
                     {"stream", true},
                     {"logit_bias", kNoEos},
                     {"stream_options", {{"include_usage", true}}}};
  auto res = r.cli->Post("/v1/chat/completions", body.dump(), "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->get_header_value("Content-Type"), "text/event-stream");
  const Sse s = parse_sse(res->body, true);
  EXPECT_TRUE(s.done);
  EXPECT_EQ(s.finish, "length");
  EXPECT_EQ(s.usage["completion_tokens"], 20);
  EXPECT_TRUE(s.chunks.back()["choices"].empty());  // the usage chunk has no choices
  EXPECT_EQ(s.chunks.front()["choices"][0]["delta"]["role"], "assistant");

  // The same request without streaming produces the same text (same seed).
  json plain = body;
  plain.erase("stream");
  plain.erase("stream_options");
  const json p = post_json(*r.cli, "/v1/chat/completions", plain, 200);
  EXPECT_EQ(p["choices"][0]["message"]["content"], s.text);

  // Completions stream too.
  auto c = r.cli->Post(
      "/v1/completions",
      json{{"prompt", "Once"}, {"max_tokens", 6}, {"stream", true}, {"logit_bias", kNoEos}}.dump(),
      "application/json");
  ASSERT_TRUE(c);
  const Sse cs = parse_sse(c->body, false);
  EXPECT_TRUE(cs.done);
  EXPECT_EQ(cs.finish, "length");
  EXPECT_TRUE(cs.usage.is_null());  // not asked for
}

// n > 1: choices indexed 0..n-1, choice i sampled as a lone request with seed + i would be,
// usage counting the prompt once and every choice's tokens, streamed chunks carrying their
// choice's index; n above the server's cap (--max-n) is a 400.
TEST(Server, NChoicesAreIndexedSeededAndCounted) {
  ServerOptions o;
  o.max_n = 3;
  Running r = start(o);
  const json base = {{"messages", {{{"role", "user"}, {"content", "Tell me a story"}}}},
                     {"max_tokens", 8},
                     {"temperature", 0.9},
                     {"seed", 11},
                     {"logit_bias", kNoEos}};
  // First, on a fresh server: the prompt is evaluated once (timings.prompt_n) and the other
  // two choices start from its KV rows (timings.cache_n), which usage does not count.
  json req = base;
  req["n"] = 3;
  const json c = post_json(*r.cli, "/v1/chat/completions", req, 200);
  ASSERT_EQ(c["choices"].size(), 3u) << c.dump();
  const int prompt_tokens = c["usage"]["prompt_tokens"];
  EXPECT_EQ(c["timings"]["prompt_n"], prompt_tokens) << c["timings"].dump();
  EXPECT_EQ(c["timings"]["cache_n"], 2 * prompt_tokens) << c["timings"].dump();
  EXPECT_EQ(c["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  auto m = r.cli->Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_NE(m->body.find("kiln_prompt_tokens_shared_total " + std::to_string(2 * prompt_tokens)),
            std::string::npos)
      << m->body;
  std::vector<std::string> alone;
  for (int i = 0; i < 3; ++i) {
    json one = base;
    one["seed"] = 11 + i;
    const json a = post_json(*r.cli, "/v1/chat/completions", one, 200);
    alone.push_back(a["choices"][0]["message"]["content"]);
    EXPECT_EQ(a["usage"]["prompt_tokens"], prompt_tokens);
  }
  EXPECT_TRUE(alone[0] != alone[1] || alone[1] != alone[2]) << "three seeds, one text";
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(c["choices"][i]["index"], i);
    EXPECT_EQ(c["choices"][i]["finish_reason"], "length");
    EXPECT_EQ(c["choices"][i]["message"]["content"], alone[static_cast<size_t>(i)]) << i;
  }
  EXPECT_EQ(c["usage"]["prompt_tokens"], prompt_tokens);
  EXPECT_EQ(c["usage"]["completion_tokens"], 24);
  EXPECT_EQ(c["usage"]["total_tokens"], prompt_tokens + 24);
  EXPECT_EQ(c["timings"]["predicted_n"], 24);

  req["stream"] = true;
  req["stream_options"] = {{"include_usage", true}};
  auto res = r.cli->Post("/v1/chat/completions", req.dump(), "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const Sse sse = parse_sse(res->body, true);
  EXPECT_TRUE(sse.done);
  std::map<int, std::string> texts;
  std::map<int, std::string> finishes;
  std::map<int, int> roles;
  for (const json& chunk : sse.chunks)
    for (const json& ch : chunk["choices"]) {
      const int i = ch["index"];
      if (ch["delta"].contains("content")) texts[i] += ch["delta"]["content"].get<std::string>();
      if (ch["delta"].contains("role")) ++roles[i];
      if (!ch["finish_reason"].is_null()) finishes[i] = ch["finish_reason"];
    }
  ASSERT_EQ(texts.size(), 3u) << res->body;
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(texts[i], alone[static_cast<size_t>(i)]) << i;
    EXPECT_EQ(finishes[i], "length") << i;
    EXPECT_EQ(roles[i], 1) << i;  // each choice's first delta names the role, once
  }
  EXPECT_EQ(sse.usage["completion_tokens"], 24);

  // Completions too; and the cap.
  const json t =
      post_json(*r.cli, "/v1/completions",
                {{"prompt", "Once"}, {"n", 2}, {"max_tokens", 4}, {"logit_bias", kNoEos}}, 200);
  ASSERT_EQ(t["choices"].size(), 2u);
  EXPECT_EQ(t["choices"][1]["index"], 1);
  EXPECT_EQ(t["usage"]["completion_tokens"], 8);
  for (int n : {0, 4}) {
    req["n"] = n;
    const json e = post_json(*r.cli, "/v1/chat/completions", req, 400);
    EXPECT_EQ(e["error"]["param"], "n");
    EXPECT_NE(e["error"]["message"].get<std::string>().find("[1, 3]"), std::string::npos)
        << e.dump();
  }
}

// llama.cpp's `timings`: the prompt tokens evaluated and the time to the first token, the
// tokens generated and the time after; in the response, and in a stream's last chunk.
TEST(Server, TimingsAreReported) {
  Running r = start({});
  const json req = {{"prompt", "Once upon a time"}, {"max_tokens", 10}, {"logit_bias", kNoEos}};
  const json c = post_json(*r.cli, "/v1/completions", req, 200);
  const json& t = c["timings"];
  EXPECT_EQ(t["prompt_n"].get<int>() + t["cache_n"].get<int>(), c["usage"]["prompt_tokens"]);
  EXPECT_EQ(t["predicted_n"], 10);
  EXPECT_GT(t["prompt_ms"].get<double>(), 0);
  EXPECT_GT(t["predicted_ms"].get<double>(), 0);
  EXPECT_NEAR(t["predicted_per_second"].get<double>(), 1e3 * 10 / t["predicted_ms"].get<double>(),
              1e-6);
  EXPECT_NEAR(t["prompt_per_token_ms"].get<double>(),
              t["prompt_ms"].get<double>() / t["prompt_n"].get<double>(), 1e-6);
  // The same prompt again: its rows are reused (cache_n), only the last one is evaluated.
  const json again = post_json(*r.cli, "/v1/completions", req, 200);
  EXPECT_EQ(again["timings"]["cache_n"], again["usage"]["prompt_tokens_details"]["cached_tokens"]);
  EXPECT_GT(again["timings"]["cache_n"].get<int>(), 0);
  json streamed = req;
  streamed["stream"] = true;
  auto res = r.cli->Post("/v1/completions", streamed.dump(), "application/json");
  ASSERT_TRUE(res);
  const Sse s = parse_sse(res->body, false);
  ASSERT_GE(s.chunks.size(), 1u);
  const json& last = s.chunks.back();
  EXPECT_FALSE(last["choices"][0]["finish_reason"].is_null()) << last.dump();
  EXPECT_EQ(last["timings"]["predicted_n"], 10) << last.dump();
}

// CORS is off unless asked for; with --cors, allowed origins get the header on every response
// (errors too, so a page can read them) and preflights are answered without the API key.
TEST(Server, CorsIsOptInAndAnswersPreflights) {
  const httplib::Headers from_a = {{"Origin", "http://a.example"}};
  {
    Running off = start({});
    auto res = off.cli->Get("/v1/models", from_a);
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200);
    EXPECT_FALSE(res->has_header("Access-Control-Allow-Origin"));
    auto pre = off.cli->Options("/v1/chat/completions", from_a);
    ASSERT_TRUE(pre);
    EXPECT_NE(pre->status, 204);
    EXPECT_FALSE(pre->has_header("Access-Control-Allow-Origin"));
  }
  ServerOptions o;
  o.cors_origins = {"http://a.example"};
  o.api_key = "k";
  Running r = start(o);
  httplib::Headers pre_headers = from_a;
  pre_headers.emplace("Access-Control-Request-Method", "POST");
  pre_headers.emplace("Access-Control-Request-Headers", "authorization,content-type");
  auto pre = r.cli->Options("/v1/chat/completions", pre_headers);
  ASSERT_TRUE(pre);
  EXPECT_EQ(pre->status, 204);  // no key on a preflight
  EXPECT_EQ(pre->get_header_value("Access-Control-Allow-Origin"), "http://a.example");
  EXPECT_NE(pre->get_header_value("Access-Control-Allow-Methods").find("POST"), std::string::npos);
  EXPECT_EQ(pre->get_header_value("Access-Control-Allow-Headers"), "authorization,content-type");
  httplib::Headers authed = from_a;
  authed.emplace("Authorization", "Bearer k");
  auto ok = r.cli->Post("/v1/completions", authed,
                        json{{"prompt", "Once"}, {"max_tokens", 2}}.dump(), "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
  EXPECT_EQ(ok->get_header_value("Access-Control-Allow-Origin"), "http://a.example");
  EXPECT_EQ(ok->get_header_value("Vary"), "Origin");
  auto denied = r.cli->Get("/v1/models", from_a);  // no key: 401, readable by the page
  ASSERT_TRUE(denied);
  EXPECT_EQ(denied->status, 401);
  EXPECT_EQ(denied->get_header_value("Access-Control-Allow-Origin"), "http://a.example");
  auto other = r.cli->Get("/health", httplib::Headers{{"Origin", "http://b.example"}});
  ASSERT_TRUE(other);
  EXPECT_FALSE(other->has_header("Access-Control-Allow-Origin"));
  auto other_pre =
      r.cli->Options("/v1/chat/completions", httplib::Headers{{"Origin", "http://b.example"}});
  ASSERT_TRUE(other_pre);
  EXPECT_FALSE(other_pre->has_header("Access-Control-Allow-Methods"));

  ServerOptions any;
  any.cors_origins = {"*"};
  Running star = start(any);
  auto res = star.cli->Get("/health", httplib::Headers{{"Origin", "http://c.example"}});
  ASSERT_TRUE(res);
  EXPECT_EQ(res->get_header_value("Access-Control-Allow-Origin"), "*");
}

// The chat page: three same-origin files under a CSP that allows nothing else, no key needed
// (the browser test is tests/server/chat_page_test.mjs, run by kiln_server_node_tests).
TEST(Server, ChatPageIsServedUnderAStrictCsp) {
  ServerOptions o;
  o.api_key = "k";
  Running r = start(o);
  auto page = r.cli->Get("/");
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 200);
  EXPECT_EQ(page->get_header_value("Content-Type"), "text/html; charset=utf-8");
  const std::string csp = page->get_header_value("Content-Security-Policy");
  EXPECT_NE(csp.find("default-src 'none'"), std::string::npos) << csp;
  EXPECT_NE(csp.find("connect-src 'self'"), std::string::npos) << csp;
  EXPECT_NE(page->body.find(R"(<script src="/chat.js")"), std::string::npos);
  // Nothing from elsewhere, nothing inline.
  EXPECT_EQ(page->body.find("http"), std::string::npos);
  EXPECT_EQ(page->body.find("<script>"), std::string::npos);
  EXPECT_EQ(page->body.find("style="), std::string::npos);
  auto js = r.cli->Get("/chat.js");
  ASSERT_TRUE(js);
  EXPECT_EQ(js->status, 200);
  EXPECT_EQ(js->get_header_value("Content-Type"), "text/javascript; charset=utf-8");
  EXPECT_NE(js->body.find("/v1/chat/completions"), std::string::npos);
  auto css = r.cli->Get("/chat.css");
  ASSERT_TRUE(css);
  EXPECT_EQ(css->get_header_value("Content-Type"), "text/css; charset=utf-8");
}

TEST(Server, StopSequencesCutTheText) {
  Running r = start({});
  const json base = {{"prompt", "Once upon a time"},
                     {"max_tokens", 60},
                     {"temperature", 0},
                     {"logit_bias", kNoEos}};
  const json full = post_json(*r.cli, "/v1/completions", base, 200);
  const std::string text = full["choices"][0]["text"];
  ASSERT_GT(text.size(), 20u);
  const std::string stop = text.substr(10, 4);
  const size_t first = text.find(stop);
  json with_stop = base;
  with_stop["stop"] = {stop};
  const json cut = post_json(*r.cli, "/v1/completions", with_stop, 200);
  EXPECT_EQ(cut["choices"][0]["text"], text.substr(0, first));
  EXPECT_EQ(cut["choices"][0]["finish_reason"], "stop");
  with_stop["stream"] = true;
  auto res = r.cli->Post("/v1/completions", with_stop.dump(), "application/json");
  ASSERT_TRUE(res);
  const Sse s = parse_sse(res->body, false);
  EXPECT_EQ(s.text, text.substr(0, first));
  EXPECT_EQ(s.finish, "stop");
}

TEST(Server, ErrorsUseTheOpenAiShape) {
  ServerOptions o;
  o.limits.max_body_bytes = 4096;
  Running r = start(o);
  auto check = [&](const std::string& path, const std::string& body, int status,
                   const std::string& code) {
    auto res = r.cli->Post(path.c_str(), body, "application/json");
    ASSERT_TRUE(res) << body;
    EXPECT_EQ(res->status, status) << body << " -> " << res->body;
    const json j = json::parse(res->body, nullptr, false);
    ASSERT_TRUE(j.is_object()) << res->body;
    EXPECT_EQ(j["error"]["code"], code) << res->body;
    EXPECT_TRUE(j["error"]["message"].is_string());
    EXPECT_TRUE(j["error"]["type"].is_string());
  };
  check("/v1/chat/completions", "{not json", 400, "invalid_json");
  check("/v1/chat/completions", R"({"messages": [{"role": "robot", "content": "x"}]})", 400,
        "invalid_value");
  check("/v1/chat/completions",
        R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": -5})", 400,
        "invalid_value");
  check("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "n": 9})", 400,
        "invalid_value");
  check("/v1/completions", R"({"prompt": [1, 99999]})", 400, "invalid_value");
  // Prompt + max_tokens over the context of 256: the message gives the numbers.
  auto res = r.cli->Post("/v1/completions", R"({"prompt": "Once upon a time", "max_tokens": 255})",
                         "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  const std::string msg = json::parse(res->body)["error"]["message"];
  EXPECT_NE(msg.find("256"), std::string::npos) << msg;
  EXPECT_NE(msg.find("255"), std::string::npos) << msg;
  std::string long_prompt;
  for (int i = 0; i < 3000; ++i) long_prompt += "a b ";
  check("/v1/completions", json{{"prompt", long_prompt}}.dump(), 413, "request_too_large");
  json many = json::array();
  for (int i = 0; i < 300; ++i) many.push_back(i % 500);
  check("/v1/completions", json{{"prompt", many}}.dump(), 400, "context_length_exceeded");
  auto nf = r.cli->Get("/v1/nothing");
  ASSERT_TRUE(nf);
  EXPECT_EQ(nf->status, 404);
  EXPECT_EQ(json::parse(nf->body)["error"]["code"], "not_found");
}

TEST(Server, ApiKeyIsRequiredWhenSet) {
  ServerOptions o;
  o.api_key = "sekrit";
  Running r = start(o);
  const std::string body = R"({"prompt": "Once", "max_tokens": 2})";
  auto no = r.cli->Post("/v1/completions", body, "application/json");
  ASSERT_TRUE(no);
  EXPECT_EQ(no->status, 401);
  EXPECT_EQ(json::parse(no->body)["error"]["code"], "invalid_api_key");
  auto wrong =
      r.cli->Post("/v1/completions", {{"Authorization", "Bearer nope"}}, body, "application/json");
  EXPECT_EQ(wrong->status, 401);
  auto ok = r.cli->Post("/v1/completions", {{"Authorization", "Bearer sekrit"}}, body,
                        "application/json");
  EXPECT_EQ(ok->status, 200);
  EXPECT_EQ(r.cli->Get("/health")->status, 200);  // health stays open for probes
}

TEST(Server, DisconnectMidStreamFreesTheSlot) {
  ServerOptions o;
  o.n_parallel = 1;
  o.n_ctx = 1024;
  Running r = start(o);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.set_header("Content-Type", "application/json");
  req.body =
      json{{"prompt", "Once"}, {"max_tokens", 1000}, {"stream", true}, {"logit_bias", kNoEos}}
          .dump();
  std::atomic<int> chunks{0};
  req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++chunks < 3; };
  httplib::Client c("127.0.0.1", r.srv->port());
  auto res = c.send(req);  // the receiver's false closes the connection
  EXPECT_GE(chunks.load(), 3);
  // The slot frees within a few steps; a fresh request then completes.
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (metric(*r.cli, "slots_busy") != 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(10ms);
  EXPECT_EQ(metric(*r.cli, "slots_busy"), 0);
  EXPECT_EQ(metric(*r.cli, "requests_cancelled_total"), 1);
  EXPECT_LT(metric(*r.cli, "generated_tokens_total"), 900);
  post_json(*r.cli, "/v1/completions", {{"prompt", "Once"}, {"max_tokens", 3}}, 200);
}

TEST(Server, QueueOverflowGets503WithRetryAfter) {
  ServerOptions o;
  o.n_parallel = 1;
  o.max_queue = 1;
  o.n_ctx = 1024;
  Running r = start(o);
  const std::string body =
      json{{"prompt", "Once"}, {"max_tokens", 300}, {"logit_bias", kNoEos}}.dump();
  std::atomic<int> n503{0}, n200{0};
  std::vector<std::thread> ts;
  for (int i = 0; i < 6; ++i)
    ts.emplace_back([&] {
      httplib::Client c("127.0.0.1", r.srv->port());
      c.set_read_timeout(60, 0);
      auto res = c.Post("/v1/completions", body, "application/json");
      if (!res) return;
      if (res->status == 503) {
        EXPECT_EQ(res->get_header_value("Retry-After"), "1");
        EXPECT_EQ(json::parse(res->body)["error"]["code"], "queue_full");
        ++n503;
      } else if (res->status == 200) {
        ++n200;
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_GE(n503.load(), 1);
  EXPECT_GE(n200.load(), 1);
  EXPECT_EQ(n503 + n200, 6);
}

TEST(Server, ConcurrentRequestsGetTheSameTextAsAlone) {
  ServerOptions o;
  o.n_parallel = 3;
  o.prefill_chunk = 3;
  Running r = start(o);
  std::vector<json> bodies;
  for (int i = 0; i < 6; ++i)
    bodies.push_back({{"prompt", i % 2 ? "Once upon a time" : "The little dog"},
                      {"max_tokens", 16 + i},
                      {"seed", 100 + i},
                      {"temperature", 0.9},
                      {"logit_bias", kNoEos}});
  std::vector<std::string> alone;
  for (const json& b : bodies)
    alone.push_back(post_json(*r.cli, "/v1/completions", b, 200)["choices"][0]["text"]);
  std::vector<std::string> together(bodies.size());
  std::vector<std::thread> ts;
  for (size_t i = 0; i < bodies.size(); ++i)
    ts.emplace_back([&, i] {
      httplib::Client c("127.0.0.1", r.srv->port());
      auto res =
          c.Post("/v1/completions", bodies[bodies.size() - 1 - i].dump(), "application/json");
      ASSERT_TRUE(res);
      together[bodies.size() - 1 - i] = json::parse(res->body)["choices"][0]["text"];
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(together, alone);
}

// `kiln serve --draft-ngram 4`: greedy completions are the text plain decoding gives, while
// /metrics reports the verify steps, drafted and accepted tokens and the batched passes.
TEST(Server, NgramDraftingKeepsGreedyTextAndReportsCounters) {
  const std::string prompt =
      "Tom had a red ball. He liked to play with it. Tom had a red ball. "
      "He liked to play with it. Tom had a red ball.";
  std::vector<json> bodies;
  for (int i = 0; i < 3; ++i)
    bodies.push_back({{"prompt", i ? prompt : "Once upon a time"},
                      {"max_tokens", 24 + 4 * i},
                      {"temperature", 0}});
  auto texts = [&](int32_t draft_ngram, std::string* metrics) {
    ServerOptions o;
    o.n_parallel = 2;
    o.prefill_chunk = 16;
    o.draft_ngram = draft_ngram;
    Running r = start(o);
    std::vector<std::string> out(bodies.size());
    std::vector<std::thread> ts;
    for (size_t i = 0; i < bodies.size(); ++i)
      ts.emplace_back([&, i] {
        httplib::Client c("127.0.0.1", r.srv->port());
        c.set_read_timeout(30, 0);
        auto res = c.Post("/v1/completions", bodies[i].dump(), "application/json");
        ASSERT_TRUE(res);
        ASSERT_EQ(res->status, 200) << res->body;
        out[i] = json::parse(res->body)["choices"][0]["text"];
      });
    for (auto& t : ts) t.join();
    auto m = r.cli->Get("/metrics");
    EXPECT_TRUE(m && m->status == 200);
    if (m) *metrics = m->body;
    return out;
  };
  auto value = [](const std::string& metrics, const std::string& name) {
    const size_t at = metrics.find("\n" + name + " ");
    EXPECT_NE(at, std::string::npos) << name << " missing:\n" << metrics;
    return at == std::string::npos ? -1.0 : std::stod(metrics.substr(at + name.size() + 2));
  };
  std::string m_plain, m_spec;
  const auto plain = texts(0, &m_plain);
  const auto spec = texts(4, &m_spec);
  EXPECT_EQ(spec, plain);
  EXPECT_EQ(value(m_plain, "kiln_spec_steps_total"), 0);
  EXPECT_GT(value(m_spec, "kiln_spec_steps_total"), 0);
  EXPECT_GT(value(m_spec, "kiln_spec_drafted_tokens_total"), 0);
  EXPECT_GE(value(m_spec, "kiln_spec_mean_acceptance_length"), 1.0);
  EXPECT_GT(value(m_spec, "kiln_forward_passes_total"), 0);
  EXPECT_GE(value(m_spec, "kiln_forward_tokens_total"), value(m_spec, "kiln_forward_passes_total"));
  std::printf("draft-ngram 4: %.0f verify steps, %.0f drafted, %.0f accepted\n",
              value(m_spec, "kiln_spec_steps_total"),
              value(m_spec, "kiln_spec_drafted_tokens_total"),
              value(m_spec, "kiln_spec_accepted_tokens_total"));
}

// `kiln serve --dflash` on the shipped pair and `kiln serve --spec-mtp` on glm4moe: greedy
// completions are the text the same server gives without drafts, concurrent and again with a
// reused prefix; `timings` report draft_n / draft_n_accepted as llama-server does. For the
// golden prompt llama-server 0.7.0 (the peer, --spec-type draft-dflash --spec-draft-n-max 4)
// reports draft_n 72, draft_n_accepted 29 over 48 tokens, and so must kiln.
TEST(Server, ModelDraftersKeepGreedyTextAndReportDraftTimings) {
  const auto golden =
      json::parse(testing::read_file(testing::shared_path("testdata/golden/dflash.json")));
  const std::vector<int32_t> prompt = golden["prompt_tokens"].get<std::vector<int32_t>>();
  struct Case {
    std::string model, dflash;
    bool mtp = false;
    std::vector<json> bodies;
  };
  std::vector<Case> cases(2);
  cases[0].model = testing::model_path("dflash-target-f16.gguf");
  cases[0].dflash = testing::model_path("dflash-drafter-f16.gguf");
  for (size_t n : {prompt.size(), size_t(100), prompt.size()})
    cases[0].bodies.push_back(
        {{"prompt", std::vector<int32_t>(prompt.begin(), prompt.begin() + ptrdiff_t(n))},
         {"max_tokens", 48},
         {"temperature", 0}});
  cases[1].model = testing::model_path("glm4moe-f16.gguf");
  cases[1].mtp = true;
  for (int i = 0; i < 3; ++i)
    cases[1].bodies.push_back({{"prompt", i == 1 ? "Lily" : "Once upon a time, there was a"},
                               {"max_tokens", 24},
                               {"temperature", 0}});
  for (const Case& c : cases) {
    auto run = [&](bool drafts, std::vector<json>* timings) {
      ServerOptions o;
      o.model_path = c.model;
      o.n_parallel = 2;
      o.prefill_chunk = 64;
      o.n_ctx = 512;
      if (drafts) {
        o.dflash = c.dflash;
        o.spec_mtp = c.mtp;
      }
      Running r = start(o);
      std::vector<std::string> out;
      // The first two side by side, then the first again (its prefix is cached).
      std::vector<json> got(2);
      std::vector<std::thread> ts;
      for (size_t i = 0; i < 2; ++i)
        ts.emplace_back([&, i] {
          httplib::Client cl("127.0.0.1", r.srv->port());
          cl.set_read_timeout(60, 0);
          auto res = cl.Post("/v1/completions", c.bodies[i].dump(), "application/json");
          ASSERT_TRUE(res);
          ASSERT_EQ(res->status, 200) << res->body;
          got[i] = json::parse(res->body);
        });
      for (auto& t : ts) t.join();
      // A reply can reach its client before its slot is released: the third request must find
      // both slots free, or it may take the other one and reuse a 1-token prefix (seen once under
      // a loaded ctest -j 2, session 28).
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (metric(*r.cli, "slots_busy") != 0 && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      got.push_back(post_json(*r.cli, "/v1/completions", c.bodies[2], 200));
      for (const json& g : got) {
        out.push_back(g["choices"][0]["text"]);
        timings->push_back(g["timings"]);
      }
      return out;
    };
    std::vector<json> t_plain, t_spec;
    const auto plain = run(false, &t_plain);
    const auto spec = run(true, &t_spec);
    EXPECT_EQ(spec, plain) << c.model;
    for (size_t i = 0; i < t_spec.size(); ++i) {
      EXPECT_FALSE(t_plain[i].contains("draft_n")) << t_plain[i].dump();
      ASSERT_TRUE(t_spec[i].contains("draft_n")) << c.model << " " << t_spec[i].dump();
      EXPECT_GT(t_spec[i]["draft_n"].get<int>(), 0);
      EXPECT_LE(t_spec[i]["draft_n_accepted"].get<int>(), t_spec[i]["draft_n"].get<int>());
      std::printf("%s request %zu: draft_n %d, draft_n_accepted %d, cache_n %d\n",
                  c.mtp ? "spec-mtp" : "dflash", i, t_spec[i]["draft_n"].get<int>(),
                  t_spec[i]["draft_n_accepted"].get<int>(), t_spec[i]["cache_n"].get<int>());
    }
    if (!c.mtp) {
      for (size_t i : {size_t(0), size_t(2)}) {
        EXPECT_EQ(t_spec[i]["draft_n"], 72) << t_spec[i].dump();
        EXPECT_EQ(t_spec[i]["draft_n_accepted"], 29) << t_spec[i].dump();
      }
    }
    // Both drafters resume a cached prefix (the DFlash KV, the NextN hidden states), with the
    // drafts of a fresh start.
    EXPECT_EQ(t_spec[2]["cache_n"], t_plain[2]["cache_n"]) << c.model;
    EXPECT_GT(t_spec[2]["cache_n"].get<int>(), 0) << c.model;
    EXPECT_EQ(t_spec[2]["draft_n"], t_spec[0]["draft_n"]) << c.model;
    EXPECT_EQ(t_spec[2]["draft_n_accepted"], t_spec[0]["draft_n_accepted"]) << c.model;
  }
}

// A drafter needs a model that has one: --spec-mtp on a model without NextN layers is refused
// at load with one line.
TEST(Server, SpecMtpWithoutNextNIsRefused) {
  ServerOptions o;
  o.spec_mtp = true;
  o.model_path = testing::model_path("stories260K.gguf");
  o.host = "127.0.0.1";
  o.port = 0;
  o.engine.threads = 1;
  HttpServer srv(o);
  ASSERT_TRUE(srv.start().is_ok());
  const Status st = srv.load();
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("NextN"), std::string::npos) << st.message();
  srv.stop();
}

// stories260K with a chat template added (none of the shared models carries one), and
// optionally some tokens' texts replaced (`tokens`: id -> text).
std::string model_with_template(const std::string& tmpl,
                                const std::map<int32_t, std::string>& tokens = {},
                                const std::string& file = "templated.gguf",
                                const std::map<int32_t, int32_t>& types = {}) {
  auto src = GgufFile::open(testing::model_path("stories260K.gguf"));
  EXPECT_TRUE(src.has_value()) << src.error();
  GgufWriter w;
  w.copy_metadata(*src);
  w.set_str("tokenizer.chat_template", tmpl);
  if (!tokens.empty()) {
    auto texts = src->get_array<std::string>("tokenizer.ggml.tokens");
    EXPECT_TRUE(texts.has_value());
    for (const auto& [id, text] : tokens) (*texts)[id] = text;
    w.set_str_array("tokenizer.ggml.tokens", *texts);
  }
  if (!types.empty()) {  // token types (3: control)
    auto t = src->get_array<int32_t>("tokenizer.ggml.token_type");
    EXPECT_TRUE(t.has_value());
    for (const auto& [id, type] : types) (*t)[id] = type;
    w.set_i32_array("tokenizer.ggml.token_type", *t);
  }
  for (const TensorInfo& t : src->tensors())
    w.add_tensor(t.name, t.dtype, std::vector<int64_t>(t.ne.begin(), t.ne.begin() + t.n_dims),
                 src->view(t).bytes);
  const std::string path = testing::temp_dir() + "/" + file;
  Status st = w.write(path);
  EXPECT_TRUE(st.is_ok()) << st.message();
  return path;
}

TEST(Server, ChatUsesTheGgufTemplate) {
  ServerOptions o;
  o.model_path = model_with_template(
      "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
      "{% if add_generation_prompt %}<|assistant|>{% endif %}"
      "{% if messages[0].content == 'boom' %}{{ raise_exception('no booms') }}{% endif %}");
  Running r = start(o);
  const json models = json::parse(r.cli->Get("/v1/models")->body);
  EXPECT_EQ(models["data"][0]["meta"]["chat_template"], true);
  const json chat = post_json(
      *r.cli, "/v1/chat/completions",
      {{"messages",
        {{{"role", "system"}, {"content", "Be kind."}}, {{"role", "user"}, {"content", "Hi"}}}},
       {"max_tokens", 2}},
      200);
  // The template writes BOS as text; it must become the one BOS token, not a second one.
  const json t = post_json(*r.cli, "/tokenize",
                           {{"content", "<s><|system|>Be kind.\n<|user|>Hi\n<|assistant|>"}}, 200);
  EXPECT_EQ(chat["usage"]["prompt_tokens"], t["tokens"].size());
  EXPECT_EQ(t["tokens"][0], 1);
  EXPECT_NE(t["tokens"][1], 1);
  auto res = r.cli->Post("/v1/chat/completions",
                         json{{"messages", {{{"role", "user"}, {"content", "boom"}}}}}.dump(),
                         "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_EQ(json::parse(res->body)["error"]["code"], "template_error");
  EXPECT_NE(res->body.find("no booms"), std::string::npos) << res->body;
}

// Tool calling through the server. stories260K cannot write a call by itself, so one of its
// tokens is renamed to a whole Hermes call and a +100 logit bias makes it the first token: the
// reply then goes through the same path a real model's would (special-token rendering, stop
// matching, the parser, the response and stream shapes). The template is the real Hermes 3
// one, recognised by its markers.
constexpr int32_t kCallToken = 300;
const std::string kCallText =
    R"(<tool_call>{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}</tool_call>)";
const json kTools = json::parse(R"([{"type": "function", "function": {"name": "get_weather",
    "description": "Get the weather", "parameters": {"type": "object", "properties":
    {"city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]}}}])");

Running start_with_tools() {
  ServerOptions o;
  o.model_path = model_with_template(
      testing::read_file(testing::shared_path(
          "testdata/templates/NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja")),
      {{kCallToken, kCallText}}, "hermes.gguf");
  o.n_ctx = 1024;
  return start(o);
}

json call_request(bool stream) {
  json req = {{"messages", {{{"role", "user"}, {"content", "Weather in Paris?"}}}},
              {"tools", kTools},
              {"max_tokens", 3},
              {"temperature", 0},
              {"logit_bias", {{std::to_string(kCallToken), 100}}},
              // The model would repeat the forced token; the call's closing tag ends the reply.
              {"stop", {"</tool_call>"}}};
  if (stream) req["stream"] = true;
  return req;
}

TEST(ServerTools, ReplyIsParsedIntoToolCalls) {
  Running r = start_with_tools();
  const json chat = post_json(*r.cli, "/v1/chat/completions", call_request(false), 200);
  const json& choice = chat["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls") << chat.dump();
  EXPECT_TRUE(choice["message"]["content"].is_null()) << chat.dump();
  ASSERT_EQ(choice["message"]["tool_calls"].size(), 1u) << chat.dump();
  const json& call = choice["message"]["tool_calls"][0];
  EXPECT_EQ(call["type"], "function");
  EXPECT_EQ(call["function"]["name"], "get_weather");
  EXPECT_EQ(call["function"]["arguments"], R"({"city":"Paris","unit":"celsius"})");
  const std::string id = call["id"];
  EXPECT_TRUE(id.starts_with("call_") && id.size() == 29) << id;
  EXPECT_FALSE(call.contains("index"));

  // Streamed: no text of the call leaks as content; one delta carries the call, with index.
  auto res = r.cli->Post("/v1/chat/completions", call_request(true).dump(), "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const Sse s = parse_sse(res->body, true);
  EXPECT_TRUE(s.done);
  EXPECT_EQ(s.text, "");
  EXPECT_EQ(s.finish, "tool_calls");
  json calls = json::array();
  for (const json& c : s.chunks)
    for (const json& ch : c["choices"])
      if (ch["delta"].contains("tool_calls"))
        for (const json& t : ch["delta"]["tool_calls"]) calls.push_back(t);
  ASSERT_EQ(calls.size(), 1u) << res->body;
  EXPECT_EQ(calls[0]["index"], 0);
  EXPECT_EQ(calls[0]["type"], "function");
  EXPECT_EQ(calls[0]["function"]["name"], "get_weather");
  EXPECT_EQ(calls[0]["function"]["arguments"], R"({"city":"Paris","unit":"celsius"})");
  EXPECT_TRUE(calls[0]["id"].get<std::string>().starts_with("call_"));
  EXPECT_EQ(s.chunks.front()["choices"][0]["delta"]["role"], "assistant");

  // tool_choice "none": the same reply is plain text, and the tools never reach the template.
  json none = call_request(false);
  none["tool_choice"] = "none";
  const json plain = post_json(*r.cli, "/v1/chat/completions", none, 200);
  EXPECT_EQ(plain["choices"][0]["finish_reason"], "stop");
  EXPECT_FALSE(plain["choices"][0]["message"].contains("tool_calls"));
  EXPECT_EQ(plain["choices"][0]["message"]["content"],
            kCallText.substr(0, kCallText.size() - std::string("</tool_call>").size()));
  EXPECT_LT(plain["usage"]["prompt_tokens"], chat["usage"]["prompt_tokens"]);
}

// gpt-oss (harmony channels, the real template): a streamed call arrives as deltas while it is
// written: the analysis message as reasoning_content, the call's first delta with its id and
// name, then its arguments in pieces (here: two tokens, each holding part of the reply, forced
// in order by a grammar that spells the reply and a logit bias that picks those tokens).
TEST(ServerTools, GptOssCallStreamsAsDeltas) {
  const std::string head =
      "<|channel|>analysis<|message|>Let me look.<|end|><|start|>assistant "
      "to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": ";
  const std::string tail = "\"Paris\"}<|call|>";
  ServerOptions o;
  o.model_path = model_with_template(
      testing::read_file(testing::shared_path("testdata/templates/openai-gpt-oss-120b.jinja")),
      {{kCallToken, head}, {kCallToken + 1, tail}}, "gpt-oss.gguf");
  o.n_ctx = 1024;
  Running r = start(o);
  auto gbnf_literal = [](const std::string& s) {
    std::string out = "\"";
    for (char c : s) {
      if (c == '"' || c == '\\') out += '\\';
      out += c;
    }
    return out + "\"";
  };
  json req = {
      {"messages", {{{"role", "user"}, {"content", "Weather in Paris?"}}}},
      {"tools", kTools},
      {"max_tokens", 8},
      {"temperature", 0},
      {"grammar", "root ::= " + gbnf_literal(head + tail)},
      {"logit_bias", {{std::to_string(kCallToken), 100}, {std::to_string(kCallToken + 1), 100}}}};
  const json whole = post_json(*r.cli, "/v1/chat/completions", req, 200);
  const json& msg = whole["choices"][0]["message"];
  EXPECT_EQ(whole["choices"][0]["finish_reason"], "tool_calls") << whole.dump();
  EXPECT_EQ(msg["reasoning_content"], "Let me look.") << whole.dump();
  ASSERT_EQ(msg["tool_calls"].size(), 1u) << whole.dump();
  EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(msg["tool_calls"][0]["function"]["arguments"], R"({"city":"Paris"})");
  EXPECT_EQ(whole["usage"]["completion_tokens"], 2) << whole.dump();

  req["stream"] = true;
  auto res = r.cli->Post("/v1/chat/completions", req.dump(), "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const Sse sse = parse_sse(res->body, true);
  EXPECT_TRUE(sse.done);
  EXPECT_EQ(sse.finish, "tool_calls") << res->body;
  EXPECT_EQ(sse.text, "") << res->body;
  std::string reasoning, args;
  std::vector<json> call_deltas;
  for (const json& c : sse.chunks)
    for (const json& ch : c["choices"]) {
      const json& d = ch["delta"];
      if (d.contains("reasoning_content")) reasoning += d["reasoning_content"].get<std::string>();
      if (!d.contains("tool_calls")) continue;
      for (const json& t : d["tool_calls"]) {
        call_deltas.push_back(t);
        args += t["function"]["arguments"].get<std::string>();
      }
    }
  EXPECT_EQ(reasoning, "Let me look.");
  // The start (id, type, name, no arguments yet), then the arguments token by token.
  ASSERT_EQ(call_deltas.size(), 3u) << res->body;
  EXPECT_EQ(call_deltas[0]["index"], 0);
  EXPECT_TRUE(call_deltas[0]["id"].get<std::string>().starts_with("call_"));
  EXPECT_EQ(call_deltas[0]["type"], "function");
  EXPECT_EQ(call_deltas[0]["function"]["name"], "get_weather");
  EXPECT_EQ(call_deltas[0]["function"]["arguments"], "");
  EXPECT_EQ(call_deltas[1]["function"]["arguments"], "{\"city\": ");
  EXPECT_FALSE(call_deltas[1].contains("id"));
  EXPECT_EQ(call_deltas[2]["index"], 0);
  EXPECT_EQ(json::parse(args), json::parse(R"({"city":"Paris"})"));
}

TEST(ServerTools, TemplateGetsToolsAndTheRoundTrip) {
  Running r = start_with_tools();
  const std::string tmpl_src = testing::read_file(
      testing::shared_path("testdata/templates/NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja"));
  // The conversation as the client sends it, and as Hermes' template must receive it.
  const json messages = json::parse(R"([
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": null, "tool_calls": [{"id": "call_abc", "type": "function",
     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_abc", "name": "get_weather", "content": "sunny"}])");
  nlohmann::ordered_json ctx = {{"messages", nlohmann::ordered_json::parse(R"([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_abc", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_abc", "name": "get_weather"}])")},
                                {"tools", nlohmann::ordered_json::parse(kTools.dump())},
                                {"add_generation_prompt", true},
                                {"bos_token", "<s>"},
                                {"eos_token", "</s>"}};
  auto text = render_chat_template(tmpl_src, ctx);
  ASSERT_TRUE(text) << text.error();
  ASSERT_NE(text->find("get_weather"), std::string::npos);
  ASSERT_NE(text->find("sunny"), std::string::npos);
  const json t = post_json(*r.cli, "/tokenize", {{"content", *text}}, 200);
  const json chat = post_json(
      *r.cli, "/v1/chat/completions",
      {{"messages", messages}, {"tools", kTools}, {"max_tokens", 1}, {"temperature", 0}}, 200);
  EXPECT_EQ(chat["usage"]["prompt_tokens"], t["tokens"].size());
}

TEST(ServerTools, RefusedWhereTheyCannotWork) {
  // A template without a tool-call format: tools refused unless tool_choice is "none".
  ServerOptions o;
  o.model_path = model_with_template(
      "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>", {},
      "plain.gguf");
  Running r = start(o);
  json req = {
      {"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"tools", kTools}, {"max_tokens", 2}};
  const json e = post_json(*r.cli, "/v1/chat/completions", req, 400);
  EXPECT_EQ(e["error"]["param"], "tools");
  EXPECT_NE(e["error"]["message"].get<std::string>().find("format"), std::string::npos);
  req["tool_choice"] = "none";
  post_json(*r.cli, "/v1/chat/completions", req, 200);
  req["tool_choice"] = "required";  // the format is what is missing
  EXPECT_EQ(post_json(*r.cli, "/v1/chat/completions", req, 400)["error"]["param"], "tools");

  // No template at all: tools and tool messages are refused, never flattened to text.
  Running plain = start({});
  req.erase("tool_choice");
  EXPECT_EQ(post_json(*plain.cli, "/v1/chat/completions", req, 400)["error"]["param"], "tools");
  const json tool_msg = {
      {"messages", {{{"role", "tool"}, {"tool_call_id", "x"}, {"content", "sunny"}}}},
      {"max_tokens", 2}};
  post_json(*plain.cli, "/v1/chat/completions", tool_msg, 400);
}

// Forced tool calls (tool_choice "required" or a named function): the grammar makes
// stories260K, which knows nothing of tools, write a reply that is only calls in the
// template's format, to an allowed function, with arguments that follow its schema; the
// server's own parser must read them back.
const json kForceTools = json::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
   "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
   "days": {"type": "integer"}}, "required": ["city", "days"]}}},
  {"type": "function", "function": {"name": "get_time", "description": "The time",
   "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
   "required": ["zone"]}}}])");

// (Mistral Small 3.2's system prompt alone is 1835 tokens of stories260K's small vocabulary:
// max_tokens 200 keeps every request inside the 2048 positions.)
// A call's name and arguments must satisfy kForceTools (and `only`, when given).
void expect_valid_call(const json& call, const std::string& only, const std::string& where) {
  const std::string name = call["function"]["name"];
  if (!only.empty()) EXPECT_EQ(name, only) << where;
  const json args = json::parse(call["function"]["arguments"].get<std::string>(), nullptr, false);
  ASSERT_TRUE(args.is_object()) << where << ": " << call.dump();
  if (name == "get_weather") {
    EXPECT_TRUE(args["city"] == "Paris" || args["city"] == "Oslo") << where << args.dump();
    EXPECT_TRUE(args["days"].is_number_integer()) << where << args.dump();
    EXPECT_EQ(args.size(), 2u) << where << args.dump();
  } else {
    EXPECT_EQ(name, "get_time") << where;
    EXPECT_TRUE(args["zone"] == "UTC" || args["zone"] == "CET") << where << args.dump();
    EXPECT_EQ(args.size(), 1u) << where << args.dump();
  }
}

struct ForcedCase {
  const char* tmpl;    // under testdata/templates
  const char* format;  // what /props reports
};
class ServerForcedTools : public ::testing::TestWithParam<ForcedCase> {};

TEST_P(ServerForcedTools, RequiredAndNamedChoicesGiveValidCalls) {
  ServerOptions o;
  o.model_path = model_with_template(testing::read_file(testing::shared_path(
                                         std::string("testdata/templates/") + GetParam().tmpl)),
                                     {}, "forced.gguf");
  o.n_ctx = 2048;
  Running r = start(o);
  EXPECT_EQ(json::parse(r.cli->Get("/props")->body)["chat_template_tool_format"],
            GetParam().format);
  for (const std::string only : {"", "get_time"}) {
    for (const bool stream : {false, true}) {
      const std::string where =
          fmt::format("{} only='{}' stream={}", GetParam().tmpl, only, stream);
      json req = {{"messages", {{{"role", "user"}, {"content", "What now?"}}}},
                  {"tools", kForceTools},
                  {"parallel_tool_calls", false},
                  {"temperature", 0},
                  {"max_tokens", 200}};
      req["tool_choice"] = only.empty()
                               ? json("required")
                               : json{{"type", "function"}, {"function", {{"name", only}}}};
      if (stream) req["stream"] = true;
      auto res = r.cli->Post("/v1/chat/completions", req.dump(), "application/json");
      ASSERT_TRUE(res) << where;
      ASSERT_EQ(res->status, 200) << where << res->body;
      json calls;
      if (stream) {
        const Sse sse = parse_sse(res->body, true);
        EXPECT_TRUE(sse.done) << where;
        EXPECT_EQ(sse.finish, "tool_calls") << where << res->body;
        EXPECT_EQ(sse.text, "") << where;
        calls = json::array();
        for (const json& c : sse.chunks)
          for (const json& ch : c["choices"])
            if (ch["delta"].contains("tool_calls"))
              for (const json& t : ch["delta"]["tool_calls"]) calls.push_back(t);
      } else {
        const json chat = json::parse(res->body);
        EXPECT_EQ(chat["choices"][0]["finish_reason"], "tool_calls") << where << res->body;
        EXPECT_TRUE(chat["choices"][0]["message"]["content"].is_null()) << where << res->body;
        calls = chat["choices"][0]["message"]["tool_calls"];
      }
      ASSERT_EQ(calls.size(), 1u) << where << res->body;  // parallel_tool_calls: false
      expect_valid_call(calls[0], only, where);
    }
  }
  // Parallel calls allowed: one or more, every one valid (or cut by max_tokens).
  json req = {{"messages", {{{"role", "user"}, {"content", "Weather and time?"}}}},
              {"tools", kForceTools},
              {"tool_choice", "required"},
              {"temperature", 0},
              {"max_tokens", 200}};
  const json chat = post_json(*r.cli, "/v1/chat/completions", req, 200);
  if (chat["choices"][0]["finish_reason"] == "tool_calls") {
    ASSERT_GE(chat["choices"][0]["message"]["tool_calls"].size(), 1u) << chat.dump();
    for (const json& c : chat["choices"][0]["message"]["tool_calls"])
      expect_valid_call(c, "", "parallel");
  } else {
    EXPECT_EQ(chat["choices"][0]["finish_reason"], "length") << chat.dump();
  }
}

INSTANTIATE_TEST_SUITE_P(
    Formats, ServerForcedTools,
    ::testing::Values(ForcedCase{"NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "hermes"},
                      ForcedCase{"Qwen-Qwen2.5-7B-Instruct.jinja", "hermes"},
                      ForcedCase{"meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3"},
                      ForcedCase{"Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral"},
                      ForcedCase{"mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral"}),
    [](const ::testing::TestParamInfo<ForcedCase>& i) {
      std::string n = i.param.tmpl;
      n = n.substr(0, n.find('.'));
      for (char& c : n)
        if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
      return n + "_" + std::to_string(i.index);
    });

// A format whose markers are control tokens (a real Hermes or Qwen vocabulary): the forced
// call's grammar runs over a vocabulary view where the marker token is its text, so the model
// writes the marker as the one token it was trained on, not spelled out in pieces.
TEST(ServerTools, ForcedCallMayUseTheFormatsControlToken) {
  ServerOptions o;
  o.model_path = model_with_template(
      testing::read_file(testing::shared_path(
          "testdata/templates/NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja")),
      {{kCallToken, "<tool_call>"}}, "control.gguf", {{kCallToken, 3}});
  o.n_ctx = 2048;
  Running r = start(o);
  json req = {{"messages", {{{"role", "user"}, {"content", "Weather?"}}}},
              {"tools", kForceTools},
              {"tool_choice", {{"type", "function"}, {"function", {{"name", "get_weather"}}}}},
              {"temperature", 0},
              {"max_tokens", 200},
              {"parallel_tool_calls", false},
              {"logprobs", true},
              {"logit_bias", {{std::to_string(kCallToken), 100}}}};
  const json chat = post_json(*r.cli, "/v1/chat/completions", req, 200);
  EXPECT_EQ(chat["choices"][0]["finish_reason"], "tool_calls") << chat.dump();
  ASSERT_EQ(chat["choices"][0]["message"]["tool_calls"].size(), 1u) << chat.dump();
  expect_valid_call(chat["choices"][0]["message"]["tool_calls"][0], "get_weather", "control");
  // The first token is the control token, rendered as the marker.
  EXPECT_EQ(chat["choices"][0]["logprobs"]["content"][0]["token"], "<tool_call>") << chat.dump();
}

TEST(ServerTools, ForcedCallIsRefusedNamingTheFormatWhereNotSupported) {
  ServerOptions o;
  o.model_path = model_with_template(
      testing::read_file(testing::shared_path("testdata/templates/GLM-4.6.jinja")), {}, "glm.gguf");
  o.n_ctx = 2048;
  Running r = start(o);
  json req = {{"messages", {{{"role", "user"}, {"content", "Hi"}}}},
              {"tools", kForceTools},
              {"tool_choice", "required"},
              {"max_tokens", 2}};
  const json e = post_json(*r.cli, "/v1/chat/completions", req, 400);
  EXPECT_EQ(e["error"]["param"], "tool_choice");
  EXPECT_NE(e["error"]["message"].get<std::string>().find("'glm'"), std::string::npos) << e.dump();
  req["tool_choice"] = "auto";  // the format is parsed: only forcing is refused
  post_json(*r.cli, "/v1/chat/completions", req, 200);

  // A schema keyword kiln cannot enforce is refused, naming the tool, not half applied.
  Running h = start_with_tools();
  json bad_tools = kForceTools;
  bad_tools[1]["function"]["parameters"]["properties"]["zone"] = {{"type", "string"},
                                                                  {"pattern", "^[A-Z]+$"}};
  req["tools"] = bad_tools;
  req["tool_choice"] = "required";
  const json e2 = post_json(*h.cli, "/v1/chat/completions", req, 400);
  EXPECT_EQ(e2["error"]["param"], "tool_choice");
  EXPECT_NE(e2["error"]["message"].get<std::string>().find("tools[1].function.parameters"),
            std::string::npos)
      << e2.dump();
  EXPECT_NE(e2["error"]["message"].get<std::string>().find("pattern"), std::string::npos);
}

TEST(Server, AliasTemplateFileSamplingDefaultsPropsAndCachedTokens) {
  const std::string tmpl_path = testing::temp_dir() + "/chat.jinja";
  {
    std::ofstream f(tmpl_path);
    f << "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]";
  }
  ServerOptions o;
  o.alias = "storyteller";
  o.chat_template_file = tmpl_path;
  o.n_parallel = 1;  // the second request lands on the slot that holds the first one's prompt
  o.sampling.temperature = 0;  // greedy unless a request says otherwise
  o.sampling.top_k = 7;
  Running r = start(o);
  const json models = json::parse(r.cli->Get("/v1/models")->body);
  EXPECT_EQ(models["data"][0]["id"], "storyteller");
  EXPECT_EQ(models["data"][0]["meta"]["chat_template"], true);

  const json props = json::parse(r.cli->Get("/props")->body);
  EXPECT_EQ(props["model_alias"], "storyteller");
  EXPECT_EQ(props["total_slots"], 1);
  EXPECT_EQ(props["default_generation_settings"]["n_ctx"], 256);
  EXPECT_EQ(props["default_generation_settings"]["params"]["temperature"], 0.0);
  EXPECT_EQ(props["default_generation_settings"]["params"]["top_k"], 7);
  EXPECT_EQ(props["chat_template"], testing::read_file(tmpl_path));
  EXPECT_EQ(props["chat_template_tool_format"], "none");
  EXPECT_EQ(props["bos_token"], "<s>");

  // The template file is what renders the prompt.
  const json msgs = {{{"role", "user"}, {"content", "A cat"}}};
  const json t = post_json(*r.cli, "/tokenize", {{"content", "[user] A cat\n[assistant]"}}, 200);
  json req = {{"messages", msgs}, {"max_tokens", 16}, {"logit_bias", kNoEos}};
  const json a = post_json(*r.cli, "/v1/chat/completions", req, 200);
  EXPECT_EQ(a["model"], "storyteller");
  EXPECT_EQ(a["usage"]["prompt_tokens"], t["tokens"].size() + 1);  // + BOS
  // Greedy by default: other seeds give the same text; a request's own temperature wins.
  req["seed"] = 12345;
  const json b = post_json(*r.cli, "/v1/chat/completions", req, 200);
  EXPECT_EQ(a["choices"][0]["message"]["content"], b["choices"][0]["message"]["content"]);
  std::set<std::string> texts;
  for (int seed = 0; seed < 4; ++seed) {
    json hot = req;
    hot["temperature"] = 2.0;
    hot["top_k"] = 0;
    hot["seed"] = seed;
    texts.insert(
        post_json(*r.cli, "/v1/chat/completions", hot, 200)["choices"][0]["message"]["content"]
            .get<std::string>());
  }
  EXPECT_GT(texts.size(), 1u) << "temperature 2 from the request did not apply";

  // cached_tokens: the same prompt again finds its KV rows in the slot, all but the last
  // token (whose logits give the first sampled token). The hot requests shared the prompt too.
  EXPECT_EQ(b["usage"]["prompt_tokens_details"]["cached_tokens"],
            b["usage"]["prompt_tokens"].get<int>() - 1);
  EXPECT_EQ(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  const json again = post_json(*r.cli, "/v1/chat/completions", req, 200);
  const int n_prompt = again["usage"]["prompt_tokens"];
  EXPECT_EQ(again["usage"]["prompt_tokens_details"]["cached_tokens"], n_prompt - 1)
      << again["usage"].dump();
}

TEST(Server, BadChatTemplateFileFailsTheLoad) {
  ServerOptions o;
  o.chat_template_file = testing::temp_dir() + "/missing.jinja";
  o.model_path = testing::model_path("stories260K.gguf");
  o.host = "127.0.0.1";
  o.port = 0;
  HttpServer srv(o);
  ASSERT_TRUE(srv.start().is_ok());
  Status st = srv.load();
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("missing.jinja"), std::string::npos) << st.message();
  srv.stop();
}

TEST(Server, StopEndsInFlightStreamsCleanly) {
  Running r = start({});
  std::thread t([&] {
    httplib::Client c("127.0.0.1", r.srv->port());
    c.set_read_timeout(30, 0);
    auto res = c.Post(
        "/v1/completions",
        json{{"prompt", "Once"}, {"max_tokens", 200}, {"stream", true}, {"logit_bias", kNoEos}}
            .dump(),
        "application/json");
    // Either the stream ended with finish_reason "cancelled" + [DONE], or the connection closed.
    if (res && res->status == 200) {
      const Sse s = parse_sse(res->body, false);
      if (s.done) EXPECT_TRUE(s.finish == "cancelled" || s.finish == "length") << s.finish;
    }
  });
  std::this_thread::sleep_for(30ms);
  r.srv->stop();
  t.join();
  r.srv->stop();  // idempotent
}

// A tensor-parallel backend (two CPU ranks, backend/tp_group.h) through the runtime's
// options (--device cpu --tensor-parallel 2): the scheduler's batched steps run on both ranks
// and serve the same greedy text as one backend, for several concurrent requests.
TEST(Server, TensorParallelBackendServesTheSameText) {
  auto complete = [](bool tp) {
    ServerOptions o;
    o.model_path = testing::model_path("stories260K.gguf");
    if (tp) {
      o.engine.device = Device::Cpu;
      o.engine.tensor_parallel = 2;
    }
    Running r = start(o);
    const json models = json::parse(r.cli->Get("/v1/models")->body);
    EXPECT_EQ(models["data"][0]["meta"]["backend"], tp ? "cpu x2" : "cpu") << models.dump();
    std::vector<std::string> texts(3);
    std::vector<std::thread> clients;
    for (int i = 0; i < 3; ++i)
      clients.emplace_back([&, i] {
        auto cli = std::make_unique<httplib::Client>("127.0.0.1", r.srv->port());
        cli->set_read_timeout(30, 0);
        const json c = post_json(*cli, "/v1/completions",
                                 {{"prompt", i == 1 ? "Lily had a dog" : "Once upon a time"},
                                  {"max_tokens", 16},
                                  {"temperature", 0}},
                                 200);
        texts[static_cast<size_t>(i)] = c["choices"][0]["text"].get<std::string>();
      });
    for (std::thread& t : clients) t.join();
    return texts;
  };
  const std::vector<std::string> one = complete(false), two = complete(true);
  EXPECT_FALSE(one[0].empty());
  EXPECT_EQ(one, two);
}

}  // namespace
}  // namespace kiln::server

namespace kiln::server {
namespace {

// `kiln serve --expert-cap N` streams a MoE model's experts through the slab cache; the text a
// greedy request gets is the same as with the experts mapped (the store's identity contract).
TEST(Server, ExpertStreamingServesTheSameText) {
  auto complete = [](const moe::StoreConfig& experts) {
    ServerOptions o;
    o.model_path = testing::model_path("qwen3moe-q4_k_m.gguf");
    o.engine.experts = experts;
    Running r = start(o);
    const json c =
        post_json(*r.cli, "/v1/completions",
                  {{"prompt", "Once upon a time"}, {"max_tokens", 12}, {"temperature", 0}}, 200);
    return c["choices"][0]["text"].get<std::string>();
  };
  const std::string mapped = complete({});
  EXPECT_FALSE(mapped.empty());
  moe::StoreConfig capped;
  capped.cap = 2;
  const uint64_t misses_before = process_counters().counter("moe.expert_misses").value();
  EXPECT_EQ(complete(capped), mapped);
  EXPECT_GT(process_counters().counter("moe.expert_misses").value(), misses_before)
      << "the capped server did not go through the expert store";
}

}  // namespace
}  // namespace kiln::server
