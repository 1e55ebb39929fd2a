// quant/mix.h: llama.cpp's quantization presets (LLAMA_FTYPE numbers and names) and its
// per-tensor type choices (llama_tensor_get_type): which tensors are quantized at all, and
// which get more bits (output.weight, some attn_v / ffn_down layers in the _M mixes).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "format/gguf.h"

namespace kiln::quant {

// llama.cpp's llama_ftype values, as written to general.file_type.
enum class FileType : uint32_t {
  ALL_F32 = 0,
  MOSTLY_F16 = 1,
  MOSTLY_Q4_0 = 2,
  MOSTLY_Q4_1 = 3,
  MOSTLY_Q8_0 = 7,
  MOSTLY_Q5_0 = 8,
  MOSTLY_Q5_1 = 9,
  MOSTLY_Q2_K = 10,
  MOSTLY_Q3_K_S = 11,
  MOSTLY_Q3_K_M = 12,
  MOSTLY_Q3_K_L = 13,
  MOSTLY_Q4_K_S = 14,
  MOSTLY_Q4_K_M = 15,
  MOSTLY_Q5_K_S = 16,
  MOSTLY_Q5_K_M = 17,
  MOSTLY_Q6_K = 18,
  MOSTLY_IQ4_NL = 25,
  MOSTLY_IQ4_XS = 30,
  MOSTLY_BF16 = 32,
  MOSTLY_MXFP4_MOE = 38,
};

struct Preset {
  std::string_view name;  // llama-quantize's spelling: "Q4_K_M"
  FileType ftype;
  DType base;  // the type most weight matrices get (MXFP4_MOE: the expert tensors)
};

// Presets `kiln quantize` offers, in llama-quantize's order.
const std::vector<Preset>& presets();
// Case-insensitive lookup ("q4_k_m" works).
std::optional<Preset> preset_from_name(std::string_view name);
std::string preset_names();  // "Q4_0, Q4_1, ..." for help and error text

// What the model's metadata says that the mix rules depend on.
struct MixFacts {
  std::string arch;
  int64_t n_layer = 0;
  int64_t n_expert = 0;
  int64_t n_head = 0;
  int64_t n_head_kv = 0;
  int64_t n_embd = 0;
  bool has_output = false;  // a separate output.weight (otherwise token_embd doubles as it)
};
Expected<MixFacts> mix_facts(const GgufFile& model);

// The order llama.cpp's loader keeps tensors in, and so the order llama-quantize processes
// and writes them: tensors outside "blk.N." first, then by layer number, each group by name.
// Indices into model.tensors().
std::vector<size_t> llama_tensor_order(const GgufFile& model);

// One output type per input tensor (same order as model.tensors()), or an error naming the tensor
// llama.cpp would also refuse (a row length no fallback type can hold).
Expected<std::vector<DType>> plan_tensor_types(const Preset& preset, const GgufFile& model);

}  // namespace kiln::quant
