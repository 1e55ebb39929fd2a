// tests/e2e/atomic_write_test.cpp: `kiln quantize` and `kiln kv save` write beside the target
// and rename, so a process killed (SIGKILL) at any moment leaves either no file under the
// final name or a whole one, never a truncated one. Each command is killed at several points
// of its run (fractions of a timed full run) and the final name is checked.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "common/testdata.h"
#include "format/gguf.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

pid_t spawn(const std::vector<std::string>& args) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int null = ::open("/dev/null", O_WRONLY);
    ::dup2(null, 1);
    ::dup2(null, 2);
    std::vector<std::string> a = args;
    std::vector<char*> argv;
    for (auto& s : a) argv.push_back(s.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

// Seconds a whole run takes (its exit status must be 0).
double timed_run(const std::vector<std::string>& args) {
  const auto t0 = Clock::now();
  const pid_t pid = spawn(args);
  int st = 0;
  ::waitpid(pid, &st, 0);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Kills a run after `delay` seconds (or lets it end first).
void killed_run(const std::vector<std::string>& args, double delay) {
  const pid_t pid = spawn(args);
  std::this_thread::sleep_for(std::chrono::duration<double>(delay));
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
}

// Kills `args` at fractions of a full run; `whole(path)` says whether a file is complete.
template <class Whole>
void check_kills(const std::vector<std::string>& args, const std::string& out, Whole whole) {
  const double full = timed_run(args);
  ASSERT_TRUE(fs::exists(out));
  ASSERT_TRUE(whole(out)) << "a complete run's output is not whole";
  const uintmax_t full_size = fs::file_size(out);
  int absent = 0, present = 0;
  for (double f : {0.05, 0.2, 0.35, 0.5, 0.65, 0.8, 0.95}) {
    fs::remove(out);
    killed_run(args, full * f);
    if (!fs::exists(out)) {
      ++absent;
      continue;
    }
    ++present;
    EXPECT_EQ(fs::file_size(out), full_size) << "killed at " << f << " of the run";
    EXPECT_TRUE(whole(out)) << "killed at " << f << " of the run";
  }
  ::testing::Test::RecordProperty("absent", absent);
  ::testing::Test::RecordProperty("present", present);
}

TEST(AtomicWrite, KilledQuantizeLeavesNoTruncatedFile) {
  const std::string out = kiln::testing::temp_dir() + "/atomic-q8.gguf";
  check_kills({kiln::testing::kiln_binary(), "quantize",
               kiln::testing::model_path("llama-gqa-f16.gguf"), out, "Q8_0", "-t", "1"},
              out, [](const std::string& p) { return kiln::GgufFile::open(p).has_value(); });
}

TEST(AtomicWrite, KilledKvSaveLeavesNoTruncatedFile) {
  const std::string out = kiln::testing::temp_dir() + "/atomic.kvpack";
  std::string prompt;
  for (int i = 0; i < 40; ++i) prompt += "Once upon a time there was a little dog. ";
  check_kills({kiln::testing::kiln_binary(), "kv", "save", "-m",
               kiln::testing::model_path("stories260K.gguf"), "-p", prompt, "-n", "4", "-o", out,
               "-t", "1"},
              out, [](const std::string& p) {
                // A whole pack loads back (kv info checks its framing and checksum).
                const pid_t pid = spawn({kiln::testing::kiln_binary(), "kv", "info", "-i", p});
                int st = 0;
                ::waitpid(pid, &st, 0);
                return WIFEXITED(st) && WEXITSTATUS(st) == 0;
              });
}

}  // namespace
