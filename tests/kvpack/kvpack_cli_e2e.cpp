// tests/kvpack/kvpack_cli_e2e.cpp: the `kiln` binary end to end. `kv save` + `kv load` give the
// ids `kiln run` gives for the same text; `kv info` verifies a pack and rejects a damaged one
// with one line; `serve --role prefill` + `kv remote` over TCP and UCX on loopback give the
// local ids; a stalled peer falls back with one notice line and the same ids; and the two
// roles in two network namespaces joined by a veth pair (needs root and `ip netns`; skipped
// with the reason otherwise).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>

#include <nlohmann/json.hpp>

#include "common/testdata.h"
#include "transfer/transport.h"

extern char** environ;

namespace kiln {
namespace {

const std::string kPrompt = "Once upon a time, there was a little girl named Lily";

struct Proc {
  int rc = -1;
  std::string out, err;
};

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// Starts argv[0] (searched in PATH) with stdout/stderr to files under `dir`; returns the pid.
pid_t spawn(std::vector<std::string> args, const std::string& out, const std::string& err) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawnp(&pid, argv[0], &fa, nullptr, argv.data(), environ) != 0) pid = -1;
  posix_spawn_file_actions_destroy(&fa);
  return pid;
}

Proc run(std::vector<std::string> args) {
  static const std::string dir = testing::temp_dir();
  Proc p;
  const pid_t pid = spawn(std::move(args), dir + "/out", dir + "/err");
  if (pid < 0) return p;
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFEXITED(status)) p.rc = WEXITSTATUS(status);
  p.out = slurp(dir + "/out");
  p.err = slurp(dir + "/err");
  return p;
}
Proc kiln(std::vector<std::string> args) {
  args.insert(args.begin(), testing::kiln_binary());
  return run(std::move(args));
}

std::string ids_hash(const std::string& err) {
  std::smatch m;
  if (std::regex_search(err, m, std::regex("ids xxh64 ([0-9a-f]{16})"))) return m[1];
  return "";
}

// `kiln serve --role prefill` in the background (optionally under `prefix`, e.g. ip netns
// exec); stopped with SIGTERM when destroyed.
struct PrefillNode {
  pid_t pid = -1;
  std::string log;
  // kv_serve: the HTTP-less `kiln kv serve` instead of `kiln serve --role prefill`.
  PrefillNode(std::vector<std::string> prefix, const std::string& host, int port,
              const std::string& transport, bool kv_serve = false) {
    static const std::string dir = testing::temp_dir();
    log = dir + "/prefill-" + transport + (kv_serve ? "-kv" : "") + ".log";
    std::vector<std::string> args = std::move(prefix);
    const std::vector<std::string> tail = kv_serve
                                              ? std::vector<std::string>{testing::kiln_binary(),
                                                                         "kv",
                                                                         "serve",
                                                                         "--host",
                                                                         host,
                                                                         "--kv-port",
                                                                         std::to_string(port),
                                                                         "--transport",
                                                                         transport}
                                              : std::vector<std::string>{testing::kiln_binary(),
                                                                         "serve",
                                                                         "--role",
                                                                         "prefill",
                                                                         "--host",
                                                                         host,
                                                                         "--kv-port",
                                                                         std::to_string(port),
                                                                         "--kv-transport",
                                                                         transport};
    args.insert(args.end(), tail.begin(), tail.end());
    pid = spawn(args, dir + "/prefill.out", log);
  }
  // The port it listens on, once its "listening on" line appears (0 if it never does).
  int wait_port() {
    for (int i = 0; i < 200; ++i) {
      std::smatch m;
      const std::string text = slurp(log);
      if (std::regex_search(text, m, std::regex("listening on \\w+ [^ ]+:(\\d+)")))
        return std::stoi(m[1]);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return 0;
  }
  ~PrefillNode() {
    if (pid <= 0) return;
    kill(pid, SIGTERM);
    int status = 0;
    waitpid(pid, &status, 0);
  }
};

std::string local_hash() {
  static const std::string h = [] {
    Proc p = kiln({"run", "-p", kPrompt, "-n", "24", "--temp", "0"});
    EXPECT_EQ(p.rc, 0) << p.err;
    return ids_hash(p.err);
  }();
  return h;
}

TEST(KvCli, SaveLoadContinuesLikeRun) {
  const std::string pack = testing::temp_dir() + "/s.kvpack";
  Proc s = kiln({"kv", "save", "-p", "Once upon a time, there was a little girl", "-o", pack});
  ASSERT_EQ(s.rc, 0) << s.err;
  Proc l = kiln({"kv", "load", "-i", pack, "-p", " named Lily", "-n", "24"});
  ASSERT_EQ(l.rc, 0) << l.err;
  ASSERT_FALSE(local_hash().empty());
  EXPECT_EQ(ids_hash(l.err), local_hash()) << l.err;
  Proc info = kiln({"kv", "info", "-i", pack});
  ASSERT_EQ(info.rc, 0) << info.err;
  EXPECT_NE(info.out.find("verified"), std::string::npos) << info.out;

  // A damaged copy: info and load refuse it with one line each.
  std::string bytes = slurp(pack);
  bytes[bytes.size() / 2] ^= 0x10;
  const std::string bad = pack + ".bad";
  std::ofstream(bad, std::ios::binary) << bytes;
  for (std::string cmd : {"info", "load"}) {
    std::vector<std::string> args = {"kv", cmd, "-i", bad};
    if (cmd == "load") args.insert(args.end(), {"-p", " x"});
    Proc p = kiln(args);
    EXPECT_EQ(p.rc, 1) << cmd;
    EXPECT_EQ(std::count(p.err.begin(), p.err.end(), '\n'), 1) << p.err;
    EXPECT_NE(p.err.find("checksum"), std::string::npos) << p.err;
  }
  // A pack of another model.
  Proc other = kiln(
      {"kv", "load", "-m", testing::model_path("stories260K-q8_0.gguf"), "-i", pack, "-p", " x"});
  EXPECT_EQ(other.rc, 1);
  EXPECT_NE(other.err.find("model fingerprint"), std::string::npos) << other.err;
}

void remote_same_as_local(const std::string& transport, bool kv_serve = false) {
  PrefillNode node({}, "127.0.0.1", 0, transport, kv_serve);
  const int port = node.wait_port();
  ASSERT_GT(port, 0) << slurp(node.log);
  Proc d = kiln({"kv", "remote", "--prefill-peer", "127.0.0.1:" + std::to_string(port),
                 "--transport", transport, "-p", kPrompt, "-n", "24"});
  ASSERT_EQ(d.rc, 0) << d.err;
  EXPECT_EQ(d.err.find("notice"), std::string::npos) << d.err;
  EXPECT_NE(d.err.find("remote prefill + transfer"), std::string::npos) << d.err;
  EXPECT_EQ(ids_hash(d.err), local_hash()) << d.err;
}

TEST(KvCli, RemotePrefillTcpLoopback) { remote_same_as_local("tcp"); }
// The same through `kiln kv serve`, the prefill node of builds without the HTTP server.
TEST(KvCli, KvServeNodeTcpLoopback) { remote_same_as_local("tcp", /*kv_serve=*/true); }
TEST(KvCli, RemotePrefillUcxLoopback) {
  if (!transfer::ucx_built()) GTEST_SKIP() << "built without UCX";
  remote_same_as_local("ucx");
}

// `kiln serve --role decode --prefill-peer`: an HTTP completion whose prompt was prefilled
// by the prefill node answers what `kiln run` prints.
TEST(KvCli, ServeDecodeRoleUsesThePrefillNode) {
  PrefillNode node({}, "127.0.0.1", 0, "tcp");
  const int kv_port = node.wait_port();
  ASSERT_GT(kv_port, 0) << slurp(node.log);
  const std::string dir = testing::temp_dir();
  const pid_t dec =
      spawn({testing::kiln_binary(), "serve", "--role", "decode", "--port", "0", "--prefill-peer",
             "127.0.0.1:" + std::to_string(kv_port), "--log-level", "info"},
            dir + "/dec.out", dir + "/dec.err");
  ASSERT_GT(dec, 0);
  int http_port = 0;
  for (int i = 0; i < 200 && !http_port; ++i) {
    std::smatch m;
    const std::string text = slurp(dir + "/dec.err");
    if (text.find("ready") != std::string::npos &&
        std::regex_search(text, m, std::regex("http://[0-9.]+:(\\d+)")))
      http_port = std::stoi(m[1]);
    else
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GT(http_port, 0) << slurp(dir + "/dec.err");
  httplib::Client cli("127.0.0.1", http_port);
  nlohmann::json req = {{"prompt", kPrompt}, {"max_tokens", 24}, {"temperature", 0}};
  auto res = cli.Post("/v1/completions", req.dump(), "application/json");
  kill(dec, SIGTERM);
  int status = 0;
  waitpid(dec, &status, 0);
  ASSERT_TRUE(res) << "no HTTP answer";
  ASSERT_EQ(res->status, 200) << res->body;
  const std::string text = nlohmann::json::parse(res->body)["choices"][0]["text"];
  Proc local = kiln({"run", "-p", kPrompt, "-n", "24", "--temp", "0"});
  EXPECT_EQ(text, local.out);
  const std::string log = slurp(dir + "/dec.err");
  EXPECT_NE(log.find("remote prefill of 14 tokens"), std::string::npos) << log;
  EXPECT_EQ(log.find("notice"), std::string::npos) << log;
}

TEST(KvCli, StalledPeerFallsBackWithOneNotice) {
  // A listener that accepts (the kernel does) but never answers.
  auto l = transfer::tcp_listen("127.0.0.1", 0);
  ASSERT_TRUE(l.has_value()) << l.error();
  Proc d = kiln({"kv", "remote", "--prefill-peer", "127.0.0.1:" + std::to_string((*l)->port()),
                 "--timeout-ms", "300", "-p", kPrompt, "-n", "24"});
  ASSERT_EQ(d.rc, 0) << d.err;
  std::smatch m;
  EXPECT_TRUE(std::regex_search(d.err, m,
                                std::regex("notice: remote prefill from .* timed out.*"
                                           "prefilling locally\n")))
      << d.err;
  EXPECT_EQ(ids_hash(d.err), local_hash());
}

// A TCP relay between the decode node and a real prefill node: it forwards both directions
// byte for byte and, once `kill_after` bytes of the node's answer ("KVOK" + kvpack stream)
// have gone through, SIGKILLs the node process. It then relays whatever the dead node's socket
// still yields (what its kernel had queued) and its end of stream, so the decode node sees
// exactly what a peer dying at that point would leave: no bytes are dropped or invented here.
// The upstream receive buffer is kept small so the node cannot run far ahead of the relay.
class KillingRelay {
 public:
  KillingRelay(int upstream_port, pid_t node, uint64_t kill_after)
      : upstream_port_(upstream_port), node_(node), kill_after_(kill_after) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
        ::listen(listen_fd_, 1) == 0 &&
        ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0)
      port_ = ntohs(a.sin_port);
    if (port_ > 0) thread_ = std::thread([this] { serve_one(); });
  }
  ~KillingRelay() {
    ::shutdown(listen_fd_, SHUT_RDWR);
    if (thread_.joinable()) thread_.join();
    ::close(listen_fd_);
  }
  int port() const { return port_; }
  // After the decode node's process ended: bytes of the answer that reached it, whether the
  // node was killed, and how it ended (waitpid status; valid once killed).
  uint64_t delivered() {
    if (thread_.joinable()) thread_.join();
    return delivered_;
  }
  bool killed() const { return killed_; }
  int node_status() const { return node_status_; }

 private:
  static bool send_all(int fd, const char* p, size_t n) {
    while (n > 0) {
      const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
      if (w <= 0) return false;
      p += w;
      n -= size_t(w);
    }
    return true;
  }
  void serve_one() {
    const int down = ::accept(listen_fd_, nullptr, nullptr);
    if (down < 0) return;
    const int up = ::socket(AF_INET, SOCK_STREAM, 0);
    const int small = 4096;
    ::setsockopt(up, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(uint16_t(upstream_port_));
    if (::connect(up, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(up);
      ::close(down);
      return;
    }
    // decode -> node: the request and the acknowledgement; its end ends the relay.
    std::thread request([&] {
      char buf[4096];
      for (ssize_t n; (n = ::recv(down, buf, sizeof buf, 0)) > 0;)
        if (!send_all(up, buf, size_t(n))) break;
      ::shutdown(up, SHUT_WR);
    });
    // node -> decode, killing the node once kill_after bytes went through.
    std::vector<char> buf(4096);
    for (;;) {
      size_t want = buf.size();
      if (!killed_ && kill_after_ > 0) want = std::min<uint64_t>(want, kill_after_ - delivered_);
      const ssize_t n = ::recv(up, buf.data(), want, 0);
      if (n <= 0) break;  // end of stream, or a reset from the dead node
      if (!send_all(down, buf.data(), size_t(n))) break;
      delivered_ += uint64_t(n);
      if (!killed_ && kill_after_ > 0 && delivered_ >= kill_after_) {
        ::kill(node_, SIGKILL);
        ::waitpid(node_, &node_status_, 0);
        killed_ = true;
      }
    }
    ::shutdown(down, SHUT_WR);
    request.join();
    ::close(up);
    ::close(down);
  }

  int listen_fd_ = -1, port_ = 0, upstream_port_;
  pid_t node_;
  uint64_t kill_after_, delivered_ = 0;
  bool killed_ = false;
  int node_status_ = 0;
  std::thread thread_;
};

// Issue 37, point 5: the prefill peer dying mid-transfer. A real `kiln kv serve` process is
// SIGKILLed after 2,000 bytes of its kvpack stream reached the decode node (`kiln kv remote`,
// another process); the decode node falls back to a local prefill with one notice line and
// generates the ids of a run without a peer. The same relay without the kill first shows the
// relay itself is transparent and gives the full size of the answer, so the test can check
// that the killed node's stream really ended short.
TEST(KvCli, PrefillNodeKilledMidStreamFallsBack) {
  // A long prompt in chunks of 4 tokens, so the node is still computing when it is killed.
  std::string long_prompt;
  for (int i = 0; i < 24; ++i) long_prompt += (i ? " " : "") + kPrompt + ".";
  Proc local = kiln({"kv", "remote", "--local", "-p", long_prompt, "-n", "24"});
  ASSERT_EQ(local.rc, 0) << local.err;
  const std::string want = ids_hash(local.err);
  ASSERT_FALSE(want.empty()) << local.err;

  const std::string dir = testing::temp_dir();
  auto start_node = [&](const std::string& tag, int* port) {
    const std::string log = dir + "/kill-node-" + tag + ".log";
    const pid_t pid = spawn({testing::kiln_binary(), "kv", "serve", "--host", "127.0.0.1",
                             "--kv-port", "0", "--prefill-chunk", "4"},
                            dir + "/kill-node.out", log);
    *port = 0;
    for (int i = 0; i < 200 && pid > 0 && *port == 0; ++i) {
      std::smatch m;
      const std::string text = slurp(log);
      if (std::regex_search(text, m, std::regex("listening on \\w+ [^ ]+:(\\d+)")))
        *port = std::stoi(m[1]);
      else
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return pid;
  };
  auto decode_through = [&](int relay_port) {
    return kiln({"kv", "remote", "--prefill-peer", "127.0.0.1:" + std::to_string(relay_port),
                 "--timeout-ms", "20000", "-p", long_prompt, "-n", "24"});
  };

  // Through the relay, nothing killed: the remote path works and the answer's size is known.
  int port = 0;
  const pid_t whole_node = start_node("whole", &port);
  ASSERT_GT(whole_node, 0);
  ASSERT_GT(port, 0);
  uint64_t full = 0;
  {
    KillingRelay relay(port, whole_node, /*kill_after=*/0);
    ASSERT_GT(relay.port(), 0);
    Proc d = decode_through(relay.port());
    full = relay.delivered();
    kill(whole_node, SIGTERM);
    waitpid(whole_node, nullptr, 0);
    ASSERT_EQ(d.rc, 0) << d.err;
    EXPECT_EQ(d.err.find("notice"), std::string::npos) << d.err;
    EXPECT_NE(d.err.find("remote prefill + transfer"), std::string::npos) << d.err;
    EXPECT_EQ(ids_hash(d.err), want) << d.err;
  }
  ASSERT_GT(full, 20000u) << "the answer is too small to be cut mid-stream";

  // The same, the node killed after 2,000 bytes of its answer.
  const pid_t node = start_node("killed", &port);
  ASSERT_GT(node, 0);
  ASSERT_GT(port, 0);
  KillingRelay relay(port, node, /*kill_after=*/2000);
  ASSERT_GT(relay.port(), 0);
  Proc d = decode_through(relay.port());
  const uint64_t got = relay.delivered();
  if (!relay.killed()) {
    kill(node, SIGKILL);
    waitpid(node, nullptr, 0);
  }
  ASSERT_TRUE(relay.killed()) << "the node's answer ended before 2,000 bytes: " << got;
  EXPECT_TRUE(WIFSIGNALED(relay.node_status()) && WTERMSIG(relay.node_status()) == SIGKILL);
  EXPECT_GE(got, 2000u);
  EXPECT_LT(got, full) << "the node finished its stream before the kill landed";
  ASSERT_EQ(d.rc, 0) << d.err;
  std::smatch m;
  EXPECT_TRUE(std::regex_search(
      d.err, m,
      std::regex("notice: remote prefill from tcp 127\\.0\\.0\\.1:\\d+ failed \\([^\n]*"
                 "\\); prefilling locally\n")))
      << d.err;
  EXPECT_EQ(std::count(d.err.begin(), d.err.end(), '\n'), 3) << d.err;  // notice, stats, ids
  EXPECT_NE(d.err.find("local prefill"), std::string::npos) << d.err;
  EXPECT_EQ(ids_hash(d.err), want) << d.err;
  std::printf("[kvpack] prefill node killed after %llu of %llu bytes: %s", (unsigned long long)got,
              (unsigned long long)full, d.err.substr(0, d.err.find('\n') + 1).c_str());
}

TEST(KvCli, BadRoleOptionsAreOneLineErrors) {
  for (std::vector<std::string> args :
       {std::vector<std::string>{"serve", "--role", "relay"},
        std::vector<std::string>{"serve", "--role", "decode"},
        std::vector<std::string>{"serve", "--prefill-peer", "h:1"},
        std::vector<std::string>{"serve", "--role", "decode", "--prefill-peer", "nohost"},
        std::vector<std::string>{"kv", "remote", "-p", "x", "--prefill-peer", "h:1", "--transport",
                                 "smoke"}}) {
    Proc p = kiln(args);
    EXPECT_EQ(p.rc, 1) << args[1];
    EXPECT_EQ(std::count(p.err.begin(), p.err.end(), '\n'), 1) << p.err;
  }
}

// Two namespaces joined by a veth pair: the prefill role in one, the decode node in the other.
class NetNs : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "network namespaces need root";
    const std::string tag = std::to_string(getpid() % 100000);
    a_ = "kvpa" + tag;
    b_ = "kvpb" + tag;
    if (run({"ip", "netns", "add", a_}).rc != 0)
      GTEST_SKIP() << "`ip netns add` not permitted here (no CAP_SYS_ADMIN or no iproute2)";
    made_a_ = true;
    made_b_ = run({"ip", "netns", "add", b_}).rc == 0;
    const std::string va = "kva" + tag, vb = "kvb" + tag;
    for (std::vector<std::string> cmd :
         {std::vector<std::string>{"ip", "link", "add", va, "type", "veth", "peer", "name", vb},
          {"ip", "link", "set", va, "netns", a_},
          {"ip", "link", "set", vb, "netns", b_},
          {"ip", "-n", a_, "addr", "add", "10.213.7.1/24", "dev", va},
          {"ip", "-n", b_, "addr", "add", "10.213.7.2/24", "dev", vb},
          {"ip", "-n", a_, "link", "set", va, "up"},
          {"ip", "-n", b_, "link", "set", vb, "up"},
          {"ip", "-n", a_, "link", "set", "lo", "up"},
          {"ip", "-n", b_, "link", "set", "lo", "up"}}) {
      Proc p = run(cmd);
      ASSERT_EQ(p.rc, 0) << "setup step failed: " << cmd[1] << " " << cmd[2] << ": " << p.err;
    }
  }
  void TearDown() override {
    // Deleting a namespace removes the veth end inside it, and with it the pair.
    if (made_a_) run({"ip", "netns", "del", a_});
    if (made_b_) run({"ip", "netns", "del", b_});
  }
  void roles_in_two_namespaces(const std::string& transport) {
    PrefillNode node({"ip", "netns", "exec", a_}, "10.213.7.1", 7070, transport);
    ASSERT_EQ(node.wait_port(), 7070) << slurp(node.log);
    Proc d =
        run({"ip", "netns", "exec", b_, testing::kiln_binary(), "kv", "remote", "--prefill-peer",
             "10.213.7.1:7070", "--transport", transport, "-p", kPrompt, "-n", "24"});
    ASSERT_EQ(d.rc, 0) << d.err;
    EXPECT_EQ(d.err.find("notice"), std::string::npos) << d.err;
    EXPECT_EQ(ids_hash(d.err), local_hash()) << d.err;
  }
  std::string a_, b_;
  bool made_a_ = false, made_b_ = false;
};

TEST_F(NetNs, TcpAcrossNamespaces) { roles_in_two_namespaces("tcp"); }
TEST_F(NetNs, UcxAcrossNamespaces) {
  if (!transfer::ucx_built()) GTEST_SKIP() << "built without UCX";
  roles_in_two_namespaces("ucx");
}

}  // namespace
}  // namespace kiln
