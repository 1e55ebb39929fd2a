// apps/kiln/cmd_tokenize.cpp: `kiln tokenize -m MODEL [--add-special] [--parse-special]
// [--pieces] (TEXT | -f FILE)`: token ids on one line, separated by single spaces, nothing else
// on stdout; --pieces adds a second line with each token's piece, quoted and escaped. Works on
// vocabulary-only GGUF files. Errors: one line on stderr, exit status 1.
#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>

#include "apps/kiln/commands.h"
#include "format/gguf.h"
#include "tokenizer/tokenizer.h"

namespace kiln::app {
namespace {

struct TokenizeArgs {
  std::string model;
  std::string text;
  std::string file;
  bool add_special = false;
  bool parse_special = false;
  bool pieces = false;
};

// A piece as a quoted, single-line string: control bytes, quotes, backslashes and bytes that
// are not part of valid UTF-8 are escaped, so the line can be split on spaces safely.
std::string quote_piece(const std::string& p) {
  std::string out = "'";
  for (size_t i = 0; i < p.size();) {
    const auto b = static_cast<uint8_t>(p[i]);
    if (b == '\n')
      out += "\\n";
    else if (b == '\t')
      out += "\\t";
    else if (b == '\r')
      out += "\\r";
    else if (b == '\\')
      out += "\\\\";
    else if (b == '\'')
      out += "\\'";
    else if (b == ' ')
      out += ' ';
    else if (b < 0x20 || b == 0x7F)
      out += fmt::format("\\x{:02x}", b);
    else if (b < 0x80)
      out += static_cast<char>(b);
    else {
      const size_t len = b >= 0xF0 && b < 0xF5   ? 4
                         : b >= 0xE0 && b < 0xF0 ? 3
                         : b >= 0xC2 && b < 0xE0 ? 2
                                                 : 0;
      bool ok = len > 0 && i + len <= p.size();
      for (size_t k = 1; ok && k < len; ++k) ok = (static_cast<uint8_t>(p[i + k]) & 0xC0) == 0x80;
      if (ok) {
        out.append(p, i, len);
        i += len;
        continue;
      }
      out += fmt::format("\\x{:02x}", b);
    }
    ++i;
  }
  return out + "'";
}

int run_tokenize(const TokenizeArgs& a, bool have_text) {
  const auto fail = [](const std::string& msg) {
    fmt::print(stderr, "kiln tokenize: {}\n", msg);
    return 1;
  };
  if (have_text == !a.file.empty()) return fail("give exactly one of TEXT or -f FILE");
  std::string text = a.text;
  if (!a.file.empty()) {
    if (a.file == "-") {
      text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
    } else {
      std::ifstream f(a.file, std::ios::binary);
      if (!f) return fail(fmt::format("cannot read '{}'", a.file));
      std::ostringstream ss;
      ss << f.rdbuf();
      if (f.bad()) return fail(fmt::format("error reading '{}'", a.file));
      text = ss.str();
    }
  }
  auto g = GgufFile::open(a.model);
  if (!g) return fail(g.error());
  auto tok = Tokenizer::from_gguf(*g);
  if (!tok) return fail(tok.error());
  const std::vector<int32_t> ids = tok->encode(text, a.add_special, a.parse_special);
  std::string line;
  line.reserve(ids.size() * 6);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) line += ' ';
    line += std::to_string(ids[i]);
  }
  line += '\n';
  if (a.pieces) {
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) line += ' ';
      line += quote_piece(tok->token_to_piece(ids[i], true));
    }
    line += '\n';
  }
  if (std::fwrite(line.data(), 1, line.size(), stdout) != line.size() || std::fflush(stdout) != 0)
    return fail("cannot write to stdout");
  return 0;
}

}  // namespace

void add_tokenize_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("tokenize", "print the token ids of a text");
  auto args = std::make_shared<TokenizeArgs>();
  cmd->add_option("-m,--model", args->model, "GGUF file (a vocabulary-only file is enough)")
      ->required();
  auto* text_opt = cmd->add_option("text", args->text, "text to tokenize");
  cmd->add_option("-f,--file", args->file, "read the text from FILE ('-' for stdin)");
  cmd->add_flag("--add-special", args->add_special, "add BOS/EOS as the vocabulary asks");
  cmd->add_flag("--parse-special", args->parse_special,
                "text matching a special token's text becomes that token");
  cmd->add_flag("--pieces", args->pieces, "print a second line with each token's piece");
  cmd->callback(
      [args, text_opt, &exit_code] { exit_code = run_tokenize(*args, text_opt->count() > 0); });
}

}  // namespace kiln::app
