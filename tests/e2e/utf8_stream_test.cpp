// tests/e2e/utf8_stream_test.cpp: the prompt check and the streaming hold-back `kiln run`
// uses, on byte sequences whose validity is known from the UTF-8 definition.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tokenizer/utf8_stream.h"

namespace kiln::app {
namespace {

TEST(Utf8, ValidAndInvalidPrompts) {
  EXPECT_EQ(invalid_utf8_offset("plain ascii"), std::string::npos);
  EXPECT_EQ(invalid_utf8_offset("caf\xC3\xA9 \xE2\x96\x81 \xF0\x9F\x98\x80"), std::string::npos);
  EXPECT_EQ(invalid_utf8_offset("ab\xFF"), 2u);            // never a UTF-8 byte
  EXPECT_EQ(invalid_utf8_offset("ab\xC3"), 2u);            // truncated 2-byte sequence
  EXPECT_EQ(invalid_utf8_offset("\xC3\x28"), 0u);          // bad continuation
  EXPECT_EQ(invalid_utf8_offset("x\xC0\xAF"), 1u);         // overlong '/'
  EXPECT_EQ(invalid_utf8_offset("\xED\xA0\x80"), 0u);      // UTF-16 surrogate
  EXPECT_EQ(invalid_utf8_offset("\xF4\x90\x80\x80"), 0u);  // past U+10FFFF
  EXPECT_EQ(invalid_utf8_offset("\xE0\x80\xAF"), 0u);      // overlong 3-byte
}

TEST(Utf8, StreamNeverSplitsACharacter) {
  // Every split of a mixed string into single-byte pushes: each write must itself be valid
  // UTF-8, and the writes must add up to the input.
  const std::string text = "a\xC3\xA9 \xE2\x96\x81z\xF0\x9F\x98\x80!";
  Utf8Stream s;
  std::string joined;
  int writes = 0;
  for (char c : text) {
    std::string out = s.push(std::string(1, c));
    EXPECT_EQ(invalid_utf8_offset(out), std::string::npos) << "split character in a write";
    if (!out.empty()) ++writes;
    joined += out;
  }
  joined += s.flush();
  EXPECT_EQ(joined, text);
  EXPECT_EQ(writes, 7);  // one per character: a, é, space, ▁, z, 😀, !
}

TEST(Utf8, StreamPassesInvalidBytesThrough) {
  Utf8Stream s;
  std::string out = s.push("x\xFF");
  out += s.push("\x80y");
  out += s.push("\xE2\x96");  // incomplete at the end: held back until flush
  EXPECT_EQ(out, "x\xFF\x80y");
  EXPECT_EQ(s.flush(), "\xE2\x96");
  EXPECT_EQ(s.flush(), "");
}

}  // namespace
}  // namespace kiln::app
