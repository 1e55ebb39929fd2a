// tokenizer/vocab_load.cpp: Tokenizer::from_gguf. Reads tokenizer.ggml.* and applies
// llama.cpp's defaults and fix-ups (special ids per model type, add_bos/add_eos, EOT/EOG tokens
// recognised by text, token attributes), then builds the lookup tables each algorithm needs.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "format/gguf.h"
#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/unicode.h"

namespace kiln {
namespace {

uint32_t attr_from_type(int64_t type) {
  switch (type) {
    case 1:
      return kAttrNormal;
    case 2:
      return kAttrUnknown;
    case 3:
      return kAttrControl;
    case 4:
      return kAttrUserDefined;
    case 5:
      return kAttrUnused;
    case 6:
      return kAttrByte;
    default:
      return kAttrUndefined;
  }
}

// The array under `key`, checked to hold `n` elements (when n >= 0); nullptr if absent.
Expected<const GgufArray*> optional_array(const GgufFile& g, std::string_view key, int64_t n) {
  const GgufValue* v = g.find(key);
  if (!v) return static_cast<const GgufArray*>(nullptr);
  if (!v->is_array())
    return Status::errorf("metadata '{}' has type {}, expected an array", key,
                          gguf_type_name(v->type));
  if (n >= 0 && static_cast<int64_t>(v->arr().items.size()) != n)
    return Status::errorf("metadata '{}' has {} entries but the vocabulary has {} tokens", key,
                          v->arr().items.size(), n);
  return &v->arr();
}

// BYTE tokens are "<0xNN>"; llama.cpp reads the two hex digits after "<0x".
uint8_t byte_of_token(const std::string& text) {
  if (text.size() < 5) return 0;
  const std::string hex = text.substr(3, 2);
  return static_cast<uint8_t>(std::strtol(hex.c_str(), nullptr, 16));
}

// llama.cpp's llama_decode_text: byte-level text back to bytes; a code point outside the
// 256-byte map is spelled out rather than dropped.
std::string bpe_piece(const std::string& text) {
  std::string out;
  for (size_t i = 0; i < text.size();) {
    const size_t start = i;
    const uint32_t cpt = tok::decode_utf8(text, i);
    const int b = tok::cpt_to_byte(cpt);
    if (b >= 0) {
      out.push_back(static_cast<char>(b));
      continue;
    }
    std::string utf8;
    tok::append_utf8(cpt, utf8);
    out += "[UNK_BYTE_0x";
    for (char c : utf8) out += fmt::format("{:02x}", static_cast<uint8_t>(c));
    out += text + "]";
    (void)start;
  }
  return out;
}

std::string make_piece(const Tokenizer::Impl& v, int32_t id) {
  const uint32_t a = v.attrs[id];
  const std::string& text = v.texts[id];
  if (a & (kAttrUnknown | kAttrControl | kAttrUserDefined)) return text;
  if (v.type == VocabType::kBpe) return (a & kAttrNormal) ? bpe_piece(text) : std::string();
  if (a & kAttrNormal) {
    std::string out;
    for (size_t i = 0; i < text.size(); ++i) {
      if (text.compare(i, 3, "\xE2\x96\x81") == 0) {
        out.push_back(' ');
        i += 2;
      } else {
        out.push_back(text[i]);
      }
    }
    return out;
  }
  if (a & kAttrByte) return std::string(1, static_cast<char>(byte_of_token(text)));
  return {};
}

bool contains_any(const std::string& s, std::initializer_list<std::string_view> subs) {
  return std::any_of(subs.begin(), subs.end(),
                     [&](std::string_view x) { return s.find(x) != std::string::npos; });
}

}  // namespace

Expected<Tokenizer> Tokenizer::from_gguf(const GgufFile& g) {
  auto impl = std::make_shared<Impl>();
  Impl& v = *impl;
  const auto fail = [&](const Status& s) {
    return s.context(fmt::format("{}: tokenizer", g.path()));
  };

  const GgufValue* model_v = g.find("tokenizer.ggml.model");
  if (!model_v)
    return fail(Status::error("no vocabulary (metadata 'tokenizer.ggml.model' missing)"));
  if (!model_v->is_string()) return fail(Status::error("'tokenizer.ggml.model' is not a string"));
  const std::string& model = model_v->str();
  if (model == "llama") {
    v.type = VocabType::kSpm;
    v.bos = 1, v.eos = 2, v.unk = 0;
    v.add_space_prefix = true, v.add_bos = true;
  } else if (model == "gpt2") {
    v.type = VocabType::kBpe;
    v.bos = 11, v.eos = 11;
  } else if (model == "bert") {
    v.type = VocabType::kWpm;
    v.bos = 101, v.unk = 100, v.sep = 102, v.pad = 0, v.mask = 103;
    v.add_bos = true, v.add_sep = true;
  } else if (model == "no_vocab" || model == "none") {
    return fail(Status::error("the file has no vocabulary (tokenizer.ggml.model = 'none')"));
  } else {
    return fail(
        Status::errorf("unsupported tokenizer model '{}' (supported: llama, gpt2, bert)", model));
  }

  // Vocabulary.
  auto tokens = optional_array(g, "tokenizer.ggml.tokens", -1);
  if (!tokens) return fail(tokens.status());
  if (!*tokens) return fail(Status::error("metadata 'tokenizer.ggml.tokens' missing"));
  const auto& items = (*tokens)->items;
  if (items.empty()) return fail(Status::error("'tokenizer.ggml.tokens' is empty"));
  if (items.size() > static_cast<size_t>(INT32_MAX / 2))
    return fail(Status::errorf("{} tokens is more than supported", items.size()));
  const auto n = static_cast<int32_t>(items.size());
  auto scores = optional_array(g, "tokenizer.ggml.scores", n);
  if (!scores) return fail(scores.status());
  auto types = optional_array(g, "tokenizer.ggml.token_type", n);
  if (!types) return fail(types.status());

  v.texts.resize(n);
  v.scores.assign(n, 0.0f);
  v.attrs.assign(n, kAttrNormal);
  v.text_to_id.reserve(static_cast<size_t>(n) * 2);
  for (int32_t i = 0; i < n; ++i) {
    if (!items[i].is_string())
      return fail(Status::errorf("'tokenizer.ggml.tokens'[{}] is not a string", i));
    v.texts[i] = items[i].str();
    if (v.texts[i].empty()) v.texts[i] = fmt::format("[EMPTY_{}]", i);  // as llama.cpp
    v.text_to_id[v.texts[i]] = i;  // a repeated text maps to its last id, as in llama.cpp
    if (*scores) {
      auto s = gguf_convert<float>((*scores)->items[i], "tokenizer.ggml.scores");
      if (!s) return fail(s.status());
      v.scores[i] = *s;
    }
    if (*types) {
      auto t = gguf_convert<int64_t>((*types)->items[i], "tokenizer.ggml.token_type");
      if (!t) return fail(t.status());
      v.attrs[i] = attr_from_type(*t);
    }
    v.max_token_len = std::max(v.max_token_len, v.texts[i].size());
  }

  // Pre-tokenizer (BPE only) and its overrides of the defaults.
  std::string pre;
  if (const GgufValue* p = g.find("tokenizer.ggml.pre"); p && p->is_string()) pre = p->str();
  if (v.type == VocabType::kBpe) {
    auto info = tok::find_pre_tokenizer(pre);
    if (!info) return fail(info.status());
    v.pre_name = info->name;
    v.clean_spaces = info->clean_spaces;
    v.ignore_merges = info->ignore_merges;
    if (info->force_add_bos >= 0) v.add_bos = info->force_add_bos != 0;
    if (info->no_bos) v.bos = kTokenNull;
    if (info->add_sep) v.add_sep = true;
    auto p = tok::PreTokenizer::create(info->regexes);
    if (!p) return fail(p.status());
    v.pre = std::move(*p);
  } else {
    v.pre_name = "default";
  }
  auto prefix = g.get_or<bool>("tokenizer.ggml.add_space_prefix", v.add_space_prefix);
  if (!prefix) return fail(prefix.status());
  v.add_space_prefix = *prefix;

  // Special ids: a value outside the vocabulary keeps the default, as llama.cpp does.
  const std::pair<std::string_view, int32_t*> ids[] = {
      {"tokenizer.ggml.bos_token_id", &v.bos},     {"tokenizer.ggml.eos_token_id", &v.eos},
      {"tokenizer.ggml.eot_token_id", &v.eot},     {"tokenizer.ggml.eom_token_id", &v.eom},
      {"tokenizer.ggml.unknown_token_id", &v.unk}, {"tokenizer.ggml.seperator_token_id", &v.sep},
      {"tokenizer.ggml.padding_token_id", &v.pad}, {"tokenizer.ggml.mask_token_id", &v.mask},
  };
  for (const auto& [key, dst] : ids) {
    const GgufValue* val = g.find(key);
    if (!val || !val->is_integer()) continue;
    auto id = gguf_convert<int64_t>(*val, key);
    if (id && *id >= 0 && *id < n) *dst = static_cast<int32_t>(*id);
  }
  for (const auto& [key, dst] : ids)
    if (*dst >= n) *dst = kTokenNull;  // a default past a tiny vocabulary
  for (auto [key, dst] :
       {std::pair<std::string_view, bool*>{"tokenizer.ggml.add_bos_token", &v.add_bos},
        {"tokenizer.ggml.add_eos_token", &v.add_eos},
        {"tokenizer.ggml.add_sep_token", &v.add_sep}}) {
    auto b = g.get_or<bool>(key, *dst);
    if (!b) return fail(b.status());
    *dst = *b;
  }

  // End-of-turn tokens that llama.cpp recognises by their text; CONTROL is added to their
  // attributes. That matters for tokenization: with special tokens not parsed, only tokens
  // without CONTROL (user-defined ones) are matched in the text, so e.g. phi-3's "</s>" (typed
  // user-defined in its vocabulary) stays text, as in llama.cpp 0.7.0.
  static constexpr std::string_view kEotTexts[] = {
      "<|eot_id|>",      "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
      "<|end_of_text|>", "<EOT>",      "_<EOT>",  "[EOT]",         "<end_of_utterance>"};
  static constexpr std::string_view kEogTexts[] = {"<|eot_id|>",
                                                   "<|im_end|>",
                                                   "<|end|>",
                                                   "<|return|>",
                                                   "<|call|>",
                                                   "<|flush|>",
                                                   "<|calls|>",
                                                   "<end_of_turn>",
                                                   "<|endoftext|>",
                                                   "</s>",
                                                   "<|eom_id|>",
                                                   "<EOT>",
                                                   "_<EOT>",
                                                   "[EOT]",
                                                   "[EOS]",
                                                   "<|end_of_text|>",
                                                   "<end_of_utterance>",
                                                   "<eos>",
                                                   "<turn|>",
                                                   "<|tool_response>"};
  const auto listed = [](const auto& list, std::string_view t) {
    return std::find(std::begin(list), std::end(list), t) != std::end(list);
  };
  for (int32_t i = 0; i < n; ++i) {
    const std::string& t = v.texts[i];
    if (v.text_to_id[t] != i) continue;
    if (v.eot == kTokenNull && listed(kEotTexts, t)) {
      v.eot = i;
      v.attrs[i] |= kAttrControl;
    }
    if (v.eom == kTokenNull && t == "<|eom_id|>") {
      v.eom = i;
      v.attrs[i] |= kAttrControl;
    }
  }
  for (int32_t i = 0; i < n; ++i) {
    const std::string& t = v.texts[i];
    if (v.text_to_id[t] != i) continue;
    if (listed(kEogTexts, t)) {
      v.eog.push_back(i);
      v.attrs[i] |= kAttrControl;
    }
    // gpt-oss's channel markup is always rendered: llama.cpp makes these user-defined.
    if (t == "<|channel|>" || t == "<|message|>" || t == "<|start|>" || t == "<|constrain|>")
      v.attrs[i] = kAttrUserDefined;
  }
  for (int32_t id : {v.eos, v.eot, v.eom})
    if (id != kTokenNull) v.eog.push_back(id);
  std::sort(v.eog.begin(), v.eog.end());
  v.eog.erase(std::unique(v.eog.begin(), v.eog.end()), v.eog.end());
  // llama.cpp's two corrections of that list: with <|return|> and <|call|> (o200k_harmony) or
  // <|calls|> and <|flush|> (solar-open), <|end|> ends no generation and becomes user-defined;
  // with <|tool_response>, </s> is ordinary text (gemma4).
  const auto eog_id = [&](std::string_view text) {
    for (int32_t id : v.eog)
      if (v.texts[id] == text) return id;
    return kTokenNull;
  };
  const auto drop_eog = [&](int32_t id, uint32_t attr) {
    v.eog.erase(std::find(v.eog.begin(), v.eog.end(), id));
    v.attrs[id] = attr;
  };
  const bool has_call = eog_id("<|call|>") != kTokenNull || eog_id("<|calls|>") != kTokenNull;
  if (const int32_t end_id = eog_id("<|end|>");
      end_id != kTokenNull && has_call &&
      (eog_id("<|return|>") != kTokenNull || eog_id("<|flush|>") != kTokenNull))
    drop_eog(end_id, kAttrUserDefined);
  if (const int32_t s_id = eog_id("</s>");
      s_id != kTokenNull && eog_id("<|tool_response>") != kTokenNull)
    drop_eog(s_id, kAttrNormal);

  // Tokens matched in the text before the main algorithm runs, longest first.
  for (int32_t i = 0; i < n; ++i)
    if (v.attrs[i] & (kAttrControl | kAttrUserDefined | kAttrUnknown))
      v.special_tokens.push_back(i);
  std::stable_sort(v.special_tokens.begin(), v.special_tokens.end(),
                   [&](int32_t a, int32_t b) { return v.texts[a].size() > v.texts[b].size(); });

  // llama.cpp's per-model attribute fix-ups (only those that change tokenization).
  std::string name;
  if (const GgufValue* nv = g.find("general.name"); nv && nv->is_string()) name = nv->str();
  std::transform(name.begin(), name.end(), name.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  std::string arch;
  if (const GgufValue* av = g.find("general.architecture"); av && av->is_string()) arch = av->str();
  const auto set_attr = [&](std::string_view text, uint32_t bit, bool on) {
    const int32_t id = v.find(text);
    if (id == kTokenNull) return;
    v.attrs[id] = on ? (v.attrs[id] | bit) : (v.attrs[id] & ~bit);
  };
  if (contains_any(pre, {"jina-v2-de", "jina-v2-es", "jina-v2-code"}) ||
      contains_any(arch, {"nomic-bert-moe", "jina-bert-v3"})) {
    set_attr("<mask>", kAttrLstrip, true);
  } else if (contains_any(name, {"phi-3", "phi3"})) {
    for (int32_t id : v.special_tokens) v.attrs[id] |= kAttrRstrip;
    set_attr("</s>", kAttrRstrip, true);
    for (std::string_view t : {"<unk>", "<s>", "<|endoftext|>"}) set_attr(t, kAttrRstrip, false);
  }

  // Per-algorithm tables.
  for (int b = 0; b < 256; ++b) {
    const std::string hex = fmt::format("<0x{:02X}>", b);
    int32_t id = v.find(hex);
    if (id == kTokenNull) {
      const char c = static_cast<char>(b);
      id = v.find(std::string_view(&c, 1));
    }
    v.spm_byte_token[b] = id;
  }
  if (v.type == VocabType::kSpm) tok::spm_build(v);
  if (v.type == VocabType::kBpe) {
    std::vector<std::string_view> merges;
    auto m = optional_array(g, "tokenizer.ggml.merges", -1);
    if (!m) return fail(m.status());
    if (!*m) return fail(Status::error("BPE vocabulary without 'tokenizer.ggml.merges'"));
    merges.reserve((*m)->items.size());
    for (const GgufValue& item : (*m)->items) {
      if (!item.is_string())
        return fail(Status::error("'tokenizer.ggml.merges' holds a non-string"));
      merges.push_back(item.str());
    }
    KILN_TRY(tok::bpe_build(v, merges));
  }
  if (v.add_bos && v.bos == kTokenNull) v.add_bos = false;  // nothing to add
  if (v.add_eos && v.eos == kTokenNull) v.add_eos = false;
  if (v.add_sep && v.sep == kTokenNull) v.add_sep = false;

  v.pieces.resize(n);
  for (int32_t i = 0; i < n; ++i) v.pieces[i] = make_piece(v, i);
  return Tokenizer(std::move(impl));
}

}  // namespace kiln
