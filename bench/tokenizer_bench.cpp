// bench/tokenizer_bench.cpp: tokenizer throughput, single thread. 1 MB of English (the GPL
// head repeated) and 1 MB of generated code/Unicode mix, through byte-level BPE (gpt-2, and
// deepseek-coder's five-regex pre-tokenizer) and SentencePiece (llama-spm); bytes/s is input
// text per second. Also: vocabulary load time.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "format/gguf.h"
#include "tokenizer/tokenizer.h"

namespace {

namespace fs = std::filesystem;

// ../shared beside the checkout (this file is <checkout>/bench/tokenizer_bench.cpp).
std::string shared(const std::string& rel) {
  const fs::path p = fs::path(__FILE__).parent_path().parent_path().parent_path() / "shared" / rel;
  if (!fs::exists(p)) {
    std::fprintf(stderr, "tokenizer_bench: missing %s\n", p.c_str());
    std::exit(1);
  }
  return p.string();
}

constexpr size_t kTextBytes = 1 << 20;

const std::string& english() {
  static const std::string text = [] {
    std::ifstream f(shared("testdata/text/gpl-3-head.txt"), std::ios::binary);
    std::ostringstream ss;
    ss << f.rdbuf();
    const std::string head = ss.str();
    std::string t;
    while (t.size() < kTextBytes) t += head;
    t.resize(kTextBytes);
    while (!t.empty() && (static_cast<unsigned char>(t.back()) & 0xC0) == 0x80) t.pop_back();
    return t;
  }();
  return text;
}

// Code and multilingual text from a fixed generator: identifiers, numbers, operators,
// indentation, and words in Latin-with-accents, Cyrillic, Greek, CJK, Hangul, plus emoji.
const std::string& mixed() {
  static const std::string text = [] {
    static const char* parts[] = {
        "def ",
        "return ",
        "for (int i = 0; i < n; ++i) {",
        "}",
        "    ",
        "\t",
        "\n",
        "\n\n",
        "x_",
        "value",
        "count",
        " = ",
        " += ",
        "==",
        "->",
        "::",
        "(",
        ")",
        "[",
        "]",
        ";",
        ", ",
        "0x1F",
        "3.14159",
        "42",
        "1000000",
        "\"str\"",
        "'c'",
        "// note: ",
        "# comment ",
        "caf\xC3\xA9 ",
        "na\xC3\xAFve ",
        "\xC3\x9C"
        "ber ",
        "\xD0\xBF\xD1\x80\xD0\xB8\xD0\xB2\xD0\xB5\xD1\x82 ",
        "\xCE\xBA\xCF\x8C\xCF\x83\xCE\xBC\xCE\xB5 ",
        "\xE4\xB8\xAD\xE6\x96\x87\xE5\xAD\x97 ",
        "\xED\x95\x9C\xEA\xB5\xAD\xEC\x96\xB4 ",
        "\xE3\x81\x93\xE3\x82\x93\xE3\x81\xAB\xE3\x81\xA1\xE3\x81\xAF",
        "\xF0\x9F\x99\x82",
        "\xF0\x9F\xA6\x99 ",
        "\xE2\x86\x92 ",
        "\xC2\xA0",
        "  ",
        "it's ",
        "We'll ",
    };
    uint64_t s = 0x9E3779B97F4A7C15ull;
    std::string t;
    while (t.size() < kTextBytes) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      t += parts[(s >> 33) % (sizeof(parts) / sizeof(parts[0]))];
    }
    while (t.size() > kTextBytes) t.pop_back();
    while (!t.empty() && (static_cast<unsigned char>(t.back()) & 0xC0) == 0x80) t.pop_back();
    return t;
  }();
  return text;
}

const kiln::Tokenizer& vocab(const std::string& name) {
  static std::map<std::string, kiln::Tokenizer> cache;
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  auto g = kiln::GgufFile::open(shared("testdata/vocab/ggml-vocab-" + name + ".gguf"));
  if (!g) {
    std::fprintf(stderr, "tokenizer_bench: %s\n", g.error().c_str());
    std::exit(1);
  }
  auto t = kiln::Tokenizer::from_gguf(*g);
  if (!t) {
    std::fprintf(stderr, "tokenizer_bench: %s\n", t.error().c_str());
    std::exit(1);
  }
  return cache.emplace(name, std::move(*t)).first->second;
}

void encode(benchmark::State& state, const std::string& name, const std::string& (*text)()) {
  const kiln::Tokenizer& tok = vocab(name);
  const std::string& t = text();
  size_t n_tokens = 0;
  for (auto _ : state) {
    auto ids = tok.encode(t, false, false);
    n_tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * t.size()));
  state.counters["tokens"] = static_cast<double>(n_tokens);
  state.counters["tok/s"] = benchmark::Counter(static_cast<double>(n_tokens * state.iterations()),
                                               benchmark::Counter::kIsRate);
}

void decode(benchmark::State& state, const std::string& name) {
  const kiln::Tokenizer& tok = vocab(name);
  const auto ids = tok.encode(english(), false, false);
  for (auto _ : state) {
    auto s = tok.decode(ids);
    benchmark::DoNotOptimize(s.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * english().size()));
}

void load(benchmark::State& state, const std::string& name) {
  const std::string path = shared("testdata/vocab/ggml-vocab-" + name + ".gguf");
  for (auto _ : state) {
    auto g = kiln::GgufFile::open(path);
    auto t = kiln::Tokenizer::from_gguf(*g);
    benchmark::DoNotOptimize(t.has_value());
  }
}

BENCHMARK_CAPTURE(encode, gpt2_english, "gpt-2", english)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(encode, gpt2_mixed, "gpt-2", mixed)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(encode, deepseek_coder_english, "deepseek-coder", english)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(encode, deepseek_coder_mixed, "deepseek-coder", mixed)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(encode, llama_spm_english, "llama-spm", english)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(encode, llama_spm_mixed, "llama-spm", mixed)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(decode, gpt2_english, "gpt-2")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(decode, llama_spm_english, "llama-spm")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(load, gpt2, "gpt-2")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(load, llama_spm, "llama-spm")->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
