// tests/e2e/signals_test.cpp: `kiln serve` and SIGTERM. During the load (held open here by a
// chat template file that is a FIFO nobody writes) the process exits 0 at once with one line;
// during a generation the stream ends with finish_reason "cancelled" and [DONE] and the
// process exits 0.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "common/testdata.h"

namespace {

using namespace std::chrono_literals;

struct Serve {
  pid_t pid = -1;
  std::string log_path;

  void start(const std::vector<std::string>& extra) {
    log_path = kiln::testing::temp_dir() + "/signals-serve.log";
    std::vector<std::string> args = {kiln::testing::kiln_binary(),
                                     "serve",
                                     "-m",
                                     kiln::testing::model_path("stories260K.gguf"),
                                     "--port",
                                     "0",
                                     "--threads",
                                     "1"};
    args.insert(args.end(), extra.begin(), extra.end());
    pid = ::fork();
    if (pid == 0) {
      const int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 2);
      ::dup2(fd, 1);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
  }
  std::string log() const {
    std::ifstream f(log_path);
    return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  }
  // Waits for `what` in the log; the port once "listening" appeared.
  bool wait_for(const std::string& what, int* port = nullptr) {
    for (int i = 0; i < 400; ++i) {
      const std::string l = log();
      if (l.find(what) != std::string::npos) {
        std::smatch m;
        static const std::regex re("listening on http://127\\.0\\.0\\.1:(\\d+)");
        if (port && std::regex_search(l, m, re)) *port = std::stoi(m[1]);
        return true;
      }
      std::this_thread::sleep_for(25ms);
    }
    return false;
  }
  // The exit status after SIGTERM, -1 when it had to be killed or died of a signal.
  int term_and_wait(std::chrono::milliseconds limit) {
    ::kill(pid, SIGTERM);
    const auto end = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < end) {
      int st = 0;
      if (::waitpid(pid, &st, WNOHANG) == pid) {
        pid = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
      }
      std::this_thread::sleep_for(20ms);
    }
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    pid = -1;
    return -1;
  }
  ~Serve() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
};

TEST(ServeSignals, TermDuringLoadExitsAtOnce) {
  const std::string fifo = kiln::testing::temp_dir() + "/template.fifo";
  ::unlink(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  Serve s;
  s.start({"--chat-template-file", fifo});
  ASSERT_TRUE(s.wait_for("listening on")) << s.log();
  std::this_thread::sleep_for(200ms);  // load() now blocks opening the FIFO
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(s.term_and_wait(5000ms), 0) << s.log();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);
  EXPECT_NE(s.log().find("SIGTERM received while loading; exiting"), std::string::npos) << s.log();
  ::unlink(fifo.c_str());
}

TEST(ServeSignals, TermDuringGenerationEndsTheStreamAndExitsZero) {
  Serve s;
  s.start({"-c", "2048"});
  int port = -1;
  ASSERT_TRUE(s.wait_for("ready")) << s.log();
  ASSERT_TRUE(s.wait_for("listening on", &port)) << s.log();
  ASSERT_GT(port, 0);
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  const std::string body =
      R"({"prompt":"Once","max_tokens":2000,"stream":true,"logit_bias":{"2":-100}})";
  const std::string req =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
      "Content-Type: application/json\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  ASSERT_EQ(::send(fd, req.data(), req.size(), 0), ssize_t(req.size()));
  std::string got;
  char buf[4096];
  // Some tokens first: the generation is running when the signal comes.
  while (got.find("\"text\"") == std::string::npos) {
    pollfd p{fd, POLLIN, 0};
    ASSERT_GT(::poll(&p, 1, 10000), 0) << got;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    ASSERT_GT(n, 0) << got;
    got.append(buf, size_t(n));
  }
  std::thread reader([&] {
    for (;;) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 10000) <= 0) return;
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) return;
      got.append(buf, size_t(n));
    }
  });
  EXPECT_EQ(s.term_and_wait(10000ms), 0) << s.log();
  reader.join();
  ::close(fd);
  EXPECT_NE(got.find("\"finish_reason\":\"cancelled\""), std::string::npos) << got.substr(0, 400);
  EXPECT_NE(got.find("data: [DONE]"), std::string::npos);
  EXPECT_NE(s.log().find("SIGTERM received, shutting down"), std::string::npos) << s.log();
}

}  // namespace
