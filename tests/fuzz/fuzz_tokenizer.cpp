// tests/fuzz/fuzz_tokenizer.cpp: libFuzzer target for the tokenizers. Random bytes (invalid
// UTF-8, special-token text, megabyte inputs) go through encode and decode of an SPM vocabulary
// with byte fallback, one without (<unk>), and byte-level BPE vocabularies with single- and
// multi-regex pre-tokenizers. Checked: no crash, ids in range, SPM byte-fallback round trip.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include <filesystem>

#include "format/gguf.h"
#include "tokenizer/tokenizer.h"

namespace {

// KILN_SHARED, else ../shared beside the checkout (this file is
// <checkout>/tests/fuzz/fuzz_tokenizer.cpp); a git worktree elsewhere needs KILN_SHARED.
std::string shared_path(const std::string& rel) {
  namespace fs = std::filesystem;
  if (const char* e = std::getenv("KILN_SHARED"); e && *e) return (fs::path(e) / rel).string();
  return (fs::path(__FILE__).parent_path().parent_path().parent_path().parent_path() / "shared" /
          rel)
      .string();
}

std::vector<kiln::Tokenizer> load_all() {
  std::vector<kiln::Tokenizer> out;
  for (const std::string rel :
       {"testdata/models/stories260K.gguf", "testdata/models/babyllama-tok105-f32.gguf",
        "testdata/vocab/ggml-vocab-gpt-2.gguf", "testdata/vocab/ggml-vocab-deepseek-coder.gguf",
        "testdata/vocab/ggml-vocab-phi-3.gguf", "testdata/vocab/ggml-vocab-bert-bge.gguf"}) {
    auto g = kiln::GgufFile::open(shared_path(rel));
    if (!g) {
      std::fprintf(stderr, "fuzz_tokenizer: %s\n", g.error().c_str());
      std::abort();
    }
    auto t = kiln::Tokenizer::from_gguf(*g);
    if (!t) {
      std::fprintf(stderr, "fuzz_tokenizer: %s\n", t.error().c_str());
      std::abort();
    }
    out.push_back(std::move(*t));
  }
  return out;
}

// Loaded once, before the first input: loading every vocabulary under ASan takes seconds,
// which must not count against the first input's -timeout.
const std::vector<kiln::Tokenizer>* g_toks = nullptr;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  static const std::vector<kiln::Tokenizer> all = load_all();
  g_toks = &all;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<kiln::Tokenizer>& toks = *g_toks;
  if (size < 1) return 0;
  // First byte: which vocabulary and the two flags; the rest is the text.
  const uint8_t ctl = data[0];
  const kiln::Tokenizer& tok = toks[(ctl & 0x0F) % toks.size()];
  const bool add_special = ctl & 0x10, parse_special = ctl & 0x20;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);

  const std::vector<int32_t> ids = tok.encode(text, add_special, parse_special);
  for (int32_t id : ids)
    if (id < 0 || id >= tok.n_vocab()) std::abort();
  const std::string back = tok.decode(ids, ctl & 0x40);
  // SPM with byte fallback keeps every byte, so the text comes back unless it has spaces next
  // to invalid lead bytes or a literal "▁" (both documented exceptions), or special tokens.
  if ((ctl & 0x0F) % toks.size() == 0 && !add_special && !parse_special && !(ctl & 0x40) &&
      text.find(' ') == std::string_view::npos &&
      text.find("\xE2\x96\x81") == std::string_view::npos &&
      text.find('<') == std::string_view::npos && back != text)
    std::abort();

  // The same bytes read as ids (out-of-range ones included) must decode without harm.
  std::vector<int32_t> raw_ids(text.size() / 4);
  for (size_t i = 0; i < raw_ids.size(); ++i)
    raw_ids[i] = static_cast<int32_t>(static_cast<uint32_t>(data[1 + 4 * i]) |
                                      static_cast<uint32_t>(data[2 + 4 * i]) << 8 |
                                      static_cast<uint32_t>(data[3 + 4 * i]) << 16 |
                                      static_cast<uint32_t>(data[4 + 4 * i]) << 24);
  (void)tok.decode(raw_ids, ctl & 0x80);
  for (size_t i = 0; i < raw_ids.size() && i < 64; ++i)
    (void)tok.token_to_piece(raw_ids[i], ctl & 0x80);
  return 0;
}
