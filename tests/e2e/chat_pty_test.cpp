// tests/e2e/chat_pty_test.cpp: `kiln chat` as a person uses it, through a pseudo-terminal:
// the prompt appears, a message gets a streamed reply, a message continued with '\' is one
// message, /clear and /exit work, and `kiln run -cnv` is the same chat; the weights' page-in
// progress line on a terminal (with --mlock and without).
#include <gtest/gtest.h>
#include <poll.h>
#include <pty.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "common/testdata.h"

namespace kiln {
namespace {

class Pty {
 public:
  explicit Pty(std::vector<std::string> args) {
    args.insert(args.begin(), testing::kiln_binary());
    pid_ = forkpty(&fd_, nullptr, nullptr, nullptr);
    if (pid_ == 0) {
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
  }
  ~Pty() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (fd_ >= 0) close(fd_);
  }
  bool started() const { return pid_ > 0; }
  void type(const std::string& text) { (void)!write(fd_, text.data(), text.size()); }
  // Reads until `needle` appears after `from` in all output so far (or 20 s pass).
  bool wait_for(const std::string& needle, size_t from) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (out_.find(needle, from) == std::string::npos) {
      if (std::chrono::steady_clock::now() > end) return false;
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      char buf[4096];
      const ssize_t n = read(fd_, buf, sizeof buf);
      if (n <= 0) return out_.find(needle, from) != std::string::npos;
      out_.append(buf, static_cast<size_t>(n));
    }
    return true;
  }
  int exit_status() {
    int st = 0;
    waitpid(pid_, &st, 0);
    reaped_ = true;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }
  const std::string& out() const { return out_; }

 private:
  int fd_ = -1;
  pid_t pid_ = -1;
  bool reaped_ = false;
  std::string out_;
};

void converse(std::vector<std::string> args) {
  Pty chat(std::move(args));
  ASSERT_TRUE(chat.started());
  ASSERT_TRUE(chat.wait_for("> ", 0)) << chat.out();
  size_t at = chat.out().size();
  chat.type("Once upon a time\n");
  ASSERT_TRUE(chat.wait_for("> ", at + 20)) << chat.out();
  // The reply, between the echoed message and the next prompt.
  const std::string first = chat.out().substr(at);
  EXPECT_GT(first.size(), 30u) << first;
  at = chat.out().size();
  chat.type("Lily had a\\\nred ball\n");  // one message over two lines
  ASSERT_TRUE(chat.wait_for("> ", at + 20)) << chat.out();
  at = chat.out().size();
  chat.type("/clear\n");
  ASSERT_TRUE(chat.wait_for("> ", at + 7)) << chat.out();
  at = chat.out().size();
  chat.type("Once upon a time\n");  // after /clear: the first turn again, the same reply
  ASSERT_TRUE(chat.wait_for("> ", at + 20)) << chat.out();
  EXPECT_EQ(chat.out().substr(at), first);
  chat.type("/exit\n");
  EXPECT_EQ(chat.exit_status(), 0) << chat.out();
}

TEST(KilnChat, ConversesThroughATerminal) {
  converse({"chat", "-m", testing::model_path("stories260K.gguf"), "--temp", "0", "-n", "24",
            "--threads", "1"});
}

TEST(KilnChat, RunConversationIsTheChat) {
  converse({"run", "-cnv", "-m", testing::model_path("stories260K.gguf"), "--temp", "0", "-n", "24",
            "--threads", "1"});
}

// --mlock on a terminal: one line counts up to 100% while the weights are paged in and locked
// (on a pipe nothing: KilnRun.MlockChangesNothingButResidency sees the same stderr either way).
TEST(KilnRun, MlockShowsAPageInProgressLineOnATerminal) {
  Pty run({"run", "-m", testing::model_path("stories260K.gguf"), "-p", "Once", "-n", "2", "--temp",
           "0", "--threads", "1", "--mlock"});
  ASSERT_TRUE(run.started());
  ASSERT_TRUE(run.wait_for("100.0%", 0)) << run.out();
  EXPECT_NE(run.out().find("\rkiln: paging in stories260K.gguf: "), std::string::npos) << run.out();
  EXPECT_EQ(run.exit_status(), 0) << run.out();
}

// Without --mlock a host backend reads the mapped weights in at load (issue 35, point 7), with
// the same line on a terminal, instead of faulting them in silently during the first prefill;
// --log-level above notice keeps it quiet.
TEST(KilnRun, FirstTouchPagingShowsTheProgressLineUnlessQuiet) {
  const std::vector<std::string> args = {
      "run",       "-m",     testing::model_path("stories260K.gguf"),
      "-p",        "Once",   "-n",
      "2",         "--temp", "0",
      "--threads", "1",      "--device",
      "cpu"};
  Pty run(args);
  ASSERT_TRUE(run.started());
  ASSERT_TRUE(run.wait_for("ids xxh64", 0)) << run.out();
  EXPECT_NE(run.out().find("\rkiln: paging in stories260K.gguf: 100.0%"), std::string::npos)
      << run.out();
  EXPECT_EQ(run.exit_status(), 0) << run.out();

  std::vector<std::string> quiet_args = args;
  quiet_args.insert(quiet_args.end(), {"--log-level", "warn"});
  Pty quiet(quiet_args);
  ASSERT_TRUE(quiet.started());
  ASSERT_TRUE(quiet.wait_for("ids xxh64", 0)) << quiet.out();
  EXPECT_EQ(quiet.out().find("paging in"), std::string::npos) << quiet.out();
  EXPECT_EQ(quiet.exit_status(), 0) << quiet.out();
}

}  // namespace
}  // namespace kiln
