// tokenizer/pretokenize.cpp: pre-tokenizer regex tables (per tokenizer.ggml.pre, as llama.cpp
// selects them) and the splitting loop on PCRE2.
//
// How llama.cpp's results are reproduced: llama.cpp runs two hand-written splitters (for the
// GPT-2 and Llama-3 expressions) and std::regex for the rest, on text where every non-ASCII
// whitespace code point is replaced by U+000B (so `\s` means ASCII whitespace plus "any Unicode
// White_Space"). We build the same substitute subject and compile without PCRE2_UCP, so `\s`
// matches exactly ASCII whitespace there. The hand-written splitters treat unassigned code
// points (flags 0) as matching nothing, so each becomes a piece of one code point: the
// translated GPT-2/Llama-3 patterns exclude \p{Cn} and end with a one-character alternative.
#include "tokenizer/pretokenize.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <fmt/format.h>

#include <array>

#include "core/check.h"
#include "tokenizer/unicode.h"

namespace kiln::tok {
namespace {

constexpr const char* kGpt2 =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)";
constexpr const char* kLlama3 =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
    "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr const char* kLlama3Original =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr const char* kQwen2 =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr const char* kPoro = " ?[^(\\s|.,!?…。，、।۔،)]+";
constexpr const char* kTekken =
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|[^\\r\\n\\p{L}\\p{N}]?((?"
    "="
    "[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|"
    "\\s+(?!\\S)|\\s+";
constexpr const char* kGpt4o =
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'"
    "["
    "vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^"
    "A-"
    "Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}"
    "]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

// Translates one llama.cpp expression to the PCRE2 pattern that reproduces its splits.
std::string translate(const std::string& re) {
  if (re == kGpt2)
    return "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}\\p{Cn}]+|\\s+(?!\\S)|"
           "\\s+|[\\s\\S]";
  if (re == kLlama3 || re == kLlama3Original)
    return "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+"
           "|"
           "\\p{N}{1,3}| "
           "?[^\\s\\p{L}\\p{N}\\p{Cn}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+|[\\s\\S]";
  return re;  // std::regex (ECMAScript) and PCRE2 agree on the constructs these use
}

struct PreEntry {
  std::vector<std::string_view> names;
  std::vector<std::string> regexes;
  bool clean_spaces = true;
  bool ignore_merges = false;
  int force_add_bos = -1;
  bool no_bos = false;
  bool add_sep = false;
};

// The table's regexes stay one literal each, as llama.cpp writes them.
// clang-format off
const std::vector<PreEntry>& pre_table() {
  static const std::vector<PreEntry> table = [] {
    std::vector<PreEntry> t;
    const std::vector<std::string> starcoder = {"\\p{N}", kGpt2};
    t.push_back({{"default"},
                 {"[\\p{P}\\$\\+<=>\\^~\\|]+", kGpt2, "\\p{N}+", "[0-9][0-9][0-9]"}});
    t.push_back({{"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                  "lfm2"},
                 {kLlama3}, true, true, 1});
    t.push_back({{"dbrx", "smaug-bpe"}, {kLlama3}});
    t.push_back({{"deepseek-llm"},
                 {"[\r\n]",
                  "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-"
                  "ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\\x{1F7D}ᾀ-ᾴᾶ-ᾼ\\x{1FBE}ῂ-ῄῆ-ῌῐ-\\x{1FD3}ῖ-\\x{1FDB}ῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\\x{2126}ℨ\\x{212A}-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤ"
                  "Ⳬ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
                  "\\s?[!-/:-~！-／：-～‘-‟　-。]+", "\\s+$", "[一-龥ࠀ-一가-퟿]+", "\\p{N}+"},
                 false});
    t.push_back({{"deepseek-v3", "hunyuan-dense"},
                 {"\\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                  "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}"
                  "\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"},
                 false});
    t.push_back({{"deepseek-coder"},
                 {"[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[一-龥ࠀ-一가-퟿]+", "\\p{N}"},
                 false});
    t.push_back({{"falcon"}, {"[\\p{P}\\$\\+<=>\\^~\\|`]+", kGpt2, "[0-9][0-9][0-9]"}});
    t.push_back({{"starcoder", "refact", "codeshell", "exaone", "minerva-7b"}, starcoder});
    t.push_back({{"command-r", "smollm"}, starcoder, false});
    t.push_back({{"gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
                  "a.x-4.0", "mellum", "mpt", "olmo", "jais", "trillion", "granite-docling"},
                 {kGpt2}});
    t.push_back({{"jina-v1-en", "jina-v2-code", "roberta-bpe"}, {kGpt2}, true, false, -1, false,
                 true});
    t.push_back({{"stablelm2", "hunyuan"}, {kQwen2}});
    t.push_back({{"qwen2", "deepseek-r1-qwen", "kormo", "megrez"}, {kQwen2}, false});
    t.push_back({{"bloom", "gpt3-finnish"}, {kPoro}});
    t.push_back({{"poro-chat"}, {kPoro}, false});
    t.push_back({{"viking"}, {kPoro, "\\p{N}"}, false});
    t.push_back({{"chatglm-bpe", "glm4"}, {kLlama3}, true, false, -1, true});
    t.push_back({{"tekken"}, {kTekken}, false, true, 1});
    t.push_back({{"chameleon"},
                 {"<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )",
                  "\\p{N}", "[\\p{P}!-/:-@\\[-`{-~]", kGpt2},
                 false, false, 1});
    t.push_back({{"gpt-4o", "llama4"}, {kGpt4o}, false});
    return t;
  }();
  // clang-format on
  return table;
}

}  // namespace

Expected<PreTokenizerInfo> find_pre_tokenizer(std::string_view pre) {
  const std::string_view key = pre.empty() ? "default" : pre;
  for (const PreEntry& e : pre_table()) {
    for (std::string_view n : e.names) {
      if (n == key) {
        PreTokenizerInfo info;
        info.name = std::string(key);
        info.regexes = e.regexes;
        info.clean_spaces = e.clean_spaces;
        info.ignore_merges = e.ignore_merges;
        info.force_add_bos = e.force_add_bos;
        info.no_bos = e.no_bos;
        info.add_sep = e.add_sep;
        return info;
      }
    }
  }
  return Status::errorf("unsupported pre-tokenizer type '{}' (tokenizer.ggml.pre)", pre);
}

struct PreTokenizer::Regex {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Regex() { pcre2_code_free(code); }
};

Expected<PreTokenizer> PreTokenizer::create(const std::vector<std::string>& llama_regexes) {
  PreTokenizer p;
  for (const std::string& re : llama_regexes) {
    const std::string pattern = translate(re);
    int err = 0;
    PCRE2_SIZE err_off = 0;
    auto r = std::make_shared<Regex>();
    r->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                            PCRE2_UTF | PCRE2_DOLLAR_ENDONLY, &err, &err_off, nullptr);
    if (!r->code) {
      std::array<PCRE2_UCHAR, 256> msg{};
      pcre2_get_error_message(err, msg.data(), msg.size());
      return Status::errorf("pre-tokenizer regex does not compile at offset {}: {}", err_off,
                            reinterpret_cast<const char*>(msg.data()));
    }
    // JIT is an optimisation only: without it pcre2_match gives the same matches.
    r->jit = pcre2_jit_compile(r->code, PCRE2_JIT_COMPLETE) == 0;
    p.regexes_.push_back(std::move(r));
  }
  return p;
}

namespace {

// Per-call PCRE2 state (match data, and a JIT stack allocated only if the default one
// overflows), freed on every path.
struct MatchState {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mctx = nullptr;
  pcre2_jit_stack* stack = nullptr;
  ~MatchState() {
    pcre2_match_data_free(md);
    pcre2_match_context_free(mctx);
    pcre2_jit_stack_free(stack);
  }
};

// One match at or after `pos` in subject[0, len); false when none. Errors (resource limits)
// end the search: the rest of the piece then stays one piece, which is still a valid split.
bool find_match(const PreTokenizer::Regex& re, MatchState& st, const char* subject, size_t len,
                size_t pos, size_t& mstart, size_t& mend) {
  const auto* s = reinterpret_cast<PCRE2_SPTR>(subject);
  for (int attempt = 0; attempt < 2; ++attempt) {
    int rc;
    if (re.jit)
      rc = pcre2_jit_match(re.code, s, len, pos, 0, st.md, st.mctx);
    else
      rc = pcre2_match(re.code, s, len, pos, PCRE2_NO_UTF_CHECK, st.md, st.mctx);
    if (rc >= 0) {
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.md);
      mstart = ov[0];
      mend = ov[1];
      return true;
    }
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT && attempt == 0) {
      st.stack = pcre2_jit_stack_create(64 * 1024, 64 * 1024 * 1024, nullptr);
      if (!st.mctx) st.mctx = pcre2_match_context_create(nullptr);
      if (!st.stack || !st.mctx) return false;
      pcre2_jit_stack_assign(st.mctx, nullptr, st.stack);
      continue;
    }
    return false;
  }
  return false;
}

}  // namespace

void PreTokenizer::split(std::string_view text, std::vector<uint32_t>& ends) const {
  if (text.empty()) return;
  KILN_CHECK(text.size() < UINT32_MAX, "pre-tokenizer input of {} bytes", text.size());
  // The subject llama.cpp matches against: non-ASCII whitespace becomes U+000B. Most text
  // has none, and then the subject is the text itself.
  const auto is_wide_space = [](uint32_t cpt) { return cpt >= 0x80 && is_whitespace(cpt); };
  bool shadowed = false;
  for (size_t i = 0; i < text.size() && !shadowed;) {
    if (static_cast<uint8_t>(text[i]) < 0x80) {
      ++i;
      continue;
    }
    shadowed = is_wide_space(decode_utf8(text, i));
  }
  std::string shadow;
  std::string_view subject = text;
  if (shadowed) {
    shadow.reserve(text.size());
    for (size_t i = 0; i < text.size();) {
      size_t j = i;
      if (is_wide_space(decode_utf8(text, j)))
        shadow.push_back('\x0B');
      else
        shadow.append(text.substr(i, j - i));
      i = j;
    }
    subject = shadow;
  }

  std::vector<uint32_t> cur{static_cast<uint32_t>(subject.size())};
  std::vector<uint32_t> next;
  for (const auto& re : regexes_) {
    MatchState st;
    st.md = pcre2_match_data_create_from_pattern(re->code, nullptr);
    KILN_CHECK(st.md != nullptr, "out of memory for PCRE2 match data");
    next.clear();
    next.reserve(cur.size() * 2);
    uint32_t start = 0;
    for (uint32_t end : cur) {
      const char* piece = subject.data() + start;
      const size_t len = end - start;
      size_t pos = 0, emitted = 0;
      size_t ms = 0, me = 0;
      while (pos < len && find_match(*re, st, piece, len, pos, ms, me)) {
        if (me == ms) {  // an empty match splits nothing; step over one code point
          pos = ms + 1;
          while (pos < len && (static_cast<uint8_t>(piece[pos]) & 0xC0) == 0x80) ++pos;
          continue;
        }
        if (ms > emitted) next.push_back(start + static_cast<uint32_t>(ms));
        next.push_back(start + static_cast<uint32_t>(me));
        emitted = pos = me;
      }
      if (emitted < len) next.push_back(end);
      start = end;
    }
    cur.swap(next);
  }

  if (!shadowed) {
    ends.insert(ends.end(), cur.begin(), cur.end());
    return;
  }
  // Map piece ends in the substitute subject back to `text` by walking both in step.
  size_t ti = 0, si = 0;
  for (uint32_t e : cur) {
    while (si < e) {
      size_t tj = ti;
      const uint32_t cpt = decode_utf8(text, tj);
      si += is_wide_space(cpt) ? 1 : tj - ti;
      ti = tj;
    }
    ends.push_back(static_cast<uint32_t>(ti));
  }
}

}  // namespace kiln::tok
