// tests/common/run_kiln.h: runs the built `kiln` binary as a child process for end-to-end
// tests (no shell, so arguments such as prompts pass through byte for byte).
#pragma once

#include <string>
#include <vector>

namespace kiln::testing {

struct KilnProc {
  int rc = -1;     // exit status; -1 when killed by a signal
  int signal = 0;  // the signal that killed it, else 0
  std::string out, err;
};

// kiln_binary() with `args`; stdout and stderr are captured whole. A failure to start is a
// test failure (rc stays -1).
// stdin_text: what the child reads on standard input (else it inherits the test's).
KilnProc run_kiln(const std::vector<std::string>& args, const std::string* stdin_text = nullptr);
// The same for another program of the build (the examples).
KilnProc run_program(const std::string& path, const std::vector<std::string>& args,
                     const std::string* stdin_text = nullptr);

// A failed command as kiln promises: exit status 1 (not a crash), one stderr line mentioning
// `what`.
void expect_clean_error(const KilnProc& p, const std::string& what);

}  // namespace kiln::testing
