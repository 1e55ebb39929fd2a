// tests/unit/progress_test.cpp: the in-place progress line (core/progress.h): on a terminal it
// redraws one line with \r, rate-limited, and ends it with the last state and a newline; not on
// a terminal it writes nothing at all.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "core/progress.h"

namespace kiln {
namespace {

std::string contents(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) out.append(buf, n);
  return out;
}

TEST(ProgressLine, RedrawsOneLineOnATerminal) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  constexpr uint64_t kMiB = 1 << 20;
  {
    ProgressLine p("kiln: paging in x.gguf", 256 * kMiB, f, /*tty=*/true);
    for (uint64_t done = 0; done <= 256 * kMiB; done += kMiB) p.update(done);
  }  // the destructor finishes the line
  const std::string out = contents(f);
  std::fclose(f);
  ASSERT_FALSE(out.empty());
  EXPECT_EQ(out.front(), '\r');
  EXPECT_EQ(out.back(), '\n');
  EXPECT_EQ(out.find('\n'), out.size() - 1) << "one line only";
  EXPECT_NE(out.find("kiln: paging in x.gguf:"), std::string::npos) << out;
  EXPECT_TRUE(out.ends_with("100.0% (256 / 256 MiB)\n")) << out;
  // 257 updates in well under 100 ms: the first one and the final state are drawn, not all.
  size_t draws = 0;
  for (char c : out) draws += c == '\r';
  EXPECT_LE(draws, 10u) << out;
}

TEST(ProgressLine, SaysNothingWhenNotATerminal) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    ProgressLine p("kiln: paging in x.gguf", 100, f, /*tty=*/false);
    p.update(50);
    p.finish();
    p.finish();
  }
  EXPECT_EQ(contents(f), "");
  std::fclose(f);
}

}  // namespace
}  // namespace kiln
