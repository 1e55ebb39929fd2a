// tests/tokenizer/tokenize_cli_test.cpp: end-to-end `kiln tokenize`: runs the built binary and
// compares its stdout with the library's ids for the same text; errors exit 1 with one line.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <fstream>

#include "common/testdata.h"
#include "format/gguf.h"
#include "tokenizer/tokenizer.h"

namespace kiln {
namespace {

struct RunResult {
  int exit_code = -1;
  std::string out, err;
};

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

RunResult run_kiln(const std::string& args) {
  static const std::string dir = testing::temp_dir();
  const std::string out = dir + "/out", err = dir + "/err";
  const std::string cmd =
      fmt::format("{} {} >{} 2>{} </dev/null", shell_quote(testing::kiln_binary()), args,
                  shell_quote(out), shell_quote(err));
  RunResult r;
  const int st = std::system(cmd.c_str());
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  r.out = testing::read_file(out);
  r.err = testing::read_file(err);
  return r;
}

std::string ids_line(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? " " : "") + std::to_string(ids[i]);
  return s + "\n";
}

Tokenizer load(const std::string& path) {
  auto g = GgufFile::open(path);
  if (!g) std::abort();
  auto t = Tokenizer::from_gguf(*g);
  if (!t) std::abort();
  return std::move(*t);
}

TEST(TokenizeCli, IdsMatchLibraryOnVocabOnlyFile) {
  const std::string vocab = testing::shared_path("testdata/vocab/ggml-vocab-gpt-2.gguf");
  const Tokenizer tok = load(vocab);
  const std::string text = "Hello world, it's 2026! \xF0\x9F\x99\x82<|endoftext|>";
  auto r = run_kiln(fmt::format("tokenize -m {} {}", shell_quote(vocab), shell_quote(text)));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, ids_line(tok.encode(text, false, false)));
  EXPECT_EQ(r.err, "");
  r = run_kiln(fmt::format("tokenize -m {} --parse-special --add-special {}", shell_quote(vocab),
                           shell_quote(text)));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, ids_line(tok.encode(text, true, true)));
}

TEST(TokenizeCli, FileInputAndPieces) {
  const std::string model = testing::model_path("stories260K.gguf");
  const Tokenizer tok = load(model);
  const std::string path = testing::temp_dir() + "/in.txt";
  const std::string text = "Once upon a time,\nthere was 'a' cat\t\\ \xC3\xA9.";
  std::ofstream(path, std::ios::binary) << text;
  auto r = run_kiln(fmt::format("tokenize -m {} --add-special --pieces -f {}", shell_quote(model),
                                shell_quote(path)));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto ids = tok.encode(text, true, false);
  const size_t nl = r.out.find('\n');
  ASSERT_NE(nl, std::string::npos);
  EXPECT_EQ(r.out.substr(0, nl + 1), ids_line(ids));
  const std::string pieces = r.out.substr(nl + 1);
  ASSERT_FALSE(pieces.empty());
  EXPECT_EQ(pieces.back(), '\n');
  EXPECT_EQ(std::count(pieces.begin(), pieces.end(), '\n'), 1);  // escaped: one line
  // One quoted piece per id, each unescaping to the library's piece.
  std::vector<std::string> parsed;
  for (size_t i = 0; i + 1 < pieces.size();) {
    ASSERT_EQ(pieces[i], '\'') << pieces.substr(i);
    std::string p;
    for (++i; i < pieces.size() && pieces[i] != '\''; ++i) {
      if (pieces[i] != '\\') {
        p += pieces[i];
        continue;
      }
      const char e = pieces[++i];
      if (e == 'n')
        p += '\n';
      else if (e == 't')
        p += '\t';
      else if (e == 'r')
        p += '\r';
      else if (e == 'x') {
        p += static_cast<char>(std::stoi(pieces.substr(i + 1, 2), nullptr, 16));
        i += 2;
      } else
        p += e;
    }
    parsed.push_back(p);
    i += 2;  // closing quote and the separating space (or the final newline)
  }
  ASSERT_EQ(parsed.size(), ids.size());
  for (size_t k = 0; k < ids.size(); ++k) EXPECT_EQ(parsed[k], tok.token_to_piece(ids[k])) << k;
}

TEST(TokenizeCli, ErrorsAreOneLineAndExitOne) {
  const std::string vocab = testing::shared_path("testdata/vocab/ggml-vocab-llama-spm.gguf");
  for (const std::string& args :
       {fmt::format("tokenize -m {}", shell_quote(vocab)),                        // no text
        fmt::format("tokenize -m {} hi -f /nonexistent", shell_quote(vocab)),     // both
        fmt::format("tokenize -m {} -f /nonexistent/x.txt", shell_quote(vocab)),  // unreadable
        std::string("tokenize -m /nonexistent.gguf hi"),                          // no model
        fmt::format("tokenize -m {} hi",
                    shell_quote(testing::shared_path("testdata/text/gpl-3-head.txt")))}) {
    const auto r = run_kiln(args);
    EXPECT_EQ(r.exit_code, 1) << args;
    EXPECT_EQ(r.out, "") << args;
    EXPECT_FALSE(r.err.empty()) << args;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << args << ": " << r.err;
  }
}

}  // namespace
}  // namespace kiln
