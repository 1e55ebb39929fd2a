// tests/server/node_e2e_test.cpp: `kiln serve` as a real process on loopback, driven by the
// official OpenAI Node SDK (installed here with `npm install openai` into the build tree)
// and by a 64-client streaming load test. Skips only when node or npm is not installed;
// any other failure (npm install, SDK assertion, a load error) fails the test. RSS of the
// server before and after the load is reported.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "common/testdata.h"
#include "format/gguf.h"
#include "format/gguf_writer.h"

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

constexpr int kLoadClients = 64;

// Load duration: KILN_LOAD_SECONDS in the environment (a longer soak on demand:
// `KILN_LOAD_SECONDS=1800 ctest --timeout 2400 -R NodeE2E`), else the build's default
// (CMake cache KILN_LOAD_TEST_SECONDS, 120 s in CI).
int load_seconds() {
  if (const char* v = std::getenv("KILN_LOAD_SECONDS")) {
    const int s = std::atoi(v);
    if (s > 0) return s;
    ADD_FAILURE() << "KILN_LOAD_SECONDS='" << v << "' is not a positive number of seconds";
  }
  return KILN_LOAD_TEST_SECONDS;
}

bool have(const char* tool) {
  return std::system(fmt::format("command -v {} >/dev/null 2>&1", tool).c_str()) == 0;
}

// Runs a shell command, returning (exit status, stdout+stderr).
std::pair<int, std::string> run(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return {-1, "popen failed"};
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int st = ::pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

uint64_t rss_kib(pid_t pid) {
  std::ifstream f(fmt::format("/proc/{}/status", pid));
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6));
  return 0;
}

// `kiln serve --port 0` as a child; the port comes from its "listening on" line.
struct ServeProcess {
  pid_t pid = -1;
  int port = -1;
  std::string log_path;

  bool start(const std::string& key, std::string model = "") {
    if (model.empty()) model = kiln::testing::model_path("stories260K.gguf");
    log_path = kiln::testing::temp_dir() + "/serve.log";
    pid = ::fork();
    if (pid == 0) {
      const int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 2);
      ::dup2(fd, 1);
      const std::string bin = kiln::testing::kiln_binary();
      std::vector<std::string> args = {bin,          "serve", "-m", model,  "--port",    "0",
                                       "--parallel", "4",     "-c", "1024", "--threads", "1"};
      if (!key.empty()) args.insert(args.end(), {"--api-key", key});
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(bin.c_str(), argv.data());
      ::_exit(127);
    }
    const std::regex re("listening on http://127\\.0\\.0\\.1:(\\d+)");
    for (int i = 0; i < 300; ++i) {
      std::ifstream f(log_path);
      const std::string log((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      std::smatch m;
      if (std::regex_search(log, m, re)) port = std::stoi(m[1]);
      if (port > 0 && log.find("ready") != std::string::npos) return true;
      if (::waitpid(pid, nullptr, WNOHANG) == pid) {
        pid = -1;
        ADD_FAILURE() << "kiln serve exited early:\n" << log;
        return false;
      }
      std::this_thread::sleep_for(50ms);
    }
    ADD_FAILURE() << "kiln serve did not get ready in 15 s";
    return false;
  }
  // SIGTERM; returns the exit status (or -1 if it had to be killed).
  int stop() {
    if (pid <= 0) return -1;
    ::kill(pid, SIGTERM);
    for (int i = 0; i < 200; ++i) {
      int st = 0;
      if (::waitpid(pid, &st, WNOHANG) == pid) {
        pid = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
      }
      std::this_thread::sleep_for(50ms);
    }
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    pid = -1;
    return -1;
  }
  ~ServeProcess() { stop(); }
};

// An exclusive flock on a file, held for the object's life.
class FileLock {
 public:
  explicit FileLock(const fs::path& path)
      : fd_(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644)) {
    if (fd_ >= 0) locked_ = ::flock(fd_, LOCK_EX) == 0;
  }
  ~FileLock() {
    if (fd_ >= 0) ::close(fd_);  // closing drops the lock
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  bool locked() const { return locked_; }

 private:
  int fd_;
  bool locked_ = false;
};

// The folder where `npm install openai` put the SDK, with the test scripts copied beside it;
// empty (after a failure) when it cannot be made. ctest runs each NodeE2E test as its own
// process, two at a time in CI: without the lock two `npm install`s into one folder race
// (ENOTEMPTY on rmdir, or a half-written node_modules the other test then imports).
fs::path sdk_dir() {
  const fs::path dir = KILN_NPM_DIR;
  fs::create_directories(dir);
  const FileLock lock(dir / ".install.lock");
  if (!lock.locked()) {
    ADD_FAILURE() << "cannot lock " << (dir / ".install.lock");
    return {};
  }
  if (!fs::exists(dir / "node_modules/openai/package.json")) {
    const auto [rc, out] = run(fmt::format(
        "cd '{}' && timeout 300 npm install --no-audit --no-fund --loglevel=error openai",
        dir.string()));
    if (rc != 0) {
      ADD_FAILURE() << "npm install openai failed:\n" << out;
      return {};
    }
  }
  for (const char* f :
       {"sdk_test.mjs", "load_test.mjs", "sdk_tools_test.mjs", "chat_page_test.mjs"})
    fs::copy_file(fs::path(KILN_SERVER_TEST_DIR) / f, dir / f,
                  fs::copy_options::update_existing);  // never under a running test
  return dir;
}

TEST(NodeE2E, OpenAiSdkAndStreamingLoad) {
  if (!have("node") || !have("npm"))
    GTEST_SKIP() << "node and npm are required for the OpenAI SDK test; not installed";
  const fs::path dir = sdk_dir();
  ASSERT_FALSE(dir.empty());

  ServeProcess srv;
  ASSERT_TRUE(srv.start("test-key"));
  {
    const auto [rc, out] = run(fmt::format("cd '{}' && timeout 120 node sdk_test.mjs {} test-key",
                                           dir.string(), srv.port));
    EXPECT_EQ(rc, 0) << out;
    std::printf("sdk: %s", out.c_str());
  }
  if (have("curl")) {
    // Raw SSE as curl sees it: data: lines, a blank line after each, [DONE] last.
    const auto [rc, out] =
        run(fmt::format("timeout 60 curl -sN -H 'Authorization: Bearer test-key' -H 'Content-Type: "
                        "application/json' "
                        "-d '{{\"prompt\":\"Once\",\"max_tokens\":5,\"stream\":true}}' "
                        "http://127.0.0.1:{}/v1/completions",
                        srv.port));
    EXPECT_EQ(rc, 0) << out;
    EXPECT_EQ(out.rfind("data: ", 0), 0u) << out;
    EXPECT_TRUE(out.ends_with("data: [DONE]\n\n")) << out;
  }
  const uint64_t rss_before = rss_kib(srv.pid);
  const int seconds = load_seconds();
  std::printf("load: %d streaming clients for %d s\n", kLoadClients, seconds);
  {
    const auto [rc, out] =
        run(fmt::format("cd '{}' && timeout {} node load_test.mjs {} test-key {} {}", dir.string(),
                        seconds + 90, srv.port, kLoadClients, seconds));
    EXPECT_EQ(rc, 0) << out;
    const auto j = nlohmann::json::parse(out.substr(0, out.find('\n')), nullptr, false);
    ASSERT_TRUE(j.is_object()) << out;
    EXPECT_EQ(j["errors"], 0) << out;
    EXPECT_EQ(j["incomplete"], 0) << out;
    EXPECT_GT(j["streams"].get<int>(), kLoadClients) << out;
    std::printf("load: %s", out.c_str());
  }
  const uint64_t rss_after = rss_kib(srv.pid);
  std::printf("load: server RSS before %.1f MiB, after %.1f MiB\n", rss_before / 1024.0,
              rss_after / 1024.0);
  // Bounded growth: 64 finished streams must not leave their buffers behind.
  EXPECT_LT(rss_after, rss_before + 64 * 1024) << "RSS grew by more than 64 MiB";
  EXPECT_EQ(srv.stop(), 0) << "kiln serve did not exit cleanly on SIGTERM";
}

// stories260K renamed "hermes": Hermes 3's chat template, and token 300 reading as a whole
// Hermes tool call (the model cannot write one itself; a logit bias picks the token).
std::string hermes_model() {
  auto src = kiln::GgufFile::open(kiln::testing::model_path("stories260K.gguf"));
  EXPECT_TRUE(src.has_value()) << src.error();
  kiln::GgufWriter w;
  w.copy_metadata(*src);
  w.set_str("tokenizer.chat_template",
            kiln::testing::read_file(kiln::testing::shared_path(
                "testdata/templates/NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja")));
  auto texts = src->get_array<std::string>("tokenizer.ggml.tokens");
  EXPECT_TRUE(texts.has_value());
  (*texts)[300] =
      R"(<tool_call>{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}</tool_call>)";
  w.set_str_array("tokenizer.ggml.tokens", *texts);
  for (const kiln::TensorInfo& t : src->tensors())
    w.add_tensor(t.name, t.dtype, std::vector<int64_t>(t.ne.begin(), t.ne.begin() + t.n_dims),
                 src->view(t).bytes);
  const std::string path = kiln::testing::temp_dir() + "/hermes.gguf";
  const kiln::Status st = w.write(path);
  EXPECT_TRUE(st.is_ok()) << st.message();
  return path;
}

TEST(NodeE2E, OpenAiSdkToolCalls) {
  if (!have("node") || !have("npm"))
    GTEST_SKIP() << "node and npm are required for the OpenAI SDK test; not installed";
  const fs::path dir = sdk_dir();
  ASSERT_FALSE(dir.empty());
  ServeProcess srv;
  ASSERT_TRUE(srv.start("test-key", hermes_model()));
  const auto [rc, out] = run(fmt::format(
      "cd '{}' && timeout 120 node sdk_tools_test.mjs {} test-key", dir.string(), srv.port));
  EXPECT_EQ(rc, 0) << out;
  std::printf("sdk tools: %s", out.c_str());
  EXPECT_EQ(srv.stop(), 0);
}

// The first Chromium on PATH, or "".
std::string chromium() {
  for (const char* name : {"chromium", "chromium-browser", "google-chrome"})
    if (have(name)) return name;
  return "";
}

// The chat page at / in headless Chromium (Debian's chromium: scripts/setup installs it): load,
// type, send, see the answer stream in, screenshot. The driver needs no npm package.
TEST(NodeE2E, ChatPageInHeadlessChromium) {
  if (!have("node")) GTEST_SKIP() << "node is required for the chat page test; not installed";
  const std::string browser = chromium();
  if (browser.empty())
    GTEST_SKIP() << "chromium is not installed (scripts/setup installs it): the chat page test "
                    "is skipped";
  ServeProcess srv;
  ASSERT_TRUE(srv.start("page-key"));
  const fs::path shot = fs::path(KILN_NPM_DIR).parent_path() / "chat_page.png";
  const auto [rc, out] = run(
      fmt::format("timeout 120 node '{}/chat_page_test.mjs' {} http://127.0.0.1:{}/ page-key '{}'",
                  KILN_SERVER_TEST_DIR, browser, srv.port, shot.string()));
  EXPECT_EQ(rc, 0) << out;
  std::printf("chat page: %s", out.c_str());
  if (rc == 0) std::printf("chat page screenshot: %s\n", shot.string().c_str());
  EXPECT_EQ(srv.stop(), 0);
}

}  // namespace
