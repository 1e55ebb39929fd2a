// core/dtype.h: tensor element types, numbered exactly as ggml/GGUF number them, with block
// geometry. Every type GGUF files may carry is listed so the reader can size any tensor;
// which types can be computed is the quant layer's business.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace kiln {

enum class DType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  IQ2_XXS = 16,
  IQ2_XS = 17,
  IQ3_XXS = 18,
  IQ1_S = 19,
  IQ4_NL = 20,
  IQ3_S = 21,
  IQ2_S = 22,
  IQ4_XS = 23,
  I8 = 24,
  I16 = 25,
  I32 = 26,
  I64 = 27,
  F64 = 28,
  IQ1_M = 29,
  BF16 = 30,
  TQ1_0 = 34,
  TQ2_0 = 35,
  MXFP4 = 39,
};

struct DTypeTraits {
  std::string_view name;  // llama.cpp spelling: "f32", "q4_K", ...
  uint32_t block_size;    // elements per block
  uint32_t type_size;     // bytes per block
};

// Traits of a known type, or nullopt for an id no GGUF writer produces.
std::optional<DTypeTraits> dtype_traits(uint32_t raw);
DTypeTraits traits(DType t);  // aborts on an unknown enumerator (cannot happen after parsing)
std::string_view dtype_name(DType t);
// Parses llama.cpp names, case-insensitive ("Q4_K", "q8_0", "f16").
std::optional<DType> dtype_from_name(std::string_view name);
// The comparison dtype_from_name uses, for names built from type names (llama-quantize's
// presets: "q4_k_m" names Q4_K_M). ASCII only, as llama.cpp's names are.
bool type_names_equal(std::string_view a, std::string_view b);

// Bytes of one row of n elements; nullopt if n is not a multiple of the block size.
std::optional<uint64_t> row_bytes(DType t, uint64_t n);

}  // namespace kiln
