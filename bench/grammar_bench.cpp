// bench/grammar_bench.cpp: the cost of constrained decoding per generated token, on real
// vocabularies (llama-spm 32000, gpt-2 50257, deepseek-llm 102400 ids). A JSON document that
// validates against a schema is tokenized; each of its tokens is one step: the full mask
// (Matcher::fill_mask, the trie walk that sampled requests pay), the greedy fast path's
// single-token check (Matcher::accepts_token) and the advance. Also: the vocabulary trie's
// build time (once per model). Compare the per-token figures with a decode step's time.
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "engine/constrained.h"
#include "format/gguf.h"
#include "grammar/json_schema.h"
#include "tokenizer/tokenizer.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double since_us(Clock::time_point t) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t).count();
}

// ../shared beside the checkout, or KILN_SHARED.
std::string shared(const std::string& rel) {
  fs::path base = std::getenv("KILN_SHARED")
                      ? fs::path(std::getenv("KILN_SHARED"))
                      : fs::path(__FILE__).parent_path().parent_path().parent_path() / "shared";
  return (base / rel).string();
}

constexpr const char* kSchema = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string"},
    "age": {"type": "integer"},
    "email": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {
      "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
      "required": ["street", "city"]},
    "active": {"type": "boolean"},
    "score": {"type": "number"}
  },
  "required": ["name", "age", "tags", "address", "active"],
  "additionalProperties": false
})";

constexpr const char* kDocument =
    R"({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["mathematics", "poetry", "engines", "notes on the analytical engine"], "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"}, "active": true, "score": 97.25})";

int run(const std::string& vocab_file) {
  auto gguf = kiln::GgufFile::open(vocab_file);
  if (!gguf) {
    std::fprintf(stderr, "grammar_bench: %s\n", gguf.error().c_str());
    return 1;
  }
  auto tok = kiln::Tokenizer::from_gguf(*gguf);
  if (!tok) {
    std::fprintf(stderr, "grammar_bench: %s\n", tok.error().c_str());
    return 1;
  }
  auto t0 = Clock::now();
  auto trie = kiln::make_token_trie(*tok);
  const double trie_us = since_us(t0);
  auto gbnf = kiln::grammar::json_schema_to_gbnf(nlohmann::ordered_json::parse(kSchema));
  t0 = Clock::now();
  auto g = kiln::grammar::Grammar::parse(*gbnf);
  const double compile_us = since_us(t0);
  if (!g) {
    std::fprintf(stderr, "grammar_bench: %s\n", g.error().c_str());
    return 1;
  }
  // The document's tokens: at each step the longest allowed token that the rest of the
  // document starts with (the tokenizer's own split may begin with a space-prefixed piece the
  // grammar does not allow at the start).
  std::vector<int32_t> ids;
  {
    kiln::grammar::Matcher m(*g);
    std::vector<uint8_t> mask;
    std::string_view rest = kDocument;
    while (!rest.empty()) {
      m.fill_mask(*trie, mask);
      int32_t best = -1;
      for (int32_t id = 0; id < trie->n_vocab(); ++id) {
        const std::string& p = trie->piece(id);
        if (mask[size_t(id)] && !p.empty() && rest.substr(0, p.size()) == p &&
            (best < 0 || p.size() > trie->piece(best).size()))
          best = id;
      }
      if (best < 0) {
        std::fprintf(stderr, "grammar_bench: no token continues the document\n");
        return 1;
      }
      ids.push_back(best);
      rest.remove_prefix(trie->piece(best).size());
      if (!m.advance_token(*trie, best).is_ok()) return 1;
    }
  }
  double mask_us = 0, check_us = 0, advance_us = 0;
  int64_t allowed_sum = 0;
  constexpr int kReps = 5;
  for (int rep = 0; rep < kReps; ++rep) {
    kiln::grammar::Matcher m(*g);
    std::vector<uint8_t> mask;
    for (int32_t id : ids) {
      t0 = Clock::now();
      allowed_sum += m.fill_mask(*trie, mask);
      mask_us += since_us(t0);
      t0 = Clock::now();
      const bool ok = m.accepts_token(*trie, id);
      check_us += since_us(t0);
      t0 = Clock::now();
      const kiln::Status st = m.advance_token(*trie, id);
      advance_us += since_us(t0);
      if (!ok || !st.is_ok()) return 1;
    }
    if (!m.accepting() || m.can_continue()) {
      std::fprintf(stderr, "grammar_bench: the document does not complete the grammar\n");
      return 1;
    }
  }
  const double n = double(ids.size()) * kReps;
  fmt::print("| {} | {} | {:.1f} | {:.0f} | {} | {:.1f} | {:.2f} | {:.2f} | {:.0f} |\n",
             fs::path(vocab_file).filename().string(), tok->n_vocab(), trie_us / 1e3, compile_us,
             ids.size(), mask_us / n, check_us / n, advance_us / n, double(allowed_sum) / n);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) files.push_back(argv[i]);
  if (files.empty())
    for (const char* v :
         {"ggml-vocab-llama-spm.gguf", "ggml-vocab-gpt-2.gguf", "ggml-vocab-deepseek-llm.gguf"})
      files.push_back(shared(std::string("testdata/vocab/") + v));
  fmt::print(
      "| vocabulary | n_vocab | trie build ms | schema compile us | tokens | full mask us/token | "
      "greedy check us/token | advance us/token | allowed ids/step |\n|---|---|---|---|---|---|---|"
      "---|---|\n");
  for (const std::string& f : files)
    if (int rc = run(f)) return rc;
  return 0;
}
