// tests/common/run_kiln.cpp: posix_spawn of the kiln binary with stdout/stderr sent to files.
#include "common/run_kiln.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>

#include "common/testdata.h"

extern char** environ;

namespace kiln::testing {

KilnProc run_kiln(const std::vector<std::string>& args, const std::string* stdin_text) {
  return run_program(kiln_binary(), args, stdin_text);
}

KilnProc run_program(const std::string& path, const std::vector<std::string>& args,
                     const std::string* stdin_text) {
  static const std::string dir = temp_dir();
  const std::string out_path = dir + "/stdout", err_path = dir + "/stderr";
  const std::string in_path = dir + "/stdin";
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (stdin_text != nullptr) {
    write_file(in_path, *stdin_text);
    posix_spawn_file_actions_addopen(&fa, 0, in_path.c_str(), O_RDONLY, 0);
  }
  posix_spawn_file_actions_addopen(&fa, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<std::string> full = {path};
  full.insert(full.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : full) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  KilnProc p;
  const int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    ADD_FAILURE() << "cannot start " << argv[0];
    return p;
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFEXITED(status))
    p.rc = WEXITSTATUS(status);
  else if (WIFSIGNALED(status))
    p.signal = WTERMSIG(status);
  p.out = read_file(out_path);
  p.err = read_file(err_path);
  return p;
}

void expect_clean_error(const KilnProc& p, const std::string& what) {
  EXPECT_EQ(p.signal, 0) << "crashed: " << p.err;
  EXPECT_EQ(p.rc, 1) << p.err;
  EXPECT_NE(p.err.find(what), std::string::npos) << "stderr: " << p.err;
  EXPECT_LE(std::count(p.err.begin(), p.err.end(), '\n'), 1) << "stderr: " << p.err;
}

}  // namespace kiln::testing
