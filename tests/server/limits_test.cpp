// tests/server/limits_test.cpp: the connection layer and size limits of the HTTP server
// (server/connections.h, server/limits.h) against raw sockets: 500 never-finished headers
// (from 50 addresses, and from one) do not stop a normal client, the header, body and idle
// timeouts, the 431 header cap, the per-client and total connection caps, keep-alive's request
// count with pipelined requests, the response cap for whole bodies and streams, and the
// constant-time API-key comparison.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/testdata.h"
#include "server/auth.h"
#include "server/server.h"

namespace kiln::server {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

std::unique_ptr<HttpServer> start_server(ServerOptions o) {
  o.model_path = testing::model_path("stories260K.gguf");
  o.host = "127.0.0.1";
  o.port = 0;
  o.engine.threads = 1;
  o.n_ctx = 256;
  auto srv = std::make_unique<HttpServer>(o);
  Status st = srv->start();
  EXPECT_TRUE(st.is_ok()) << st.message();
  st = srv->load();
  EXPECT_TRUE(st.is_ok()) << st.message();
  return srv;
}

// A TCP connection to the server from `source` (any 127.x.y.z address is loopback), or -1.
int connect_from(const char* source, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in src{};
  src.sin_family = AF_INET;
  ::inet_pton(AF_INET, source, &src.sin_addr);
  sockaddr_in dst{};
  dst.sin_family = AF_INET;
  dst.sin_port = htons(uint16_t(port));
  ::inet_pton(AF_INET, "127.0.0.1", &dst.sin_addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof src) != 0 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof dst) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool send_all(int fd, const std::string& s) {
  size_t at = 0;
  while (at < s.size()) {
    const ssize_t n = ::send(fd, s.data() + at, s.size() - at, MSG_NOSIGNAL);
    if (n <= 0) return false;
    at += size_t(n);
  }
  return true;
}

// Everything the server sends until it closes the connection or `limit` passes.
struct Received {
  std::string bytes;
  bool closed = false;  // EOF or reset seen
};
Received receive_until_close(int fd, std::chrono::milliseconds limit) {
  Received r;
  const auto end = Clock::now() + limit;
  char buf[4096];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now());
    if (left.count() <= 0) return r;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, int(left.count())) <= 0) return r;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) {
      r.closed = true;
      return r;
    }
    r.bytes.append(buf, size_t(n));
  }
}

int count_of(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

// A normal client's completion, timed.
double timed_completion(int port, std::string* text) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(30, 0);
  const auto t0 = Clock::now();
  auto res =
      c.Post("/v1/completions",
             json{{"prompt", "Once upon a time"}, {"max_tokens", 8}, {"temperature", 0}}.dump(),
             "application/json");
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_TRUE(res);
  if (res) {
    EXPECT_EQ(res->status, 200) << res->body;
    if (text) *text = json::parse(res->body)["choices"][0]["text"];
  }
  return s;
}

double metric(int port, const std::string& name) {
  httplib::Client c("127.0.0.1", port);
  auto res = c.Get("/metrics");
  if (!res) return -1;
  const std::string key = "\nkiln_" + name + " ";
  const size_t at = ("\n" + res->body).find(key);
  if (at == std::string::npos) return -1;
  return std::stod(res->body.substr(at + key.size() - 1));
}

// Issue 37: 80 never-finished headers used to stall the server (every pool thread blocked
// reading one). 500 of them, from 50 addresses so that none hits the per-client cap, now wait
// in the waiting room, and a normal client is served within a second.
TEST(ServerLimits, FiveHundredSlowHeadersDoNotStopANormalClient) {
  ServerOptions o;
  o.limits.header_timeout_ms = 60'000;  // none may time out while the 500 connect on a busy box
  auto srv = start_server(o);
  std::string alone;
  timed_completion(srv->port(), &alone);
  std::vector<int> slow;
  for (int i = 0; i < 500; ++i) {
    const std::string src = "127.0.1." + std::to_string(1 + i % 50);
    const int fd = connect_from(src.c_str(), srv->port());
    ASSERT_GE(fd, 0) << "connect " << i << " from " << src;
    ASSERT_TRUE(send_all(fd, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty"));
    slow.push_back(fd);
  }
  // Every one of them is admitted and waits without a thread.
  for (int i = 0; i < 100 && metric(srv->port(), "http_connections_waiting") < 500; ++i)
    std::this_thread::sleep_for(20ms);
  EXPECT_GE(metric(srv->port(), "http_connections_waiting"), 500);
  std::string text;
  const double s = timed_completion(srv->port(), &text);
  EXPECT_LT(s, 1.0) << "a normal client waited " << s << " s behind 500 slow connections";
  EXPECT_EQ(text, alone);
  for (int fd : slow) ::close(fd);
}

// The same 500 from one address: the per-client cap admits 128 and answers the rest 503 at
// once; a client from another address is served within a second.
TEST(ServerLimits, OneAddressIsHeldToItsConnectionCap) {
  ServerOptions o;
  o.limits.header_timeout_ms = 60'000;
  auto srv = start_server(o);
  std::vector<int> slow;
  int refused = 0;
  for (int i = 0; i < 500; ++i) {
    const int fd = connect_from("127.0.2.1", srv->port());
    ASSERT_GE(fd, 0);
    send_all(fd, "GET /health HTTP/1.1\r\nHo");
    slow.push_back(fd);
  }
  for (int fd : slow) {
    const Received r = receive_until_close(fd, 5ms);
    if (r.bytes.rfind("HTTP/1.1 503", 0) == 0) {
      ++refused;
      EXPECT_NE(r.bytes.find("max_connections_per_client)"), std::string::npos) << r.bytes;
      EXPECT_NE(r.bytes.find("Retry-After: 1"), std::string::npos) << r.bytes;
    }
  }
  EXPECT_GE(metric(srv->port(), "http_connections_refused_total"), 372);
  EXPECT_GE(refused, 300) << "most refusals should reach the client before the close";
  EXPECT_LT(timed_completion(srv->port(), nullptr), 1.0);
  for (int fd : slow) ::close(fd);
}

TEST(ServerLimits, TotalConnectionCap) {
  ServerOptions o;
  o.limits.max_connections = 5;
  auto srv = start_server(o);
  std::vector<int> held;
  for (int i = 0; i < 5; ++i) {
    const std::string src = "127.0.3." + std::to_string(1 + i);
    held.push_back(connect_from(src.c_str(), srv->port()));
    ASSERT_GE(held.back(), 0);
  }
  // (Not /metrics: it would need a connection of its own.) Give the listen thread a moment
  // to admit the five.
  std::this_thread::sleep_for(100ms);
  const int extra = connect_from("127.0.3.99", srv->port());
  ASSERT_GE(extra, 0);
  const Received r = receive_until_close(extra, 2000ms);
  EXPECT_EQ(r.bytes.rfind("HTTP/1.1 503", 0), 0u) << r.bytes;
  EXPECT_NE(r.bytes.find("--limits max_connections)"), std::string::npos) << r.bytes;
  EXPECT_TRUE(r.closed);
  ::close(extra);
  for (int fd : held) ::close(fd);
  // Once they close, clients are served again.
  bool served = false;
  for (int i = 0; i < 100 && !served; ++i) {
    httplib::Client c("127.0.0.1", srv->port());
    auto h = c.Get("/health");
    served = h && h->status == 200;
    if (!served) std::this_thread::sleep_for(20ms);
  }
  EXPECT_TRUE(served);
}

TEST(ServerLimits, HeaderTimeoutAnswers408AndClosed) {
  ServerOptions o;
  o.limits.header_timeout_ms = 300;
  auto srv = start_server(o);
  const int fd = connect_from("127.0.0.1", srv->port());
  ASSERT_GE(fd, 0);
  // A byte now and then does not extend the deadline (slowloris).
  const auto t0 = Clock::now();
  send_all(fd, "GET /health HTTP/1.1\r\n");
  for (int i = 0; i < 4; ++i) {
    std::this_thread::sleep_for(100ms);
    send_all(fd, "X");
  }
  const Received r = receive_until_close(fd, 3000ms);
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_EQ(r.bytes.rfind("HTTP/1.1 408", 0), 0u) << r.bytes;
  EXPECT_NE(r.bytes.find("header_timeout"), std::string::npos) << r.bytes;
  EXPECT_TRUE(r.closed);
  EXPECT_LT(s, 1.5);
  ::close(fd);
  EXPECT_GE(metric(srv->port(), "http_header_timeouts_total"), 1);
}

TEST(ServerLimits, OversizedHeaderGets431) {
  ServerOptions o;
  o.limits.max_header_bytes = 4 << 10;
  auto srv = start_server(o);
  const int fd = connect_from("127.0.0.1", srv->port());
  ASSERT_GE(fd, 0);
  std::string req = "GET /health HTTP/1.1\r\n";
  for (int i = 0; i < 200; ++i)
    req += "X-Pad-" + std::to_string(i) + ": " + std::string(40, 'a') + "\r\n";
  send_all(fd, req);
  const Received r = receive_until_close(fd, 3000ms);
  EXPECT_EQ(r.bytes.rfind("HTTP/1.1 431", 0), 0u) << r.bytes;
  EXPECT_NE(r.bytes.find("--limits max_header_kib"), std::string::npos) << r.bytes;
  ::close(fd);
  // A header under the cap is served.
  httplib::Client c("127.0.0.1", srv->port());
  auto h = c.Get("/health", {{"X-Pad", std::string(2000, 'b')}});
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
}

TEST(ServerLimits, SlowBodyIsCutAtTheBodyTimeout) {
  ServerOptions o;
  o.limits.body_timeout_ms = 300;
  auto srv = start_server(o);
  const int fd = connect_from("127.0.0.1", srv->port());
  ASSERT_GE(fd, 0);
  const auto t0 = Clock::now();
  send_all(fd,
           "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           "Content-Length: 100\r\n\r\n{\"content\":");
  const Received r = receive_until_close(fd, 3000ms);
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_TRUE(r.closed);
  EXPECT_LT(s, 1.5);
  EXPECT_EQ(r.bytes.find("HTTP/1.1 200"), std::string::npos) << r.bytes;
  ::close(fd);
  EXPECT_LT(timed_completion(srv->port(), nullptr), 1.0);
}

// Pipelined requests are answered in order from the bytes already read (nothing is lost
// between requests); the connection closes after --keep-alive-max of them.
TEST(ServerLimits, KeepAliveMaxAndPipelining) {
  ServerOptions o;
  o.limits.keep_alive_max_requests = 3;
  auto srv = start_server(o);
  const int fd = connect_from("127.0.0.1", srv->port());
  ASSERT_GE(fd, 0);
  std::string four;
  for (int i = 0; i < 4; ++i) four += "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
  send_all(fd, four);
  const Received r = receive_until_close(fd, 3000ms);
  EXPECT_EQ(count_of(r.bytes, "HTTP/1.1 200"), 3) << r.bytes;
  EXPECT_EQ(count_of(r.bytes, "Connection: close"), 1) << r.bytes;
  EXPECT_TRUE(r.closed);
  ::close(fd);
}

TEST(ServerLimits, IdleKeptAliveConnectionIsClosed) {
  ServerOptions o;
  o.limits.idle_timeout_ms = 300;
  auto srv = start_server(o);
  const int fd = connect_from("127.0.0.1", srv->port());
  ASSERT_GE(fd, 0);
  send_all(fd, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  const auto t0 = Clock::now();
  const Received r = receive_until_close(fd, 3000ms);
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_EQ(count_of(r.bytes, "HTTP/1.1 200"), 1) << r.bytes;
  EXPECT_TRUE(r.closed);
  EXPECT_GT(s, 0.25);
  EXPECT_LT(s, 1.5);
  ::close(fd);
}

TEST(ServerLimits, ResponseCapRefusesWholeBodiesAndCutsStreams) {
  ServerOptions o;
  o.limits.max_response_bytes = 4 << 10;
  auto srv = start_server(o);
  httplib::Client c("127.0.0.1", srv->port());
  c.set_read_timeout(30, 0);
  auto small = c.Post("/tokenize", json{{"content", "hello"}}.dump(), "application/json");
  ASSERT_TRUE(small);
  EXPECT_EQ(small->status, 200);
  auto big =
      c.Post("/tokenize",
             json{{"content", std::string(8000, 'a') + " once upon"}, {"with_pieces", true}}.dump(),
             "application/json");
  ASSERT_TRUE(big);
  EXPECT_EQ(big->status, 500) << big->body.substr(0, 200);
  EXPECT_NE(big->body.find("--limits max_response_kib"), std::string::npos) << big->body;
  // A stream of 200 tokens with logprobs passes 4 KiB: it is cut, without [DONE].
  std::string body;
  httplib::Client s("127.0.0.1", srv->port());
  s.set_read_timeout(30, 0);
  auto st = s.Post("/v1/completions",
                   json{{"prompt", "Once"},
                        {"max_tokens", 200},
                        {"stream", true},
                        {"logprobs", 5},
                        {"logit_bias", {{"2", -100}}}}
                       .dump(),
                   "application/json");
  if (st) body = st->body;
  EXPECT_EQ(body.find("[DONE]"), std::string::npos);
  EXPECT_LT(body.size(), size_t(8 << 10));
  // The server lives on.
  EXPECT_LT(timed_completion(srv->port(), nullptr), 1.0);
}

TEST(ServerLimits, ApiKeyComparisonIsExact) {
  EXPECT_TRUE(constant_time_equal("", ""));
  EXPECT_TRUE(constant_time_equal("sekrit", "sekrit"));
  EXPECT_FALSE(constant_time_equal("sekrit", "sekriT"));
  EXPECT_FALSE(constant_time_equal("sekrit", "sekri"));
  EXPECT_FALSE(constant_time_equal("sekri", "sekrit"));
  EXPECT_FALSE(constant_time_equal(std::string("a\0b", 3), std::string("a\0c", 3)));
  EXPECT_FALSE(constant_time_equal("abc", std::string("abc\0", 4)));
  EXPECT_TRUE(bearer_matches("Bearer k1", "k1"));
  EXPECT_FALSE(bearer_matches("bearer k1", "k1"));
  EXPECT_FALSE(bearer_matches("Bearer k1 ", "k1"));
  EXPECT_FALSE(bearer_matches("Bearer ", "k1"));
  EXPECT_FALSE(bearer_matches("k1", "k1"));
}

}  // namespace
}  // namespace kiln::server
