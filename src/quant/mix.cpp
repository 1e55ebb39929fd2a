// quant/mix.cpp: llama.cpp's per-tensor type rules (llama-quant.cpp's llama_tensor_get_type
// and the "should this tensor be quantized" filter), limited to the presets we produce.
#include "quant/mix.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>

namespace kiln::quant {
namespace {

bool contains(std::string_view s, std::string_view part) {
  return s.find(part) != std::string_view::npos;
}

bool ends_with(std::string_view s, std::string_view tail) {
  return s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail;
}

// Layer index from "blk.N.…", or -1.
int layer_of(std::string_view name) {
  if (name.substr(0, 4) != "blk.") return -1;
  int v = -1;
  auto [p, ec] = std::from_chars(name.data() + 4, name.data() + name.size(), v);
  if (ec != std::errc() || p == name.data() + name.size() || *p != '.') return -1;
  return v;
}

// llama.cpp's use_more_bits: the first and last eighth of the layers, and every third
// layer in between, get the larger type in the _M mixes.
bool use_more_bits(int64_t i_layer, int64_t n_layers) {
  return i_layer < n_layers / 8 || i_layer >= 7 * n_layers / 8 || (i_layer - n_layers / 8) % 3 == 2;
}

bool is_quantized(DType t) { return t != DType::F32 && t != DType::F16 && t != DType::BF16; }

// Whether llama-quantize touches the tensor at all (its filter in llama_model_quantize_impl);
// everything else is copied unchanged.
bool wants_quantization(const TensorInfo& t) {
  const std::string_view name = t.name;
  if (!ends_with(name, "weight")) return false;
  if (t.n_dims < 2) return false;
  if (contains(name, "_norm.weight")) return false;
  if (contains(name, "ffn_gate_inp.weight")) return false;  // MoE routers stay exact
  if (name == "position_embd.weight" || name == "token_types.weight") return false;
  if (contains(name, "ssm_conv1d.weight")) return false;
  if (contains(name, "attn_rel_b.weight")) return false;
  return true;
}

struct Counters {
  int64_t n_attention_wv = 0;
  int64_t i_attention_wv = 0;
};

// llama_tensor_get_type for our presets. `t` is the tensor, `type` starts as the preset's
// base type.
Expected<DType> tensor_type(const Preset& p, const MixFacts& f, Counters& c, const TensorInfo& t) {
  const std::string_view name = t.name;
  const FileType ft = p.ftype;
  DType type = p.base;
  const int64_t n_gqa = f.n_head_kv > 0 ? f.n_head / f.n_head_kv : 1;
  // llama.cpp keys its 70B rule on the detected model size; for llama that is 80 layers.
  const bool is_70b = f.arch == "llama" && f.n_layer == 80;
  const bool is_iq4 = ft == FileType::MOSTLY_IQ4_NL || ft == FileType::MOSTLY_IQ4_XS;
  if (name == "output.weight" || (!f.has_output && name == "token_embd.weight")) {
    const int64_t qk = traits(type).block_size;
    if (ft == FileType::MOSTLY_MXFP4_MOE || f.arch == "falcon" || t.ne[0] % qk != 0)
      type = DType::Q8_0;
    else if (type != DType::Q8_0)
      type = DType::Q6_K;
  } else if (ft == FileType::MOSTLY_MXFP4_MOE) {
    // llama.cpp's MoE mix: stacked expert tensors (a third dimension) MXFP4, the rest Q8_0;
    // none of the rules below applies.
    type = t.ne[2] > 1 ? DType::MXFP4 : DType::Q8_0;
  } else if (contains(name, "attn_v.weight")) {
    if (ft == FileType::MOSTLY_Q2_K)
      type = n_gqa >= 4 ? DType::Q4_K : DType::Q3_K;
    else if (ft == FileType::MOSTLY_Q3_K_M)
      type = c.i_attention_wv < 2 ? DType::Q5_K : DType::Q4_K;
    else if (ft == FileType::MOSTLY_Q3_K_L)
      type = DType::Q5_K;
    else if (is_iq4 && n_gqa >= 4)
      type = DType::Q5_K;
    else if ((ft == FileType::MOSTLY_Q4_K_M || ft == FileType::MOSTLY_Q5_K_M) &&
             use_more_bits(c.i_attention_wv, c.n_attention_wv))
      type = DType::Q6_K;
    else if (ft == FileType::MOSTLY_Q4_K_S && c.i_attention_wv < 4)
      type = DType::Q5_K;
    if (is_70b && (type == DType::Q3_K || type == DType::Q4_K)) type = DType::Q5_K;
    if (f.n_expert == 8) type = DType::Q8_0;
    ++c.i_attention_wv;
  } else if (contains(name, "attn_k.weight")) {
    if (f.n_expert == 8) type = DType::Q8_0;
  } else if (contains(name, "ffn_down")) {
    const int64_t i_layer = layer_of(name);
    if (i_layer < 0 || i_layer >= f.n_layer)
      return Status::errorf("tensor '{}': cannot tell its layer (block_count {})", name, f.n_layer);
    const int64_t n_layer = f.n_layer;
    if (ft == FileType::MOSTLY_Q2_K)
      type = DType::Q3_K;
    else if (ft == FileType::MOSTLY_Q3_K_M)
      type = i_layer < n_layer / 16                                    ? DType::Q5_K
             : (f.arch != "falcon" || use_more_bits(i_layer, n_layer)) ? DType::Q4_K
                                                                       : DType::Q3_K;
    else if (ft == FileType::MOSTLY_Q3_K_L)
      type = DType::Q5_K;
    else if (ft == FileType::MOSTLY_Q4_K_M && use_more_bits(i_layer, n_layer))
      type = DType::Q6_K;
    else if (is_iq4 && i_layer < n_layer / 8)  // llama.cpp: only without an imatrix
      type = DType::Q5_K;
    else if (ft == FileType::MOSTLY_Q5_K_M && use_more_bits(i_layer, n_layer))
      type = DType::Q6_K;
    else if (ft == FileType::MOSTLY_Q4_K_S && f.arch != "falcon" && i_layer < n_layer / 8)
      type = DType::Q5_K;
  } else if (contains(name, "attn_output.weight")) {
    if (f.arch != "falcon") {
      if (f.n_expert == 8) {
        if (ft == FileType::MOSTLY_Q2_K || ft == FileType::MOSTLY_Q3_K_S ||
            ft == FileType::MOSTLY_Q3_K_M || ft == FileType::MOSTLY_Q4_K_S ||
            ft == FileType::MOSTLY_Q4_K_M || is_iq4)
          type = DType::Q5_K;
      } else {
        if (ft == FileType::MOSTLY_Q2_K)
          type = DType::Q3_K;
        else if (ft == FileType::MOSTLY_Q3_K_M)
          type = DType::Q4_K;
        else if (ft == FileType::MOSTLY_Q3_K_L)
          type = DType::Q5_K;
      }
    } else if (ft == FileType::MOSTLY_Q3_K_L) {
      type = DType::Q4_K;
    }
  } else if (contains(name, "attn_qkv.weight")) {
    if (ft == FileType::MOSTLY_Q3_K_M || ft == FileType::MOSTLY_Q3_K_L)
      type = DType::Q4_K;
    else if (ft == FileType::MOSTLY_Q4_K_M)
      type = DType::Q5_K;
    else if (ft == FileType::MOSTLY_Q5_K_M)
      type = DType::Q6_K;
  }

  // A row length the chosen type cannot hold falls back as llama.cpp does.
  if (t.ne[0] % traits(type).block_size != 0) {
    switch (type) {
      case DType::Q4_K:
        type = DType::Q5_0;
        break;
      case DType::Q5_K:
        type = DType::Q5_1;
        break;
      case DType::Q6_K:
        type = DType::Q8_0;
        break;
      case DType::Q2_K:
      case DType::Q3_K:
        type = DType::Q4_0;  // llama-quantize 0.7.0 on stories260K's 64-wide rows
        break;
      case DType::IQ4_XS:
        type = DType::IQ4_NL;
        break;
      case DType::IQ4_NL:
      case DType::Q4_0:
      case DType::Q4_1:
      case DType::Q5_0:
      case DType::Q5_1:
      case DType::Q8_0:
        type = DType::F16;  // what llama.cpp's stories260K-q8_0 fixture shows for 172 columns
        break;
      default:
        return Status::errorf("tensor '{}': row length {} is not a multiple of {}'s block of {}",
                              name, t.ne[0], dtype_name(type), traits(type).block_size);
    }
    if (t.ne[0] % traits(type).block_size != 0) type = DType::F16;
  }
  return type;
}

}  // namespace

const std::vector<Preset>& presets() {
  static const std::vector<Preset> kPresets = {
      {"Q4_0", FileType::MOSTLY_Q4_0, DType::Q4_0},
      {"Q4_1", FileType::MOSTLY_Q4_1, DType::Q4_1},
      {"MXFP4_MOE", FileType::MOSTLY_MXFP4_MOE, DType::MXFP4},
      {"Q5_0", FileType::MOSTLY_Q5_0, DType::Q5_0},
      {"Q5_1", FileType::MOSTLY_Q5_1, DType::Q5_1},
      {"Q2_K", FileType::MOSTLY_Q2_K, DType::Q2_K},
      {"Q3_K_S", FileType::MOSTLY_Q3_K_S, DType::Q3_K},
      {"Q3_K_M", FileType::MOSTLY_Q3_K_M, DType::Q3_K},
      {"Q3_K_L", FileType::MOSTLY_Q3_K_L, DType::Q3_K},
      {"Q4_K_S", FileType::MOSTLY_Q4_K_S, DType::Q4_K},
      {"Q4_K_M", FileType::MOSTLY_Q4_K_M, DType::Q4_K},
      {"Q5_K_S", FileType::MOSTLY_Q5_K_S, DType::Q5_K},
      {"Q5_K_M", FileType::MOSTLY_Q5_K_M, DType::Q5_K},
      {"Q6_K", FileType::MOSTLY_Q6_K, DType::Q6_K},
      {"IQ4_NL", FileType::MOSTLY_IQ4_NL, DType::IQ4_NL},
      {"IQ4_XS", FileType::MOSTLY_IQ4_XS, DType::IQ4_XS},
      {"Q8_0", FileType::MOSTLY_Q8_0, DType::Q8_0},
      {"F16", FileType::MOSTLY_F16, DType::F16},
      {"BF16", FileType::MOSTLY_BF16, DType::BF16},
      {"F32", FileType::ALL_F32, DType::F32},
  };
  return kPresets;
}

std::optional<Preset> preset_from_name(std::string_view name) {
  for (const Preset& p : presets())
    if (type_names_equal(p.name, name)) return p;
  return std::nullopt;
}

std::string preset_names() {
  std::string out;
  for (const Preset& p : presets()) out += (out.empty() ? "" : ", ") + std::string(p.name);
  return out;
}

Expected<MixFacts> mix_facts(const GgufFile& model) {
  MixFacts f;
  KILN_ASSIGN_OR_RETURN(f.arch, model.get<std::string>("general.architecture"));
  const std::string a = f.arch;
  KILN_ASSIGN_OR_RETURN(f.n_layer, model.get<int64_t>(a + ".block_count"));
  KILN_ASSIGN_OR_RETURN(f.n_expert, model.get_or<int64_t>(a + ".expert_count", 0));
  KILN_ASSIGN_OR_RETURN(f.n_embd, model.get_or<int64_t>(a + ".embedding_length", 0));
  // Head counts may be per-layer arrays in some architectures; the mix only needs the ratio,
  // so a non-scalar value counts as "no GQA information" (ratio 1), as for a missing key.
  if (auto h = model.get<int64_t>(a + ".attention.head_count"); h) f.n_head = *h;
  if (auto h = model.get<int64_t>(a + ".attention.head_count_kv"); h)
    f.n_head_kv = *h;
  else
    f.n_head_kv = f.n_head;
  f.has_output = model.find_tensor("output.weight") != nullptr;
  return f;
}

std::vector<size_t> llama_tensor_order(const GgufFile& model) {
  const auto& ts = model.tensors();
  std::vector<size_t> order(ts.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const int la = layer_of(ts[a].name), lb = layer_of(ts[b].name);
    if (la != lb) return la < lb;
    return ts[a].name < ts[b].name;
  });
  return order;
}

Expected<std::vector<DType>> plan_tensor_types(const Preset& preset, const GgufFile& model) {
  KILN_ASSIGN_OR_RETURN(MixFacts facts, mix_facts(model));
  Counters c;
  for (const TensorInfo& t : model.tensors())
    if (contains(t.name, "attn_v.weight")) ++c.n_attention_wv;
  // Decided in llama.cpp's processing order: the attn_v counter depends on it.
  std::vector<DType> out(model.tensors().size());
  for (size_t idx : llama_tensor_order(model)) {
    const TensorInfo& t = model.tensors()[idx];
    DType type = t.dtype;
    if (wants_quantization(t)) {
      type = preset.base;
      if (is_quantized(preset.base)) {
        KILN_ASSIGN_OR_RETURN(type, tensor_type(preset, facts, c, t));
      }
    }
    out[idx] = type;
  }
  return out;
}

}  // namespace kiln::quant
