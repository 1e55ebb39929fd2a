// tests/fuzz/fuzz_grammar.cpp: libFuzzer target for the grammar compiler and the JSON Schema
// converter. The first byte picks the mode:
//   even: the rest is GBNF text; if it compiles, the matcher runs over the input's bytes
//         (advance, accepts, the mask over a small byte vocabulary agreeing with per-token
//         checks);
//   odd:  the rest is a JSON Schema; if it converts, the GBNF it gives must compile (the
//         converter never emits a grammar the parser refuses).
// Checked: no crash, no hang, every error one line with its prefix.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "grammar/grammar.h"
#include "grammar/json_schema.h"
#include "grammar/matcher.h"

namespace {

void require(bool ok, const char* what, const std::string& detail = {}) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_grammar: %s %s\n", what, detail.c_str());
    std::abort();
  }
}

void one_line(const std::string& msg, std::string_view prefix) {
  require(msg.rfind(prefix, 0) == 0, "error without its prefix:", msg);
  require(msg.find('\n') == std::string::npos, "multi-line error:", msg);
}

const kiln::grammar::TokenTrie& vocab() {
  static const kiln::grammar::TokenTrie v = [] {
    std::vector<std::string> pieces = {"",     "{",        "}", "\"", "a", "ab", "\xC3",
                                       "\xA9", "\xC3\xA9", " ", "\n", "1", "12", "true",
                                       "null", "[",        "]", ",",  ":"};
    const int32_t eog[] = {0};
    return kiln::grammar::TokenTrie(std::move(pieces), eog);
  }();
  return v;
}

void run_matcher(const std::shared_ptr<const kiln::grammar::Grammar>& g, std::string_view input) {
  kiln::grammar::Matcher m(g);
  std::vector<uint8_t> mask;
  for (size_t i = 0; i < input.size() && i < 64; ++i) {
    if (i % 8 == 0) {
      m.fill_mask(vocab(), mask);
      for (int32_t id = 0; id < vocab().n_vocab(); ++id)
        require((mask[size_t(id)] != 0) == m.accepts_token(vocab(), id), "mask != accepts_token");
    }
    const std::string_view b = input.substr(i, 1);
    const bool ok = m.accepts(b);
    const kiln::Status st = m.advance(b);
    require(ok == st.is_ok(), "accepts() and advance() disagree");
    if (!st.is_ok()) one_line(st.message(), "grammar: ");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if ((data[0] & 1) == 0) {
    auto g = kiln::grammar::Grammar::parse(text);
    if (!g) {
      one_line(g.error(), "grammar: ");
      return 0;
    }
    run_matcher(*g, text);
    return 0;
  }
  auto schema = nlohmann::ordered_json::parse(text.begin(), text.end(), nullptr, false);
  if (schema.is_discarded()) return 0;
  auto gbnf = kiln::grammar::json_schema_to_gbnf(schema);
  if (!gbnf) {
    one_line(gbnf.error(), "json_schema: ");
    return 0;
  }
  auto g = kiln::grammar::Grammar::parse(*gbnf);
  require(g.has_value(), "the converter's GBNF does not compile:",
          g.has_value() ? std::string() : g.error() + "\n" + *gbnf);
  run_matcher(*g, "{\"a\": [1, true, null, \"\xC3\xA9\"]}");
  return 0;
}
